"""Shared by embedded/, logprobs.py and loss/.

Attention masks handed to a transformers model in 4-D form, which its mask creation passes on unchanged.

The embedded decode loop and the shared-prompt training forward build their own masks (a row's keys per
query); this is where a model is checked to take one and where the mask takes the attention's format, and
where a wrapped model is unwrapped to read what it takes.
"""
from __future__ import annotations

import torch
from torch import Tensor, nn

MASK_FORMATS = {"sdpa": "bool", "eager": "additive"}  # attention implementations a 4-D mask is built for


def mask_reason(model: nn.Module) -> str | None:
    """Why ``model`` cannot take a 4-D mask of full attention (a decoder-only transformers model whose layers all
    attend fully, under sdpa or eager attention), or None when it can."""
    config = getattr(model, "config", None)
    if config is None or getattr(config, "is_encoder_decoder", False):
        return "not a decoder-only transformers model"
    layer_types = getattr(config, "layer_types", None)
    if layer_types is not None and set(layer_types) != {"full_attention"}:
        return f"its layers are not all full attention ({sorted(set(layer_types))})"
    if layer_types is None and getattr(config, "sliding_window", None) is not None:
        return f"it has a sliding window ({config.sliding_window})"
    implementation = getattr(config, "_attn_implementation", None)
    if implementation not in MASK_FORMATS:
        return f"attention implementation {implementation!r} (4-D masks are built for {sorted(MASK_FORMATS)})"
    return None


def transformers_model(model) -> nn.Module:
    """The transformers model under a LoRA run's ``BasePolicy``, a DeepSpeed or DDP wrapper, a PEFT wrapper (each
    passes keyword arguments on to it): its config and forward's signature say what it takes."""
    model = getattr(model, "policy", model)  # lora.BasePolicy
    model = getattr(model, "module", model)
    return model.get_base_model() if hasattr(model, "get_base_model") else model


def additive_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype of the additive mask ``model``'s attention takes, or None where it takes a boolean one."""
    additive = MASK_FORMATS[model.config._attn_implementation] == "additive"
    return next(model.parameters()).dtype if additive else None


def model_mask(mask: Tensor, dtype: torch.dtype | None) -> Tensor:  # [B, 1, Q, S] bool (True: attend)
    """The mask as the attention takes it: as is, or 0 / the dtype's minimum where ``dtype`` is given."""
    if dtype is None:
        return mask
    return torch.zeros(mask.shape, dtype=dtype, device=mask.device).masked_fill(~mask, torch.finfo(dtype).min)
