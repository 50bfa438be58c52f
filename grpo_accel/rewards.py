"""Reward functions: the protocol, a weighted set of them, and the built-ins.

A reward function is any callable ``fn(prompts, completions, **fields) -> list[float]``:

- ``prompts``: list[str], one per completion (a prompt repeated G times for its group): the text the model
  read, i.e. a chat-formatted row's messages after the chat template;
- ``completions``: list[str], decoded completion texts (special tokens skipped, as SGLang returns them);
- ``fields``: ``completion_ids`` (list[list[int]]), ``finish_reason`` (list[str]), ``prompt_messages`` (the
  row's chat messages with the system prompt, as TRL passes conversational prompts; None for a string prompt)
  and every extra column of the dataset row (e.g. ``answer``), each a list aligned with ``completions``.
  For multi-turn episodes (``rollout.environment``) the completion is the model's last turn, and two more fields
  come: ``conversation`` (the episode's messages, the model's turns as "assistant" messages) and
  ``env_rewards`` (the environment's per-turn reward terms summed over the episode: name -> float).

It returns one float per completion. Accept ``**fields`` so that new fields never break it. It may be declared
``async def``: a set's async functions are awaited together. Reward models, reward services and functions run in
worker processes with a time limit are such functions too (:mod:`grpo_accel.reward_sources`).

Per-reward scaling: a set may standardise a function's values (``normalize`` "group": within each prompt's group,
"batch": over the batch this process scores) before the weighted sum, so that one reward's scale cannot drown
another's (GDPO's per-reward normalisation, trl#4785).
"""
from __future__ import annotations

import asyncio
import inspect
import re
import threading
from collections.abc import Iterable
from typing import Callable, Mapping, Sequence

import torch
from tensordict import TensorDict

from grpo_accel.advantages import standardised
from grpo_accel.errors import UserError
from grpo_accel.reward_sources import RewardFault, RewardSource, is_finite_number
from grpo_accel.rules import check_choice

RewardFn = Callable[..., Sequence[float]]
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
    ``__call__`` is one (:class:`~grpo_accel.reward_sources.AsyncReward`)."""
    target = getattr(fn, "func", fn)  # functools.partial
    return inspect.iscoroutinefunction(target) or inspect.iscoroutinefunction(getattr(target, "__call__", None))

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


def answer_match(prompts: list[str], completions: list[str], answer: list, **fields) -> list[float]:
    """1.0 when the last number in the completion equals the row's ``answer`` numerically, else 0.0 (thousands'
    commas read as people write them: "1,085" is 1085). The answer must be a number: a worked solution such as
    GSM8K's is read with ``data.answer_format``."""
    out = []
    for text, expected in zip(completions, answer):
        gold = str(expected).replace(",", "").strip()
        if not _NUMBER.fullmatch(gold):
            raise ValueError(f"answer_match compares numbers, and the row's answer {str(expected)[-60:]!r} is not one; "
                             "for worked solutions ending '#### N' set data.answer_format=gsm8k (\\boxed{N}: boxed), "
                             "or use the math_answer reward")
        found = _NUMBER.findall(_THOUSANDS.sub("", text))
        out.append(float(bool(found) and float(found[-1]) == float(gold)))
    return out


_THOUSANDS = re.compile(r"(?<=\d),(?=\d{3}(?!\d))")
"""A comma between digits followed by exactly three more: a thousands' separator ("1,085")."""


def format_match(prompts: list[str], completions: list[str], pattern: str = r"-?\d+", **fields) -> list[float]:
    """1.0 when the whole completion (whitespace-stripped) matches the regex ``pattern`` and it stopped on its
    own (finish reason "stop", not cut by the length limit), else 0.0."""
    regex = re.compile(pattern)
    reasons = fields.get("finish_reason") or ["stop"] * len(completions)
    return [float(r == "stop" and regex.fullmatch(c.strip()) is not None) for c, r in zip(completions, reasons)]


