"""A ``trl grpo`` config file run as it is: TRL 1.16's GRPOConfig, ScriptArguments and ModelConfig names become
grpo_accel's settings, the units converted exactly.

    grpo-accel train --config trl_grpo.yaml            # a file whose keys are TRL's is read as TRL's

TRL counts optimizer steps and per-device completions; grpo_accel counts frames (completions) and prompts per
batch. TRL's batch arithmetic (``GRPOConfig.__post_init__``), for ``P`` processes:

    steps_per_generation  = generation_batch_size / (per_device_train_batch_size x P)   (default: the accumulation)
    generation_batch_size = per_device_train_batch_size x P x steps_per_generation
    optimizer steps per generation = steps_per_generation x num_iterations / gradient_accumulation_steps

so a TRL generation is one collected batch here: ``rollout.prompts_per_batch = generation_batch_size /
num_generations``, ``trainer.micro_batch_completions = per_device_train_batch_size``, the same accumulation,
``trainer.num_epochs = num_iterations``, and each optimizer step collects ``generation_batch_size /
(optimizer steps per generation)`` frames: ``max_steps``, ``logging_steps`` and ``save_steps`` become frames by
that factor (``num_train_epochs``: epochs x the dataset's rows x num_generations). Settings TRL's file leaves out
take TRL's defaults where grpo_accel's differ (a linear schedule, clip range 0.2 on both sides, Adam's beta2 0.999,
seed 42, 512 new tokens, 3 epochs, logging every 10 steps, saving every 500).

Every key is in one of :mod:`grpo_accel.config.trl.fields`' lists: translated by the rules below, named once as
having no effect here, or refused in one line with the reason. A file may mix TRL's flat names with grpo_accel's
settings (nested sections or dotted keys): each is read by its own side, and a setting given by both is an error.
"""
from __future__ import annotations

from typing import Any, Callable

from grpo_accel.config.checks import ConfigError
from grpo_accel.config.trl.fields import NO_EFFECT, REFUSED, TRANSLATED, TRL_KEYS
from grpo_accel.config.trl.rules import (TRL_DEFAULTS, Translation, TrlLayout, evaluation_rules, logging_rules, reward_rules,
                                         vllm_rules)

LOSS_TYPES = {"grpo": "seq_mean_token_mean", "dapo": "token_mean", "dr_grpo": "seq_mean_token_sum_norm"}
SCHEDULES = {"linear": "linear", "cosine": "cosine", "cosine_with_min_lr": "cosine", "constant": "constant",
             "constant_with_warmup": "constant"}
MODEL_INIT = {"dtype": "model.dtype", "torch_dtype": "model.dtype", "attn_implementation": "model.attn_implementation",
              "revision": "model.revision", "trust_remote_code": "model.trust_remote_code"}
RULED = {"model_init_kwargs", "gradient_checkpointing_kwargs", "use_peft", "lora_r", "lora_alpha", "lora_dropout",
         "lora_target_modules", "dataset_test_split", "lr_scheduler_type", "lr_scheduler_kwargs", "warmup_steps",
         "warmup_ratio", "adam_beta1", "adam_beta2", "generation_batch_size", "steps_per_generation",
         "use_bias_correction_kl", "epsilon", "loss_type", "scale_rewards", "reward_funcs", "reward_weights",
         "reward_model_name_or_path", "max_completion_len", "soft_punish_cache", "max_steps", "num_train_epochs",
         "bf16", "fp16", "logging_strategy", "logging_steps", "log_level", "disable_tqdm", "report_to",
         "wandb_entity", "wandb_run_group", "trackio_space_id", "log_completions", "num_completions_to_print",
         "eval_strategy", "eval_steps", "save_strategy", "save_steps", "resume_from_checkpoint"} | {
    k for k in TRANSLATED if k.startswith("vllm_") or k == "use_vllm"}
"""TRL names translated by a rule of their own (units, value maps, TRL's defaults); every other translated name is
its setting, the value as it is."""
DIRECT = {name: t.key for name, t in TRANSLATED.items() if name not in RULED}


def trl_keys(data: dict) -> set[str]:
    """The keys of ``data`` that are TRL's: its names, less those that are grpo_accel's sections here (``optim``
    as a mapping) or settings of both (``output_dir``)."""
    from grpo_accel.config.schema import GRPOConfig

    ours = set(GRPOConfig.__dataclass_fields__)
    return {k for k in data if k in TRL_KEYS and not (k in ours and (isinstance(data[k], dict) or k == "output_dir"))}


def is_trl_config(data: dict) -> bool:
    """A config file written for ``trl grpo``: at least one of TRL's names at its top (it may hold grpo_accel's
    settings besides)."""
    return bool(trl_keys(data))


def translate(trl: dict, processes: int, rows: Callable[[dict], int]) -> tuple[dict, list[str]]:
    """``trl`` (a TRL config's keys) as grpo_accel's settings (dotted keys: ``{"optim.lr": 1e-6, ...}``), and one line
    per translated key (the last names every key that has no effect here). ``rows`` counts the rows of the dataset
    those settings name (for ``num_train_epochs`` and ``epoch`` strategies)."""
    t = translation(trl, processes, rows)
    return t.settings, t.lines


