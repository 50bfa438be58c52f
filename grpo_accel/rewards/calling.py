"""How a reward function is called: as TRL's GRPOTrainer calls it, so that TRL's reward functions run unchanged.

Every function gets keyword arguments: ``prompts``, ``completions``, ``completion_ids`` (token ids), every dataset
column, ``finish_reason`` and ``prompt_messages``, ``trainer_state`` (:class:`TrainerState`), ``log_extra(column,
values)`` and ``log_metric(name, value)``; a function that takes no ``**kwargs`` gets only the names it lists. What
``prompts`` and ``completions`` hold is the one rule:

* on rows whose prompt is text, the prompt text and the completion text;
* on chat rows, what TRL passes: the prompt's messages (system prompt included) and each completion as one
  assistant message, ``[{"role": "assistant", "content": text}]``;
* except for functions that read text (:func:`text_reward`: every built-in reward, reward models and services,
  and a function of yours marked ``@text_reward``), which get the prompt as the model read it (the chat template
  applied) and the completion text on every row.

A function may return ``None`` for a completion it cannot judge: that reward is left out of that completion's
weighted sum, as TRL does (a completion no function judged gets 0, and a warning).

This module imports no torch: reward worker processes import it.
"""
from __future__ import annotations

import dataclasses
import inspect
from collections import defaultdict
from typing import Any, Callable, Mapping


def text_reward(fn: Callable) -> Callable:
    """Mark ``fn`` as reading text: on chat rows too it gets the rendered prompt and the completion text (instead
    of TRL's message lists). Returns ``fn``.

    Example:
        >>> @text_reward
        ... def brief(prompts, completions, **fields):
        ...     return [-len(c.split()) / 100 for c in completions]
    """
    fn.reads_text = True
    return fn


def reads_text(fn: Callable) -> bool:
    """Whether ``fn`` (or the function a reward source or ``functools.partial`` wraps) is marked :func:`text_reward`,
    or is a reward source that reads text itself."""
    while True:
        if getattr(fn, "reads_text", False):
            return True
        inner = getattr(fn, "func", None) or getattr(fn, "fn", None)  # partial; AsyncReward, TimedReward
        if inner is None or inner is fn:
            return False
        fn = inner


def as_messages(completions: list[str]) -> list[list[dict[str, str]]]:
    """Each completion as TRL passes it on chat rows: one assistant message."""
    return [[{"role": "assistant", "content": text}] for text in completions]


@dataclasses.dataclass
class TrainerState:
    """``trainer_state``, for rewards shaped by the run's progress (TRL passes its ``TrainerState``, whose first two
    fields these are): the recipe keeps it current, once per iteration."""

    global_step: int = 0  # optimizer steps taken so far
    max_steps: int = 0  # optimizer steps of the whole run
    frames: int = 0  # completions collected so far, over all processes
    iterations: int = 0  # batches collected so far


class RewardLog:
    """What reward functions logged during one scoring (TRL's ``log_extra`` and ``log_metric``): per-completion
    columns for the logged samples and scalars averaged into ``train/<name>``."""

    def __init__(self) -> None:
        self.extra: dict[str, list] = defaultdict(list)
        self.metrics: dict[str, list[float]] = defaultdict(list)

    def log_extra(self, column: str, values: list) -> None:
        """Add ``values`` (one per completion of the call) as column ``column`` of the logged samples."""
        self.extra[str(column)].extend(values)

    def log_metric(self, name: str, value: float) -> None:
        """Log scalar ``value`` under ``train/<name>`` (averaged over the calls and processes of an iteration)."""
        self.metrics[str(name)].append(float(value))


TRAINER_ARGUMENTS = ("trainer_state", "log_extra", "log_metric")
"""What the trainer adds to every call besides the completions' fields (TRL's names)."""


def per_completion(arguments: Mapping[str, Any], n: int) -> dict[str, list]:
    """The arguments that hold one value per completion (of ``n``): prompts, completions, token ids, finish reasons,
    dataset columns; not ``trainer_state`` nor the log callbacks."""
    return {k: v for k, v in arguments.items() if isinstance(v, list) and len(v) == n}


def positional_slots(params: list[inspect.Parameter], names) -> int:
    """How many of a function's first two parameters take ``prompts`` and ``completions`` by position: those that
    are positional-only or named none of ``names`` (the arguments it is called with)."""
    count = 0
    for param in params[:2]:
        if param.kind is param.POSITIONAL_ONLY or (param.kind is param.POSITIONAL_OR_KEYWORD and param.name not in names):
            count += 1
        else:
            break
    return count


def call_reward(fn: Callable, arguments: Mapping[str, Any]):
    """``fn`` called with ``arguments`` by keyword, as TRL calls it. A function without ``**kwargs`` gets only the
    names it lists; one whose first parameters are named otherwise (``f(p, c, answer)``) or positional-only gets
    ``prompts`` and ``completions`` there by position, as grpo_accel used to call every function."""
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):  # no readable signature: everything, by keyword
        return fn(**arguments)
    positional = ["prompts", "completions"][:positional_slots(params, arguments)]
    rest = params[len(positional):]
    if any(p.kind is p.VAR_KEYWORD for p in rest):
        kwargs = {k: v for k, v in arguments.items() if k not in positional}
    else:
        names = {p.name for p in rest if p.kind in (p.POSITIONAL_OR_KEYWORD, p.KEYWORD_ONLY)}
        kwargs = {k: v for k, v in arguments.items() if k in names}
    return fn(*[arguments[k] for k in positional], **kwargs)
