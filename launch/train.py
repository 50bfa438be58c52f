"""GRPO training recipe: config -> tokenizer, model, data, engine, rewards, loss, optimizer -> trainer.train().

    accelerate launch --config_file accelerate_configs/single_process.yaml launch/train.py \
        [--config launch/configs/default.yaml] [key=value ...]

With no model named, this trains the built-in tiny Llama (random weights) on the built-in addition task.
Outputs in ``output_dir``: config.yaml (resolved), tensorboard/ (event files), checkpoints/, summary.json.
``checkpoint.resume=auto`` continues from the newest complete checkpoint; SIGTERM/SIGINT checkpoint and exit 0.
"""
from __future__ import annotations

import argparse
import copy
import json
import logging
import os
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing
sys.path.insert(1, str(Path.cwd()))  # reward functions named `module:function` may live where the run starts

import yaml

from grpo_accel.recipe.loading import load_config, to_dict
from grpo_accel.recipe.schema import GRPOConfig
from grpo_accel.recipe.run_folder import RunFolderLock

log = logging.getLogger("grpo_accel.train")


def build_trainer(cfg: GRPOConfig):
    import torch

    from grpo_accel.recipe.build import batch_layout, build_environment, build_policy, build_rewards, build_rows
    from grpo_accel.checkpoint import Checkpoint, CheckpointRotation
    from grpo_accel.recipe.checks import ConfigError
    from grpo_accel.distributed import launch_world_size, make_accelerator, preflight
    from grpo_accel.reporting.evaluation import Evaluator
    from grpo_accel.lora import trainable_parameters
    from grpo_accel.loss import GRPOLoss
    from grpo_accel.rollout.collector import GRPOCollector
    from grpo_accel.recipe.run_folder import data_fingerprints, start_point
    from grpo_accel.reporting.tracking import TensorBoardLogger
    from grpo_accel.trainer import GRPOTrainer

    t, r, lc = cfg.trainer, cfg.rollout, cfg.loss
    # Everything that can be checked without a process group is checked first.
    preflight()
    batch_layout(cfg, launch_world_size())
    per_step = r.prompts_per_batch * r.group_size
    if t.total_frames % per_step:
        rounded = -(-t.total_frames // per_step) * per_step
        log.warning("trainer.total_frames=%d is rounded up to %d: batches are collected whole (%d prompts x %d = %d "
                    "completions)", t.total_frames, rounded, r.prompts_per_batch, r.group_size, per_step)
        t.total_frames = rounded
    c = cfg.checkpoint
    checkpoint = Checkpoint(Path(cfg.output_dir) / "checkpoints", resume=c.resume)
    start_point(cfg, checkpoint, first_process())
    fingerprints = data_fingerprints(cfg.data)  # read once: every checkpoint records them
    rows, held_out = build_rows(cfg.data)
    if cfg.eval.every_iterations and not held_out:
        raise ConfigError(f"eval.every_iterations={cfg.eval.every_iterations}: there are no held-out rows; set "
                          "data.holdout (built-in task), data.eval_path or data.eval_split, or eval.every_iterations=0.")
    # Models are built before the Accelerator: under ZeRO-3 that keeps zero.Init out, so every stage starts
    # from the same weights (DeepSpeed partitions them in prepare()).
    rewards = build_rewards(cfg.rewards)  # a bad reward module or environment is refused before any process group
    environment = build_environment(r, cfg.data)
    tokenizer, model, reference = build_policy(cfg.model, with_reference=lc.kl_coef > 0, seed=t.seed)
    accelerator = make_accelerator(t.gradient_accumulation_steps, t.mixed_precision)
    log.info("process group ready: rank %d of %d (%s)", accelerator.process_index, accelerator.num_processes,
             accelerator.distributed_type.name)
    layout = batch_layout(cfg, accelerator.num_processes)
    if accelerator.is_main_process:  # the start-up block once, not once per process
        log.info(layout.describe())
    engine, sender = build_engine_and_sender(cfg, model, tokenizer, accelerator)

    collector = GRPOCollector(  # the trainer gives it this process's share of each batch
        engine, tokenizer, rows, rewards, prompts_per_batch=r.prompts_per_batch,
        group_size=r.group_size, prompt_field=cfg.data.prompt_field, max_prompt_tokens=r.max_prompt_tokens,
        system_prompt=cfg.data.system_prompt,
        scale_advantages=lc.scale_advantages, leave_one_out=lc.leave_one_out, seed=t.seed,
        dynamic_sampling=r.dynamic_sampling, max_extra_rounds=r.max_extra_rounds,
        environment=environment, max_turns=r.max_turns, max_episode_tokens=r.max_episode_tokens,
    )
    loss = GRPOLoss(
        model, reference, clip_epsilon=(lc.clip_eps_low, lc.clip_eps_high),
        kl_coef=lc.kl_coef, kl_estimator=lc.kl_estimator, aggregation=lc.aggregation,
        max_completion_tokens=r.max_completion_tokens, importance_level=lc.importance_level, tis_cap=lc.tis_cap,
        temperature=r.temperature, packing=lc.packing,
    )
    o = cfg.optim
    optimizer = torch.optim.AdamW(trainable_parameters(model), lr=o.lr, betas=tuple(o.betas), weight_decay=o.weight_decay,
                                  fused=True)  # one kernel for all parameters (TRL's default too): 4x faster on the tiny model
    logger = TensorBoardLogger(Path(cfg.output_dir) / "tensorboard") if accelerator.is_main_process else None
    trainer = GRPOTrainer(
        collector=collector, total_frames=t.total_frames, optim_steps_per_batch=t.optim_steps_per_batch,
        loss_module=loss, optimizer=optimizer, weight_sync_sender=sender,
        weight_update_frequency=t.weight_update_frequency, async_collection=t.async_collection,
        max_staleness=t.max_staleness,
        empty_replay_buffer_on_weight_update=t.empty_replay_buffer_on_weight_update,
        batch_size=layout.micro_batch, gradient_accumulation_steps=t.gradient_accumulation_steps,
        mixed_precision=t.mixed_precision != "no",
        autocast_dtype=torch.float16 if t.mixed_precision == "fp16" else torch.bfloat16,
        logger=logger, clip_norm=o.clip_norm, progress_bar=t.progress_bar, seed=t.seed,
        log_interval=t.log_interval, num_epochs=t.num_epochs, log_timings=t.log_timings,
        log_rewards=t.log_rewards, log_kl=t.log_kl, log_samples=t.log_samples, accelerator=accelerator,
        checkpoint=checkpoint, save_trainer_interval=c.interval_frames, save_trainer_file=c.legacy_file,
        checkpoint_rotation=CheckpointRotation(c.keep_last, c.keep_best, c.best_metric, c.best_mode),
        checkpoint_metadata=lambda: {"config": to_dict(cfg), "data": fingerprints},
    )
    if r.colocate:  # the servers free their GPU memory for the optimiser steps; the next push takes it back
        trainer.register_op("pre_optim", lambda _: sender.release_memory(), "release_colocated_servers")
    if cfg.eval.every_iterations:
        evaluator = Evaluator(engine, tokenizer, held_out, rewards, every=cfg.eval.every_iterations, k=cfg.eval.k,
                              prompt_field=cfg.data.prompt_field, system_prompt=cfg.data.system_prompt,
                              success_threshold=cfg.eval.success_threshold, episodes=collector.episodes)
        trainer.register_op("pre_train", evaluator.before_training, "evaluate_untrained")
        trainer.register_op("post_iteration", evaluator, "evaluate")
    return trainer


def first_process() -> bool:
    """Rank 0 of the launch (before any process group exists)."""
    return os.environ.get("RANK", "0") == "0"


def build_engine_and_sender(cfg: GRPOConfig, model, tokenizer, accelerator):
    """The rollout engine and the weight-sync sender that keeps it current."""
    import torch

    r, w = cfg.rollout, cfg.weight_sync
    if r.backend == "sglang":
        from grpo_accel.batch import stop_token_ids
        from grpo_accel.recipe.checks import ConfigError
        from grpo_accel.sglang.engine import SGLangEngine
        from grpo_accel.sglang import sender as senders

        engine = SGLangEngine(r.urls, tokenizer, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                              top_p=r.top_p, top_k=r.top_k, api_key=r.api_key, health_timeout_s=r.health_timeout_s,
                              retries=r.request_retries, request_size=r.request_size,
                              request_timeout_s=r.request_timeout_s,
                              stop_token_ids=stop_token_ids(tokenizer, getattr(model, "generation_config", None)))
        if accelerator.is_main_process:
            log.info(engine.description)
        saving = [i.url for i in engine.servers if not i.memory_saver]
        if r.colocate and saving:
            raise ConfigError(f"rollout.colocate=true: {', '.join(saving)} runs without --enable-memory-saver, so it "
                              "cannot free its GPU memory for training; start it with that flag, or set "
                              "rollout.colocate=false.")
        common = dict(api_key=r.api_key, admin_api_key=w.admin_api_key, bucket_mb=w.bucket_mb, dtype=getattr(torch, w.dtype),
                      max_attempts=w.max_attempts, verify_tensors=w.verify_tensors, timeout_s=w.timeout_s,
                      pause_mode=w.pause_mode)
        if w.method == "distributed":
            sender = senders.DistributedWeightSender(accelerator, model, r.urls, master_address=w.master_address,
                                                     master_port=w.master_port, backend=w.backend, layout=w.layout,
                                                     **common)
        elif w.method == "disk":
            sender = senders.DiskWeightSender(accelerator, model, r.urls, w.disk_path or Path(cfg.output_dir) / "weights",
                                              **common)
        else:
            sender = senders.TensorWeightSender(accelerator, model, r.urls, **common)
        return engine, sender
    from grpo_accel.distributed import gathered_parameters
    from grpo_accel.rollout.embedded import EmbeddedEngine
    from grpo_accel.weight_sync.embedded import EmbeddedWeightSync

    # Async collection generates while the policy is updated, so the engine needs its own copy of the weights.
    engine_model = copy.deepcopy(model) if cfg.trainer.async_collection else model
    engine = EmbeddedEngine(engine_model, tokenizer, max_new_tokens=r.max_new_tokens, temperature=r.temperature,
                            top_p=r.top_p, top_k=r.top_k, decoder=r.decoder, worker=r.embedded_worker,
                            gather=(lambda: gathered_parameters(model.parameters())) if r.zero3_gather_full else None)
    return engine, EmbeddedWeightSync(engine, source=model)


def summarize(trainer, wall_s: float) -> dict:
    import torch

    from grpo_accel.distributed import local_parameter_fraction, optimizer_state_bytes, trainable_elements, zero_stage

    rewards = [h["train/reward_mean"] for h in trainer.history if "train/reward_mean" in h]
    k = min(10, len(rewards))
    acc = trainer.accelerator
    return {
        "num_processes": acc.num_processes,
        "torch_threads": torch.get_num_threads(),
        "distributed_type": acc.distributed_type.name,
        "zero_stage": zero_stage(acc),
        "param_fraction_on_rank0": round(local_parameter_fraction(trainer.loss_module), 4),
        "trainable_parameters": trainable_elements(trainer.loss_module),
        "optimizer_state_bytes_rank0": optimizer_state_bytes(trainer.optimizer),
        "iterations": len(trainer.history),
        "weight_sync_s": round(getattr(trainer.weight_sync_sender, "last_sync_s", 0.0), 4),
        "weight_sync_peak_extra_bytes": getattr(getattr(trainer.weight_sync_sender, "gather", None), "peak_extra_bytes", 0),
        "final_iteration": trainer.iterations,
        "weight_version": trainer.weight_version,
        "stop_reason": trainer.stop_reason,
        "reward_first10_mean": sum(rewards[:k]) / max(k, 1),
        "reward_last10_mean": sum(rewards[-k:]) / max(k, 1),
        "wall_time_s": round(wall_s, 1),
    }


def write_config(out: Path, cfg: GRPOConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(to_dict(cfg), sort_keys=False))


def keys_with_defaults() -> str:
    """Every config key with its default, for --help (meanings: README.md, "Configuration")."""
    from grpo_accel.recipe.loading import flatten_keys

    flat = flatten_keys(to_dict(GRPOConfig()))
    return "keys (key=default; README.md, section Configuration, says what each means):\n" + "\n".join(
        f"  {key}={json.dumps(value)}" for key, value in flat.items())


def quiet_console() -> None:
    """Our log lines; each warning once per process (DeepSpeed's ZeRO-3 collectives raised torch's deprecation
    warning ~40 times per batch); Accelerate's per-checkpoint INFO lines dropped (we log one line per checkpoint).
    ``python -W``/``PYTHONWARNINGS`` still win."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not sys.warnoptions:
        warnings.showwarning = shown_once(warnings.showwarning)
    for name in ("accelerate.accelerator", "accelerate.checkpointing"):
        logging.getLogger(name).setLevel(logging.WARNING)
    # Every checkpoint of a tied-embedding model said "Removed shared tensor {'policy.lm_head.weight'} while
    # saving": the tie is expected, and the weight comes back tied.
    logging.getLogger("accelerate.utils.other").addFilter(lambda r: "Removed shared tensor" not in r.getMessage())


def shown_once(showwarning):
    """``showwarning`` for each (text, category) once. The "once" filter cannot do it: every change to the
    filters (each ``warnings.catch_warnings`` block, which torch and DeepSpeed enter per step) clears its memory."""
    seen = set()

    def show(message, category, filename, lineno, file=None, line=None):
        if (key := (str(message), category)) not in seen:
            seen.add(key)
            showwarning(message, category, filename, lineno, file, line)

    return show


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
                                     epilog=keys_with_defaults())
    parser.add_argument("--config", help="YAML config file (defaults: the built-in embedded run)")
    parser.add_argument("overrides", nargs="*", help="key=value overrides, e.g. trainer.total_frames=256")
    args = parser.parse_args(argv)
    quiet_console()
    from grpo_accel.runtime import configure_threads

    cfg = load_config(args.config, args.overrides)
    configure_threads()
    start = time.perf_counter()
    lock = RunFolderLock(cfg.output_dir) if first_process() else None
    if lock is not None:
        lock.acquire()  # before anything is read or written there: one run per folder
    try:
        return run(cfg, start)
    finally:
        if lock is not None:
            lock.release()


def run(cfg: GRPOConfig, start: float) -> int:
    trainer = build_trainer(cfg)
    out = Path(cfg.output_dir)
    main_process = trainer.accelerator.is_main_process
    # A resume can still fail (checkpoint checks run in train()): its config.yaml is written once it has run, so a
    # failed resume changes nothing in the run folder.
    resuming = trainer.checkpoint is not None and trainer.checkpoint.resume_path() is not None
    if main_process and not resuming:
        write_config(out, cfg)
    from tqdm.contrib.logging import logging_redirect_tqdm

    try:
        with logging_redirect_tqdm():  # log lines print above the progress bar, which stays one line
            trainer.train()
    finally:
        if hasattr(trainer.weight_sync_sender, "close"):  # SGLang senders leave no group behind on the servers
            trainer.weight_sync_sender.close()
        if hasattr(trainer.collector.engine, "close"):  # the embedded engine's decode worker, if any
            trainer.collector.engine.close()
        trainer.collector.rewards.close()  # reward worker processes, if any
        if trainer.logger is not None:  # the event files are complete, also after an error
            trainer.logger.close()
    trainer.accelerator.wait_for_everyone()
    if main_process:
        if resuming:
            write_config(out, cfg)
        summary = summarize(trainer, time.perf_counter() - start)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("summary: %s", json.dumps(summary))
        saved = trainer.checkpoint.complete() if trainer.checkpoint is not None else []
        if trainer.stop_reason is not None and saved:
            log.warning("stopped (%s) after %d frames, saved in %s; to continue, run the same command with "
                        "checkpoint.resume=auto", trainer.stop_reason, trainer.frames, saved[-1])
    trainer.accelerator.end_training()
    return 0


def user_errors() -> tuple[type[Exception], ...]:
    """Our errors whose message names the setting or file, the value and the fix: no traceback needed."""
    from grpo_accel.checkpoint import CheckpointError
    from grpo_accel.recipe.checks import ConfigError
    from grpo_accel.data import DataError
    from grpo_accel.distributed import DistributedConfigError
    from grpo_accel.http import ServerError
    from grpo_accel.reward_sources import RewardFault
    from grpo_accel.rewards import RewardError
    from grpo_accel.rollout.episodes import EpisodeError
    from grpo_accel.recipe.run_folder import RunFolderBusy
    from grpo_accel.sglang.sender import WeightSyncError

    return (ConfigError, DataError, DistributedConfigError, CheckpointError, RunFolderBusy, RewardError, RewardFault,
            EpisodeError, ServerError, WeightSyncError)


def main_reporting_errors(argv: list[str] | None = None) -> int:
    """``main()``; one of :func:`user_errors` becomes one line on stderr and exit code 2 instead of a traceback
    per process. Before the process group exists every process meets the same error, so rank 0 alone says it
    (the others wait a moment, so that rank 0's is the first failure); after, each failing process says it with
    its rank. Under torchrun the line also goes to the agent's error file, so the launcher's failure report shows
    it instead of a pointer to the docs. Other errors keep their traceback."""
    from grpo_accel.hooks import HookError

    try:
        try:
            return main(argv)
        except HookError as err:  # e.g. a user hook (evaluation) meeting a bad setting or file
            if isinstance(err.__cause__, user_errors()):
                raise err.__cause__ from None
            raise
    except user_errors() as err:
        import torch.distributed as dist

        from grpo_accel.distributed import launch_world_size

        world = launch_world_size()
        grouped = dist.is_available() and dist.is_initialized() and world > 1
        line = f"error (rank {os.environ.get('RANK', '0')} of {world}): {err}" if grouped else f"error: {err}"
        if first_process() or grouped:
            logging.shutdown()  # pending log lines first: this one stays last
            print(line, file=sys.stderr, flush=True)
        if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
            Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
        if not grouped and not first_process():
            time.sleep(3)  # rank 0 fails first and says it: the launcher stops the others at the first failure
        return 2


if __name__ == "__main__":
    from grpo_accel.runtime import exit_skipping_teardown, terminal_foreground

    with terminal_foreground():  # Ctrl-C reaches the trainer alone, not Accelerate's launcher too
        code = main_reporting_errors()
    exit_skipping_teardown(code)
