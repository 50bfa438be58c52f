"""Decode-time matrix weights in oneDNN's blocked layout: the memory-bound products of a CPU decode step, faster.

A decode step multiplies a few rows (the live completions) by every weight matrix of the model. On a CPU that
is a read of each matrix, and the read is the cost: MKL's small-batch ``sgemm`` (what ``nn.Linear`` calls)
reached 7-10 GB/s here while a plain ``sum`` read memory at 23-27 GB/s. oneDNN's inner-product kernel on a
weight reordered once into its blocked layout reads the same matrix at ~16 GB/s (8 rows x 576 -> 1536, 60
distinct matrices, 2 threads). :class:`PackedLinears` reorders the weights of a model's plain ``nn.Linear``
modules for the length of one decode call and has those modules multiply by the reordered copy:

- SmolLM2-135M, 8 rows x 32 tokens: 3.61 s -> 1.99 s a batch, plus 0.19 s to reorder 538 MB;
- a model whose matrices sit in cache got slower packed: the tiny Qwen2 (0.3 MB) 0.030 -> 0.046 s, and, measured
  again with the lean forward's fused products (8 rows x 32 tokens, alternating in one process), the built-in
  Llama of 32 MiB of matrices 133 -> 171 ms (16 rows 188 -> 216 ms), while one of 128 MiB went 484 -> 425 ms
  (16 rows 701 -> 531 ms) and one of 432 MiB 1613 -> 1193 ms: :data:`PACK_MIN_BYTES` sits between them.

The reorder is done at every call (the weights may have changed since: an optimizer step, a weight push, or the
trainer process writing shared memory that a decode worker reads), and dropped after it. The products agree
with ``nn.Linear``'s to float32 rounding (another summation order), so a token drawn at a probability boundary
can differ from the unpacked loop's; float64 models, GPUs and ZeRO-3's partitioned parameters are never packed.
"""
from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from contextlib import contextmanager
from functools import partial

import torch
from torch import Tensor, nn

PACK_MIN_BYTES = 64 * 2**20
"""Matrix weights of at least this many bytes in all are packed (below it they stay in cache and packing costs)."""
PACKED_ROWS = 8
"""The batch the reorder is told to expect (a hint: any number of rows multiplies correctly)."""


def packing_reason(model: nn.Module) -> str | None:
    """Why :class:`PackedLinears` leaves ``model``'s products as they are, or None when it packs them."""
    linears = _plain_linears(model)
    if not linears:
        return "no nn.Linear modules"
    weight = linears[0].weight
    if weight.device.type != "cpu" or weight.dtype != torch.float32:
        return f"{weight.dtype} weights on {weight.device.type} (packing is for float32 on CPU)"
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN"
    size = sum(m.weight.numel() * m.weight.element_size() for m in linears)
    if size < PACK_MIN_BYTES:
        return f"{size / 2**20:.1f} MiB of matrix weights (packing pays from {PACK_MIN_BYTES // 2**20} MiB)"
    return None


class PackedLinears:
    """``with packed():`` the model's plain ``nn.Linear`` modules multiply by oneDNN-packed copies of their
    weights, taken when the block starts (forward hooks still run: only ``forward`` is swapped).

    Example:
        >>> packed = PackedLinears(model)
        >>> with torch.inference_mode(), packed():
        ...     logits = model(input_ids).logits
    """

    def __init__(self, model: nn.Module) -> None:
        # a module whose forward is already swapped (accelerate's offload hooks do that) keeps its own
        self.linears = [m for m in _plain_linears(model) if "forward" not in m.__dict__]

    @contextmanager
    def __call__(self, skip: Collection[nn.Module] = ()) -> Iterator[None]:
        """Packed for the block; the modules in ``skip`` (multiplied some other way) stay as they are."""
        swapped = [m for m in self.linears if all(m is not s for s in skip)]
        try:
            for module in swapped:
                module.forward = packed_product(module.weight, module.bias)
            yield
        finally:
            for module in swapped:
                module.__dict__.pop("forward", None)


def packed_product(weight: Tensor, bias: Tensor | None) -> Callable[[Tensor], Tensor]:
    """``x -> x @ weight.T + bias`` ([..., in] -> [..., out]) by ``weight`` as it is now, reordered for oneDNN."""
    packed = torch.ops.mkldnn._reorder_linear_weight(weight.detach(), PACKED_ROWS)
    return partial(_packed_linear, packed, None if bias is None else bias.detach())


def _packed_linear(packed: Tensor, bias: Tensor | None, x: Tensor) -> Tensor:  # [..., in] -> [..., out]
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


def _plain_linears(model: nn.Module) -> list[nn.Linear]:
    """The ``nn.Linear`` modules themselves (not subclasses, whose forward may do more: LoRA's wraps its base
    layer, which is a plain one)."""
    return [m for m in model.modules() if type(m) is nn.Linear]
