"""Hook stages of the training loop: what runs when, and what a hook may read or change.

A hook is ``fn(trainer, *args)``; register one with ``trainer.register_op(stage, fn, name=...)``. Hooks of a
stage run in registration order. The loop's own steps (storing the rollout, pushing weights, logging,
checkpointing) are not hooks: ``GRPOTrainer._iteration`` calls them in order, and the stages sit between them.

| stage            | when                                                          | arguments        | may                                   |
|------------------|---------------------------------------------------------------|------------------|---------------------------------------|
| pre_train        | once, when ``train()`` starts (after a resume)                | -                | evaluate the untrained model          |
| post_collect     | a batch was collected and scored, before it is stored          | rollout          | return a replacement (e.g. filtered) rollout for the next hook; an empty one skips optimisation |
| pre_optim        | the batch is stored (with old / reference logprobs)           | -                | change trainer state                  |
| post_optim_step  | after each optimizer step (async: after its weight push)      | stats (dict)     | add entries to stats                  |
| post_optim       | after the optimisation of a batch (sync: weights pushed)      | -                | read the new weights                  |
| log              | the batch's scalars are ready, before writing                 | rollout, scalars | add or change scalars                 |
| post_iteration   | end of an iteration, after logging and a checkpoint when due  | -                | evaluate, request_stop                |
| post_checkpoint  | a checkpoint folder was written (every process)                | path             | copy or upload it (not change it)     |
| post_train       | training ended (after its last checkpoint), not after an error | -                | finish what hooks started             |

A hook that raises stops training with a :class:`HookError` naming the hook and the stage.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any, Callable

STAGES = ("pre_train", "post_collect", "pre_optim", "post_optim_step", "post_optim", "log", "post_iteration",
          "post_checkpoint", "post_train")


class HookError(RuntimeError):
    """A hook raised; the message names the hook and its stage."""


class Hooks:
    """Ordered hooks per stage, with per-hook wall time (read by ``log_timings``)."""

    def __init__(self) -> None:
        self._ops: dict[str, list[tuple[str, Callable]]] = {stage: [] for stage in STAGES}
        self.seconds: dict[str, float] = defaultdict(float)

    def register(self, stage: str, fn: Callable, name: str | None = None) -> str:
        if stage not in self._ops:
            raise ValueError(f"register_op: stage {stage!r} is unknown; stages are {list(STAGES)}.")
        name = name or getattr(fn, "__name__", type(fn).__name__)
        if any(existing == name for existing, _ in self._ops[stage]):
            raise ValueError(f"register_op: a hook named {name!r} is already registered at {stage!r}; pick another name.")
        self._ops[stage].append((name, fn))
        return name

    def names(self, stage: str) -> list[str]:
        return [name for name, _ in self._ops[stage]]

    def run(self, stage: str, trainer, *args) -> None:
        for name, fn in self._ops[stage]:
            self._call(stage, name, fn, trainer, *args)

    def chain(self, stage: str, trainer, value):
        """Pass ``value`` through the stage's hooks: each gets the previous one's result (None keeps it)."""
        for name, fn in self._ops[stage]:
            result = self._call(stage, name, fn, trainer, value)
            value = value if result is None else result
        return value

    def _call(self, stage: str, name: str, fn: Callable, trainer, *args) -> Any:
        start = time.perf_counter()
        try:
            return fn(trainer, *args)
        except Exception as exc:
            raise HookError(f"hook {name!r} at stage {stage!r} raised {type(exc).__name__}: {exc}") from exc
        finally:
            self.seconds[name] += time.perf_counter() - start
