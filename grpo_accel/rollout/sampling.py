"""Keyed sampling: each completion's random stream depends only on its own key, never on the batch around it.

``argmax(logits / T + Gumbel noise)`` is an exact sample from ``softmax(logits / T)`` (the Gumbel-max trick).
The noise of row ``r`` at decoding step ``t`` is a counter-based hash of ``(key[r], t, token)``: the same key
gives the same completion whichever process, batch or position generates it. That makes runs reproducible
across process counts (2 processes x 64 completions sample exactly what 1 x 128 samples).
"""
from __future__ import annotations

import torch
from torch import Tensor

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_STEP = 0xD1B54A32D192ED03


def _i64(x: int) -> Tensor:
    """The uint64 value ``x mod 2**64`` as an int64 tensor with the same bits."""
    x %= 1 << 64
    return torch.tensor(x - (1 << 64) if x >= 1 << 63 else x, dtype=torch.long)


def _xor_shr_(x: Tensor, bits: int, scratch: Tensor) -> Tensor:
    """``x ^= x >>> bits`` in place (a logical shift of int64 bit patterns: torch's >> is arithmetic)."""
    torch.bitwise_right_shift(x, bits, out=scratch)
    scratch &= (1 << (64 - bits)) - 1
    return x.bitwise_xor_(scratch)


def keyed_uniform(keys: Tensor, steps: Tensor, vocab: int) -> Tensor:  # [N], [S] -> [N, S, V] float64 in (0, 1)
    """splitmix64 of (key, step, token): independent uniforms per row, step and token. In place on one buffer:
    at a real vocabulary the temporaries, not the arithmetic, were the cost."""
    x = keys[:, None, None] * _i64(_GOLDEN) + (steps.to(keys.device) * _i64(_STEP))[None, :, None]
    x = x + torch.arange(vocab, device=keys.device)
    scratch = torch.empty_like(x)
    _xor_shr_(x, 30, scratch).mul_(_i64(_MIX1))  # int64 multiplication wraps: exactly the uint64 product's bits
    _xor_shr_(x, 27, scratch).mul_(_i64(_MIX2))
    _xor_shr_(x, 31, scratch)
    torch.bitwise_right_shift(x, 11, out=scratch)
    scratch &= (1 << 53) - 1
    return scratch.double().add_(0.5).div_(float(1 << 53))


def keyed_gumbel(keys: Tensor, steps: Tensor, vocab: int) -> Tensor:  # [N], [S] -> [N, S, V] float32
    return keyed_uniform(keys, steps, vocab).log_().neg_().log_().neg_().float()


class KeyedSampler:
    """A transformers ``LogitsProcessor`` that turns greedy decoding into keyed sampling.

    Applies temperature, top-k and top-p, then adds keyed Gumbel noise; ``generate(do_sample=False)`` then
    picks the sampled token. ``prompt_width`` locates the decoding step from the sequence length.
    """

    def __init__(self, keys: Tensor, prompt_width: int, temperature: float, top_k: int = 0, top_p: float = 1.0):
        self.keys, self.prompt_width = keys, prompt_width
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:  # [N, L], [N, V] -> [N, V]
        step = torch.tensor([input_ids.shape[1] - self.prompt_width])
        return self.filtered(scores) + keyed_gumbel(self.keys.to(scores.device), step, scores.shape[-1])[:, 0]

    def filtered(self, scores: Tensor) -> Tensor:  # [N, V] -> [N, V] float32
        """``scores / temperature`` with top-k / top-p applied: adding the keyed noise and taking the argmax draws."""
        z = scores.float() / self.temperature
        if self.top_k:
            kth = z.topk(min(self.top_k, z.shape[-1]), dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_z, order = z.sort(dim=-1, descending=True)
            cum = sorted_z.softmax(-1).cumsum(-1)
            drop_sorted = cum - sorted_z.softmax(-1) > self.top_p  # keep the smallest prefix reaching top_p
            z = z.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        return z