def translation(trl: dict, processes: int, rows: Callable[[dict], int]) -> Translation:
    """:func:`translate`'s settings and lines, with the TRL key each setting came from."""
    refused = [f"{k}={v!r}: {REFUSED[k].why}; drop it" for k, v in trl.items()
               if k in REFUSED and not _harmless(v, REFUSED[k].harmless)]
    refused += [f"{k}={v!r}: not one of TRL's GRPO settings here (docs/pages/coming-from-trl.md lists them)"
                for k, v in trl.items() if k not in TRL_KEYS]
    if refused:
        raise ConfigError("a TRL config with settings that cannot be honoured here:\n  " + "\n  ".join(refused))
    t = Translation(trl, processes, rows)
    for name, key in DIRECT.items():
        if name in trl:
            t.put(key, trl[name], f"{name}={trl[name]!r}", name)
    for name in trl:
        if name in NO_EFFECT:
            t.no_effect(name)
        elif name in REFUSED:
            t.no_effect(name, f"{trl[name]!r} asks for nothing")
    layout = TrlLayout(trl, processes)
    _batches(t, layout)
    _length(t, layout)
    _model(t)
    _loss(t)
    _optim(t)
    logging_rules(t, layout)
    evaluation_rules(t, layout)
    vllm_rules(t)
    reward_rules(t)
    if t.inert:
        t.lines.append("no effect here: " + ", ".join(t.inert))
    return t


def _harmless(value: Any, harmless: tuple) -> bool:
    """``value`` is one of ``harmless`` (YAML's false is not 0)."""
    return any(value == h and isinstance(value, bool) == isinstance(h, bool) for h in harmless)


def _batches(t: Translation, layout: TrlLayout) -> None:
    t.put("rollout.prompts_per_batch", layout.prompts, f"generation_batch_size={layout.generation} / num_generations="
          f"{layout.group} (TRL's default: per_device_train_batch_size x {t.processes} processes x "
          "steps_per_generation)", "generation_batch_size" if "generation_batch_size" in t.trl else
          "steps_per_generation" if "steps_per_generation" in t.trl else "")
    for name in ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations",
                 "seed", "max_completion_length", "learning_rate"):
        if name not in t.trl:  # TRL's default, where grpo_accel's differs
            t.put(DIRECT[name], TRL_DEFAULTS[name], f"{name} (TRL's default {TRL_DEFAULTS[name]})")


def _length(t: Translation, layout: TrlLayout) -> None:
    steps = t.get("max_steps")
    if steps is not None and steps > 0:
        t.put("trainer.total_frames", layout.frames(steps), f"max_steps={steps} optimizer steps "
              f"({layout.optimizer_steps} per generation of {layout.generation} completions)", "max_steps")
    else:
        epochs = float(t.get("num_train_epochs"))
        t.put("trainer.total_frames", t.epoch_frames(layout, epochs), f"num_train_epochs={epochs:g} x {t.rows()} "
              f"rows x num_generations={layout.group}", "num_train_epochs")
    total = t.settings["trainer.total_frames"]
    strategy = t.get("save_strategy")
    if strategy == "no":
        t.put("checkpoint.interval_frames", None, "save_strategy='no' (a checkpoint at the end only)", "save_strategy")
    elif strategy == "epoch":
        t.put("checkpoint.interval_frames", t.epoch_frames(layout), "save_strategy='epoch' (one pass over the "
              f"{t.rows()} rows)", "save_strategy")
    elif strategy == "steps":
        t.put("checkpoint.interval_frames", t.steps_to_frames(layout, "save_steps", total),
              f"save_steps={t.get('save_steps')} optimizer steps", "save_steps")
    else:
        raise ConfigError(f"save_strategy={strategy!r}: here checkpoints are saved by steps, by epoch or not at all; "
                          "use steps, epoch or no.")
    if t.trl.get("resume_from_checkpoint") not in (None, False, ""):
        value = t.trl["resume_from_checkpoint"]
        t.put("checkpoint.resume", "auto" if value is True or value == "true" else str(value),
              f"resume_from_checkpoint={value!r}", "resume_from_checkpoint")


def _model(t: Translation) -> None:
    for key, value in (t.trl.get("model_init_kwargs") or {}).items():
        if key not in MODEL_INIT:
            raise ConfigError(f"model_init_kwargs.{key}={value!r}: the model is loaded here with "
                              f"{sorted(MODEL_INIT)} only; drop it.")
        t.put(MODEL_INIT[key], value, f"model_init_kwargs.{key}={value!r}", "model_init_kwargs")
    extra = set(t.trl.get("gradient_checkpointing_kwargs") or {}) - {"use_reentrant"}
    if extra:
        raise ConfigError(f"gradient_checkpointing_kwargs: {sorted(extra)}: checkpointing here takes no arguments "
                          "(it is always non-reentrant); drop them.")
    if "gradient_checkpointing_kwargs" in t.trl:
        t.no_effect("gradient_checkpointing_kwargs", "checkpointing here is non-reentrant: the same gradients")
    lora = [k for k in ("lora_r", "lora_alpha", "lora_dropout", "lora_target_modules") if k in t.trl]
    if t.trl.get("use_peft"):
        t.put("model.lora.r", t.trl.get("lora_r", 16), f"use_peft=True, lora_r={t.trl.get('lora_r', 16)}", "use_peft")
        for name in lora[1:] if lora and lora[0] == "lora_r" else lora:
            t.put(TRANSLATED[name].key, t.trl[name], f"{name}={t.trl[name]!r}", name)
    else:
        t.inert += [f"{name} (use_peft is off)" for name in lora]


