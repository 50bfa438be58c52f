"""The embedded engine's decode loop: the model's own forward, a lean loop around it.

``generate`` in transformers spends most of a small model's decode step outside the model: it re-creates the
attention mask from the 2-D padding mask, grows the key/value cache by concatenation, and runs its logits
processors and stopping criteria one by one. This loop keeps the model's forward (any causal LM whose layers
all use full attention; for Llama-family models its modules without transformers' wrappers,
:mod:`grpo_accel.embedded.lean`) and does the rest once:

- one prefill per prompt: the G completions of a prompt copy its keys and values instead of recomputing them
  (a later turn of multi-turn episodes too: each episode then prefills only its own tokens after the prompt);
- a key/value cache allocated once for the whole completion budget, written in place (:class:`BudgetCache`);
- the attention mask made once per call in the attention's format, 4-D, each step's a slice of it (the model
  builds no mask of its own);
- the keyed sampler and the logprob of the drawn token in the same step;
- finished rows leave the batch once they are half of it (the cache rows are compacted).

The draws are those of :class:`~grpo_accel.rollout.sampling.KeyedSampler` under ``generate``: the same keys give
the same tokens, and the reported logprobs are ``log_softmax(logits / temperature)`` at the drawn token (before
top-k/top-p), as SGLang reports them.
"""
from __future__ import annotations

import contextlib
import inspect
from dataclasses import dataclass

import torch
from torch import Tensor, nn
from transformers.cache_utils import Cache, CacheLayerMixin

from grpo_accel import batch
from grpo_accel.attention import additive_dtype, mask_reason, model_mask, transformers_model
from grpo_accel.distributed import zero3_collective, zero3_partitioned
from grpo_accel.logprobs import position_ids_from_mask
from grpo_accel.embedded.lean import LeanForward, lean_reason, plain_product
from grpo_accel.embedded.packed import PackedLinears, packed_product, packing_reason
from grpo_accel.rollout.sampling import KeyedSampler, keyed_uniform

DECODERS = ("auto", "fast", "compiled", "generate")
"""The embedded engine's decode paths (``EmbeddedEngine(decoder=...)``, ``rollout.decoder``)."""


@dataclass
class DecodeSettings:
    """What to draw: the budget, the sampler's settings and the stop tokens (the first is the EOS)."""

    max_new_tokens: int
    stop_ids: tuple[int, ...]
    pad_id: int
    temperature: float = 1.0
    top_k: int = 0
    top_p: float = 1.0
    min_new_tokens: int = 0  # EOS is not drawn before this many tokens (the benchmark's fixed-length mode)


def unsupported_reason(model: nn.Module) -> str | None:
    """Why this loop cannot decode ``model`` (then transformers' ``generate`` does), or None when it can."""
    reason = mask_reason(model)
    if reason is not None:
        return reason
    try:
        BudgetCache(1, 1)
    except TypeError as exc:  # another transformers release asks more of a cache layer
        return f"this transformers release's Cache interface ({exc})"
    return None


