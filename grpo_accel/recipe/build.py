"""The recipe's wiring: a :class:`~grpo_accel.config.schema.GRPOConfig` becomes a ready :class:`GRPOTrainer`.

    trainer = build_trainer(load_config("launch/configs/default.yaml"))
    trainer.train()

Everything that can be checked without a process group is checked first (the DeepSpeed file, the batch layout,
where the run starts, the data, the rewards); the run's one :class:`~grpo_accel.layout.BatchLayout` is made here
and handed to the collector, which the trainer reads it from. The policy and its KL reference are built once the
Accelerator exists: under ZeRO-3 transformers then loads a named model under DeepSpeed's ``zero.Init``, so no
process ever holds the whole model (each fills its shards from the checkpoint, one module at a time); every stage
loads the same weights. The built-in tiny model is constructed directly, whole and seeded, on every stage.
"""
from __future__ import annotations

import logging
from pathlib import Path

from grpo_accel.distributed import first_process, full_numel
from grpo_accel.layout import BatchLayout
from grpo_accel.config.checks import ConfigError
from grpo_accel.config.defaults import unused_settings
from grpo_accel.config.schema import GRPOConfig
from grpo_accel.recipe.engines import build_engine_and_sender
from grpo_accel.recipe.wiring import COLLECTOR_NAMES, LAYOUT_NAMES, as_written, by_name

log = logging.getLogger(__name__)


def batch_layout(cfg: GRPOConfig, num_processes: int) -> tuple[BatchLayout, int]:
    """The run's batch layout over ``num_processes`` and its micro-batch size (``micro_batch_completions``, "auto"
    resolved), checked against accumulation and sampled micro-batches: a ConfigError names the setting to change."""
    r, t = cfg.rollout, cfg.trainer
    try:
        layout = BatchLayout(r.prompts_per_batch, r.group_size, num_processes, LAYOUT_NAMES)
        ga = t.gradient_accumulation_steps
        micro_batch = layout.auto_micro_batch(ga) if t.micro_batch_completions == "auto" else t.micro_batch_completions
        layout.check_steps(micro_batch, ga, t.optim_steps_per_batch)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    return layout, micro_batch


