"""Every field of TRL 1.16's ``GRPOConfig`` (with the ``transformers.TrainingArguments`` it inherits),
``ScriptArguments``, ``trl grpo``'s ``GRPOScriptArguments``, ``ModelConfig`` and ``DatasetMixtureConfig``, and the
keys the recipe scripts built on TRL add (open-r1's ``grpo.py``), in one of three lists:

* :data:`TRANSLATED`: it does here what it does in TRL, as the setting named (its unit converted where they differ);
* :data:`NO_EFFECT`: accepted, and named once at start as having no effect here (with why);
* :data:`REFUSED`: it would change what the user gets and that cannot be done here: one line with the reason.
  A refused field at a value that asks for nothing (TRL's default, "off") is accepted as having no effect.

:mod:`grpo_accel.config.trl.translate` reads a file by these lists, the unknown-key error names a TRL key's
counterpart (:func:`trl_hint`), ``docs/pages/coming-from-trl.md`` is rendered from them
(:func:`grpo_accel.config.reference.trl_markdown`), and a
test enumerates the dataclasses of the installed ``trl`` and fails on a field in none of them.

Units: a *frame* is one completion; a *batch* is one collected batch (``rollout.prompts_per_batch`` prompts x
``rollout.group_size`` completions), TRL's *generation*; an *optimizer step* is one update of the weights.
"""
from __future__ import annotations

from typing import NamedTuple


class Translated(NamedTuple):
    key: str | None  # the setting here; None: several, or what its rule says
    note: str = ""  # the unit, or how it is read


class Inert(NamedTuple):
    why: str  # why it changes nothing here


class Refused(NamedTuple):
    why: str  # what it would do, and why that cannot be done here
    harmless: tuple = ()  # values that ask for nothing: accepted as no effect


STEPS = "optimizer steps in TRL, frames here: x the frames of one optimizer step (a float below 1: a share of the run)"

