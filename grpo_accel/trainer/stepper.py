"""The optimization stepper: autocast, backward, clipping, optimizer step, through an Accelerator."""
from __future__ import annotations

import contextlib
import functools
import math

import torch
from torch.optim.lr_scheduler import LambdaLR

from grpo_accel.contracts import OptimizationStepper
from grpo_accel.distributed import uses_deepspeed


class MixedPrecisionOptimizationStepper(OptimizationStepper):
    """Backward / clip / step / zero_grad with autocast and (fp16) a gradient scaler.

    Accelerate autocasts on GPUs (with its scaler for fp16) and in bf16 on CPU. It runs fp16 on CPU silently
    in float32, so that case is done here: ``torch.autocast("cpu", float16)`` and a ``torch.amp.GradScaler``.

    A custom stepper passed as ``optimization_stepper`` subclasses :class:`~grpo_accel.contracts.OptimizationStepper`
    (or this class).

    Example:
        >>> stepper = MixedPrecisionOptimizationStepper(torch.optim.AdamW(model.parameters()), clip_norm=1.0)
        >>> GRPOTrainer(..., optimization_stepper=stepper)
    """

    def __init__(self, optimizer: torch.optim.Optimizer, clip_norm: float | None = 1.0,
                 mixed_precision: bool = False, autocast_dtype: torch.dtype = torch.bfloat16) -> None:
        self.optimizer, self.clip_norm = optimizer, clip_norm
        self.mixed_precision, self.autocast_dtype = mixed_precision, autocast_dtype
        self.accelerator = self.module = self.scaler = None

    def bind(self, accelerator, module: torch.nn.Module) -> None:
        """Called by the trainer once ``module`` and ``optimizer`` are prepared."""
        self.accelerator, self.module = accelerator, module
        own_fp16 = (self.mixed_precision and self.autocast_dtype == torch.float16 and not accelerator.native_amp
                    and not uses_deepspeed(accelerator))
        self.scaler = torch.amp.GradScaler(accelerator.device.type) if own_fp16 else None

    def autocast(self):
        if self.scaler is not None:
            return torch.autocast(self.accelerator.device.type, dtype=torch.float16)
        return self.accelerator.autocast() if self.mixed_precision else contextlib.nullcontext()

    def backward(self, loss: torch.Tensor) -> None:
        self.accelerator.backward(self.scaler.scale(loss) if self.scaler is not None else loss)

    def step(self) -> dict[str, float]:
        """Call after every micro-batch's backward; clips and steps only when gradients are synchronised."""
        stats: dict[str, float] = {}
        if not self.accelerator.sync_gradients:
            self.optimizer.step()  # Accelerate's wrapper skips it while accumulating (DeepSpeed steps in backward)
            return stats
        if self.scaler is not None:
            self.scaler.unscale_(self.optimizer)
        if self.clip_norm:
            norm = self.accelerator.clip_grad_norm_(self.module.parameters(), self.clip_norm)
            if norm is not None:
                stats["grad_norm"] = float(norm)
        if self.scaler is not None:
            self.scaler.step(self.optimizer)
            self.scaler.update()
            stats["loss_scale"] = float(self.scaler.get_scale())
        else:
            self.optimizer.step()
        self.optimizer.zero_grad()
        return stats

    def state_dict(self) -> dict:
        return {"scaler": self.scaler.state_dict() if self.scaler is not None else None}

    def load_state_dict(self, state: dict) -> None:
        if self.scaler is not None and state.get("scaler"):
            self.scaler.load_state_dict(state["scaler"])


SCHEDULES = ("constant", "linear", "cosine")


def lr_factor(step: int, warmup: int, total: int, kind: str, min_ratio: float = 0.0) -> float:
    """The share of the peak rate at optimizer step ``step`` of ``total``: a linear rise over ``warmup`` steps,
    then constant, linear down to 0 at ``total``, or half a cosine down to ``min_ratio`` (transformers' formulas:
    ``get_linear_schedule_with_warmup``, ``get_cosine_with_min_lr_schedule_with_warmup``)."""
    if step < warmup:
        return step / max(1, warmup)
    if kind == "constant":
        return 1.0
    progress = (step - warmup) / max(1, total - warmup)
    if kind == "linear":
        return max(0.0, 1.0 - progress)
    return max(0.0, min_ratio + (1.0 - min_ratio) * 0.5 * (1.0 + math.cos(math.pi * progress)))


class Schedule(LambdaLR):
    """The run's learning-rate schedule: :func:`lr_factor` of the peak each parameter group was built with, one
    torch step per optimizer step (a torch ``LambdaLR``: the stepper restores it as one)."""

    def __init__(self, optimizer: torch.optim.Optimizer, kind: str, warmup: int, total: int,
                 min_ratio: float = 0.0) -> None:
        if kind not in SCHEDULES:
            raise ValueError(f"Schedule kind={kind!r}: must be one of {list(SCHEDULES)}.")
        # the curve lives in the factor alone (a checkpoint's state restores the step, not another run's curve)
        super().__init__(optimizer, functools.partial(lr_factor, warmup=warmup, total=total, kind=kind,
                                                      min_ratio=min_ratio))


class LearningRate:
    """The rate of each optimizer step, from the optimizer's own rate or ``scheduler`` (a torch LR scheduler over it,
    stepped once per optimizer step, never prepared: Accelerate's wrapper would step it once per process and
    DeepSpeed's engine inside backward).

    On a resume the run's own rates win over the checkpoint's (:meth:`restore`): the peak the optimizer was built
    with is the peak from the first resumed step, and a schedule continues at its step on its own curve (a run
    extended to more steps continues on the longer curve, at the point it had reached, not at the old end).
    """

    def __init__(self, optimizer: torch.optim.Optimizer, scheduler=None) -> None:
        self.optimizer, self.scheduler = optimizer, scheduler
        self.given = _peaks(optimizer.param_groups)  # the run's
        self.last = optimizer.param_groups[0]["lr"]  # the rate of the last optimizer step (train/lr)

    def step(self) -> None:
        """After an optimizer step: remember its rate, move the schedule to the next one's."""
        self.last = self.optimizer.param_groups[0]["lr"]
        if self.scheduler is not None:
            self.scheduler.step()

    def restore(self) -> list[tuple[float, float]]:
        """After a checkpoint's optimizer and schedule state were loaded: the given peaks back, and each group's
        rate the schedule's at its step; returns the (checkpoint's, this run's) peaks that differ."""
        groups = self.optimizer.param_groups
        saved = _peaks(groups)
        if isinstance(self.scheduler, LambdaLR):  # ours (Schedule), or transformers': a factor of the peak
            self.scheduler.base_lrs = list(self.given)
            rates = [base * f(self.scheduler.last_epoch) for base, f in zip(self.given, self.scheduler.lr_lambdas)]
            self.scheduler._last_lr = rates  # what get_last_lr() reports
        elif self.scheduler is not None:  # another scheduler: its own state (DeepSpeed may not carry the rate)
            rates = self.scheduler.get_last_lr()
        else:
            rates = self.given
        for group, given, rate in zip(groups, self.given, rates):
            if "initial_lr" in group:
                group["initial_lr"] = given
            group["lr"] = rate
        return [(a, b) for a, b in zip(saved, self.given) if a != b]


def _peaks(groups: list[dict]) -> list[float]:
    """Each parameter group's peak rate: the one a schedule scales (its ``initial_lr``), else its rate."""
    return [group.get("initial_lr", group["lr"]) for group in groups]