def build_trainer(cfg: GRPOConfig):
    """The trainer of ``cfg`` with its parts, hooks and checkpoint folder; call ``train()`` on it."""
    import torch

    from grpo_accel.checkpoint import Checkpoint, CheckpointRotation
    from grpo_accel.distributed.deepspeed_files import preflight
    from grpo_accel.distributed import launch_world_size, make_accelerator
    from grpo_accel.recipe.parts import build_environment, build_policy, build_rewards, build_rows, build_tokenizer
    from grpo_accel.run.folder import data_fingerprints, keep_the_batch, start_point
    from grpo_accel.config.secrets import record
    from grpo_accel.trainer import GRPOTrainer

    t, r, c = cfg.trainer, cfg.rollout, cfg.checkpoint
    preflight()
    layout, micro_batch = batch_layout(cfg, launch_world_size())
    _round_total_frames(t, layout)
    checkpoint = Checkpoint(Path(cfg.output_dir) / "checkpoints", resume=c.resume,
                            names={"resume": "checkpoint.resume"})
    fingerprints = data_fingerprints(cfg.data)  # read once: a resume compares them, every checkpoint records them
    check_report_to(t.report_to)
    rows, held_out = build_rows(cfg.data)
    if cfg.eval.every_iterations and not held_out:
        raise ConfigError(f"eval.every_iterations={cfg.eval.every_iterations}: there are no held-out rows; set "
                          "data.holdout (built-in task), data.eval_path or data.eval_split, or "
                          "eval.every_iterations=0.")
    tokenizer = build_tokenizer(cfg.model)
    fit_unset_budget(cfg, tokenizer, rows)  # before the settings are compared with a checkpoint's
    resume = start_point(cfg, checkpoint, fingerprints, first_process())
    if resume is not None:
        micro_batch = keep_the_batch(cfg, checkpoint.read_metadata(resume), layout, micro_batch)
    rewards = build_rewards(cfg.rewards, r.max_new_tokens, cfg.model)  # a bad reward module, environment or model
    environment = build_environment(r, cfg.data)  # folder: refused before any process group starts
    accelerator = make_accelerator(t.gradient_accumulation_steps, t.mixed_precision)
    log.info("process group ready: rank %d of %d (%s)", accelerator.process_index, accelerator.num_processes,
             accelerator.distributed_type.name)
    model, reference = build_policy(cfg.model, tokenizer, with_reference=cfg.loss.kl_coef > 0, seed=t.seed)
    if accelerator.is_main_process:  # the start-up block once, not once per process
        if line := cfg.followed_defaults.describe():
            log.info(line)
        warn_unusual_settings(cfg, model)
        for line in unused_settings(cfg):
            log.warning(line)
        log.info(layout.describe(micro_batch, t.gradient_accumulation_steps, t.num_epochs, t.optim_steps_per_batch))
    trackers = open_run_trackers(cfg, resume) if accelerator.is_main_process else None
    engine, sender = build_engine_and_sender(cfg, model, tokenizer, accelerator)
    collector = build_collector(cfg, engine, tokenizer, rows, rewards, environment, layout, accelerator.process_index)
    optimizer = build_optimizer(cfg, model)
    rewards.trainer_state.max_steps = run_steps = run_optimizer_steps(cfg, layout, micro_batch)
    trainer = GRPOTrainer(
        **by_name(GRPOTrainer, t, cfg.optim, skip=("mixed_precision",)),  # total_frames, seed, log_*, clip_norm, ...
        collector=collector, loss_module=build_loss(cfg, model, reference), optimizer=optimizer,
        lr_scheduler=build_scheduler(cfg.optim, optimizer, run_steps), weight_sync_sender=sender,
        batch_size=micro_batch, mixed_precision=t.mixed_precision != "no",
        autocast_dtype=torch.float16 if t.mixed_precision == "fp16" else torch.bfloat16,
        logger=trackers, accelerator=accelerator,
        checkpoint=checkpoint, save_trainer_interval=c.interval_frames, save_trainer_file=c.legacy_file,
        checkpoint_rotation=CheckpointRotation(c.keep_last, c.keep_best, c.best_metric, c.best_mode),
        checkpoint_metadata=lambda: {"config": record(cfg), "data": fingerprints,
                                     "trackers": trackers.run_ids() if trackers is not None else {}},
    )
    _register_hooks(trainer, cfg, engine, sender, tokenizer, held_out, rewards)
    return trainer


def fit_unset_budget(cfg: GRPOConfig, tokenizer, rows: list[dict]) -> None:
    """An unset ``rollout.max_new_tokens`` (TRL's 256 for a named model) that would not fit after the longest prompt
    in the model's context follows the model there too: what the context leaves, said in a line. A value set
    anywhere is kept (and refused, naming it, if it does not fit)."""
    from grpo_accel.data.prompts import encode_prompts
    from grpo_accel.config.defaults import fitted_budget
    from grpo_accel.recipe.parts import model_context

    r, m = cfg.rollout, cfg.model
    if "rollout.max_new_tokens" not in cfg.followed_defaults.values or m.name_or_path is None or r.backend != "embedded" \
            or r.environment is not None:
        return
    context = model_context(m)
    if context is None or r.max_new_tokens + r.max_prompt_tokens <= context:  # fits whatever the prompts are
        return
    longest = max(len(ids) for ids in encode_prompts(rows, tokenizer, prompt_field=cfg.data.prompt_field,
                                                     system_prompt=cfg.data.system_prompt).ids)
    fitted = fitted_budget(r.max_new_tokens, context, longest)
    if fitted != r.max_new_tokens:
        if first_process():
            log.info("rollout.max_new_tokens (unset) follows the model: %d, what its %d positions leave after the "
                     "longest prompt (%d tokens), not the default %d; set it to choose", fitted, context, longest,
                     r.max_new_tokens)
        r.max_new_tokens = cfg.followed_defaults.values["rollout.max_new_tokens"] = fitted


def check_report_to(names: list[str]) -> None:
    """Every tracker of trainer.report_to imports, before any process group (one line naming its install)."""
    from grpo_accel.reporting.trackers import check_trackers

    try:
        check_trackers(names, {"report_to": "trainer.report_to"})
    except (ImportError, ValueError) as exc:
        raise ConfigError(str(exc)) from None


