"""Builders that turn a :class:`~grpo_accel.config.GRPOConfig` into components (used by launch/train.py)."""
from __future__ import annotations

import functools
import importlib

from grpo_accel.config import ConfigError, DataConfig, ModelConfig, RewardConfig
from grpo_accel.data import load_rows, validate_rows
from grpo_accel.rewards import BUILTIN_REWARDS, RewardSet


def build_tokenizer_and_model(cfg: ModelConfig, seed: int = 0):
    """(tokenizer, causal LM): the built-in tiny pair when ``name_or_path`` is None, else loaded from it."""
    import torch

    if cfg.name_or_path is None:
        from grpo_accel.tasks.tiny import TinyModelSpec, build_char_tokenizer, build_tiny_model

        tokenizer = build_char_tokenizer()
        spec = TinyModelSpec(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size)
        return tokenizer, build_tiny_model(tokenizer, spec, seed=seed)
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(cfg.name_or_path, padding_side="left")
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    model = AutoModelForCausalLM.from_pretrained(cfg.name_or_path, dtype=getattr(torch, cfg.dtype))
    return tokenizer, model


def build_rows(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows), validated; the built-in addition task when ``path`` is None."""
    if cfg.path is None:
        from grpo_accel.tasks.addition import addition_rows

        train, held_out = addition_rows(cfg.max_operand, cfg.holdout)
        train = validate_rows(train, "prompt", "built-in addition task")
    else:
        train, held_out = validate_rows(load_rows(cfg.path), cfg.prompt_field, f"data.path={cfg.path!r}"), []
    if cfg.eval_path is not None:
        held_out = validate_rows(load_rows(cfg.eval_path), cfg.prompt_field, f"data.eval_path={cfg.eval_path!r}")
    return train, held_out


def resolve_reward(name: str):
    """A built-in reward function by name, or ``package.module:function``."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    module, sep, attr = name.partition(":")
    if not sep:
        raise ConfigError(f"rewards name={name!r}: not a built-in {sorted(BUILTIN_REWARDS)}; "
                          "for your own function write 'package.module:function'.")
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"rewards name={name!r}: cannot import it ({exc}); check the module path and function name.") from exc


def build_rewards(cfgs: list[RewardConfig]) -> RewardSet:
    fns = {}
    for c in cfgs:
        fn = resolve_reward(c.name)
        fns[c.name] = functools.partial(fn, **c.kwargs) if c.kwargs else fn
    return RewardSet(fns, {c.name: c.weight for c in cfgs})
