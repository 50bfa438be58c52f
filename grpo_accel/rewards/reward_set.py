"""A weighted set of reward functions (:class:`RewardSet`): scoring a batch, each function's values and their
weighted sum, checked, with per-reward scaling (:func:`standardise`)."""
from __future__ import annotations

import asyncio
import inspect
import logging
import math
from collections.abc import Iterable
from typing import Mapping, Sequence

import torch
from tensordict import NonTensorStack, TensorDict

from grpo_accel.advantages import standardised
from grpo_accel.errors import UserError
from grpo_accel.rewards.builtin import RewardFn
from grpo_accel.rewards.calling import (TRAINER_ARGUMENTS, RewardLog, TrainerState, as_messages, call_reward,
                                        per_completion, positional_slots, reads_text)
from grpo_accel.rewards.sources import RewardFault, RewardSource, is_finite_number
from grpo_accel.rules import check_choice

PROVIDED_FIELDS = ("completion_ids", "finish_reason", "prompt_messages")  # besides the dataset's columns
EPISODE_FIELDS = ("conversation", "env_rewards")  # multi-turn episodes only
NORMALIZE = ("none", "group", "batch")
logger = logging.getLogger(__name__)


def standardise(values: torch.Tensor, mode: str, group_size: int | None = None) -> torch.Tensor:  # [N] -> [N]
    """``values`` minus their mean over each group of ``group_size`` contiguous rows ("group") or over all rows
    ("batch"), divided by that std (population) + 1e-6; "none" leaves them. NaN (a function's None) stays NaN and
    is left out of its group's mean and std."""
    if mode == "none":
        return values
    if mode == "group" and not group_size:
        raise ValueError("normalize='group' needs the group size")
    x = values.view(-1, group_size) if mode == "group" else values.view(1, -1)
    if not x.isnan().any():
        return standardised(x, x.mean(1, keepdim=True), sample_std=False, eps=1e-6).reshape(-1)
    mean = x.nanmean(1, keepdim=True)
    std = (x - mean).square().nanmean(1, keepdim=True).sqrt().nan_to_num(0.0)  # population std of the judged
    return ((x - mean) / (std + 1e-6)).reshape(-1)


def is_async_reward(fn) -> bool:
    """Whether calling ``fn`` gives a coroutine: an ``async def`` function, a partial of one, or an object whose
    ``__call__`` is one (:class:`~grpo_accel.rewards.sources.AsyncReward`)."""
    target = getattr(fn, "func", fn)  # functools.partial
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))

class RewardError(UserError, RuntimeError):
    """A reward function failed or returned something unusable; the message names it."""


