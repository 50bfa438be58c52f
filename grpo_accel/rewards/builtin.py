"""The built-in reward functions, named in a config's ``rewards`` by their names in :data:`BUILTIN_REWARDS`, and
the reference answers they compare with (:func:`reference_answer`)."""
from __future__ import annotations

import re
import threading
from typing import Callable, Sequence

from grpo_accel.rewards.calling import text_reward
from grpo_accel.rewards.sources import TimedReward

RewardFn = Callable[..., Sequence[float]]

_NUMBER = re.compile(r"-?\d+(?:\.\d+)?")


@text_reward
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


@text_reward
def format_match(prompts: list[str], completions: list[str], pattern: str = r"-?\d+", **fields) -> list[float]:
    """1.0 when the whole completion (whitespace-stripped) matches the regex ``pattern`` and it stopped on its
    own (finish reason "stop", not cut by the length limit), else 0.0."""
    regex = re.compile(pattern)
    reasons = fields.get("finish_reason") or ["stop"] * len(completions)
    return [float(r == "stop" and regex.fullmatch(c.strip()) is not None) for c, r in zip(completions, reasons)]


@text_reward
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


@text_reward
def overlong_penalty(prompts: list[str], completions: list[str], completion_ids: list[list[int]], max_tokens: int,
                     cache_tokens: int, **fields) -> list[float]:
    """:func:`soft_overlong_penalty` of each completion's token count; the reward's weight is DAPO's penalty
    factor. The recipe sets ``max_tokens`` to the completion budget (rollout.max_new_tokens) unless given."""
    if not 0 < cache_tokens <= max_tokens:
        raise ValueError(f"overlong_penalty: cache_tokens={cache_tokens} must be in 1..max_tokens={max_tokens}")
    return [soft_overlong_penalty(len(ids), max_tokens, cache_tokens) for ids in completion_ids]


@text_reward
def env_reward(prompts: list[str], completions: list[str], env_rewards: list[dict], **fields) -> list[float]:
    """The environment's own reward terms of each episode, summed (multi-turn episodes)."""
    return [float(sum(terms.values())) for terms in env_rewards]


_OFF_THREAD_VERIFY = TimedReward("math_answer (math-verify)", _math_verify, processes=1, timeout_s=5.0, fallback=0.0)
"""math-verify outside a main thread: one worker process, started at first use, each check limited to 5 s."""

BUILTIN_REWARDS: dict[str, RewardFn] = {"answer_match": answer_match, "format_match": format_match,
                                        "math_answer": math_answer, "env_reward": env_reward,
                                        "overlong_penalty": overlong_penalty}


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
