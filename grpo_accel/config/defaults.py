"""Settings that follow the model and the hardware: one table of the defaults that differ between a pretrained
model (named by ``model.name_or_path``) on a CUDA device, the same on a CPU, and the built-in tiny one, and the
check that warns about a setting unusual for a pretrained model. A key left unset (null) takes its column; a
value set in a file or on the command line is kept as it is.

Why the columns: the built-in model is a 0.1M-parameter toy with random weights that must learn "3+4=7" in 30 s
(large steps, four tokens, float32); a pretrained model is wrecked by such a learning rate and needs room to
answer. The pretrained column is TRL 1.16's GRPOConfig defaults (learning_rate 1e-6, max_completion_length 256,
max_prompt_length 512, bf16 and gradient checkpointing on): bf16 (fp16 on a GPU without bfloat16, before Ampere)
runs on the GPU's matrix units, and checkpointing trades ~30% more compute for activations that no longer grow
with the layers. On a CPU both cost time and save nothing a CPU is short of, so a CPU keeps float32 and off.

Example:
    >>> cfg = load_config(None, ["model.name_or_path=runs/smollm2-135m"])
    >>> cfg.optim.lr, cfg.rollout.max_new_tokens, cfg.trainer.mixed_precision   # on a CPU
    (1e-06, 256, 'no')
"""
from __future__ import annotations

import os
from typing import Any, NamedTuple


class ModelDefault(NamedTuple):
    pretrained: Any  # model.name_or_path names a model (on a CPU)
    builtin: Any  # model.name_or_path is null: the built-in tiny Llama
    pretrained_cuda: Any = None  # a named model on a CUDA device, where it differs (None: as on a CPU)


MODEL_DEFAULTS: dict[str, ModelDefault] = {
    "optim.lr": ModelDefault(1e-6, 3e-4),
    "rollout.max_new_tokens": ModelDefault(256, 4),
    "rollout.max_prompt_tokens": ModelDefault(512, 64),
    "trainer.mixed_precision": ModelDefault("no", "no", pretrained_cuda="bf16"),  # fp16 where bf16 is not there
    "model.gradient_checkpointing": ModelDefault(False, False, pretrained_cuda=True),
}


class Hardware(NamedTuple):
    """What this process trains on, as far as the defaults care."""

    cuda: bool  # a CUDA device is visible
    bf16: bool  # it computes in bfloat16 (compute capability 8.0 and newer: A100, H100, RTX 30xx on)

    def describe(self) -> str:
        return "a CPU" if not self.cuda else f"a CUDA device{'' if self.bf16 else ' without bfloat16'}"


def detect_hardware() -> Hardware:
    """The device this process will train on. Creates no CUDA context: the launcher's processes read their config
    before the Accelerator gives each its GPU, and a context made here would sit on GPU 0 for all of them."""
    import torch

    if not torch.cuda.is_available():
        return Hardware(False, False)
    device = int(os.environ.get("LOCAL_RANK", "0")) % torch.cuda.device_count()
    return Hardware(True, torch.cuda.get_device_capability(device)[0] >= 8)


class Followed(NamedTuple):
    """The settings that were left unset and took their column's values, and why that column."""

    values: dict[str, Any]  # key -> the value it took
    reason: str  # which column, in words

    def describe(self) -> str | None:
        """One start-up line naming each setting that followed the model and the hardware; None if none."""
        if not self.values:
            return None
        values = ", ".join(f"{key}={_shown(value)}" for key, value in self.values.items())
        return f"unset settings that follow the model ({self.reason}): {values}; set any of them to choose otherwise"


def model_default(key: str, pretrained: bool, hardware: Hardware) -> Any:
    """The value of ``MODEL_DEFAULTS[key]`` for a named (``pretrained``) or built-in model on ``hardware``."""
    default = MODEL_DEFAULTS[key]
    if not pretrained:
        return default.builtin
    value = default.pretrained_cuda if hardware.cuda and default.pretrained_cuda is not None else default.pretrained
    if key == "trainer.mixed_precision" and value == "bf16" and not hardware.bf16:
        return "fp16"  # a GPU without bfloat16 still has half-precision matrix units; fp16 adds a loss scaler
    return value


