"""TRL's GRPOConfig names and what they are called here, with the unit where it differs: the unknown-key error
uses it ("`num_generations` is TRL's name; here it is `rollout.group_size` ..."), docs/pages/coming-from-trl.md shows it, and a test
checks that every key it names exists.

Units: a *frame* is one completion; a *batch* is one collected batch (``rollout.prompts_per_batch`` prompts x
``rollout.group_size`` completions); an *optimizer step* is one update of the weights.
"""
from __future__ import annotations

from typing import NamedTuple


class Here(NamedTuple):
    key: str | None  # the setting here; None: there is none
    note: str = ""  # the unit, or how the setting differs (or why there is none)


TRL_NAMES: dict[str, Here] = {
    "learning_rate": Here("optim.lr"),
    "lr_scheduler_type": Here("optim.scheduler", "constant, linear or cosine"),
    "warmup_ratio": Here("optim.warmup_ratio"),
    "warmup_steps": Here("optim.warmup_steps", "optimizer steps"),
    "weight_decay": Here("optim.weight_decay"),
    "adam_beta1": Here("optim.betas", "[beta1, beta2]"),
    "adam_beta2": Here("optim.betas", "[beta1, beta2]"),
    "max_grad_norm": Here("optim.clip_norm"),
    "num_generations": Here("rollout.group_size", "completions per prompt"),
    "max_completion_length": Here("rollout.max_new_tokens", "tokens"),
    "max_prompt_length": Here("rollout.max_prompt_tokens", "tokens; a longer prompt is an error naming its row, "
                                                           "or data.overlong_prompts drops or cuts it"),
    "temperature": Here("rollout.temperature"),
    "top_p": Here("rollout.top_p"),
    "top_k": Here("rollout.top_k"),
    "generation_batch_size": Here("rollout.prompts_per_batch", "prompts per collected batch, not completions: "
                                                               "TRL's count is this x rollout.group_size"),
    "use_vllm": Here("rollout.backend", "embedded or sglang (SGLang servers, not vLLM)"),
    "ds3_gather_for_generation": Here("rollout.zero3_gather_full"),
    "beta": Here("loss.kl_coef"),
    "epsilon": Here("loss.clip_eps_low"),
    "epsilon_high": Here("loss.clip_eps_high"),
    "loss_type": Here("loss.aggregation", "grpo -> seq_mean_token_mean, dapo -> token_mean, dr_grpo -> "
                                          "seq_mean_token_sum_norm"),
    "scale_rewards": Here("loss.scale_advantages", "true/false (per group)"),
    "importance_sampling_level": Here("loss.importance_level", "token or sequence"),
    "vllm_importance_sampling_cap": Here("loss.tis_cap"),
    "num_iterations": Here("trainer.num_epochs", "passes over each collected batch"),
    "per_device_train_batch_size": Here("trainer.micro_batch_completions", "completions per forward on one process"),
    "gradient_accumulation_steps": Here("trainer.gradient_accumulation_steps", "micro-batches per optimizer step"),
    "steps_per_generation": Here(None, "optimizer steps per collected batch follow from the batch, "
                                       "trainer.micro_batch_completions and trainer.gradient_accumulation_steps (the "
                                       "start-up 'batch layout' line gives them)"),
    "max_steps": Here("trainer.total_frames", "frames (completions), not optimizer steps: steps x completions per "
                                              "optimizer step"),
    "num_train_epochs": Here("trainer.total_frames", "frames (completions): epochs x rows x rollout.group_size"),
    "logging_steps": Here("trainer.log_interval", "frames (completions), not steps"),
    "save_steps": Here("checkpoint.interval_frames", "frames (completions), not steps"),
    "save_total_limit": Here("checkpoint.keep_last"),
    "resume_from_checkpoint": Here("checkpoint.resume", "auto or a checkpoint folder"),
    "seed": Here("trainer.seed"),
    "bf16": Here("trainer.mixed_precision", "bf16"),
    "fp16": Here("trainer.mixed_precision", "fp16"),
    "gradient_checkpointing": Here("model.gradient_checkpointing"),
    "report_to": Here("trainer.report_to"),
    "run_name": Here("trainer.run_name"),
    "log_completions": Here("trainer.log_samples", "how many completions per log; 0 turns it off"),
    "num_completions_to_print": Here("trainer.log_samples", "completions per log"),
    "reward_funcs": Here("rewards", "a list of {name, weight}"),
    "reward_weights": Here("rewards", "each entry's weight"),
    "model_name_or_path": Here("model.name_or_path"),
    "torch_dtype": Here("model.dtype"),
    "dtype": Here("model.dtype"),
    "attn_implementation": Here("model.attn_implementation"),
    "trust_remote_code": Here("model.trust_remote_code"),
    "model_revision": Here("model.revision"),
    "dataset_name": Here("data.path", "a file, a saved dataset folder or a hub id"),
    "dataset_config": Here("data.name"),
    "dataset_train_split": Here("data.split"),
    "dataset_test_split": Here("data.eval_split"),
    "eval_steps": Here("eval.every_iterations", "batches"),
    "mask_truncated_completions": Here("loss.mask_truncated"),
    "sync_ref_model": Here(None, "the reference model stays the initial one"),
}


def trl_hint(name: str) -> str:
    """The sentence an unknown key ``name`` (its last part) gets when it is one of TRL's names, else ""."""
    here = TRL_NAMES.get(name.rsplit(".", 1)[-1])
    if here is None:
        return ""
    leaf = name.rsplit(".", 1)[-1]
    if here.key is None:
        return f" `{leaf}` is TRL's name; there is no such setting here: {here.note}."
    return f" `{leaf}` is TRL's name; here it is `{here.key}`" + (f" ({here.note})." if here.note else ".")