TRANSLATED: dict[str, Translated] = {
    # the model (ModelConfig, GRPOConfig)
    "model_name_or_path": Translated("model.name_or_path"),
    "model_revision": Translated("model.revision"),
    "dtype": Translated("model.dtype"),
    "torch_dtype": Translated("model.dtype", "the name before TRL 1.0"),
    "attn_implementation": Translated("model.attn_implementation"),
    "trust_remote_code": Translated("model.trust_remote_code"),
    "model_init_kwargs": Translated(None, "its dtype, attn_implementation, revision and trust_remote_code, as "
                                          "the model.* settings; any other key is refused"),
    "gradient_checkpointing": Translated("model.gradient_checkpointing"),
    "gradient_checkpointing_kwargs": Translated(None, "use_reentrant: checkpointing here is always non-reentrant "
                                                      "(the same gradients); any other key is refused"),
    "use_peft": Translated("model.lora.r", "false: 0 (no LoRA); true: lora_r (16, TRL's default)"),
    "lora_r": Translated("model.lora.r", "with use_peft: true"),
    "lora_alpha": Translated("model.lora.alpha", "with use_peft: true"),
    "lora_dropout": Translated("model.lora.dropout", "with use_peft: true"),
    "lora_target_modules": Translated("model.lora.target_modules", "with use_peft: true"),
    "chat_template": Translated("model.chat_template", "open-r1's: the tokenizer's chat template replaced"),
    # the data (ScriptArguments, recipe scripts)
    "dataset_name": Translated("data.path", "a file, a saved dataset folder or a hub id"),
    "dataset_config": Translated("data.name"),
    "dataset_train_split": Translated("data.split"),
    "dataset_test_split": Translated("data.eval_split", "read when evaluation is on"),
    "dataset_prompt_column": Translated("data.prompt_field", "open-r1's"),
    "system_prompt": Translated("data.system_prompt", "open-r1's: a text prompt becomes a system and a user "
                                                      "message"),
    # the optimizer
    "learning_rate": Translated("optim.lr"),
    "lr_scheduler_type": Translated("optim.scheduler", "constant, constant_with_warmup, linear, cosine, "
                                                       "cosine_with_min_lr"),
    "lr_scheduler_kwargs": Translated("optim.min_lr_ratio", "cosine_with_min_lr's min_lr_rate (or min_lr / "
                                                            "learning_rate); any other key is refused"),
    "warmup_steps": Translated("optim.warmup_steps", "optimizer steps; a float below 1 is optim.warmup_ratio"),
    "warmup_ratio": Translated("optim.warmup_ratio"),
    "weight_decay": Translated("optim.weight_decay"),
    "adam_beta1": Translated("optim.betas", "[beta1, beta2]"),
    "adam_beta2": Translated("optim.betas", "[beta1, beta2]"),
    "adam_epsilon": Translated("optim.eps"),
    "max_grad_norm": Translated("optim.clip_norm"),
    # generation
    "num_generations": Translated("rollout.group_size", "completions per prompt"),
    "max_completion_length": Translated("rollout.max_new_tokens", "tokens"),
    "max_prompt_length": Translated("rollout.max_prompt_tokens", "tokens; a longer prompt is an error naming "
                                                                 "its row, or data.overlong_prompts drops or "
                                                                 "cuts it"),
    "temperature": Translated("rollout.temperature"),
    "top_p": Translated("rollout.top_p"),
    "top_k": Translated("rollout.top_k"),
    "generation_batch_size": Translated("rollout.prompts_per_batch", "prompts per collected batch, not "
                                                                     "completions: TRL's count / num_generations"),
    "steps_per_generation": Translated("rollout.prompts_per_batch", "x per_device_train_batch_size x processes "
                                                                    "/ num_generations"),
    "ds3_gather_for_generation": Translated("rollout.zero3_gather_full", "only when the file sets it (TRL's "
                                                                         "default true holds the whole model on "
                                                                         "every rank)"),
    "use_vllm": Translated("rollout.backend", "true: vLLM servers (weights pushed from disk); false: embedded"),
    "vllm_mode": Translated("rollout.colocate", "server: separate servers; colocate: servers on the trainer's "
                                                "GPUs"),
    "vllm_server_base_url": Translated("rollout.urls"),
    "vllm_server_host": Translated("rollout.urls", "with vllm_server_port; 0.0.0.0 is 127.0.0.1"),
    "vllm_server_port": Translated("rollout.urls"),
    "vllm_server_timeout": Translated("rollout.health_timeout_s"),
    "vllm_group_port": Translated(None, "the weights reach vLLM from disk here: no group"),
    "vllm_gpu_memory_utilization": Translated(None, "the server's --gpu-memory-utilization, in the line that "
                                                    "says how to start it"),
    "vllm_importance_sampling_correction": Translated("loss.tis_cap", "with use_vllm: true (TRL's default "
                                                                      "true); false: null"),
    "vllm_importance_sampling_mode": Translated("loss.tis_mode"),
    "vllm_importance_sampling_clip_max": Translated("loss.tis_cap"),
    "vllm_importance_sampling_clip_min": Translated("loss.tis_min"),
    "vllm_importance_sampling_cap": Translated("loss.tis_cap", "TRL's old name of "
                                                               "vllm_importance_sampling_clip_max"),
    # the loss
    "beta": Translated("loss.kl_coef"),
    "use_bias_correction_kl": Translated("loss.kl_importance_weighted", "with beta > 0"),
    "epsilon": Translated("loss.clip_eps_low"),
    "epsilon_high": Translated("loss.clip_eps_high", "TRL's default: epsilon"),
    "loss_type": Translated("loss.aggregation", "grpo -> seq_mean_token_mean, dapo -> token_mean, dr_grpo -> "
                                                "seq_mean_token_sum_norm"),
    "scale_rewards": Translated("loss.scale_advantages", "group/true or none/false"),
    "importance_sampling_level": Translated("loss.importance_level", "token or sequence"),
    "mask_truncated_completions": Translated("loss.mask_truncated"),
    "num_iterations": Translated("trainer.num_epochs", "passes over each collected batch"),
    # rewards (GRPOScriptArguments, recipe scripts)
    "reward_funcs": Translated("rewards", "TRL's names, open-r1's names (open_r1.rewards) or dotted paths"),
    "reward_weights": Translated("rewards", "each entry's weight"),
    "reward_model_name_or_path": Translated("rewards", "an entry {name: reward_model, path: ...}"),
    "max_completion_len": Translated("rewards", "open-r1's soft_overlong_punishment: overlong_penalty's "
                                                "max_tokens"),
    "soft_punish_cache": Translated("rewards", "open-r1's soft_overlong_punishment: overlong_penalty's "
                                               "cache_tokens"),
    # batches and the length of the run
    "per_device_train_batch_size": Translated("trainer.micro_batch_completions", "completions per forward on "
                                                                                 "one process"),
    "gradient_accumulation_steps": Translated("trainer.gradient_accumulation_steps", "micro-batches per optimizer "
                                                                                     "step"),
    "max_steps": Translated("trainer.total_frames", "frames (completions), not optimizer steps: steps x "
                                                    "completions per optimizer step"),
    "num_train_epochs": Translated("trainer.total_frames", "frames: epochs x rows x num_generations"),
    "seed": Translated("trainer.seed"),
    "bf16": Translated("trainer.mixed_precision", "bf16"),
    "fp16": Translated("trainer.mixed_precision", "fp16"),
    # logging
    "logging_strategy": Translated("trainer.log_interval", "steps (logging_steps), epoch (one dataset epoch's "
                                                           "frames) or no (once, at the end)"),
    "logging_steps": Translated("trainer.log_interval", STEPS),
    "logging_first_step": Translated("trainer.log_first"),
    "log_level": Translated("trainer.log_level", "passive: info"),
    "disable_tqdm": Translated("trainer.progress_bar", "negated"),
    "report_to": Translated("trainer.report_to", "none: []; all: every tracker installed here"),
    "run_name": Translated("trainer.run_name"),
    "project": Translated("trainer.project"),
    "wandb_project": Translated("trainer.project", "open-r1's, with wandb in report_to"),
    "wandb_entity": Translated("trainer.tracker_kwargs", "open-r1's: {wandb: {entity: ...}}"),
    "wandb_run_group": Translated("trainer.tracker_kwargs", "open-r1's: {wandb: {group: ...}}"),
    "trackio_space_id": Translated("trainer.tracker_kwargs", "{trackio: {space_id: ...}}, with trackio in "
                                                             "report_to"),
    "log_completions": Translated("trainer.log_samples", "false (TRL's default): 0; true: num_completions_to_"
                                                         "print, or every completion of a batch"),
    "num_completions_to_print": Translated("trainer.log_samples", "with log_completions: true"),
    # evaluation
    "eval_strategy": Translated("eval.every_iterations", "no: 0; steps: eval_steps; epoch: one dataset epoch's "
                                                         "batches"),
    "eval_steps": Translated("eval.every_iterations", "optimizer steps in TRL, batches here (a float below 1: a "
                                                      "share of the run); TRL's default: logging_steps"),
    "num_generations_eval": Translated("eval.k", "samples per held-out prompt"),
    # checkpoints and the Hub
    "output_dir": Translated("output_dir"),
    "save_strategy": Translated("checkpoint.interval_frames", "steps (save_steps), epoch (one dataset epoch's "
                                                              "frames) or no (at the end only)"),
    "save_steps": Translated("checkpoint.interval_frames", STEPS),
    "save_total_limit": Translated("checkpoint.keep_last"),
    "resume_from_checkpoint": Translated("checkpoint.resume", "true: auto; or a checkpoint folder"),
    "push_to_hub": Translated("hub.push", "the exported model, after each checkpoint, in the background"),
    "hub_model_id": Translated("hub.model_id", "TRL's default: output_dir's folder name"),
    "hub_strategy": Translated("hub.strategy", "end, every_save, checkpoint or all_checkpoints"),
    "hub_private_repo": Translated("hub.private"),
    "hub_token": Translated("hub.token", "a secret: ${NAME} reads the environment"),
    "hub_revision": Translated("hub.revision"),
    "hub_model_revision": Translated("hub.revision", "open-r1's"),
    "hub_always_push": Translated("hub.always_push"),
}

