"""Full parameters one bucket at a time: under ZeRO-3 every rank joins each bucket's gather (a collective)
and the extra memory on any rank is bounded by the bucket, never the whole model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import torch
from torch import nn

from grpo_accel.distributed import full_shape, gathered_parameters


@dataclass
class Bucket:
    names: list[str]  # Hugging Face names, in send order
    shapes: list[tuple[int, ...]]
    nbytes: int  # at the send dtype


def plan_buckets(named_params: list[tuple[str, nn.Parameter]], bucket_bytes: int, element_size: int) -> list[Bucket]:
    """Consecutive parameters grouped until ``bucket_bytes`` (a larger tensor gets a bucket of its own).
    Depends only on names and full shapes, so every rank plans the same buckets."""
    buckets: list[Bucket] = []
    current = Bucket([], [], 0)
    for name, p in named_params:
        shape = full_shape(p)
        nbytes = int(torch.Size(shape).numel()) * element_size
        if current.names and current.nbytes + nbytes > bucket_bytes:
            buckets.append(current)
            current = Bucket([], [], 0)
        current.names.append(name)
        current.shapes.append(shape)
        current.nbytes += nbytes
    if current.names:
        buckets.append(current)
    return buckets


class BucketedGather:
    """Iterates over a model's parameters as full tensors, bucket by bucket.

    Args:
        model: the unwrapped policy (names are its ``named_parameters``: the Hugging Face names).
        bucket_bytes: bytes per bucket at ``dtype``.
        dtype: the dtype tensors are sent in (e.g. the engine's bfloat16).

    ``peak_extra_bytes`` records the most memory the gather held at once on this rank (gathered full parameters
    beyond the local shards, plus the cast copies), measured from the tensors themselves.
    """

    def __init__(self, model: nn.Module, bucket_bytes: int, dtype: torch.dtype, materialize: bool = True) -> None:
        self.model, self.dtype, self.materialize = model, dtype, materialize
        self.named = [(n, p) for n, p in model.named_parameters()]
        self.buckets = plan_buckets(self.named, bucket_bytes, torch.tensor([], dtype=dtype).element_size())
        self.peak_extra_bytes = 0

    def __iter__(self) -> Iterator[tuple[Bucket, list[torch.Tensor] | None]]:
        """(bucket, tensors): tensors contiguous at ``dtype`` if ``materialize`` (the sending rank), else None."""
        params = dict(self.named)
        for bucket in self.buckets:
            group = [params[n] for n in bucket.names]
            with gathered_parameters(group):
                extra = sum(p.numel() * p.element_size() - _local_bytes(p) for p in group)
                tensors = [p.detach().to(self.dtype).contiguous() for p in group] if self.materialize else None
                if tensors is not None:  # casts that made a copy
                    params_ptrs = {p.data_ptr() for p in group}
                    extra += sum(t.numel() * t.element_size() for t in tensors if t.data_ptr() not in params_ptrs)
                self.peak_extra_bytes = max(self.peak_extra_bytes, extra)
                yield bucket, tensors


def _local_bytes(p: nn.Parameter) -> int:
    if hasattr(p, "ds_tensor"):
        return p.ds_tensor.numel() * p.ds_tensor.element_size()
    return p.numel() * p.element_size()

