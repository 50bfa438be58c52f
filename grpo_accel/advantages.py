"""Group-relative advantages: what the collector attaches to a scored rollout (the loss only reads them)."""
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
    adv = r - baseline
    if scale_by_std:
        adv = adv / (r.std(-1, keepdim=True) + eps)
    return adv.reshape(-1)
