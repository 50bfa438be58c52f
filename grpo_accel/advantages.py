"""Shared by rewards/ and rollout/.

Group-relative advantages: what the collector attaches to a scored rollout (the loss only reads them)."""
from __future__ import annotations

from torch import Tensor


def group_advantages(
    rewards: Tensor,  # [N] = [B*G], the G completions of a prompt contiguous
    group_size: int,
    scale_by_std: bool = True,
    leave_one_out: bool = False,
    eps: float = 1e-4,
) -> Tensor:  # [N]
    """Group-relative advantages: each reward minus its group's baseline, optionally over the group's std.

    ``leave_one_out`` uses the mean of the *other* G-1 rewards as baseline (RLOO). A group whose rewards all
    tie gets advantage 0 in every mode.
    """
    r = rewards.view(-1, group_size)  # [B, G]
    if leave_one_out:
        baseline = (r.sum(-1, keepdim=True) - r) / (group_size - 1)
    else:
        baseline = r.mean(-1, keepdim=True)
    adv = standardised(r, baseline, sample_std=True, eps=eps) if scale_by_std else r - baseline
    return adv.reshape(-1)


def standardised(x: Tensor, baseline: Tensor, *, sample_std: bool, eps: float) -> Tensor:  # [R, G], [R, 1|G] -> [R, G]
    """``(x - baseline) / (std of each row of x + eps)``: the one group statistic, with its choices explicit.

    The advantage divides by the sample std (n - 1), as torchrl's and TRL's GRPO do (their published runs use it);
    per-reward normalisation (:func:`grpo_accel.rewards.standardise`) by the population std (n), which stays
    defined on one row (a process's batch of one prompt) and gives the values unit variance over what it
    scales. The eps differ with the scale they guard: 1e-4 on rewards of ~1, 1e-6 on values already divided."""
    return (x - baseline) / (x.std(-1, correction=1 if sample_std else 0, keepdim=True) + eps)