NO_EFFECT: dict[str, Inert] = {
    # what the launch decides here
    "local_rank": Inert("set by the launcher"),
    "ddp_backend": Inert("the launch's accelerate config chooses the backend (NCCL on GPUs, gloo on CPUs)"),
    "ddp_timeout": Inert("the process group's timeout is Accelerate's"),
    "ddp_find_unused_parameters": Inert("DeepSpeed's engine reduces gradients here, not DDP"),
    "ddp_bucket_cap_mb": Inert("DeepSpeed's engine reduces gradients here, not DDP"),
    "ddp_broadcast_buffers": Inert("DeepSpeed's engine reduces gradients here, not DDP"),
    "ddp_static_graph": Inert("DeepSpeed's engine reduces gradients here, not DDP"),
    "log_on_each_node": Inert("the main process logs"),
    "save_on_each_node": Inert("every process writes its own part of a checkpoint to output_dir"),
    "num_processes": Inert("TRL's CLI launch key: the launch's --num_processes decides here"),
    "accelerate_config": Inert("TRL's CLI launch key: grpo-accel train --accelerate-config decides here"),
    "nproc_per_node": Inert("TRL's CLI launch key (torchrun's): the launch's --num_processes decides here"),
    "nnodes": Inert("TRL's CLI launch key (torchrun's): the launch's --num_machines decides here"),
    # data loading (prompts are drawn by the collector, not a DataLoader)
    "dataloader_drop_last": Inert("prompts are drawn by the collector, not a DataLoader"),
    "dataloader_num_workers": Inert("prompts are drawn by the collector, not a DataLoader"),
    "dataloader_pin_memory": Inert("prompts are drawn by the collector, not a DataLoader"),
    "dataloader_persistent_workers": Inert("prompts are drawn by the collector, not a DataLoader"),
    "dataloader_prefetch_factor": Inert("prompts are drawn by the collector, not a DataLoader"),
    "dataloader_multiprocessing_context": Inert("prompts are drawn by the collector, not a DataLoader"),
    "dataloader_in_order": Inert("prompts are drawn by the collector, not a DataLoader"),
    "remove_unused_columns": Inert("every column reaches the reward functions"),
    "label_names": Inert("a policy-gradient loss has no labels"),
    "length_column_name": Inert("prompts are not grouped by length"),
    "dataset_streaming": Inert("the rows are read whole at start"),
    "streaming": Inert("the rows are read whole at start"),
    "ignore_bias_buffers": Inert("a DPO setting"),
    "data_seed": Inert("the data order follows trainer.seed (seed)"),
    "ignore_data_skip": Inert("a resume continues the data order exactly"),
    # speed and memory knobs that leave the computation as it is
    "use_liger_kernel": Inert("the same loss without Liger's fused kernels (and their memory saving)"),
    "liger_kernel_config": Inert("the same loss without Liger's fused kernels (and their memory saving)"),
    "torch_compile": Inert("training forwards run eagerly (rollout.decoder=compiled compiles generation)"),
    "torch_compile_backend": Inert("training forwards run eagerly (rollout.decoder=compiled compiles generation)"),
    "torch_compile_mode": Inert("training forwards run eagerly (rollout.decoder=compiled compiles generation)"),
    "tf32": Inert("matmuls run at torch's default precision (mixed precision covers the speed)"),
    "use_cache": Inert("generation keeps its own KV cache; training forwards use none"),
    "cache_implementation": Inert("generation keeps its own KV cache"),
    "torch_empty_cache_steps": Inert("the CUDA cache is not emptied on a schedule"),
    "pad_to_multiple_of": Inert("rows are padded to the batch's longest (or packed)"),
    "auto_find_batch_size": Inert("batch sizes are as given; an out-of-memory error stops the run, saved"),
    "average_tokens_across_devices": Inert("token counts are summed over every process"),
    "use_transformers_continuous_batching": Inert("the embedded engine's own decode loop generates"),
    "transformers_continuous_batching_config": Inert("the embedded engine's own decode loop generates"),
    "use_transformers_paged": Inert("the embedded engine's own decode loop generates"),
    "vllm_model_impl": Inert("SGLang's own model implementation serves"),
    "vllm_enable_sleep_mode": Inert("colocated SGLang servers free their memory while the trainer trains "
                                    "(rollout.colocate)"),
    "vllm_max_model_length": Inert("the server's --context-length at its start; the trainer reads it"),
    "vllm_tensor_parallel_size": Inert("the server's --tp-size at its start"),
    "vllm_device": Inert("an old TRL key: the server's GPUs are its own"),
    "fp16_full_eval": Inert("evaluation generates with the rollout engine"),
    "bf16_full_eval": Inert("evaluation generates with the rollout engine"),
    # evaluation details
    "do_train": Inert("a flag for scripts; TRL's trainer does not read it"),
    "do_eval": Inert("a flag for scripts; eval_strategy decides"),
    "do_predict": Inert("a flag for scripts; TRL's trainer does not read it"),
    "per_device_eval_batch_size": Inert("evaluation generates every held-out prompt's samples in one collection"),
    "eval_on_start": Inert("the untrained model is always evaluated before the first batch"),
    "prediction_loss_only": Inert("evaluation scores rewards, not a loss"),
    "eval_do_concat_batches": Inert("evaluation scores rewards, not a loss"),
    "eval_use_gather_object": Inert("every process evaluates every held-out row"),
    "eval_accumulation_steps": Inert("evaluation scores rewards, not a loss"),
    "include_for_metrics": Inert("evaluation scores rewards, not a loss"),
    "batch_eval_metrics": Inert("evaluation scores rewards, not a loss"),
    "metric_for_best_model": Inert("used by load_best_model_at_end (see checkpoint.best_metric)"),
    "greater_is_better": Inert("used by load_best_model_at_end (see checkpoint.best_mode)"),
    # logging details
    "logging_nan_inf_filter": Inert("every logged scalar is what the batch computed"),
    "include_num_input_tokens_seen": Inert("token counts are logged under train/"),
    "log_level_replica": Inert("processes other than the main one log warnings and errors"),
    "skip_memory_metrics": Inert("memory is in summary.json"),
    "debug": Inert("transformers' debug modes"),
    "log_unique_prompts": Inert("logged samples are the batch's first completions"),
    "log_multimodal": Inert("text models only"),
    "log_completions_hub_repo": Inert("completions go to the trackers, not to a hub dataset"),
    "wandb_log_unique_prompts": Inert("logged samples are the batch's first completions"),
    "trackio_static_space_id": Inert("Trackio logs locally (trainer.tracker_kwargs reaches its init)"),
    # checkpoints
    "save_only_model": Inert("checkpoints keep the optimizer too, so that a run resumes (grpo-accel export "
                             "writes the model alone)"),
    "enable_jit_checkpoint": Inert("a SIGTERM or SIGINT always saves a checkpoint before the run stops"),
    "restore_callback_states_from_checkpoint": Inert("a resume restores every counter and schedule"),
    "full_determinism": Inert("a run is reproducible from trainer.seed"),
    "overwrite_output_dir": Inert("a folder holding an earlier run is refused: checkpoint.resume=auto continues "
                                  "it, overwrite=true replaces it"),
    "push_to_hub_revision": Inert("used by push_to_hub (open-r1's callback)"),
    "overwrite_hub_revision": Inert("open-r1's callback"),
    "benchmarks": Inert("open-r1's benchmarks run after training, outside the trainer"),
    "callbacks": Inert("open-r1's callbacks run in its own trainer"),
    # settings of methods that are off (their switch is refused when on)
    "ref_model_mixup_alpha": Inert("used by sync_ref_model"),
    "ref_model_sync_steps": Inert("used by sync_ref_model"),
    "entropy_coef_min": Inert("used by use_adaptive_entropy"),
    "entropy_coef_max": Inert("used by use_adaptive_entropy"),
    "entropy_coef_delta": Inert("used by use_adaptive_entropy"),
    "entropy_target": Inert("used by use_adaptive_entropy"),
    "sapo_temperature_neg": Inert("used by loss_type: sapo"),
    "sapo_temperature_pos": Inert("used by loss_type: sapo"),
    "vespo_k_pos": Inert("used by loss_type: vespo"),
    "vespo_lambda_pos": Inert("used by loss_type: vespo"),
    "vespo_k_neg": Inert("used by loss_type: vespo"),
    "vespo_lambda_neg": Inert("used by loss_type: vespo"),
    "bnb_4bit_quant_type": Inert("used by load_in_4bit"),
    "use_bnb_nested_quant": Inert("used by load_in_4bit"),
    "bnb_4bit_quant_storage": Inert("used by load_in_4bit"),
    "lora_task_type": Inert("adapters are for causal language models"),
    "max_tool_calling_iterations": Inert("tools come from rollout.environment here (its turns: rollout.max_turns)"),
    "cosine_min_value_wrong": Inert("used by open-r1's cosine reward"),
    "cosine_max_value_wrong": Inert("used by open-r1's cosine reward"),
    "cosine_min_value_correct": Inert("used by open-r1's cosine reward"),
    "cosine_max_value_correct": Inert("used by open-r1's cosine reward"),
    "cosine_max_len": Inert("used by open-r1's cosine reward"),
    "repetition_n_grams": Inert("used by open-r1's repetition_penalty reward"),
    "repetition_max_penalty": Inert("used by open-r1's repetition_penalty reward"),
    "code_language": Inert("used by open-r1's code rewards"),
    "code_eval_test_batch_size": Inert("used by open-r1's code rewards"),
    "code_eval_scoring_mode": Inert("used by open-r1's code rewards"),
    "parallel_code_exec_per_proc": Inert("used by open-r1's code rewards"),
    "e2b_router_url": Inert("used by open-r1's code rewards"),
    "morph_router_url": Inert("used by open-r1's code rewards"),
    "code_provider": Inert("used by open-r1's code rewards"),
    "ioi_provider": Inert("used by open-r1's code rewards"),
    "enforce_same_language": Inert("used by open-r1's code rewards"),
}