def _loss(t: Translation) -> None:
    loss = t.get("loss_type")
    if loss not in LOSS_TYPES:
        raise ConfigError(f"loss_type={loss!r}: the TRL losses here are {sorted(LOSS_TYPES)}; use one of them.")
    t.put("loss.aggregation", LOSS_TYPES[loss], f"loss_type={loss!r}", "loss_type")
    epsilon = t.get("epsilon")
    t.put("loss.clip_eps_low", epsilon, f"epsilon={epsilon}", "epsilon")
    if "epsilon_high" not in t.trl:
        t.put("loss.clip_eps_high", epsilon, "epsilon_high (TRL's default: epsilon)")
    scale = t.trl.get("scale_rewards", "group")
    if scale not in ("group", "none", True, False):
        raise ConfigError(f"scale_rewards={scale!r}: here advantages are scaled within each group or not at all; "
                          "use group or none.")
    t.put("loss.scale_advantages", scale in ("group", True), f"scale_rewards={scale!r}", "scale_rewards")
    if t.trl.get("beta"):
        weighted = bool(t.get("use_bias_correction_kl"))
        t.put("loss.kl_importance_weighted", weighted, f"use_bias_correction_kl={weighted} (TRL's default true) with "
              f"beta={t.trl['beta']}", "use_bias_correction_kl" if "use_bias_correction_kl" in t.trl else "")
    elif "use_bias_correction_kl" in t.trl:
        t.no_effect("use_bias_correction_kl", "beta is 0")


def _optim(t: Translation) -> None:
    schedule = t.get("lr_scheduler_type")
    if schedule not in SCHEDULES:
        raise ConfigError(f"lr_scheduler_type={schedule!r}: the schedules here are {sorted(SCHEDULES)}; use one.")
    t.put("optim.scheduler", SCHEDULES[schedule], f"lr_scheduler_type={schedule!r}", "lr_scheduler_type")
    kwargs = dict(t.trl.get("lr_scheduler_kwargs") or {})
    if schedule == "cosine_with_min_lr":
        if "min_lr_rate" in kwargs:
            ratio = float(kwargs.pop("min_lr_rate"))
        elif "min_lr" in kwargs:
            ratio = float(kwargs.pop("min_lr")) / float(t.get("learning_rate"))
        else:
            raise ConfigError("lr_scheduler_type='cosine_with_min_lr' needs lr_scheduler_kwargs with min_lr_rate or "
                              "min_lr, as in transformers; give one (e.g. min_lr_rate: 0.1).")
        t.put("optim.min_lr_ratio", ratio, f"lr_scheduler_kwargs.min_lr_rate={ratio:g}", "lr_scheduler_kwargs")
    if kwargs.pop("num_cycles", 0.5) != 0.5:
        raise ConfigError("lr_scheduler_kwargs.num_cycles: the cosine here is half a cycle (0.5); drop it.")
    if kwargs:
        raise ConfigError(f"lr_scheduler_kwargs: {sorted(kwargs)}: the schedules here take min_lr_rate (or min_lr) "
                          "with cosine_with_min_lr only; drop the others.")
    betas = [t.get("adam_beta1"), t.get("adam_beta2")]
    t.put("optim.betas", betas, "adam_beta1, adam_beta2", "adam_beta1" if "adam_beta1" in t.trl else
          "adam_beta2" if "adam_beta2" in t.trl else "")
    warmup = t.trl.get("warmup_steps", 0)
    if isinstance(warmup, float) and 0 < warmup < 1:  # TRL 1.16: a float below 1 is a ratio of the steps
        t.put("optim.warmup_ratio", warmup, f"warmup_steps={warmup} (a ratio)", "warmup_steps")
    elif warmup:
        t.put("optim.warmup_steps", int(warmup), f"warmup_steps={warmup}", "warmup_steps")
    if "warmup_ratio" in t.trl:
        t.put("optim.warmup_ratio", t.trl["warmup_ratio"], f"warmup_ratio={t.trl['warmup_ratio']}", "warmup_ratio")
    if t.trl.get("bf16") or t.trl.get("fp16"):
        kind = "bf16" if t.trl.get("bf16") else "fp16"
        t.put("trainer.mixed_precision", kind, kind, kind)
    elif t.trl.get("bf16") is False:
        t.put("trainer.mixed_precision", "no", "bf16=False", "bf16")
