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
seed 42, 512 new tokens, 3 epochs, logging every 10 steps, saving every 500). A key with no counterpart here (vLLM's,
quantisation) is refused, one line each.
"""
from __future__ import annotations

import math
from typing import Any, Callable

from grpo_accel.recipe.checks import ConfigError

TRL_DEFAULTS = {  # TRL 1.16's, where they matter here
    "learning_rate": 1e-6, "lr_scheduler_type": "linear", "adam_beta1": 0.9, "adam_beta2": 0.999, "epsilon": 0.2,
    "seed": 42, "max_completion_length": 512, "num_train_epochs": 3.0, "max_steps": -1, "logging_steps": 10,
    "save_steps": 500, "save_strategy": "steps", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "num_generations": 8, "num_iterations": 1, "loss_type": "dapo",
}
SAME = {  # TRL name -> the setting here, the value as it is
    "model_name_or_path": "model.name_or_path", "model_revision": "model.revision", "dtype": "model.dtype",
    "torch_dtype": "model.dtype", "attn_implementation": "model.attn_implementation",
    "trust_remote_code": "model.trust_remote_code", "gradient_checkpointing": "model.gradient_checkpointing",
    "lora_r": "model.lora.r", "lora_alpha": "model.lora.alpha", "lora_dropout": "model.lora.dropout",
    "lora_target_modules": "model.lora.target_modules",
    "dataset_name": "data.path", "dataset_config": "data.name", "dataset_train_split": "data.split",
    "learning_rate": "optim.lr", "weight_decay": "optim.weight_decay", "max_grad_norm": "optim.clip_norm",
    "num_generations": "rollout.group_size", "temperature": "rollout.temperature", "top_p": "rollout.top_p",
    "top_k": "rollout.top_k", "max_completion_length": "rollout.max_new_tokens",
    "max_prompt_length": "rollout.max_prompt_tokens",
    "per_device_train_batch_size": "trainer.micro_batch_completions",
    "gradient_accumulation_steps": "trainer.gradient_accumulation_steps", "num_iterations": "trainer.num_epochs",
    "seed": "trainer.seed", "run_name": "trainer.run_name", "output_dir": "output_dir",
    "beta": "loss.kl_coef", "epsilon_high": "loss.clip_eps_high", "importance_sampling_level": "loss.importance_level",
    "mask_truncated_completions": "loss.mask_truncated", "vllm_importance_sampling_cap": "loss.tis_cap",
    "save_total_limit": "checkpoint.keep_last", "ds3_gather_for_generation": "rollout.zero3_gather_full",
}
LOSS_TYPES = {"grpo": "seq_mean_token_mean", "dapo": "token_mean", "dr_grpo": "seq_mean_token_sum_norm"}
SCHEDULES = {"linear": "linear", "cosine": "cosine", "constant": "constant", "constant_with_warmup": "constant"}
TRL_REWARDS = {"accuracy_reward": "trl.rewards:accuracy_reward", "think_format_reward": "trl.rewards:think_format_reward",
               "reasoning_accuracy_reward": "trl.rewards:reasoning_accuracy_reward"}
NO_OPS = {  # keys whose value (these) changes nothing here
    "use_vllm": (False,), "logging_strategy": ("steps",), "eval_strategy": ("no",), "do_eval": (False,),
    "push_to_hub": (False,), "use_peft": (True, False), "shuffle_dataset": (True,), "remove_unused_columns": (False,),
    "log_completions": (True, False), "dataset_streaming": (False,),
    "disable_dropout": (False,), "overwrite_output_dir": (True, False),
}
HANDLED = {"max_steps", "num_train_epochs", "logging_steps", "save_steps", "generation_batch_size",
           "steps_per_generation", "loss_type", "scale_rewards", "lr_scheduler_type", "warmup_steps", "warmup_ratio",
           "adam_beta1", "adam_beta2", "epsilon", "bf16", "fp16", "report_to", "reward_funcs", "reward_weights",
           "reward_model_name_or_path", "use_peft", "num_completions_to_print", "save_strategy",
           "dataset_test_split", "eval_strategy"}
"""TRL names translated by a rule of their own (units, value maps, TRL's defaults)."""


def is_trl_config(data: dict) -> bool:
    """A config file written for ``trl grpo``: TRL's names at its top, none of grpo_accel's sections."""
    from grpo_accel.recipe.schema import GRPOConfig

    shared = {"output_dir"}  # a key of both: a file holding it alone is grpo_accel's
    keys = set(data)
    return not keys & (set(GRPOConfig.__dataclass_fields__) - shared) and bool(
        keys & (set(SAME) | HANDLED | set(NO_OPS)) - shared)


class TrlLayout:
    """TRL's batch arithmetic for one config (``GRPOConfig.__post_init__``, TRL 1.16) over ``processes``."""

    def __init__(self, trl: dict, processes: int) -> None:
        get = lambda k: trl.get(k, TRL_DEFAULTS.get(k))  # noqa: E731
        self.per_device, self.accumulation = int(get("per_device_train_batch_size")), int(get("gradient_accumulation_steps"))
        self.group, self.iterations = int(get("num_generations")), int(get("num_iterations"))
        per_step = self.per_device * processes  # completions of one micro-step over every process
        generation, steps = trl.get("generation_batch_size"), trl.get("steps_per_generation")
        if generation is not None and steps is not None:
            raise ConfigError("generation_batch_size and steps_per_generation: TRL takes one of them, not both; "
                              "drop one.")
        if generation is None:
            steps = steps or self.accumulation
            generation = per_step * steps
        elif generation % per_step:
            raise ConfigError(f"generation_batch_size={generation}: TRL needs it divisible by per_device_train_batch_"
                              f"size x processes = {per_step}; change one of them.")
        self.steps_per_generation, self.generation = generation // per_step, generation
        if generation % self.group:
            raise ConfigError(f"generation_batch_size={generation}: TRL needs whole prompt groups, divisible by "
                              f"num_generations={self.group}; change one of them.")
        optimizer_steps = self.steps_per_generation * self.iterations
        if optimizer_steps % self.accumulation:
            raise ConfigError(f"gradient_accumulation_steps={self.accumulation}: {self.steps_per_generation} micro-steps "
                              f"per generation x num_iterations={self.iterations} are not whole optimizer steps; make "
                              "steps_per_generation a multiple of it.")
        self.optimizer_steps = optimizer_steps // self.accumulation  # per generation (= per collected batch here)

    @property
    def prompts(self) -> int:
        return self.generation // self.group

    def frames(self, steps: float) -> int:
        """Frames (completions collected) over ``steps`` optimizer steps: whole generations."""
        return math.ceil(steps / self.optimizer_steps) * self.generation


def translate(trl: dict, processes: int, rows: Callable[[dict], int]) -> tuple[dict, list[str]]:
    """``trl`` (a TRL config's keys) as grpo_accel's settings (dotted keys: ``{"optim.lr": 1e-6, ...}``), and one line
    per translated key. ``rows`` counts the rows of the dataset those settings name (for ``num_train_epochs``)."""
    refused = [f"{k}={v!r}: {_why(k)}" for k, v in trl.items()
               if k not in SAME and k not in HANDLED and not (k in NO_OPS and v in NO_OPS[k])]
    if refused:
        raise ConfigError("a TRL config with settings that have no counterpart here:\n  " + "\n  ".join(refused))
    out: dict[str, Any] = {}
    lines: list[str] = []

    def put(key: str, value: Any, source: str) -> None:
        out[key] = value
        lines.append(f"{source} -> {key}={value}")

    for name, key in SAME.items():
        if name in trl:
            put(key, trl[name], f"{name}={trl[name]!r}")
    layout = TrlLayout(trl, processes)
    put("rollout.prompts_per_batch", layout.prompts, f"generation_batch_size={layout.generation} / num_generations="
        f"{layout.group} (TRL's default: per_device_train_batch_size x {processes} processes x steps_per_generation)")
    for name in ("num_generations", "per_device_train_batch_size", "gradient_accumulation_steps", "num_iterations"):
        if name not in trl:  # TRL's default, where grpo_accel's differs
            put(SAME[name], TRL_DEFAULTS[name], f"{name} (TRL's default {TRL_DEFAULTS[name]})")
    per_step = layout.generation / layout.optimizer_steps  # frames collected per optimizer step
    steps = trl.get("max_steps", -1)
    if steps is not None and steps > 0:
        put("trainer.total_frames", layout.frames(steps), f"max_steps={steps} optimizer steps ({layout.optimizer_steps} "
            f"per generation of {layout.generation} completions)")
    else:
        epochs = float(trl.get("num_train_epochs", TRL_DEFAULTS["num_train_epochs"]))
        count = rows(out)
        frames = layout.frames(math.ceil(epochs * count * layout.group / per_step))
        put("trainer.total_frames", frames, f"num_train_epochs={epochs:g} x {count} rows x num_generations="
            f"{layout.group}")
    logging = trl.get("logging_steps", TRL_DEFAULTS["logging_steps"])
    put("trainer.log_interval", max(1, round(logging * per_step)), f"logging_steps={logging} x {per_step:g} frames "
        "per optimizer step")
    if trl.get("save_strategy", "steps") == "no":
        put("checkpoint.interval_frames", None, "save_strategy='no' (a checkpoint at the end only)")
    else:
        saving = trl.get("save_steps", TRL_DEFAULTS["save_steps"])
        put("checkpoint.interval_frames", max(1, round(saving * per_step)), f"save_steps={saving} x {per_step:g} "
            "frames per optimizer step")
    _loss(trl, put)
    _optim(trl, put)
    _run(trl, put)
    _rewards(trl, put)
    return out, lines


def _loss(trl: dict, put) -> None:
    loss = trl.get("loss_type", TRL_DEFAULTS["loss_type"])
    if loss not in LOSS_TYPES:
        raise ConfigError(f"loss_type={loss!r}: the TRL losses here are {sorted(LOSS_TYPES)}; use one of them.")
    put("loss.aggregation", LOSS_TYPES[loss], f"loss_type={loss!r}")
    epsilon = trl.get("epsilon", TRL_DEFAULTS["epsilon"])
    put("loss.clip_eps_low", epsilon, f"epsilon={epsilon}")
    if "epsilon_high" not in trl:
        put("loss.clip_eps_high", epsilon, "epsilon_high (TRL's default: epsilon)")
    scale = trl.get("scale_rewards", "group")
    if scale not in ("group", "none", True, False):
        raise ConfigError(f"scale_rewards={scale!r}: here advantages are scaled within each group or not at all; "
                          "use group or none.")
    put("loss.scale_advantages", scale in ("group", True), f"scale_rewards={scale!r}")


def _optim(trl: dict, put) -> None:
    schedule = trl.get("lr_scheduler_type", TRL_DEFAULTS["lr_scheduler_type"])
    if schedule not in SCHEDULES:
        raise ConfigError(f"lr_scheduler_type={schedule!r}: the schedules here are {sorted(SCHEDULES)}; use one.")
    put("optim.scheduler", SCHEDULES[schedule], f"lr_scheduler_type={schedule!r}")
    if "learning_rate" not in trl:
        put("optim.lr", TRL_DEFAULTS["learning_rate"], "learning_rate (TRL's default)")
    betas = [trl.get("adam_beta1", TRL_DEFAULTS["adam_beta1"]), trl.get("adam_beta2", TRL_DEFAULTS["adam_beta2"])]
    put("optim.betas", betas, "adam_beta1, adam_beta2")
    warmup = trl.get("warmup_steps", 0)
    if isinstance(warmup, float) and 0 < warmup < 1:  # TRL 1.16: a float below 1 is a ratio of the steps
        put("optim.warmup_ratio", warmup, f"warmup_steps={warmup} (a ratio)")
    elif warmup:
        put("optim.warmup_steps", int(warmup), f"warmup_steps={warmup}")
    if "warmup_ratio" in trl:
        put("optim.warmup_ratio", trl["warmup_ratio"], f"warmup_ratio={trl['warmup_ratio']}")


def _run(trl: dict, put) -> None:
    if "seed" not in trl:
        put("trainer.seed", TRL_DEFAULTS["seed"], "seed (TRL's default)")
    if "max_completion_length" not in trl:
        put("rollout.max_new_tokens", TRL_DEFAULTS["max_completion_length"], "max_completion_length (TRL's default)")
    if trl.get("bf16") or trl.get("fp16"):
        put("trainer.mixed_precision", "bf16" if trl.get("bf16") else "fp16", "bf16" if trl.get("bf16") else "fp16")
    elif trl.get("bf16") is False and "bf16" in trl:
        put("trainer.mixed_precision", "no", "bf16=False")
    report = trl.get("report_to")
    if report is not None:
        names = [] if report in ("none", ["none"]) else [report] if isinstance(report, str) else list(report)
        put("trainer.report_to", names, f"report_to={report!r}")
    if trl.get("num_completions_to_print") is not None:
        put("trainer.log_samples", trl["num_completions_to_print"], "num_completions_to_print")
    if trl.get("eval_strategy", "no") != "no" and "dataset_test_split" in trl:
        put("data.eval_split", trl["dataset_test_split"], f"dataset_test_split={trl['dataset_test_split']!r}")
    if trl.get("use_peft") is False:
        put("model.lora.r", 0, "use_peft=False")
    elif trl.get("use_peft") and "lora_r" not in trl:
        put("model.lora.r", 16, "use_peft=True (TRL's default lora_r 16)")


def _rewards(trl: dict, put) -> None:
    names = list(trl.get("reward_funcs") or [])
    weights = trl.get("reward_weights") or [1.0] * (len(names) + bool(trl.get("reward_model_name_or_path")))
    entries = []
    if trl.get("reward_model_name_or_path"):
        entries.append({"name": "reward_model", "path": trl["reward_model_name_or_path"]})
    for name in names:
        if name in TRL_REWARDS:
            entries.append({"name": TRL_REWARDS[name]})
        elif name == "get_soft_overlong_punishment":  # the values trl grpo uses; DAPO's penalty, built in here
            entries.append({"name": "overlong_penalty", "kwargs": {"max_tokens": 1280, "cache_tokens": 256}})
        elif "." in name:
            module, attr = name.rsplit(".", 1)
            entries.append({"name": f"{module}:{attr}"})
        else:
            known = sorted([*TRL_REWARDS, "get_soft_overlong_punishment"])
            raise ConfigError(f"reward_funcs: {name!r} is neither one of TRL's ({known}) nor a dotted import path "
                              "(my_lib.rewards.custom_reward).")
    if not entries:
        return
    if len(weights) != len(entries):
        raise ConfigError(f"reward_weights={weights}: {len(weights)} weights for {len(entries)} reward functions; give "
                          "one each.")
    put("rewards", [{**e, "weight": float(w)} for e, w in zip(entries, weights)],
        "reward_funcs" + (", reward_weights" if trl.get("reward_weights") else ""))


def _why(key: str) -> str:
    if key.startswith("vllm") or key == "use_vllm":
        return ("vLLM is not an engine here: rollouts come from the trainer's own process (rollout.backend=embedded) "
                "or SGLang servers (rollout.backend=sglang); drop it")
    if key.startswith(("load_in_", "bnb_")) or "quant" in key:
        return "quantised training is not supported here; drop it"
    return "no counterpart here; drop it (docs/pages/coming-from-trl.md lists what each TRL setting becomes)"

