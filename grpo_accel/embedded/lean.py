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
the modules (not their weights) keeps what a module adds: RMSNorm's float32 arithmetic, LoRA adapters, any
``nn.Linear`` subclass.

It covers the decoder layouts of Llama (SmolLM2), Mistral, Qwen2 and Qwen3 (``q_norm``/``k_norm``), read from
the modules present; :func:`lean_reason` says why a model is not covered (then the model's forward is used).
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor, nn

LEAN_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")
"""``config.model_type`` values whose decoder layers :class:`LeanForward` reproduces."""


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
        # the modules whose forward this one stands in for: a hook on any of them would not run here
        self.bypassed = [model, base, self.decoder, *self.layers, *(layer.self_attn for layer in self.layers)]

    def mask_dtype(self) -> torch.dtype:
        """The dtype of the additive mask this forward takes: it adds the mask to its attention scores."""
        return next(self.decoder.parameters()).dtype

    def hooked(self) -> bool:
        """Whether a forward hook sits on a module this forward does not call (e.g. one that edits the model's
        logits): the model's own forward must then run, so that the hook does."""
        return any(m._forward_hooks or m._forward_pre_hooks for m in self.bypassed)

    def __call__(self, ids: Tensor, mask: Tensor, positions: Tensor, cache) -> Tensor:  # -> [B, V]
        hidden = self.decoder.embed_tokens(ids)  # [B, Q, H]
        cos, sin = self.decoder.rotary_emb(hidden, position_ids=positions)  # [B, Q, D] each
        cos, sin = cos[:, None], sin[:, None]
        for index, layer in enumerate(self.layers):
            hidden = hidden + self._attention(layer.self_attn, layer.input_layernorm(hidden), cos, sin, mask,
                                              cache.layers[index])
            hidden = hidden + layer.mlp(layer.post_attention_layernorm(hidden))
        return self.head(self.decoder.norm(hidden[:, -1:]))[:, -1]

    @staticmethod
    def _attention(attn: nn.Module, x: Tensor, cos: Tensor, sin: Tensor, mask: Tensor, cache_layer) -> Tensor:
        rows, width, _ = x.shape
        shape = (rows, width, -1, attn.head_dim)
        q, k, v = attn.q_proj(x).view(shape), attn.k_proj(x).view(shape), attn.v_proj(x).view(shape)
        if hasattr(attn, "q_norm"):  # Qwen3: per-head norms before the rotary embedding
            q, k = attn.q_norm(q), attn.k_norm(k)
        q, k, v = q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2)  # [B, heads, Q, D]
        q, k = q * cos + _rotate_half(q) * sin, k * cos + _rotate_half(k) * sin
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


def _rotate_half(x: Tensor) -> Tensor:
    half = x.shape[-1] // 2
    return torch.cat((-x[..., half:], x[..., :half]), dim=-1)


def _base_model(model: nn.Module) -> nn.Module:
    """The transformers model under a PEFT wrapper."""
    return model.get_base_model() if hasattr(model, "get_base_model") else model
