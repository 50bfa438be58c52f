"""The decode loop's forward for Llama-family models: the model's own modules, without its wrappers.

A small model's decode step in transformers spends most of its time around the arithmetic: per layer a decoder
layer, an attention module and an attention interface, each with argument decorators and checks, and per step
the model's input checks, output capture, mask creation and output classes. :class:`LeanForward` calls the
model's leaf modules in the model's order (embedding, each layer's norms, projections and MLP, the final norm
and head) and does the attention itself, with the layer's ``scaling`` and the model's own ``rotary_emb``: a
prefill as transformers' ``sdpa`` interface does it (``repeat_kv``, ``scaled_dot_product_attention``), a decode
step's one query per row with the heads of a key/value head as its queries (``pack_gqa``), on CPU with several
threads written out: two products and a softmax took 54-58 us where SDPA's CPU kernel, which splits its work
over the threads, took 95-97 us at SmolLM2's decode sizes (2 threads, 30 layers a token). On one thread SDPA's
kernel stays (73 against 71 us written out at SmolLM2's sizes, 25 against 29 us at the tiny Qwen2's). Calling
the modules (not their weights) keeps what a module adds: LoRA adapters, any ``nn.Linear`` subclass, hooks.

Where the model's own arithmetic can be reproduced in fewer ops, it is, with the same results:

- each layer's q/k/v products as one product, and its MLP's gate/up as one, of weights concatenated at each
  call (:meth:`LeanForward.fused`; packed for oneDNN where the decoder packs: SmolLM2 reads its weights in 121
  products a token instead of 211);
- the rotary embedding looked up in a table the model's ``rotary_emb`` computed once for every position, and
  applied with one roll (:class:`_RotaryTable`, :func:`_rotate`);
- the RMSNorms through ``torch.rms_norm`` (:func:`_rms_norm`, bitwise the module's result);
- for a float32 model on CPU, a decode step's element-wise work between two products as one call of a C library
  (:mod:`grpo_accel.embedded.native`, :meth:`LeanForward._native_step`): the residual add and the next norm, the
  rotary embedding, the cache write and the attention, SiLU times up, to float32 rounding (SmolLM2's decode call
  1.72 -> 1.45 s, the tiny Qwen2's 15.6 -> 8.0 ms, alternating in one process).

The tiny Qwen2's decode call (8 rows x 32 tokens, one thread) took 18.0 ms before these and 15.0 ms after;
SmolLM2's (2 threads), the fusion off / on alternating in one process, 1.797 / 1.714 s.

It covers the decoder layouts of Llama (SmolLM2), Mistral, Qwen2 and Qwen3 (``q_norm``/``k_norm``), read from
the modules present; :func:`lean_reason` says why a model is not covered (then the model's forward is used).
"""
from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import contextmanager
from functools import partial

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from grpo_accel.embedded.native import NativeStep, native_reason

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` values whose decoder layers :class:`LeanForward` reproduces."""
RMS_NORMS = ("LlamaRMSNorm", "MistralRMSNorm", "Qwen2RMSNorm", "Qwen3RMSNorm")
"""Their norm classes, whose forward :func:`_rms_norm` computes with ``torch.rms_norm``."""
MLPS = ("LlamaMLP", "MistralMLP", "Qwen2MLP", "Qwen3MLP")
"""Their MLP classes: ``down_proj(act_fn(gate_proj(x)) * up_proj(x))``, gate and up fusable into one product."""


def lean_reason(model: nn.Module) -> str | None:
    """Why :class:`LeanForward` cannot run ``model`` (a causal LM the decode loop supports), or None."""
    config = model.config
    if config.model_type not in LEAN_MODEL_TYPES:
        return f"model type {config.model_type!r} (covered: {', '.join(LEAN_MODEL_TYPES)})"
    if config._attn_implementation != "sdpa":
        return f"attention implementation {config._attn_implementation!r} (it computes sdpa's attention)"
    if getattr(config, "attention_dropout", 0.0):
        return f"attention_dropout={config.attention_dropout}"
    base = _base_model(model)
    if not all(hasattr(base.model, name) for name in ("embed_tokens", "layers", "norm", "rotary_emb")):
        return "its decoder is not laid out as embed_tokens / layers / norm / rotary_emb"
    return None


class LeanForward:
    """``forward(ids, mask, positions, cache) -> logits of the last position``, as the decode loop calls the model.

    ``mask`` [B, 1, Q, S] additive (0 where attended, the dtype's minimum elsewhere), ``cache`` a
    :class:`~grpo_accel.embedded.decode.BudgetCache`.
    """

    def __init__(self, model: nn.Module) -> None:
        base = _base_model(model)
        self.decoder, self.head = base.model, base.lm_head
        self.layers = list(self.decoder.layers[: base.config.num_hidden_layers])
        self.norms = {id(m): _rms_norm(m) for m in self.decoder.modules() if type(m).__name__ in RMS_NORMS}
        self.rotary = _RotaryTable(self.decoder.rotary_emb)
        # the modules whose forward this one stands in for: a hook on any of them would not run here
        self.bypassed = [model, base, self.decoder, *self.layers, *(layer.self_attn for layer in self.layers),
                         *(m for m in self.decoder.modules() if id(m) in self.norms), self.decoder.rotary_emb]
        self.products: dict[int, tuple[Callable[[Tensor], Tensor], list[int]]] = {}  # see fused()
        self.native_reason = self._native_reason()
        self.native = NativeStep() if self.native_reason is None else None

    @contextmanager
    def fused(self, product: Callable[[Tensor, Tensor | None], Callable[[Tensor], Tensor]]) -> Iterator[list[nn.Module]]:
        """For one decode call, each layer's q/k/v products as one product, and its MLP's gate and up as one:
        ``product(weight, bias)`` gives ``x -> x @ weight.T + bias`` for the concatenated weights, taken now (an
        optimizer step or a weight push may have changed them since the last call). Fewer, larger products: a
        small model's step issues fewer ops, a large one reads its weights in fewer, faster calls. Only plain
        ``nn.Linear`` modules without hooks are fused (a LoRA layer is called as it is), and an MLP only of the
        covered classes without hooks. Yields the modules multiplied through fused weights."""
        groups = {}
        for layer in self.layers:
            attn, mlp = layer.self_attn, layer.mlp
            if _fusable(attn.q_proj, attn.k_proj, attn.v_proj):
                groups[id(attn)] = (attn.q_proj, attn.k_proj, attn.v_proj)
            if type(mlp).__name__ in MLPS and not _hooked(mlp) and _fusable(mlp.gate_proj, mlp.up_proj):
                groups[id(mlp)] = (mlp.gate_proj, mlp.up_proj)
        try:
            for key, linears in groups.items():
                bias = None if linears[0].bias is None else torch.cat([m.bias for m in linears])
                self.products[key] = (product(torch.cat([m.weight for m in linears]), bias),
                                      [m.out_features for m in linears])
            yield [m for linears in groups.values() for m in linears]
        finally:
            self.products = {}

    def mask_dtype(self) -> torch.dtype:
        """The dtype of the additive mask this forward takes: it adds the mask to its attention scores."""
        return next(self.decoder.parameters()).dtype

    def hooked(self) -> bool:
        """Whether a forward hook sits on a module this forward does not call (e.g. one that edits the model's
        logits): the model's own forward must then run, so that the hook does."""
        return any(_hooked(m) for m in self.bypassed)

    def __call__(self, ids: Tensor, mask: Tensor, positions: Tensor, cache) -> Tensor:  # -> [B, V]
        if (self.native is not None and ids.shape[1] == 1 and len(self.products) == 2 * len(self.layers)
                and cache.layers[0].is_initialized):
            return self._native_step(ids, mask, positions, cache)
        hidden = self.decoder.embed_tokens(ids)  # [B, Q, H]
        cos, sin = self.rotary(hidden, positions, cache.capacity)  # [B, 1, Q, D] each
        for index, layer in enumerate(self.layers):
            hidden = hidden + self._attention(layer.self_attn, self._norm(layer.input_layernorm, hidden), cos, sin,
                                              mask, cache.layers[index])
            hidden = hidden + self._mlp(layer.mlp, self._norm(layer.post_attention_layernorm, hidden))
        return self.head(self._norm(self.decoder.norm, hidden[:, -1:]))[:, -1]

    def _native_step(self, ids: Tensor, mask: Tensor, positions: Tensor, cache) -> Tensor:  # ids [B, 1] -> [B, V]
        """One token per row, each stretch between two products one call of the C library
        (:mod:`~grpo_accel.embedded.native`): the products as in :meth:`__call__`, fused."""
        native, rows = self.native, ids.shape[0]
        hidden = self.decoder.embed_tokens(ids[:, 0]).contiguous()  # [B, H], added to in place
        cos, sin = (t.reshape(rows, -1) for t in self.rotary(hidden, positions, cache.capacity))  # [B, D] each
        normed = torch.empty_like(hidden)  # [B, H]: the next product's input
        norm = self.layers[0].input_layernorm
        native.add_rms_norm(hidden, None, norm.weight, norm.variance_epsilon, normed)
        for index, layer in enumerate(self.layers):
            attn, mlp = layer.self_attn, layer.mlp
            qkv, widths = self.products[id(attn)]
            attended = hidden.new_empty(rows, widths[0])  # [B, heads * D]
            native.attention(qkv(normed), cos, sin, cache.layers[index].keys, cache.layers[index].values, mask,
                             attended, widths[0] // attn.head_dim, widths[1] // attn.head_dim, cache.length,
                             attn.scaling)
            norm = layer.post_attention_layernorm
            native.add_rms_norm(hidden, attn.o_proj(attended).contiguous(), norm.weight, norm.variance_epsilon, normed)
            gate_up, widths = self.products[id(mlp)]
            activated = hidden.new_empty(rows, widths[0])  # [B, I]
            native.silu_mul(gate_up(normed), activated)
            norm = self.layers[index + 1].input_layernorm if index + 1 < len(self.layers) else self.decoder.norm
            native.add_rms_norm(hidden, mlp.down_proj(activated).contiguous(), norm.weight, norm.variance_epsilon,
                                normed)
        return self.head(normed)

    def _native_reason(self) -> str | None:
        """Why decode steps keep the torch ops for this model, or None when the C library does the element-wise
        work (:mod:`~grpo_accel.embedded.native`)."""
        weight = next(self.decoder.parameters())
        if weight.dtype != torch.float32 or weight.device.type != "cpu":
            return f"{weight.dtype} on {weight.device.type} (the C step is float32 on CPU)"
        norms = [self.decoder.norm, *(n for layer in self.layers for n in (layer.input_layernorm, layer.post_attention_layernorm))]
        if not all(id(n) in self.norms for n in norms) or any(hasattr(layer.self_attn, "q_norm") for layer in self.layers):
            return "norms other than one RMSNorm before attention and one before the MLP"
        if not all(type(layer.mlp.act_fn).__name__ in ("SiLU", "SiLUActivation") for layer in self.layers):
            return "an MLP activation other than SiLU"
        if not self.rotary.static:
            return "a rotary embedding that rescales with the length"
        return native_reason()

    def _norm(self, module: nn.Module, x: Tensor) -> Tensor:
        return self.norms.get(id(module), module)(x)

    def _mlp(self, mlp: nn.Module, x: Tensor) -> Tensor:
        if (fused := self.products.get(id(mlp))) is None:
            return mlp(x)
        gate, up = fused[0](x).split(fused[1], -1)
        return mlp.down_proj(mlp.act_fn(gate) * up)

    def _attention(self, attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache_layer) -> Tensor:
        rows, width, _ = x.shape
        shape = (rows, width, -1, attn.head_dim)
        if (fused := self.products.get(id(attn))) is None:
            q, k, v = attn.q_proj(x), attn.k_proj(x), attn.v_proj(x)
        else:
            q, k, v = fused[0](x).split(fused[1], -1)
        q, k, v = q.view(shape), k.view(shape), v.view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotary embedding
            q, k = self._norm(attn.q_norm, q), self._norm(attn.k_norm, k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, Q, D]
        q, k = _rotate(q, cos, sin), _rotate(k, cos, sin)
        k, v = cache_layer.update(k, v)  # [B, kv_heads, S, D]
        groups = attn.num_key_value_groups
        if width == 1 and q.is_cpu and torch.get_num_threads() > 1:  # one query, written out (module docstring)
            scores = torch.matmul(q.reshape(rows, -1, groups, attn.head_dim), k.transpose(-1, -2))  # [B, kv, g, S]
            wide = torch.promote_types(scores.dtype, torch.float32)  # softmax as SDPA computes it
            probs = torch.softmax(scores.mul_(attn.scaling).add_(mask), -1, dtype=wide).to(v.dtype)
            out = torch.matmul(probs, v)  # [B, kv_heads, groups, D]
        elif groups > 1 and width == 1:  # one query: the heads of a key/value head become its queries
            out = F.scaled_dot_product_attention(q.reshape(rows, -1, groups, attn.head_dim), k, v, attn_mask=mask,
                                                 scale=attn.scaling)
        else:
            if groups > 1:
                k, v = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
        out = out.reshape(rows, -1, width, attn.head_dim).transpose(1, 2)  # [B, Q, heads, D]
        return attn.o_proj(out.reshape(rows, width, -1))


def _rotate(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:  # [B, heads, Q, D], [B, 1, Q, D] x2 (sin signed)
    """transformers' ``x * cos + rotate_half(x) * sin`` with the sign of rotate_half's negated half moved into
    ``sin`` (:class:`_RotaryTable`): the same products, one roll instead of two slices, a negation and a cat."""
    return x * cos + x.roll(x.shape[-1] // 2, -1) * sin


class _RotaryTable:
    """The model's rotary embedding for every position below a length, computed once by the model's own
    ``rotary_emb``; a step looks its positions up. Each entry is an elementwise function of its position alone,
    so it equals the model's per-step result. RoPE types that rescale with the sequence length ("dynamic",
    "longrope") call the module at each step instead."""

    def __init__(self, rotary: nn.Module) -> None:
        self.rotary, self.cos, self.sin = rotary, None, None
        rope_type = getattr(rotary, "rope_type", "default")
        self.static = isinstance(rope_type, str) and "dynamic" not in rope_type and rope_type != "longrope"

    def __call__(self, hidden: Tensor, positions: Tensor, length: int) -> tuple[Tensor, Tensor]:
        """-> cos, sin [B, 1, Q, D] for ``positions`` [B, Q] (all below ``length``), sin with its first half
        negated (see :func:`_rotate`)."""
        if not self.static:
            return self._signed(*self.rotary(hidden, position_ids=positions))
        if self.cos is None or self.cos.shape[0] < length or (self.cos.dtype, self.cos.device) != (hidden.dtype, hidden.device):
            span = torch.arange(length, device=hidden.device)[None]
            self.cos, self.sin = (t[0, 0] for t in self._signed(*self.rotary(hidden, position_ids=span)))  # [L, D]
        return self.cos[positions][:, None], self.sin[positions][:, None]

    @staticmethod
    def _signed(cos: Tensor, sin: Tensor) -> tuple[Tensor, Tensor]:  # [B, Q, D] -> [B, 1, Q, D]
        half = sin.shape[-1] // 2
        return cos[:, None], torch.cat((-sin[..., :half], sin[..., half:]), -1)[:, None]


def _hooked(module: nn.Module) -> bool:
    return bool(module._forward_hooks or module._forward_pre_hooks)


def _fusable(*linears: nn.Module) -> bool:
    """Plain ``nn.Linear`` modules, none hooked or with its forward replaced, all with a bias or none."""
    return (all(type(m) is nn.Linear and not _hooked(m) and "forward" not in m.__dict__ for m in linears)
            and len({m.bias is None for m in linears}) == 1)


def plain_product(weight: Tensor, bias: Tensor | None) -> Callable[[Tensor], Tensor]:
    """``x -> x @ weight.T + bias``: ``nn.Linear``'s product (:meth:`LeanForward.fused` where nothing is packed)."""
    return partial(F.linear, weight=weight, bias=bias)


def _rms_norm(norm: nn.Module):
    """What transformers' ``RMSNorm.forward`` computes (float32 statistics, then the weight in the input's
    dtype) through ``torch.rms_norm``: bitwise the same, two ops where the module's forward issues seven. The
    weight is read at each call (a push may replace it)."""

    def forward(x: Tensor) -> Tensor:
        return norm.weight * torch.rms_norm(x.float(), x.shape[-1:], None, norm.variance_epsilon).to(x.dtype)

    return forward


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