class RewardSet:
    """Several reward functions with weights; scoring returns each one's rewards and the weighted total.

    Args:
        fns: name -> reward function (``async def`` ones are awaited together).
        weights: name -> weight (default 1.0 each).
        normalize: name -> "none" (default), "group" or "batch": see :func:`standardise`. The weighted total
            sums the standardised values; ``rewards`` keeps each function's own.

    Example:
        >>> rs = RewardSet({"answer": answer_match, "format": format_match}, {"format": 0.2})
        >>> td = rs(prompts, completions, answer=answers, completion_ids=ids)
        >>> td["reward"], td["rewards", "answer"]
    """

    def __init__(self, fns: Mapping[str, RewardFn], weights: Mapping[str, float] | None = None,
                 normalize: Mapping[str, str] | None = None) -> None:
        if not fns:
            raise ValueError("RewardSet: no reward function given; pass at least one (see grpo_accel.rewards).")
        weights = dict(weights or {})
        unknown = set(weights) - set(fns)
        if unknown:
            raise ValueError(f"RewardSet: weights name {sorted(unknown)}, which are not reward functions {sorted(fns)}.")
        self.fns = dict(fns)
        self.trainer_state = TrainerState()  # the run's progress, kept current by whoever runs the set (the recipe)
        self._warned = False
        self.weights = {name: float(weights.get(name, 1.0)) for name in self.fns}
        self.normalize = {name: (normalize or {}).get(name, "none") for name in self.fns}
        for name, mode in self.normalize.items():
            check_choice(f"normalize[{name!r}]", mode, NORMALIZE, owner="RewardSet: ")

    @property
    def names(self) -> list[str]:
        return list(self.fns)

    def required_columns(self, provided: Sequence[str] = PROVIDED_FIELDS) -> dict[str, list[str]]:
        """name -> the arguments each function requires beyond prompts, completions and ``provided``: dataset
        columns it will be called with (e.g. answer_match -> ["answer"], TRL's accuracy_reward -> ["solution"])."""
        known = {"prompts", "completions", *provided, *TRAINER_ARGUMENTS}
        needed = {}
        for name, fn in self.fns.items():
            try:
                params = list(inspect.signature(fn).parameters.values())
            except (TypeError, ValueError):  # a callable without a readable signature: nothing to check
                continue
            skip = positional_slots(params, known)  # f(p, c, answer): p and c take prompts and completions
            needed[name] = [p.name for p in params[skip:] if p.default is p.empty and p.name not in known
                            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return {name: cols for name, cols in needed.items() if cols}

    def __call__(self, prompts: list[str], completions: list[str], *, group_size: int | None = None,
                 **fields) -> TensorDict:
        """``rewards`` (each function's values; NaN where it returned None), ``reward`` (their weighted sum,
        standardised where asked, each completion's over the functions that judged it; ``group_size``: the
        contiguous rows of a prompt's group) and, for functions that count their faults, ``reward_faults`` (per
        completion: 1 where a call timed out or failed and got the fallback); what the functions logged: ``extra``
        (``log_extra``'s columns) and ``reward_metrics`` (``log_metric``'s means, one value repeated per row).
        Each function is called as :mod:`grpo_accel.rewards.calling` says."""
        n = len(completions)
        log = RewardLog()
        arguments = {name: self._arguments(fn, prompts, completions, fields, log) for name, fn in self.fns.items()}
        awaited = self._await_all(arguments)
        per_fn = {name: self._run(name, fn, arguments[name], awaited) for name, fn in self.fns.items()}
        weighted = torch.stack([self.weights[name] * standardise(r, self.normalize[name], group_size)
                                for name, r in per_fn.items()], dim=1)  # [N, F]
        unjudged = weighted.isnan().all(dim=1)
        if unjudged.any() and not self._warned:
            self._warned = True
            row = int(unjudged.nonzero()[0])
            logger.warning("no reward function judged completion %d (prompt %r, completion %r): every one returned "
                           "None, so its reward is 0 (as in TRL); make at least one return a value for every "
                           "completion (said once)", row, prompts[row][-80:], completions[row][-80:])
        out = {"rewards": TensorDict(per_fn, batch_size=[n]), "reward": weighted.nansum(dim=1)}
        faults = {f"{name}_{kind}": torch.tensor(counts, dtype=torch.float32)
                  for name, fn in self.fns.items() if isinstance(fn, RewardSource) for kind, counts in fn.faults.items()
                  if len(counts) == n}
        if faults:
            out["reward_faults"] = TensorDict(faults, batch_size=[n])
        if log.metrics:
            out["reward_metrics"] = TensorDict({k: torch.full((n,), sum(v) / len(v)) for k, v in log.metrics.items()},
                                               batch_size=[n])
        if columns := {k: v for k, v in log.extra.items() if len(v) == n}:
            out["extra"] = TensorDict({k: NonTensorStack(*map(str, v)) for k, v in columns.items()}, batch_size=[n])
        return TensorDict(out, batch_size=[n])

    def _arguments(self, fn, prompts: list[str], completions: list[str], fields: dict, log: RewardLog) -> dict:
        """What ``fn`` is called with: on chat rows TRL's message lists, unless it reads text."""
        messages = fields.get("prompt_messages") or [None] * len(prompts)
        if not reads_text(fn) and any(m is not None for m in messages):
            prompts = [text if m is None else m for text, m in zip(prompts, messages)]
            completions = [text if m is None else as_messages([text])[0] for text, m in zip(completions, messages)]
        return {"prompts": prompts, "completions": completions, **fields, "trainer_state": self.trainer_state,
                "log_extra": log.log_extra, "log_metric": log.log_metric}

    def _await_all(self, arguments: dict[str, dict]) -> dict:
        """The async functions' values (or exceptions), awaited together."""
        names = [name for name, fn in self.fns.items() if is_async_reward(fn)]
        if not names:
            return {}

        async def gather():
            return await asyncio.gather(*[call_reward(self.fns[name], arguments[name]) for name in names],
                                        return_exceptions=True)

        return dict(zip(names, asyncio.run(gather())))

    def close(self) -> None:
        """Stop what the functions hold (worker processes of time-limited ones)."""
        for fn in self.fns.values():
            if isinstance(fn, RewardSource):
                fn.close()

    @staticmethod
    def _run(name: str, fn: RewardFn, arguments: dict, awaited: dict) -> torch.Tensor:  # -> [N]
        prompts, completions = arguments["prompts"], arguments["completions"]
        try:
            if name in awaited:
                if isinstance(awaited[name], BaseException):
                    raise awaited[name]
                returned = awaited[name]
            else:
                returned = call_reward(fn, arguments)
        except RewardFault:
            raise
        except Exception as exc:
            if _wants_messages(fn, arguments, exc):
                raise RewardError(
                    f"reward function {name!r} reads chat messages (TRL's conversational form: completion[0]"
                    f"['content']) and got text ({type(exc).__name__}: {exc}; completion 0 is "
                    f"{str(completions[0])[:60]!r}); give data.system_prompt (a text prompt then becomes a system "
                    "and a user message) or chat rows, or mark a function written for text "
                    "@grpo_accel.rewards.text_reward.") from exc
            row = None if name in awaited else _first_failing_row(fn, arguments)
            where = "" if row is None else (f" on completion {row} (prompt {prompts[row]!r}, completion "
                                            f"{completions[row]!r})")
            raise RewardError(f"reward function {name!r} raised {type(exc).__name__}: {exc}{where}; fix the "
                              f"function or make it return 0.0 where it cannot score.{_form_hint(fn, arguments, exc)}"
                              ) from exc
        if isinstance(returned, (str, bytes)) or not isinstance(returned, Iterable):
            raise RewardError(f"reward function {name!r} returned {returned!r} ({type(returned).__name__}) for "
                              f"{len(completions)} completions; it must return a list with one float (or None) per "
                              "completion.")
        values = list(returned)
        if len(values) != len(completions):
            raise RewardError(
                f"reward function {name!r} returned {len(values)} values for {len(completions)} completions; "
                "it must return exactly one float (or None) per completion."
            )
        for i, v in enumerate(values):
            if v is not None and not is_finite_number(v):
                raise RewardError(
                    f"reward function {name!r} returned {v!r} for completion {i} (prompt {prompts[i]!r}, "
                    f"completion {completions[i]!r}); rewards must be finite numbers (bools count as 0 and 1; "
                    "strings are refused), or None where it cannot judge one: fix the function or map failures "
                    "to a finite value such as 0.0."
                )
        return torch.tensor([math.nan if v is None else float(v) for v in values], dtype=torch.float32)


def _wants_messages(fn, arguments: dict, exc: Exception) -> bool:
    """A function indexing text as TRL's message lists (``completion[0]["content"]`` on a string)."""
    completions = arguments["completions"]
    return (not reads_text(fn) and bool(completions) and isinstance(completions[0], str)
            and isinstance(exc, (TypeError, IndexError, KeyError)) and "string ind" in str(exc))


def _form_hint(fn, arguments: dict, exc: Exception) -> str:
    """On chat rows a function that failed on TRL's message lists may have been written for text: say both."""
    completions = arguments["completions"]
    if reads_text(fn) or not completions or isinstance(completions[0], str) or not isinstance(
            exc, (TypeError, AttributeError)):
        return ""
    return (" On chat rows a function gets TRL's message lists (completions[i] = [{'role': 'assistant', 'content': "
            "text}], prompts[i] the prompt's messages); a function written for text reads completion[0]['content'], "
            "or is marked @grpo_accel.rewards.text_reward.")


def _first_failing_row(fn: RewardFn, arguments: dict) -> int | None:
    """The first completion that ``fn`` also fails on alone (None: it fails only on the whole batch)."""
    lists = per_completion(arguments, len(arguments["completions"]))
    for i in range(len(arguments["completions"])):
        row = {**arguments, **{k: v[i : i + 1] for k, v in lists.items()}}
        try:
            call_reward(fn, row)
        except Exception:  # noqa: BLE001 - any failure names the row
            return i
    return None
