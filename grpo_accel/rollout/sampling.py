"""Keyed sampling: each completion's random stream depends only on its own key, never on the batch around it.

At decoding step ``t`` row ``r`` draws one uniform ``u``, a counter-based hash of ``(key[r], t)``, and takes the
token where the row's cumulative distribution ``cumsum(softmax(logits / T))`` first exceeds ``u`` (inverse
transform sampling: an exact sample of the distribution). The same key gives the same completion whichever
process, batch or position generates it, so runs are reproducible across process counts (2 processes x 64
completions sample exactly what 1 x 128 samples). One uniform per row replaced Gumbel-max noise per vocabulary
entry (a hash of every ``(key, t, token)``): at SmolLM2's 49,152 tokens and 64 rows that noise cost ~60 ms of a
258 ms decode step.
"""
from __future__ import annotations

import torch
from torch import Tensor

_GOLDEN = 0x9E3779B97F4A7C15
_MIX1, _MIX2 = 0xBF58476D1CE4E5B9, 0x94D049BB133111EB
_STEP = 0xD1B54A32D192ED03


SEED_RANGE = 2**56
"""Seeds drawn from torch's RNG for a batch given none: each then makes ``group_size`` keys (``completion_keys``)."""


def group_seeds(run_seed: int, group_ids: list[int]) -> list[int]:
    """The seed of each group (a prompt's completions in one batch) from the run's seed and the group's id (its
    index among all the groups the run draws): ``(run_seed mod 2**20) * 2**36 + id``, within ``SEED_RANGE``. It
    depends on nothing else: the same samples whatever the number of processes."""
    return [(run_seed % 2**20) * 2**36 + g % 2**36 for g in group_ids]


def batch_seeds(seeds: list[int] | None, prompts: int) -> list[int]:
    """``seeds`` (one per prompt), or without them one per prompt from torch's RNG (the trainer seeds it)."""
    return list(seeds) if seeds is not None else torch.randint(0, SEED_RANGE, (prompts,)).tolist()


def completion_keys(seeds: list[int], group_size: int) -> list[int]:
    """The key of each completion, prompt by prompt: completion j of the prompt with seed s draws with
    ``s * group_size + j``, whichever engine, process or batch generates it."""
    return [seed * group_size + j for seed in seeds for j in range(group_size)]


def turn_key(key: int, turn: int) -> int:
    """The key of a later model turn (``turn`` >= 1) of the episode whose first turn drew with ``key``."""
    return (key * 1_000_003 + turn) % SEED_RANGE


def _i64(x: int) -> Tensor:
    """The uint64 value ``x mod 2**64`` as an int64 tensor with the same bits."""
    x %= 1 << 64
    return torch.tensor(x - (1 << 64) if x >= 1 << 63 else x, dtype=torch.long)


def _xor_shr_(x: Tensor, bits: int, scratch: Tensor) -> Tensor:
    """``x ^= x >>> bits`` in place (a logical shift of int64 bit patterns: torch's >> is arithmetic)."""
    torch.bitwise_right_shift(x, bits, out=scratch)
    scratch &= (1 << (64 - bits)) - 1
    return x.bitwise_xor_(scratch)


def keyed_uniform(keys: Tensor, steps: Tensor) -> Tensor:  # [N], [S] -> [N, S] float64 in (0, 1)
    """splitmix64 of (key, step): an independent uniform per row and step."""
    x = keys[:, None] * _i64(_GOLDEN) + (steps.to(keys.device) * _i64(_STEP))[None, :]
    scratch = torch.empty_like(x)
    _xor_shr_(x, 30, scratch).mul_(_i64(_MIX1))  # int64 multiplication wraps: exactly the uint64 product's bits
    _xor_shr_(x, 27, scratch).mul_(_i64(_MIX2))
    _xor_shr_(x, 31, scratch)
    torch.bitwise_right_shift(x, 11, out=scratch)
    scratch &= (1 << 53) - 1
    return scratch.double().add_(0.5).div_(float(1 << 53))


def inverse_cdf(z: Tensor, u: Tensor) -> Tensor:  # [N, V] scaled logits (-inf: excluded), [N] in (0, 1) -> [N]
    """The token of each row where ``cumsum(softmax(z))`` first exceeds ``u`` times its total.

    The probabilities are float32 (relative error ~1e-7 each), their running sum float64: over 49,152 entries a
    float32 sum would drift by more than the smallest probabilities. Scaling ``u`` by the row's total keeps the
    index inside the row and on a token of non-zero probability (the first entry above a level has mass)."""
    cdf = torch.softmax(z.float(), dim=-1).double().cumsum_(dim=-1)  # [N, V]
    level = (u.to(cdf.device, torch.float64) * cdf[:, -1])[:, None]  # [N, 1]
    return torch.searchsorted(cdf, level, right=True)[:, 0].clamp_(max=z.shape[-1] - 1)


class KeyedSampler:
    """A transformers ``LogitsProcessor`` that turns greedy decoding into keyed sampling.

    Applies temperature, top-k and top-p, draws each row's token with its keyed uniform (:func:`inverse_cdf`)
    and leaves that token the only finite score; ``generate(do_sample=False)`` then picks it. ``prompt_width``
    locates the decoding step from the sequence length.
    """

    def __init__(self, keys: Tensor, prompt_width: int, temperature: float, top_k: int = 0, top_p: float = 1.0):
        self.keys, self.prompt_width = keys, prompt_width
        self.temperature, self.top_k, self.top_p = temperature, top_k, top_p

    def __call__(self, input_ids: Tensor, scores: Tensor) -> Tensor:  # [N, L], [N, V] -> [N, V]
        step = torch.tensor([input_ids.shape[1] - self.prompt_width])
        token = self.draw(scores, keyed_uniform(self.keys.to(scores.device), step)[:, 0])
        return torch.full_like(scores, float("-inf")).scatter_(1, token[:, None], 0.0)

    def draw(self, scores: Tensor, u: Tensor) -> Tensor:  # [N, V], [N] -> [N] tokens
        return inverse_cdf(self.filtered(scores), u)

    def filtered(self, scores: Tensor) -> Tensor:  # [N, V] -> [N, V] float32
        """``scores / temperature`` with top-k / top-p applied (excluded tokens at -inf)."""
        z = scores.float()
        if self.temperature != 1.0:  # z / 1.0 is z: one op less per decode step
            z = z / self.temperature
        if self.top_k:
            kth = z.topk(min(self.top_k, z.shape[-1]), dim=-1).values[:, -1:]
            z = z.masked_fill(z < kth, float("-inf"))
        if self.top_p < 1.0:
            sorted_z, order = z.sort(dim=-1, descending=True)
            cum = sorted_z.softmax(-1).cumsum(-1)
            drop_sorted = cum - sorted_z.softmax(-1) > self.top_p  # keep the smallest prefix reaching top_p
            z = z.masked_fill(drop_sorted.scatter(-1, order, drop_sorted), float("-inf"))
        return z
