"""The trainer's arithmetic around the loss: what each micro-batch divides by so that an optimizer step over
several micro-batches and processes takes the token mean (or the aggregation's unit) of all of them exactly once,
and filling a rollout's stored logprobs in the training forward's own chunks."""
from __future__ import annotations

from typing import Callable

import torch
from tensordict import TensorDict
from torch import Tensor

from grpo_accel import batch
from grpo_accel.contracts import LossModule


def distributed_normalizer(global_units: Tensor, num_processes: int, accumulation_steps: int) -> Tensor:
    """What each micro-batch divides its numerator by so the optimizer step sees sum(all) / global_units.

    ``global_units``: the aggregation units of the whole optimizer step, summed over micro-batches and ranks.
    Accelerate's ``backward`` divides each micro-batch loss by ``accumulation_steps`` and DDP / DeepSpeed
    average gradients over ``num_processes``; pre-multiplying by both undoes them exactly once. A step with no
    unit (every completion truncated under ``mask_truncated``) has a zero numerator too: it divides by 1.
    """
    return global_units.clamp(min=1) / (num_processes * accumulation_steps)


def step_normalizer(loss: LossModule, micro_batches: list, accelerator, accumulation_steps: int, device) -> Tensor:
    """:func:`distributed_normalizer` of one optimizer step: its units over every process (one all-reduce)."""
    units = sum(loss.units(mb.to(device)) for mb in micro_batches)
    total = accelerator.reduce(units.reshape(1).float().to(device), reduction="sum")[0]
    return distributed_normalizer(total, accelerator.num_processes, accumulation_steps)


def add_in_chunks(add: Callable[[TensorDict], None], rollout: TensorDict, key: str, chunk: int,
                  device: torch.device) -> None:
    """Fill ``rollout[key]`` with ``add`` (e.g. :meth:`~grpo_accel.contracts.LossModule.add_reference_logprobs`) over chunks of ``chunk`` rows,
    each trimmed to its longest row and moved to ``device``: the shapes the training forward sees, so the values are
    those it would compute."""
    parts = []
    for start in range(0, rollout.numel(), chunk):
        part = batch.trim_padding(rollout[start : start + chunk]).to(device)
        add(part)
        parts.append(part.to("cpu"))
    rollout[key] = batch.concat_rollouts(parts, pad_id=0)[key]