REFUSED: dict[str, Refused] = {
    "optim": Refused("the optimizer here is AdamW (torch's fused)", ("adamw_torch_fused", "adamw_torch")),
    "optim_args": Refused("the optimizer here is AdamW (torch's fused), configured by optim.*", (None, "")),
    "optim_target_modules": Refused("GaLore-style optimizers are not available here", (None,)),
    "label_smoothing_factor": Refused("a policy-gradient loss has no labels to smooth", (0, 0.0)),
    "activation_checkpointing": Refused("use gradient_checkpointing (model.gradient_checkpointing)", (None, False)),
    "activation_checkpointing_kwargs": Refused("every layer is checkpointed when gradient_checkpointing is on, "
                                               "in device memory", (None, {})),
    "neftune_noise_alpha": Refused("NEFTune's embedding noise is not added here", (None,)),
    "eval_delay": Refused("evaluation starts with the first batch here", (0, 0.0)),
    "load_best_model_at_end": Refused("the run ends with its last weights; checkpoint.keep_best keeps the best "
                                      "checkpoints (grpo-accel export writes one as a model)", (False,)),
    "use_cpu": Refused("the device is the launch's: use an accelerate config for CPU processes", (False,)),
    "accelerator_config": Refused("Accelerate is configured by the launch's accelerate config file", (None, {})),
    "parallelism_config": Refused("context and tensor parallelism are not available here", (None,)),
    "train_sampling_strategy": Refused("prompts are drawn in a shuffled order (by trainer.seed)", ("random",)),
    "fsdp": Refused("FSDP is not an engine here: DeepSpeed ZeRO 0-3 is (accelerate_configs/zero3.yaml)",
                    (None, "", [], False)),
    "fsdp_config": Refused("FSDP is not an engine here: DeepSpeed ZeRO 0-3 is (accelerate_configs/zero3.yaml)",
                           (None, {})),
    "deepspeed": Refused("the ZeRO stage is the launch's accelerate config (accelerate_configs/zero1.yaml ... "
                         "zero3.yaml, each naming its ds_configs/ file)", (None,)),
    "router_aux_loss_coef": Refused("a mixture of experts' router loss is not added here", (None,)),
    "disable_dropout": Refused("the model's own dropout stays as its config has it", (False,)),
    "cast_lm_head_to_fp32": Refused("the output head runs in the model's dtype and autocast", (False,)),
    "shuffle_dataset": Refused("prompts are always drawn shuffled, by trainer.seed", (True,)),
    "min_p": Refused("min-p sampling is not available here (top_p and top_k are)", (None, 0, 0.0)),
    "repetition_penalty": Refused("a repetition penalty would bias the importance ratio; not applied here",
                                  (1, 1.0)),
    "generation_kwargs": Refused("generation takes temperature, top_p, top_k and max_completion_length here",
                                 (None, {})),
    "vllm_structured_outputs_regex": Refused("constrained decoding is not available here", (None,)),
    "delta": Refused("INTELLECT-2's two-sided clipping is not available here", (None,)),
    "multi_objective_aggregation": Refused("the weighted rewards are summed, then normalised per group "
                                           "(rewards[].normalize: group normalises one reward first)",
                                           ("sum_then_normalize",)),
    "sync_ref_model": Refused("the KL reference stays the initial model", (False,)),
    "top_entropy_quantile": Refused("every completion token stays in the loss", (1, 1.0)),
    "entropy_coef": Refused("no entropy bonus is added to the loss", (0, 0.0)),
    "use_adaptive_entropy": Refused("no entropy bonus is added to the loss", (False,)),
    "off_policy_mask_threshold": Refused("off-policy sequence masking is not available here", (None,)),
    "lora_target_parameters": Refused("adapters go on linear layers (lora_target_modules)", (None, [])),
    "lora_modules_to_save": Refused("only the adapter trains", (None, [])),
    "use_rslora": Refused("rank-stabilised LoRA scaling is not available here", (False,)),
    "use_dora": Refused("DoRA is not available here", (False,)),
    "load_in_8bit": Refused("quantised training is not supported here", (False,)),
    "load_in_4bit": Refused("quantised training is not supported here", (False,)),
    "datasets": Refused("dataset mixtures are not read here: give dataset_name (one file, folder or hub id)",
                        ([], None)),
    "dataset_mixture": Refused("dataset mixtures are not read here: give dataset_name", (None,)),
    "test_split_size": Refused("held-out rows are a split of their own here (dataset_test_split)", (None,)),
    "trackio_bucket_id": Refused("give it in trainer.tracker_kwargs={trackio: {...}}", (None,)),
    "chat_template_kwargs": Refused("arguments to the chat template are not passed here: write them into "
                                    "chat_template (model.chat_template)", (None, {}, "")),
    "dataset_configs": Refused("an old open-r1 key: give dataset_config (one name)", (None, [])),
}