def column_reason(pretrained: bool, hardware: Hardware) -> str:
    if not pretrained:
        return "the built-in tiny model: the toy's own"
    if not hardware.cuda:
        return ("a model named by model.name_or_path on a CPU: TRL's defaults, but float32 and no gradient "
                "checkpointing, which only cost time on a CPU")
    return (f"a model named by model.name_or_path on {hardware.describe()}: TRL's defaults"
            + ("" if hardware.bf16 else ", fp16 for its bf16"))


def fill_model_defaults(cfg, hardware: Hardware | None = None) -> Followed:
    """Each ``MODEL_DEFAULTS`` key of ``cfg`` (a GRPOConfig) that is None set to its column for ``cfg``'s model
    on ``hardware`` (this process's, :func:`detect_hardware`, by default); returns what was filled."""
    pretrained = cfg.model.name_or_path is not None
    unset = [key for key in MODEL_DEFAULTS if _get(cfg, key) is None]
    hardware = hardware or (detect_hardware() if unset and pretrained else Hardware(False, False))
    values = {key: model_default(key, pretrained, hardware) for key in unset}
    for key, value in values.items():
        section, name = key.split(".")
        setattr(getattr(cfg, section), name, value)
    return Followed(values, column_reason(pretrained, hardware))


def _get(cfg, key: str) -> Any:
    section, name = key.split(".")
    return getattr(getattr(cfg, section), name)


def fitted_budget(default: int, context: int, longest_prompt: int) -> int:
    """An unset completion budget on a model of ``context`` positions: ``default``, or less where the longest
    prompt leaves less (at least 1: a prompt that fills the context is the data's error, named by the collector)."""
    return max(1, min(default, context - longest_prompt))


PRETRAINED_PARAMETERS = 10_000_000
"""A model above this many parameters is treated as pretrained by :func:`unusual_settings` (the built-in one
has ~0.1M)."""
HIGH_LR = 1e-4
SHORT_COMPLETION = 8


BUILT_IN_MODEL_SIZES = ("hidden_size", "num_layers", "num_heads", "intermediate_size")
"""``model.*`` settings that size the built-in model: they do nothing to a named one (model.name_or_path)."""


def unused_settings(cfg) -> list[str]:
    """One line per setting of ``cfg`` (a GRPOConfig) given that does nothing beside the others: the built-in model's sizes on a named
    model, ``hub.model_id`` without ``hub.push``."""
    from grpo_accel.tasks.tiny import TinyModelSpec  # the built-in model's sizes: the settings' defaults

    out = []
    if cfg.model.name_or_path is not None:
        out += [f"model.{key}={getattr(cfg.model, key)} has no effect: it sizes the built-in model, and "
                f"model.name_or_path={cfg.model.name_or_path} names another (drop it)"
                for key in BUILT_IN_MODEL_SIZES if getattr(cfg.model, key) != getattr(TinyModelSpec, key)]
    if cfg.hub.model_id and not cfg.hub.push:
        out.append(f"hub.model_id={cfg.hub.model_id} has no effect: hub.push is false (set hub.push=true to upload "
                   "there)")
    return out


def unusual_settings(cfg, parameters: int) -> list[str]:
    """One warning line per setting of ``cfg`` that is unusual for a model of ``parameters`` parameters (a
    pretrained model above ``PRETRAINED_PARAMETERS``), each naming the key, its value and the usual range."""
    if parameters <= PRETRAINED_PARAMETERS:
        return []
    size, out = f"{parameters / 1e6:.0f}M", []
    if cfg.optim.lr > HIGH_LR:
        out.append(f"optim.lr={cfg.optim.lr:g} is high for a pretrained model of {size} parameters: steps this large "
                   "usually wreck it within a few batches; 1e-6 to 1e-5 is usual (TRL's default 1e-6, the "
                   f"default here for a named model), above {HIGH_LR:g} only for the built-in tiny model.")
    if cfg.rollout.max_new_tokens < SHORT_COMPLETION:
        out.append(f"rollout.max_new_tokens={cfg.rollout.max_new_tokens} cuts a pretrained model's replies after "
                   f"{cfg.rollout.max_new_tokens} tokens, before most can state an answer; 128 to 1024 is usual "
                   f"(TRL's default 256, the default here for a named model).")
    return out


def _shown(value: Any) -> str:
    """A value as it is written on the command line (true, not True)."""
    return str(value).lower() if isinstance(value, bool) else str(value)