class _BudgetLayer(CacheLayerMixin):
    """One layer's keys and values in buffers [rows, heads, capacity, head_dim], written in place."""

    def __init__(self, owner: "BudgetCache") -> None:
        super().__init__()
        self.owner = owner

    def lazy_initialization(self, key_states: Tensor, value_states: Tensor) -> None:
        rows, heads, _, _ = key_states.shape
        self.keys = key_states.new_zeros(rows, heads, self.owner.capacity, key_states.shape[-1])
        self.values = value_states.new_zeros(rows, heads, self.owner.capacity, value_states.shape[-1])
        self.is_initialized = True

    def update(self, key_states: Tensor, value_states: Tensor, *args, **kwargs) -> tuple[Tensor, Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        start, end = self.owner.length, self.owner.length + key_states.shape[-2]
        self.keys[:, :, start:end] = key_states
        self.values[:, :, start:end] = value_states
        return self.keys[:, :, :end], self.values[:, :, :end]

    def get_mask_sizes(self, query_length: int) -> tuple[int, int]:
        return self.owner.length + query_length, 0

    def get_seq_length(self) -> int:
        return self.owner.length

    def get_max_length(self) -> int:
        return self.owner.capacity

    get_max_cache_shape = get_max_length  # the name of transformers < 5

    def take_rows(self, rows: Tensor) -> None:  # rows [M] long, repeats allowed
        self.keys, self.values = self.keys.index_select(0, rows), self.values.index_select(0, rows)


class BudgetCache(Cache):
    """A transformers ``Cache`` sized once for prompt + completion budget; ``length`` tokens are filled.

    Every layer writes at ``length``; the loop advances it after each forward (:meth:`advance`).
    """

    def __init__(self, num_layers: int, capacity: int) -> None:
        self.capacity, self.length = capacity, 0
        super().__init__(layers=[_BudgetLayer(self) for _ in range(num_layers)])

    def advance(self, tokens: int) -> None:
        self.length += tokens

    def take_rows(self, rows: Tensor) -> None:
        """Keep (or repeat) cache rows: ``rows`` [M] indexes the current rows."""
        for layer in self.layers:
            layer.take_rows(rows)


class Decoder:
    """The decode loop bound to one model: its forward and its mask format, set up once.

    The forward is :class:`~grpo_accel.embedded.lean.LeanForward` (the model's modules without transformers'
    wrappers) where it covers the model (:func:`~grpo_accel.embedded.lean.lean_reason`) and the parameters are
    whole (not under ZeRO-3, whose forward gathers them); otherwise the model's own forward. ``lean=False`` takes
    the model's forward regardless. A float32 model on CPU with enough matrix weights to leave the cache
    multiplies by weights packed for oneDNN at each call (:mod:`grpo_accel.embedded.packed`), outside ZeRO-3 and
    compilation.

    ``compiled`` compiles the model's forward with inductor and dynamic shapes (one graph for the prefill, one
    for the decode steps, whatever the lengths and batch). The first call then takes seconds to minutes; each
    decode step after it runs a fraction of the eager dispatch cost. The graph reads the parameters as inputs,
    so in-place weight updates are seen.

    Example:
        >>> decoder = Decoder(model)
        >>> tokens, logprobs = decoder(prompt_ids, prompt_mask, 8, keys, DecodeSettings(32, (eos_id,), pad_id))
    """

    def __init__(self, model: nn.Module, compiled: bool = False, lean: bool = True) -> None:
        self.model, self.compiled = model, compiled
        self.lean = lean and not compiled and not zero3_partitioned() and lean_reason(model) is None
        self.mask_dtype = additive_dtype(model)  # the model's forward takes its attention's format
        cache_arg = "cache" if "cache" in inspect.signature(transformers_model(model).forward).parameters else "past_key_values"

        def forward(ids: Tensor, mask: Tensor, positions: Tensor, cache: BudgetCache) -> Tensor:  # -> [B, V]
            out = model(input_ids=ids, attention_mask=mask, position_ids=positions, use_cache=True,
                        logits_to_keep=1, **{cache_arg: cache})
            return out.logits[:, -1]

        self.wrapped = torch.compile(forward, dynamic=True) if compiled else forward
        self.lean_forward = LeanForward(model) if self.lean else None
        self.forward = self.lean_forward or self.wrapped
        whole = not compiled and not zero3_partitioned()
        self.packed = PackedLinears(model) if whole and packing_reason(model) is None else None
        self.synced = zero3_collective()
        # inference mode skips autograd's per-op bookkeeping (~12% of a tiny model's step); not under ZeRO-3,
        # whose forward hooks allocate the gathered parameters, which must stay ordinary tensors for training
        self.no_grad = torch.no_grad if zero3_partitioned() else torch.inference_mode

    @property
    def description(self) -> str:
        """Which forward decodes, and on a slower one why (and how to get the C step): the run's start line."""
        if self.lean_forward is None:
            why = ("compiled by inductor: rollout.decoder=compiled" if self.compiled else
                   "ZeRO-3 gathers each module's shards as it runs" if zero3_partitioned() else
                   lean_reason(self.model) or "the lean forward is off")
            return f"decode: the decode loop on the model's own forward ({why})"
        reason = self.lean_forward.native_reason
        if reason is None:
            from grpo_accel.embedded.native import native_library

            return f"decode: the lean decode loop with its C step ({native_library()})"
        return f"decode: the lean decode loop on torch ops, without its C step: {reason}"

    def _everywhere(self, finished: bool) -> bool:
        """Whether every process finished. Under ZeRO-3 each forward gathers parameters from all processes, so
        all of them run the same number of steps: one that finished keeps stepping until the last one has (as
        ``generate(synced_gpus=True)`` does). Elsewhere a process decides alone."""
        if not self.synced:
            return finished
        import torch.distributed as dist

        unfinished = torch.tensor([0.0 if finished else 1.0], device=next(self.model.parameters()).device)
        dist.all_reduce(unfinished)
        return float(unfinished) == 0.0

    def __call__(
        self,
        prompt_ids: Tensor,  # [P, L] left-padded, one row per prompt
        prompt_mask: Tensor,  # [P, L]
        group_size: int,
        keys: Tensor | None,  # [N] sampling keys, None for greedy
        settings: DecodeSettings,
        *,
        prompt_of: Tensor | None = None,  # [N] the prompt each row continues (default: group_size rows per prompt)
        suffix_ids: Tensor | None = None,  # [N, S] left-padded: each row's tokens between its prompt and the draws
        suffix_mask: Tensor | None = None,  # [N, S]
    ) -> tuple[Tensor, Tensor]:  # completions [N, C] (pad after EOS), logprobs [N, C] (float32 or wider)
        """Sample ``group_size`` completions per prompt; C is the longest completion (at most the budget).

        With ``prompt_of`` and ``suffix_ids`` (a later turn of multi-turn episodes), row i continues prompt ``prompt_of[i]``
        after its own suffix: each prompt is prefilled once for all its rows, then only the suffixes are.
        """
        lean = self.lean_forward is not None and not self.lean_forward.hooked()  # hooks come and go (a test's, a user's)
        if self.lean_forward is not None:
            self.forward = self.lean_forward if lean else self.wrapped
            self.mask_dtype = self.lean_forward.mask_dtype() if lean else additive_dtype(self.model)
        with self.no_grad(), self._weights(lean):
            drawn = self._draw(prompt_ids, prompt_mask, group_size, keys, settings, prompt_of, suffix_ids, suffix_mask)
        n = prompt_ids.shape[0] * group_size if prompt_of is None else prompt_of.numel()
        return _assemble(drawn, n, settings)  # outside inference mode: ordinary tensors for the trainer

    def _draw(self, prompt_ids: Tensor, prompt_mask: Tensor, group_size: int, keys: Tensor | None,
              settings: DecodeSettings, prompt_of: Tensor | None, suffix_ids: Tensor | None,
              suffix_mask: Tensor | None) -> list[tuple[Tensor, Tensor, Tensor]]:  # (live rows, token, logprob) per step
        device = prompt_ids.device
        prompts, width = prompt_ids.shape
        if prompt_of is None:
            prompt_of = torch.arange(prompts, device=device).repeat_interleave(group_size)
        n, extra = prompt_of.numel(), 0 if suffix_ids is None else suffix_ids.shape[1]
        budget = settings.max_new_tokens
        cache = BudgetCache(self.model.config.num_hidden_layers, width + extra + budget)
        visible = torch.ones(n, width + extra + budget, dtype=torch.bool, device=device)  # [N, L + S + C] keys seen
        visible[:, :width] = prompt_mask.bool()[prompt_of]
        positions = position_ids_from_mask(prompt_mask)  # [P, L]

        logits = self.forward(prompt_ids, self._mask(_prefill_mask(prompt_mask)), positions, cache)  # [P, V]
        cache.advance(width)
        cache.take_rows(prompt_of)
        logits = logits[prompt_of]  # [N, V]
        next_position = positions[prompt_of, -1:] + 1  # [N, 1]
        if suffix_ids is not None:
            visible[:, width : width + extra] = suffix_mask.bool()
            suffix_positions = next_position + suffix_mask.cumsum(1) - 1  # [N, S]
            mask = visible[:, None, None, : width + extra].repeat(1, 1, extra, 1)  # [N, 1, S, L + S]
            mask[..., width:] &= torch.ones(extra, extra, dtype=torch.bool, device=device).tril()
            mask[..., width:] |= torch.eye(extra, dtype=torch.bool, device=device)  # a padding query sees itself
            logits = self.forward(suffix_ids, self._mask(mask), suffix_positions, cache)
            cache.advance(extra)
            next_position = suffix_positions[:, -1:] + 1
        draw = _Draws(keys, settings, device)
        stops = torch.tensor(settings.stop_ids, device=device)

        live = torch.arange(n, device=device)  # [M] the batch rows still decoding, in batch order
        done = torch.zeros(n, dtype=torch.bool, device=device)  # [M]
        seen = self._mask(visible[:, None, None])  # [M, 1, 1, L + S + C]: a step's mask is a slice of it
        drawn: list[tuple[Tensor, Tensor, Tensor]] = []  # (live rows, token [M], logprob [M]) per step
        for step in range(budget):
            token, logprob = draw(logits, step)  # [M], [M]; rows already done draw garbage, masked at the end
            drawn.append((live, token, logprob))
            done = done | torch.isin(token, stops)
            finished = int(done.sum())
            if step + 1 == budget or self._everywhere(finished == done.numel()):
                break
            if done.numel() > finished and 2 * finished >= done.numel():  # compact: the finished half leaves
                keep = (~done).nonzero().squeeze(1)
                cache.take_rows(keep)
                live, done, token, next_position, seen = (t[keep] for t in (live, done, token, next_position, seen))
                draw.keep(keep)
            logits = self.forward(token[:, None], seen[..., : cache.length + 1], next_position, cache)
            cache.advance(1)
            next_position = next_position + 1
        return drawn

    @contextlib.contextmanager
    def _weights(self, lean: bool):
        """One call's products: under the lean forward each layer's q/k/v and gate/up fused, and packed where
        the model's matrices are (each taken now: the weights may have changed since the last call)."""
        with contextlib.ExitStack() as stack:
            product = packed_product if self.packed is not None else plain_product
            fused = stack.enter_context(self.lean_forward.fused(product)) if lean else []
            if self.packed is not None:
                stack.enter_context(self.packed(skip=fused))
            yield

    def _mask(self, mask: Tensor) -> Tensor:  # [B, 1, Q, S] bool -> the attention's format
        """A 4-D mask reaches the attention as it is (transformers' mask creation returns it unchanged)."""
        return model_mask(mask, self.mask_dtype)


def _assemble(drawn: list[tuple[Tensor, Tensor, Tensor]], n: int,
              settings: DecodeSettings) -> tuple[Tensor, Tensor]:  # -> tokens [N, C], logprobs [N, C]
    """The per-step draws as [N, C] tensors, one write per stretch of steps with the same live rows; after a
    row's EOS, pad tokens and zero logprobs."""
    first = drawn[0][1]
    tokens = first.new_full((n, len(drawn)), settings.pad_id)
    logprobs = drawn[0][2].new_zeros(n, len(drawn))
    start = 0
    for end in range(1, len(drawn) + 1):
        if end == len(drawn) or drawn[end][0] is not drawn[start][0]:
            live = drawn[start][0]
            tokens[live, start:end] = torch.stack([t for _, t, _ in drawn[start:end]], 1)
            logprobs[live, start:end] = torch.stack([lp for _, _, lp in drawn[start:end]], 1)
            start = end
    after_eos = batch.after_stop(tokens, settings.stop_ids)
    return tokens.masked_fill(after_eos, settings.pad_id), logprobs.masked_fill(after_eos, 0.0)


class _Draws:
    """Each live row's token and its logprob at a step: :class:`KeyedSampler`'s draw with the row's keyed uniform
    of that step (all steps' uniforms computed at once, [M, budget]), or the most likely token without keys."""

    def __init__(self, keys: Tensor | None, settings: DecodeSettings, device: torch.device) -> None:
        self.settings = settings
        self.sampler = None if keys is None else KeyedSampler(keys, 0, settings.temperature, settings.top_k, settings.top_p)
        self.uniforms = None if keys is None else keyed_uniform(keys.to(device), torch.arange(settings.max_new_tokens))

    def __call__(self, logits: Tensor, step: int) -> tuple[Tensor, Tensor]:  # [M, V] -> token [M], logprob [M]
        s = self.settings
        z = logits.float()
        if step < s.min_new_tokens:
            z = z.index_fill(-1, torch.tensor(s.stop_ids, device=z.device), float("-inf"))
        token = z.argmax(-1) if self.sampler is None else self.sampler.draw(z, self.uniforms[:, step])
        wide = logits.to(torch.promote_types(logits.dtype, torch.float32))
        if s.temperature != 1.0:
            wide = wide / s.temperature
        logprob = torch.log_softmax(wide, -1).gather(-1, token[:, None])[:, 0]
        return token, logprob

    def keep(self, rows: Tensor) -> None:  # rows [M'] of the live rows
        if self.uniforms is not None:
            self.uniforms = self.uniforms[rows]


def _prefill_mask(prompt_mask: Tensor) -> Tensor:  # [P, L] -> [P, 1, L, L] bool
    """Causal over the prompt, padding hidden; a padding query sees itself (its output is never used)."""
    width = prompt_mask.shape[1]
    causal = torch.ones(width, width, dtype=torch.bool, device=prompt_mask.device).tril()
    mask = causal[None] & prompt_mask.bool()[:, None, :]  # [P, L, L]
    return (mask | torch.eye(width, dtype=torch.bool, device=prompt_mask.device)[None])[:, None]
