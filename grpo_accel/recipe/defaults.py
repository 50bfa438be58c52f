"""Settings that follow the model: one table of the defaults that differ between a pretrained model (named by
``model.name_or_path``) and the built-in tiny one, and the check that warns about a setting unusual for a
pretrained model. A key left unset (null) takes the column of the model the run trains; a value set in a file or
on the command line is kept as it is.

Why two columns: the built-in model is a 0.1M-parameter toy with random weights that must learn "3+4=7" in 30 s
(large steps, four tokens); a pretrained model is wrecked by such a learning rate and needs room to answer. The
pretrained column is TRL's GRPOConfig defaults (learning_rate 1e-6, max_completion_length 256,
max_prompt_length 512).

Example:
    >>> cfg = load_config(None, ["model.name_or_path=runs/smollm2-135m"])
    >>> cfg.optim.lr, cfg.rollout.max_new_tokens
    (1e-06, 256)
"""
from __future__ import annotations

from typing import Any, NamedTuple


class ModelDefault(NamedTuple):
    pretrained: Any  # model.name_or_path names a model
    builtin: Any  # model.name_or_path is null: the built-in tiny Llama


MODEL_DEFAULTS: dict[str, ModelDefault] = {
    "optim.lr": ModelDefault(1e-6, 3e-4),
    "rollout.max_new_tokens": ModelDefault(256, 4),
    "rollout.max_prompt_tokens": ModelDefault(512, 64),
}


def fill_model_defaults(cfg) -> None:
    """Each ``MODEL_DEFAULTS`` key of ``cfg`` (a GRPOConfig) that is None set to its model's column."""
    pretrained = cfg.model.name_or_path is not None
    for key, default in MODEL_DEFAULTS.items():
        section, name = key.split(".")
        if getattr(getattr(cfg, section), name) is None:
            setattr(getattr(cfg, section), name, default.pretrained if pretrained else default.builtin)


PRETRAINED_PARAMETERS = 10_000_000
"""A model above this many parameters is treated as pretrained by :func:`unusual_settings` (the built-in one
has ~0.1M)."""
HIGH_LR = 1e-4
SHORT_COMPLETION = 8


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
