"""Shared by recipe/, run/ and weight_sync/.

LoRA through PEFT: only the adapter trains, sits in the optimizer and is checkpointed; the KL reference is the
same model with its adapter switched off; engines receive the merged weights under the base model's names.

    model.lora.r=16 model.lora.alpha=32 model.lora.target_modules=all-linear

Merged weight of a targeted linear layer (the engine serves the base architecture, never an adapter)::

    W' = W + (alpha / r) * B @ A        W [out, in], A [r, in], B [out, r]
"""
from __future__ import annotations

import functools
from typing import Callable

import torch
from torch import Tensor, nn

ADAPTER = "default"  # PEFT's name for a model's one adapter
PEFT_PREFIX = "base_model.model."  # what PEFT puts before the base model's parameter names
BASE_LAYER = ".base_layer"  # and inside the name of every wrapped layer


def apply_lora(model: nn.Module, *, r: int, alpha: float = 32.0, dropout: float = 0.0,
               target_modules: str | list[str] = "all-linear", seed: int = 0) -> nn.Module:
    """``model`` wrapped by PEFT with a fresh adapter of rank ``r`` (``A`` drawn from ``seed``, ``B`` zero, so it
    starts as the base model) on ``target_modules``; every base weight is frozen. Raises ImportError without PEFT
    and ValueError naming ``target_modules`` when it names no linear layer."""
    key = f"apply_lora: target_modules={target_modules!r}"
    try:
        from peft import LoraConfig as PeftLoraConfig
        from peft import get_peft_model
        from peft.tuners.lora import Linear as LoraLinear
        from peft.tuners.lora import LoraLayer
    except ImportError as exc:
        raise ImportError(f"LoRA needs PEFT, which is not installed ({exc}); pip install 'grpo_accel[lora]'.") from exc
    peft_cfg = PeftLoraConfig(r=r, lora_alpha=alpha, lora_dropout=dropout, target_modules=target_modules,
                              task_type="CAUSAL_LM")
    with torch.random.fork_rng(devices=[]):  # every process draws the same adapter, whatever it drew before
        torch.manual_seed(seed)
        try:
            wrapped = get_peft_model(model, peft_cfg)
        except ValueError as exc:  # PEFT: "Target modules {...} not found in the base model"
            names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, nn.Linear)})
            raise ValueError(f"{key}: {str(exc).splitlines()[0]}; this model's linear layers are {names}.") from exc
    unsupported = sorted({type(m).__name__ for m in wrapped.modules()
                          if isinstance(m, LoraLayer) and (not isinstance(m, LoraLinear) or m.fan_in_fan_out)})
    if unsupported:
        raise ValueError(f"{key}: adapters on {unsupported} layers are not supported (only nn.Linear layers "
                         "are merged for the engines); name linear layers only, or use all-linear.")
    return wrapped


def is_lora(model: nn.Module) -> bool:
    return getattr(model, "peft_config", None) is not None


def merged_model(model: nn.Module) -> nn.Module:
    """A plain transformers model: a LoRA model's adapter merged into its base (PEFT's merge), else ``model``."""
    return model.merge_and_unload() if is_lora(model) else model


def trainable_parameters(model: nn.Module) -> list[nn.Parameter]:
    """What the optimizer holds: the adapter under LoRA, every weight otherwise."""
    return [p for p in model.parameters() if p.requires_grad]


class BasePolicy:
    """The reference policy of a LoRA run: the policy with its adapter off, so KL needs no second model.

    Deliberately not an ``nn.Module``: the policy's parameters stay registered once, in the policy.
    """

    def __init__(self, policy: nn.Module) -> None:
        self.policy = policy

    def __call__(self, *args, **kwargs):
        with self.policy.disable_adapter():
            return self.policy(*args, **kwargs)

    def parameters(self):
        return self.policy.parameters()


def base_name(peft_name: str) -> str:
    """The base model's name of a PEFT-wrapped parameter:
    base_model.model.model.layers.0.mlp.up_proj.base_layer.weight -> model.layers.0.mlp.up_proj.weight."""
    return peft_name.removeprefix(PEFT_PREFIX).replace(BASE_LAYER + ".", ".")


def merge_lora(weight: Tensor, lora_a: Tensor, lora_b: Tensor, scaling: float) -> Tensor:
    """W + scaling * B @ A, in float32: weight [out, in], lora_a [r, in], lora_b [out, r] -> [out, in]."""
    return weight.float() + scaling * (lora_b.float() @ lora_a.float())


def merged_engine_weights(model: nn.Module) -> list[tuple[str, tuple[nn.Parameter, ...], Callable | None]]:
    """A LoRA model's tensors as an engine serving the base architecture holds them: each targeted layer's merged
    weight and every other parameter, under the base model's names, in parameter order (adapters never leave):
    (name, the parameters it is made of, how: None for the parameter itself), as
    :class:`grpo_accel.weight_sync.gather.EngineWeight` takes them."""
    from peft.tuners.lora import LoraLayer

    layers = {name: m for name, m in model.named_modules() if isinstance(m, LoraLayer)}
    weights = []
    for name, p in model.named_parameters():
        if ".lora_" in name:
            continue  # merged into its layer's weight
        module, _, leaf = name.rpartition(".")
        layer = layers.get(module.removesuffix(BASE_LAYER)) if module.endswith(BASE_LAYER) else None
        if layer is not None and leaf == "weight":
            params = (p, layer.lora_A[ADAPTER].weight, layer.lora_B[ADAPTER].weight)
            combine = functools.partial(merge_lora, scaling=float(layer.scaling[ADAPTER]))
            weights.append((base_name(name), params, combine))
        else:
            weights.append((base_name(name), (p,), None))
    return weights