def math_answer(prompts: list[str], completions: list[str], answer: list, strict: bool = False,
                **fields) -> list[float]:
    """1.0 when the completion's final answer (:func:`final_answer`) is the row's ``answer`` (:func:`same_answer`),
    else 0.0. ``strict``: only answers written as such count (no fallback to the last number).

    A numeric reference is matched by a stated number only, never by an expression that evaluates to it: against
    "85", ``The answer is 85``, ``= 85``, ``85.``, ``85.0``, ``\\boxed{85}`` and ``85 apples`` score 1.0;
    ``The answer is 47+38``, ``= 85+0`` and ``\\boxed{170/2}`` score 0.0 (a policy learns to restate the question
    otherwise). Symbolic references (``\\frac{1}{2}``, ``2\\sqrt{3}``, ``(0, 1]``) are compared by HF math-verify:
    ``0.5`` against ``\\frac{1}{2}`` scores 1.0."""
    out = []
    for text, expected in zip(completions, answer):
        found = final_answer(text, last_number=not strict)
        out.append(float(found is not None and same_answer(found, expected)))
    return out


_ANSWER_MARKERS = tuple(re.compile(p, re.IGNORECASE) for p in (
    r"####\s*([^\n]+)", r"answer is\s*:?\s*([^\n]+)", r"answer\s*:\s*([^\n]+)", r"=\s*([^=\n]+)"))


def final_answer(text: str, last_number: bool = True) -> str | None:
    """The answer a completion states, as people write it, by priority: the last ``\\boxed{...}``, the rest of
    the line after the last "####", "answer is", "answer:" or "=" (trailing "." removed); failing those, the
    last number if ``last_number`` (thousands' commas read as such); else None."""
    if (boxed := _last_boxed(text)) is not None:
        return boxed
    for marker in _ANSWER_MARKERS:
        if found := marker.findall(text):
            return found[-1].strip().rstrip(".").strip()
    numbers = _NUMBER.findall(_THOUSANDS.sub("", text))
    return numbers[-1] if numbers and last_number else None


_STATED_NUMBER = re.compile(r"(-?)\s*\\?\$?\s*(\d+(?:\.\d+)?)\s*(?:\\?%|[A-Za-z][A-Za-z ]*)?")
"""A number alone as an answer states it: a sign, a currency sign, the digits, at most a unit in words after."""


def stated_number(found: str) -> float | None:
    """The number a stated answer is, as people write it ("85", "= 85", "85.", "-3", "$1,085", "85.0", "85 apples",
    "12%"); None for anything else: an expression ("47+38", "85+0", "170/2"), several numbers ("85 or 86"), words."""
    text = _THOUSANDS.sub("", found).strip().removeprefix("=").strip().rstrip(".").strip()
    match = _STATED_NUMBER.fullmatch(text)
    return float(match.group(1) + match.group(2)) if match else None


def same_answer(found: str, expected) -> bool:
    """Whether a stated answer is the expected one. A numeric ``expected`` ("85", "1,085", "-2.5") needs
    :func:`stated_number` of ``found`` to equal it. Any other ``expected`` (a fraction, a radical, an interval, a
    word) is decided by HF math-verify when it is installed (``pip install 'grpo_accel[math]'``), else by
    whitespace-normalised text."""
    gold = str(expected).strip()
    if _NUMBER.fullmatch(_THOUSANDS.sub("", gold)):
        number = stated_number(found)
        return number is not None and number == float(_THOUSANDS.sub("", gold))
    try:
        import math_verify  # noqa: F401 - lazy and optional: pip install 'grpo_accel[math]'
    except ImportError:
        return " ".join(found.split()) == " ".join(gold.split())
    if threading.current_thread() is threading.main_thread():
        return _math_verify([gold], [found])[0] == 1.0
    # math-verify's time limits use SIGALRM, which only a main thread may set (async collection scores in a
    # thread): there the check runs in a worker process of its own, killed and counted as "not equal" at 5 s.
    return _OFF_THREAD_VERIFY([gold], [found])[0] == 1.0


def _math_verify(golds: list[str], founds: list[str], **_) -> list[float]:
    """math-verify's verdict on each (expected, stated) pair, with its own 5 s limits (in a main thread): 1.0
    equal, else 0.0. Shaped as a reward function (``prompts`` = the expected answers) for :class:`TimedReward`."""
    from math_verify import parse, verify

    return [float(verify(parse(f"${g}$", parsing_timeout=5), parse(f"${f}$", parsing_timeout=5), timeout_seconds=5))
            for g, f in zip(golds, founds)]