def open_run_trackers(cfg: GRPOConfig, resume: Path | None):
    """The trackers of ``trainer.report_to`` (None when empty), started with the resolved config as
    hyperparameters, continuing the runs of the checkpoint resumed from."""
    import json

    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.config.loading import flatten_keys
    from grpo_accel.config.secrets import record
    from grpo_accel.reporting.trackers import open_trackers

    t = cfg.trainer
    if not t.report_to:
        return None
    ids = Checkpoint.read_metadata(resume)["user"].get("trackers", {}) if resume is not None else {}
    config = {k: v if isinstance(v, (bool, int, float, str)) or v is None else json.dumps(v)
              for k, v in flatten_keys(record(cfg)).items()}
    return open_trackers(t.report_to, cfg.output_dir, project=t.project, run_name=t.run_name or Path(cfg.output_dir).name,
                         config=config, resuming=resume is not None, run_ids=ids, init_kwargs=t.tracker_kwargs)


def _round_total_frames(t, layout: BatchLayout) -> None:
    """``trainer.total_frames`` up to whole batches (they are collected whole), with a warning."""
    if t.total_frames % layout.completions:
        rounded = -(-t.total_frames // layout.completions) * layout.completions
        log.warning("trainer.total_frames=%d is rounded up to %d: batches are collected whole (%d prompts x %d = %d "
                    "completions)", t.total_frames, rounded, layout.prompts, layout.group_size, layout.completions)
        t.total_frames = rounded


def build_collector(cfg: GRPOConfig, engine, tokenizer, rows, rewards, environment, layout: BatchLayout, rank: int):
    """The collector: this process's share of each batch's prompts, their rollouts, rewards and advantages."""
    from grpo_accel.rollout.collector import GRPOCollector

    settings = by_name(GRPOCollector, cfg.rollout, cfg.data, cfg.loss, skip=("environment",))
    return GRPOCollector(engine, tokenizer, rows, rewards, layout=layout, rank=rank, seed=cfg.trainer.seed,
                         environment=environment, names=as_written(COLLECTOR_NAMES, cfg.trl_sources), **settings)


def build_loss(cfg: GRPOConfig, model, reference):
    """``GRPOLoss`` with the config's clip range, KL term, aggregation and importance sampling."""
    from grpo_accel.loss import GRPOLoss

    lc = cfg.loss
    return GRPOLoss(model, reference, clip_epsilon=(lc.clip_eps_low, lc.clip_eps_high),
                    max_completion_tokens=cfg.rollout.max_completion_tokens, temperature=cfg.rollout.temperature,
                    **by_name(GRPOLoss, lc))


def build_optimizer(cfg: GRPOConfig, model):
    """AdamW over the trainable parameters; fused: one kernel for all of them (TRL's default too), 4x faster on
    the tiny model."""
    import torch

    from grpo_accel.lora import trainable_parameters

    o = cfg.optim
    return torch.optim.AdamW(trainable_parameters(model), lr=o.lr, betas=tuple(o.betas), eps=o.eps,
                             weight_decay=o.weight_decay, fused=True)


def build_scheduler(o, optimizer, total_steps: int):
    """The learning-rate schedule of ``o`` (an OptimConfig) over a run of ``total_steps`` optimizer steps, or
    None for a constant rate without warmup."""
    warmup = o.warmup(total_steps)
    if warmup and warmup >= total_steps:
        key = "optim.warmup_steps" if o.warmup_steps else "optim.warmup_ratio"
        raise ConfigError(f"{key}={o.warmup_steps or o.warmup_ratio}: a warmup of {warmup} optimizer steps in a run of "
                          f"{total_steps} never reaches optim.lr={o.lr:g}; warm up over fewer steps than the run has "
                          "(a tenth is usual), or train longer (trainer.total_frames).")
    if o.scheduler == "constant" and not warmup:
        return None
    from grpo_accel.trainer.stepper import Schedule

    return Schedule(optimizer, o.scheduler, warmup, total_steps, o.min_lr_ratio)


def run_optimizer_steps(cfg: GRPOConfig, layout: BatchLayout, micro_batch: int) -> int:
    """Optimizer steps over the whole run: its batches x each batch's steps (what a schedule spans)."""
    t = cfg.trainer
    per_batch = layout.optimizer_steps(micro_batch, t.gradient_accumulation_steps, t.num_epochs, t.optim_steps_per_batch)
    return t.total_frames // layout.completions * per_batch


def warn_unusual_settings(cfg: GRPOConfig, model) -> None:
    """One warning line per setting unusual for ``model`` (:func:`grpo_accel.config.defaults.unusual_settings`)."""
    from grpo_accel.config.defaults import unusual_settings

    for line in unusual_settings(cfg, sum(full_numel(p) for p in model.parameters())):
        log.warning(line)


def _register_hooks(trainer, cfg: GRPOConfig, engine, sender, tokenizer, held_out, rewards) -> None:
    """What the config adds at the trainer's hook stages: the reward functions' ``trainer_state``, colocated
    servers' memory, held-out evaluation, the pushes to the Hub."""
    state = rewards.trainer_state

    def progress(t) -> None:  # what a reward function scoring the next batch sees (TRL's trainer_state)
        state.global_step, state.frames, state.iterations = t.optim_steps, t.frames, t.iterations

    trainer.register_op("pre_train", progress, "reward_trainer_state_at_start")
    trainer.register_op("post_optim", progress, "reward_trainer_state")
    if cfg.rollout.colocate:  # the servers free their GPU memory for the optimiser steps; the next push takes it back
        trainer.register_op("pre_optim", lambda _: sender.release_memory(), "release_colocated_servers")
    if cfg.eval.every_iterations:
        from grpo_accel.reporting.evaluation import Evaluator

        evaluator = Evaluator(engine, tokenizer, held_out, rewards, every=cfg.eval.every_iterations, k=cfg.eval.k,
                              prompt_field=cfg.data.prompt_field, system_prompt=cfg.data.system_prompt,
                              success_threshold=cfg.eval.success_threshold, episodes=trainer.collector.episodes)
        trainer.register_op("pre_train", evaluator.before_training, "evaluate_untrained")
        trainer.register_op("post_iteration", evaluator, "evaluate")
    if cfg.hub.push and trainer.accelerator.is_main_process:  # the Hub gets the exported model, after each checkpoint
        from grpo_accel.run.export import export_checkpoint
        from grpo_accel.run.hub import HubPusher

        pusher = HubPusher(cfg.hub, cfg.output_dir, export_checkpoint)
        trainer.register_op("post_checkpoint", lambda _, path: pusher.after_checkpoint(path), "push_to_hub")
        trainer.register_op("post_train", lambda _: pusher.close(), "push_to_hub_end")

def close_parts(trainer, outcome: str = "finished") -> None:
    """Release what a built trainer's parts hold: SGLang's weight-update group, decode and reward workers, and
    (the main process's only) the event files, complete also after an error; the trackers' runs end as ``outcome``
    (:data:`grpo_accel.contracts.OUTCOMES`)."""
    trainer.weight_sync_sender.close()
    trainer.collector.close()
    if trainer.logger is not None:
        trainer.logger.close(outcome)


def summarize(trainer, wall_s: float) -> dict:
    """The run's numbers for ``summary.json``: processes, ZeRO, memory, the weight pushes, the reward's course."""
    import torch

    from grpo_accel.distributed import local_parameter_fraction, optimizer_state_bytes, trainable_elements, zero_stage

    rewards = [h["train/reward_mean"] for h in trainer.history if "train/reward_mean" in h]
    k = min(10, len(rewards) // 2) or len(rewards)  # windows that do not overlap (one batch: itself)
    acc, sender = trainer.accelerator, trainer.weight_sync_sender
    return {
        "num_processes": acc.num_processes,
        "torch_threads": torch.get_num_threads(),
        "distributed_type": acc.distributed_type.name,
        "zero_stage": zero_stage(acc),
        "param_fraction_on_rank0": round(local_parameter_fraction(trainer.loss_module), 4),
        "trainable_parameters": trainable_elements(trainer.loss_module),
        "optimizer_state_bytes_rank0": optimizer_state_bytes(trainer.optimizer),
        "iterations": len(trainer.history),
        "weight_sync_s": 0.0, "weight_sync_peak_extra_bytes": 0, **(sender.stats() if sender is not None else {}),
        "final_iteration": trainer.iterations,
        "weight_version": trainer.weight_version,
        "stop_reason": trainer.stop_reason,
        "reward_first_mean": sum(rewards[:k]) / max(k, 1),
        "reward_last_mean": sum(rewards[-k:]) / max(k, 1),
        "reward_window": k,  # batches in each of the two means: 10, or half the run when shorter
        "wall_time_s": round(wall_s, 1),
    }