NOT_TRLS = {  # keys of recipe scripts built on TRL, and names TRL or transformers had before, not in TRL 1.16
    **dict.fromkeys((
        "system_prompt", "dataset_prompt_column", "chat_template", "wandb_project", "wandb_entity", "wandb_run_group",
        "wandb_log_unique_prompts", "benchmarks", "callbacks", "hub_model_revision", "overwrite_hub_revision",
        "push_to_hub_revision", "dataset_mixture", "max_completion_len", "soft_punish_cache", "cosine_min_value_wrong",
        "cosine_max_value_wrong", "cosine_min_value_correct", "cosine_max_value_correct", "cosine_max_len",
        "repetition_n_grams", "repetition_max_penalty", "code_language", "code_eval_test_batch_size",
        "code_eval_scoring_mode", "parallel_code_exec_per_proc", "e2b_router_url", "morph_router_url",
        "code_provider", "ioi_provider", "enforce_same_language"), "open-r1"),
    **dict.fromkeys(("num_processes", "accelerate_config", "nproc_per_node", "nnodes"), "TRL's CLI"),
    "dataset_configs": "open-r1 (older)", "vllm_device": "TRL (older)", "torch_dtype": "TRL (older)",
    "max_prompt_length": "TRL (older)", "overwrite_output_dir": "transformers (older)",
    "warmup_ratio": "transformers (older)",
}
"""Where each key that is not a field of TRL 1.16's dataclasses comes from."""

TRL_KEYS = frozenset(TRANSLATED) | frozenset(NO_EFFECT) | frozenset(REFUSED)
"""Every key a TRL config file may hold."""


def trl_hint(name: str) -> str:
    """The sentence an unknown key ``name`` (its last part) gets when it is one of TRL's names, else ""."""
    leaf = name.rsplit(".", 1)[-1]
    if leaf in TRANSLATED:
        here = TRANSLATED[leaf]
        if here.key is None:
            return f" `{leaf}` is TRL's name; here: {here.note}."
        return f" `{leaf}` is TRL's name; here it is `{here.key}`" + (f" ({here.note})." if here.note else ".")
    if leaf in NO_EFFECT:
        return f" `{leaf}` is TRL's name; it has no effect here: {NO_EFFECT[leaf].why}."
    if leaf in REFUSED:
        return f" `{leaf}` is TRL's name; there is no such setting here: {REFUSED[leaf].why}."
    return ""