def soft_overlong_penalty(length: int, max_tokens: int, cache_tokens: int) -> float:
    """DAPO's soft overlong punishment of a completion of ``length`` tokens: 0 up to ``max_tokens - cache_tokens``,
    then falling linearly to -1 at ``max_tokens`` (the last ``cache_tokens`` tokens before the limit), -1 past it."""
    free = max_tokens - cache_tokens
    if length <= free:
        return 0.0
    return (free - length) / cache_tokens if length <= max_tokens else -1.0


def overlong_penalty(prompts: list[str], completions: list[str], completion_ids: list[list[int]], max_tokens: int,
                     cache_tokens: int, **fields) -> list[float]:
    """:func:`soft_overlong_penalty` of each completion's token count; the reward's weight is DAPO's penalty
    factor. The recipe sets ``max_tokens`` to the completion budget (rollout.max_new_tokens) unless given."""
    if not 0 < cache_tokens <= max_tokens:
        raise ValueError(f"overlong_penalty: cache_tokens={cache_tokens} must be in 1..max_tokens={max_tokens}")
    return [soft_overlong_penalty(len(ids), max_tokens, cache_tokens) for ids in completion_ids]


def env_reward(prompts: list[str], completions: list[str], env_rewards: list[dict], **fields) -> list[float]:
    """The environment's own reward terms of each episode, summed (multi-turn episodes)."""
    return [float(sum(terms.values())) for terms in env_rewards]


from grpo_accel.reward_sources import TimedReward  # noqa: E402 - after the function it runs

_OFF_THREAD_VERIFY = TimedReward("math_answer (math-verify)", _math_verify, processes=1, timeout_s=5.0, fallback=0.0)
"""math-verify outside a main thread: one worker process, started at first use, each check limited to 5 s."""

BUILTIN_REWARDS: dict[str, RewardFn] = {"answer_match": answer_match, "format_match": format_match,
                                        "math_answer": math_answer, "env_reward": env_reward,
                                        "overlong_penalty": overlong_penalty}


class RewardError(UserError, RuntimeError):
    """A reward function failed or returned something unusable; the message names it."""


ANSWER_FORMATS = ("plain", "gsm8k", "boxed")


def reference_answer(text: str, answer_format: str) -> str:
    """A dataset's reference answer as the reward functions compare it: ``plain`` keeps ``text`` (stripped);
    ``gsm8k`` takes what follows the last "####" of a worked solution (GSM8K's ``answer`` column, e.g.
    "... = 72 clips.\\n#### 72" -> "72"; thousands' commas dropped from a number: "#### 1,000" -> "1000");
    ``boxed`` takes the last ``\\boxed{...}`` (MATH's solutions). Raises ValueError when the marker is missing.

    Example:
        >>> reference_answer("Natalia sold 48/2 = <<48/2=24>>24 clips in May.\\n#### 72", "gsm8k")
        '72'
    """
    if answer_format == "plain":
        return str(text).strip()
    if answer_format == "gsm8k":
        marker = str(text).rfind("####")
        if marker < 0:
            raise ValueError("has no '####' before its final answer")
        found = text[marker + 4:].strip()
        return found.replace(",", "") if _NUMBER.fullmatch(found.replace(",", "")) else found
    if answer_format == "boxed":
        if (found := _last_boxed(str(text))) is None:
            raise ValueError("has no \\boxed{...} answer")
        return found
    raise ValueError(f"answer_format={answer_format!r}: must be one of {list(ANSWER_FORMATS)}")


def _last_boxed(text: str) -> str | None:
    start = text.rfind("\\boxed{")
    if start < 0:
        return None
    depth, i = 1, start + len("\\boxed{")
    for j in range(i, len(text)):
        depth += {"{": 1, "}": -1}.get(text[j], 0)
        if depth == 0:
            return text[i:j].strip()
    return None  # unclosed: no answer


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


