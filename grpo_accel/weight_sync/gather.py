"""Full tensors for the engines one bucket at a time: under ZeRO-3 every rank joins each bucket's gather (a
collective) and the extra memory on any rank is bounded by the bucket, never the whole model."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Iterator

import torch
from torch import Tensor, nn

from grpo_accel.distributed import full_shape, gathered_parameters, local_numel


@dataclass(frozen=True)
class EngineWeight:
    """One tensor an engine holds: its (Hugging Face) name and how it is made from the trained parameters."""

    name: str
    params: tuple[nn.Parameter, ...]  # gathered together under ZeRO-3; params[0] has the tensor's shape
    combine: Callable[..., Tensor] | None = None  # full params -> the tensor; None: params[0] itself

    def value(self) -> Tensor:
        """The tensor; call it with ``params`` gathered."""
        tensors = [p.detach() for p in self.params]
        return tensors[0] if self.combine is None else self.combine(*tensors)


def engine_weights(model: nn.Module) -> list[EngineWeight]:
    """What an engine serving ``model`` holds, in parameter order: its parameters, or for a LoRA model the merged
    weights under the base model's names (see :mod:`grpo_accel.lora`)."""
    from grpo_accel.lora import is_lora, merged_engine_weights  # lazily: peft only for LoRA runs

    if is_lora(model):
        return [EngineWeight(*weight) for weight in merged_engine_weights(model)]
    return [EngineWeight(name, (p,)) for name, p in model.named_parameters()]


@dataclass
class Bucket:
    names: list[str]  # Hugging Face names, in send order
    shapes: list[tuple[int, ...]]
    nbytes: int  # at the send dtype


def plan_buckets(named_shapes: list[tuple[str, tuple[int, ...]]], bucket_bytes: int, element_size: int) -> list[Bucket]:
    """Consecutive tensors grouped until ``bucket_bytes`` (a larger tensor gets a bucket of its own).
    Depends only on names and full shapes, so every rank plans the same buckets."""
    buckets: list[Bucket] = []
    current = Bucket([], [], 0)
    for name, shape in named_shapes:
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
    """Iterates over the tensors an engine holds (:func:`engine_weights`), bucket by bucket.

    Args:
        model: the unwrapped policy.
        bucket_bytes: bytes per bucket at ``dtype``.
        dtype: the dtype tensors are sent in (e.g. the engine's bfloat16).

    ``peak_extra_bytes`` records the most memory the gather held at once on this rank (gathered full parameters
    beyond the local shards, plus the computed and cast copies), measured from the tensors themselves.
    """

    def __init__(self, model: nn.Module, bucket_bytes: int, dtype: torch.dtype, materialize: bool = True) -> None:
        self.model, self.dtype, self.materialize = model, dtype, materialize
        self.weights = engine_weights(model)
        named_shapes = [(w.name, full_shape(w.params[0])) for w in self.weights]
        self.buckets = plan_buckets(named_shapes, bucket_bytes, torch.tensor([], dtype=dtype).element_size())
        self.peak_extra_bytes = 0

    def __iter__(self) -> Iterator[tuple[Bucket, list[torch.Tensor] | None]]:
        """(bucket, tensors): tensors contiguous at ``dtype`` if ``materialize`` (the sending rank), else None."""
        by_name = {w.name: w for w in self.weights}
        for bucket in self.buckets:
            weights = [by_name[n] for n in bucket.names]
            group = [p for w in weights for p in w.params]
            with gathered_parameters(group):
                extra = sum((p.numel() - local_numel(p)) * p.element_size() for p in group)
                tensors = [w.value().to(self.dtype).contiguous() for w in weights] if self.materialize else None
                if tensors is not None:  # tensors that are copies, not the parameters themselves
                    params_ptrs = {p.data_ptr() for p in group}
                    extra += sum(t.numel() * t.element_size() for t in tensors if t.data_ptr() not in params_ptrs)
                self.peak_extra_bytes = max(self.peak_extra_bytes, extra)
                yield bucket, tensors
