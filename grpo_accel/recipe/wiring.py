"""Settings wired by name (:func:`by_name`), and what the parts' messages call the settings they name."""
from __future__ import annotations

import dataclasses
import inspect

# What the parts' messages call the settings they name, as the config spells them (grpo_accel.rules.setting): a part
# built by the recipe says "rollout.max_new_tokens" where, built by hand, it says "max_new_tokens".
LAYOUT_NAMES = {"prompts": "rollout.prompts_per_batch", "group_size": "rollout.group_size",
                "processes": "the launch's --num_processes", "micro_batch": "trainer.micro_batch_completions",
                "accumulation": "trainer.gradient_accumulation_steps", "sampled": "trainer.optim_steps_per_batch"}
COLLECTOR_NAMES = {**{key: f"rollout.{key}" for key in ("max_new_tokens", "max_prompt_tokens", "environment")},
                   "overlong_prompts": "data.overlong_prompts", "prompts_per_batch": "rollout.prompts_per_batch"}
SGLANG_NAMES = {"api_key": "rollout.api_key", "admin_api_key": "weight_sync.admin_api_key",
                "health_timeout_s": "rollout.health_timeout_s", "urls": "rollout.urls",
                "master_address": "weight_sync.master_address", "master_port": "weight_sync.master_port",
                "timeout_s": "weight_sync.timeout_s", "pause_mode": "weight_sync.pause_mode",
                "load_format": "weight_sync.load_format"}
VLLM_NAMES = {key: SGLANG_NAMES[key] for key in ("api_key", "health_timeout_s", "urls", "timeout_s", "pause_mode")}


def as_written(names: dict[str, str], sources: dict[str, str]) -> dict[str, str]:
    """``names`` where a TRL file gave the setting: the file's key, then ours (``cfg.trl_sources``), so that a
    message names what the user wrote: ``max_prompt_length (rollout.max_prompt_tokens)``."""
    return {name: f"{sources[key]} ({key})" if sources.get(key) else key for name, key in names.items()}


def by_name(target, *sections, skip: tuple[str, ...] = ()) -> dict:
    """The settings of ``sections`` (config dataclasses) that ``target`` takes as arguments of the same name: a
    component's settings are wired by name, so that a new one is a schema line and the code that uses it. Two
    sections giving one name is refused (name it in ``skip`` and pass it by hand)."""
    parameters = inspect.signature(target).parameters
    wired: dict = {}
    for section in sections:
        for field in dataclasses.fields(section):
            if field.name in parameters and field.name not in skip:
                if field.name in wired:
                    raise TypeError(f"{field.name}: given by two config sections; skip it and pass it by hand")
                wired[field.name] = getattr(section, field.name)
    return wired
