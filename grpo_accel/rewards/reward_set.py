"""A weighted set of reward functions (:class:`RewardSet`): scoring a batch, each function's values and their
weighted sum, checked, with per-reward scaling (:func:`standardise`)."""
from __future__ import annotations

import asyncio
import inspect
from collections.abc import Iterable
from typing import Mapping, Sequence

import torch
from tensordict import TensorDict

from grpo_accel.advantages import standardised
from grpo_accel.errors import UserError
from grpo_accel.rewards.builtin import RewardFn
from grpo_accel.rewards.sources import RewardFault, RewardSource, is_finite_number
from grpo_accel.rules import check_choice

PROVIDED_FIELDS = ("completion_ids", "finish_reason", "prompt_messages")  # besides the dataset's columns
EPISODE_FIELDS = ("conversation", "env_rewards")  # multi-turn episodes only
NORMALIZE = ("none", "group", "batch")


def standardise(values: torch.Tensor, mode: str, group_size: int | None = None) -> torch.Tensor:  # [N] -> [N]
    """``values`` minus their mean over each group of ``group_size`` contiguous rows ("group") or over all rows
    ("batch"), divided by that std (population) + 1e-6; "none" leaves them."""
    if mode == "none":
        return values
    if mode == "group" and not group_size:
        raise ValueError("normalize='group' needs the group size")
    x = values.view(-1, group_size) if mode == "group" else values.view(1, -1)
    return standardised(x, x.mean(1, keepdim=True), sample_std=False, eps=1e-6).reshape(-1)


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
        self.weights = {name: float(weights.get(name, 1.0)) for name in self.fns}
        self.normalize = {name: (normalize or {}).get(name, "none") for name in self.fns}
        for name, mode in self.normalize.items():
            check_choice(f"normalize[{name!r}]", mode, NORMALIZE, owner="RewardSet: ")

    @property
    def names(self) -> list[str]:
        return list(self.fns)

    def required_columns(self, provided: Sequence[str] = PROVIDED_FIELDS) -> dict[str, list[str]]:
        """name -> the arguments each function requires beyond prompts, completions and ``provided``: dataset
        columns it will be called with (e.g. answer_match -> ["answer"])."""
        needed = {}
        for name, fn in self.fns.items():
            try:
                params = list(inspect.signature(fn).parameters.values())[2:]
            except (TypeError, ValueError):  # a callable without a readable signature: nothing to check
                continue
            needed[name] = [p.name for p in params if p.default is p.empty and p.name not in provided
                            and p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)]
        return {name: cols for name, cols in needed.items() if cols}

    def __call__(self, prompts: list[str], completions: list[str], *, group_size: int | None = None,
                 **fields) -> TensorDict:
        """``rewards`` (each function's values), ``reward`` (their weighted sum, standardised where asked;
        ``group_size``: the contiguous rows of a prompt's group) and, for functions that count their faults,
        ``reward_faults`` (per completion: 1 where a call timed out or failed and got the fallback)."""
        n = len(completions)
        awaited = self._await_all(prompts, completions, fields)
        per_fn = {name: self._run(name, fn, prompts, completions, fields, awaited) for name, fn in self.fns.items()}
        total = sum(self.weights[name] * standardise(r, self.normalize[name], group_size) for name, r in per_fn.items())
        out = {"rewards": TensorDict(per_fn, batch_size=[n]), "reward": total}
        faults = {f"{name}_{kind}": torch.tensor(counts, dtype=torch.float32)
                  for name, fn in self.fns.items() if isinstance(fn, RewardSource) for kind, counts in fn.faults.items()
                  if len(counts) == n}
        if faults:
            out["reward_faults"] = TensorDict(faults, batch_size=[n])
        return TensorDict(out, batch_size=[n])

    def _await_all(self, prompts, completions, fields) -> dict:
        """The async functions' values (or exceptions), awaited together."""
        names = [name for name, fn in self.fns.items() if is_async_reward(fn)]
        if not names:
            return {}

        async def gather():
            calls = [self.fns[name](prompts, completions, **fields) for name in names]
            return await asyncio.gather(*calls, return_exceptions=True)

        return dict(zip(names, asyncio.run(gather())))

    def close(self) -> None:
        """Stop what the functions hold (worker processes of time-limited ones)."""
        for fn in self.fns.values():
            if isinstance(fn, RewardSource):
                fn.close()

    @staticmethod
    def _run(name: str, fn: RewardFn, prompts, completions, fields, awaited: dict) -> torch.Tensor:  # -> [N]
        try:
            if name in awaited:
                if isinstance(awaited[name], BaseException):
                    raise awaited[name]
                returned = awaited[name]
            else:
                returned = fn(prompts, completions, **fields)
        except RewardFault:
            raise
        except Exception as exc:
            row = None if name in awaited else _first_failing_row(fn, prompts, completions, fields)
            where = "" if row is None else (f" on completion {row} (prompt {prompts[row]!r}, completion "
                                            f"{completions[row]!r})")
            raise RewardError(f"reward function {name!r} raised {type(exc).__name__}: {exc}{where}; fix the "
                              "function or make it return 0.0 where it cannot score.") from exc
        if isinstance(returned, (str, bytes)) or not isinstance(returned, Iterable):
            raise RewardError(f"reward function {name!r} returned {returned!r} ({type(returned).__name__}) for "
                              f"{len(completions)} completions; it must return a list with one float per "
                              "completion.")
        values = list(returned)
        if len(values) != len(completions):
            raise RewardError(
                f"reward function {name!r} returned {len(values)} values for {len(completions)} completions; "
                "it must return exactly one float per completion."
            )
        for i, v in enumerate(values):
            if not is_finite_number(v):
                raise RewardError(
                    f"reward function {name!r} returned {v!r} for completion {i} (prompt {prompts[i]!r}, "
                    f"completion {completions[i]!r}); rewards must be finite numbers (bools count as 0 and 1; "
                    "strings are refused): fix the function or map failures to a finite value such as 0.0."
                )
        return torch.tensor([float(v) for v in values], dtype=torch.float32)


def _first_failing_row(fn: RewardFn, prompts, completions, fields) -> int | None:
    """The first completion that ``fn`` also fails on alone (None: it fails only on the whole batch)."""
    for i in range(len(completions)):
        try:
            fn(prompts[i : i + 1], completions[i : i + 1], **{k: v[i : i + 1] for k, v in fields.items()})
        except Exception:  # noqa: BLE001 - any failure names the row
            return i
    return None
