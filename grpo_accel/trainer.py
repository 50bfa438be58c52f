"""GRPOTrainer: the GRPO loop under an ``accelerate.Accelerator``, with torchrl's constructor and methods.

One iteration (``_iteration``, in this order; the hook stages users register at in brackets, see
:mod:`grpo_accel.hooks`)::

    collector ──► rollout [N] (ids, masks, engine logprobs, rewards, advantages)
      [post_collect]   users may filter or replace the rollout
      drop it if stale (async); old / reference logprobs (only when needed) ─► replay buffer
      [pre_optim]      num_epochs x micro-batches ─► GRPOLoss ─► stepper (backward / accumulate / clip / step)
                       async: push weights every weight_update_frequency optimizer steps; [post_optim_step]
      sync: push weights (once per collected batch), then empty the buffer if asked; [post_optim]
      rollout metrics + loss diagnostics; [log] ─► logger
      checkpoint every save_trainer_interval frames; [post_iteration] (evaluation, request_stop)
"""
from __future__ import annotations

import functools
import logging
import math
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
from tensordict import TensorDict, TensorDictBase

from grpo_accel import batch as K
from grpo_accel.buffer import ReplayBuffer
from grpo_accel.checkpoint import (Checkpoint, CheckpointError, RunCheckpointer, load_trainer_payload,
                                   parameter_signature, save_trainer_payload)
from grpo_accel.distributed import any_process, configure_deepspeed_for, full_shape, make_accelerator, zero_stage
from grpo_accel.hooks import Hooks
from grpo_accel.loss import distributed_normalizer
from grpo_accel.metrics import completion_samples, mean_over_processes, rollout_scalars
from grpo_accel.runtime import stop_on_signals
from grpo_accel.stepper import MixedPrecisionOptimizationStepper

logger = logging.getLogger(__name__)


class GRPOTrainer:
    """A trainer for LLM alignment with GRPO-style objectives; the README maps every parameter to a test.

    A *frame* is one completion: ``total_frames`` counts completions collected over all processes.
    Beyond the spec: ``accelerator`` (use this one instead of creating one) and ``max_staleness`` (async mode:
    batches generated with weights more than this many pushes old are dropped; None keeps all).

    Example:
        >>> trainer = GRPOTrainer(collector=collector, total_frames=12_800, loss_module=GRPOLoss(model),
        ...                       optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        ...                       replay_buffer=ReplayBuffer(batch_size=64),
        ...                       empty_replay_buffer_on_weight_update=True)
        >>> trainer.register_op("post_iteration", lambda t: print(t.frames))
        >>> trainer.train()
    """

    def __init__(
        self,
        collector,
        total_frames: int,
        frame_skip: int = 1,
        optim_steps_per_batch: int | None = None,
        loss_module: torch.nn.Module | None = None,
        optimizer: torch.optim.Optimizer | None = None,
        optimization_stepper=None,
        weight_sync_sender=None,
        weight_update_frequency: int = 1,
        empty_replay_buffer_on_weight_update: bool = False,
        replay_buffer: ReplayBuffer | None = None,
        batch_size: int | None = None,
        device: torch.device | str | None = None,
        mixed_precision: bool = False,
        autocast_dtype: torch.dtype = torch.bfloat16,
        gradient_accumulation_steps: int = 1,
        logger=None,
        clip_norm: float | None = 1.0,
        progress_bar: bool = False,
        seed: int | None = None,
        save_trainer_interval: int | None = None,
        log_interval: int = 1,
        save_trainer_file: str | Path | None = None,
        checkpoint: Checkpoint | None = None,
        checkpoint_rotation=None,
        checkpoint_metadata: Callable[[], dict] | None = None,
        num_epochs: int = 1,
        async_collection: bool = False,
        log_timings: bool = False,
        auto_log_optim_steps: bool = True,
        log_rewards: bool = True,
        log_kl: bool = True,
        *,
        accelerator=None,
        max_staleness: int | None = 1,
        log_samples: int = 3,
    ) -> None:
        _require(loss_module is not None, "loss_module", loss_module, "pass a GRPOLoss (or a module returning loss_* keys)")
        _require((optimizer is None) != (optimization_stepper is None), "optimizer", optimizer,
                 "pass exactly one of optimizer= and optimization_stepper=")
        _require(total_frames > 0, "total_frames", total_frames, "count of completions to collect, > 0")
        _require(frame_skip >= 1, "frame_skip", frame_skip, "use 1 for LLM tasks")
        _require(num_epochs >= 1, "num_epochs", num_epochs, "use 1 or more passes per collected batch")
        _require(gradient_accumulation_steps >= 1, "gradient_accumulation_steps", gradient_accumulation_steps, "use 1 or more")
        _require(optim_steps_per_batch is None or optim_steps_per_batch >= 1, "optim_steps_per_batch",
                 optim_steps_per_batch, "use None (whole buffer once per epoch) or a positive count")
        _require(weight_update_frequency >= 1, "weight_update_frequency", weight_update_frequency, "optimizer steps, >= 1")
        _require(log_interval >= 1, "log_interval", log_interval, "frames between logs, >= 1")
        _require(max_staleness is None or max_staleness >= 0, "max_staleness", max_staleness, "use None or >= 0")
        _require(log_samples >= 0, "log_samples", log_samples, "completions written as text per log, >= 0")
        _require(save_trainer_interval is None or save_trainer_interval >= 1, "save_trainer_interval",
                 save_trainer_interval, "frames between saves: None (only at the end) or >= 1")
        _require(save_trainer_interval is None or checkpoint is not None or save_trainer_file is not None,
                 "save_trainer_interval", save_trainer_interval, "pass checkpoint= or save_trainer_file= to save")
        _require(checkpoint_rotation is None or checkpoint is not None, "checkpoint_rotation", checkpoint_rotation,
                 "rotation needs checkpoint=Checkpoint(directory)")
        if seed is not None:
            from accelerate.utils import set_seed

            set_seed(seed)
        if accelerator is None:
            modes = {torch.bfloat16: "bf16", torch.float16: "fp16"}
            _require(not mixed_precision or autocast_dtype in modes, "autocast_dtype", autocast_dtype,
                     "use torch.bfloat16 or torch.float16")
            accelerator = make_accelerator(gradient_accumulation_steps, modes[autocast_dtype] if mixed_precision else "no")
        self.accelerator = accelerator
        acc = self.accelerator
        _require(acc.gradient_accumulation_steps == gradient_accumulation_steps, "gradient_accumulation_steps",
                 gradient_accumulation_steps, f"the given accelerator accumulates {acc.gradient_accumulation_steps}")
        _require(not (async_collection and zero_stage(acc) == 3), "async_collection", async_collection,
                 "background generation cannot join ZeRO-3's collective gathers; use ZeRO-0/1/2 or a separate engine")
        _require(not (async_collection and getattr(getattr(collector, "engine", None), "model", None) is
                      getattr(loss_module, "policy", object())), "async_collection", async_collection,
                 "the engine generates from the weights being trained; give it its own copy and a weight-sync sender")
        _shard_collector(collector, acc)
        self.collector, self.total_frames, self.frame_skip = collector, total_frames, frame_skip
        self.optim_steps_per_batch, self.num_epochs = optim_steps_per_batch, num_epochs
        self.weight_sync_sender, self.weight_update_frequency = weight_sync_sender, weight_update_frequency
        self.empty_replay_buffer_on_weight_update = empty_replay_buffer_on_weight_update
        self.replay_buffer = replay_buffer or ReplayBuffer(batch_size or collector.completions_per_batch, seed=seed)
        if batch_size is not None:
            self.replay_buffer.batch_size = batch_size
        self.gradient_accumulation_steps = gradient_accumulation_steps
        if hasattr(collector, "completions_per_batch"):  # the usual layout can be checked before anything runs
            self._check_accumulation(collector.completions_per_batch)
        self.logger, self.log_interval, self.progress_bar = logger, log_interval, progress_bar
        self.log_timings, self.auto_log_optim_steps = log_timings, auto_log_optim_steps
        self.log_rewards, self.log_kl, self.log_samples = log_rewards, log_kl, log_samples
        self.async_collection, self.max_staleness = async_collection, max_staleness
        self.stepper = optimization_stepper or MixedPrecisionOptimizationStepper(
            optimizer, clip_norm, mixed_precision, autocast_dtype)
        configure_deepspeed_for(acc, loss_module, micro_batch=self.replay_buffer.batch_size,
                                accumulation=gradient_accumulation_steps, clip_norm=clip_norm)
        self.loss_module, self.stepper.optimizer = acc.prepare(loss_module, self.stepper.optimizer)
        self._unwrapped_loss = acc.unwrap_model(self.loss_module)  # ~1 ms a call: Accelerate reads package metadata
        self.stepper.bind(acc, self.loss_module)
        self.device = torch.device(device) if device is not None else acc.device
        self.checkpoint, self.save_trainer_interval = checkpoint, save_trainer_interval
        self.save_trainer_file = Path(save_trainer_file) if save_trainer_file is not None else None
        self._checkpointer = RunCheckpointer(acc, checkpoint, checkpoint_rotation, checkpoint_metadata) if checkpoint else None
        self.frames = self.optim_steps = self.iterations = self.weight_version = self.dropped_batches = 0
        self.history: list[dict[str, float]] = []  # every logged scalar dict, in order
        self._stop_reason: str | None = None
        self._saved_at, self._batch_frames, self._last_log_frames, self._staleness = -1, 0, -math.inf, 0.0
        self._timings: dict[str, float] = defaultdict(float)
        self.hooks = Hooks()  # the users' stages; the loop's own steps are called in _iteration

    # ------------------------------------------------------------------------------------------ public API

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.stepper.optimizer

    @property
    def unwrapped_loss(self) -> torch.nn.Module:
        """The loss module without Accelerate/DeepSpeed wrappers (its methods compute old/ref logprobs)."""
        return self._unwrapped_loss

    @property
    def stop_reason(self) -> str | None:
        """Why training stopped early (a signal, ``request_stop``, another process), or None."""
        return self._stop_reason

    def register_op(self, stage: str, op: Callable, name: str | None = None) -> str:
        """Run ``op(trainer, ...)`` at ``stage`` (see :mod:`grpo_accel.hooks`); returns the hook's name."""
        return self.hooks.register(stage, op, name)

    def train(self) -> None:
        """Collect, optimise and push weights until ``total_frames`` completions or ``request_stop``.

        With a ``checkpoint`` whose ``resume`` is set, training first continues from it. SIGTERM/SIGINT on
        any process stop every process at the same loop boundary, after a checkpoint; a second signal exits.
        """
        if self.checkpoint is not None and (path := self.checkpoint.resume_path()) is not None:
            self._resume(path)
            if hasattr(self.weight_sync_sender, "push"):  # the engine's weights are unknown to a new process
                self.weight_sync_sender.push(self.weight_version)
        self.hooks.run("pre_train", self)
        bar = self._progress()
        source = self.collector
        if self.async_collection:
            from grpo_accel.rollout.background import BackgroundCollector

            source = BackgroundCollector(self.collector)
        try:
            with stop_on_signals(self.request_stop):
                for rollout in source:
                    self._iteration(rollout, bar)
                    if self._should_stop():
                        break
                if self._stop_reason is not None:
                    logger.warning("training stopped early after %d frames: %s", self.frames, self._stop_reason)
                if self._saved_at != self.iterations and self.iterations > 0:
                    self.save_checkpoint(self._stop_reason or "end of training")
        finally:
            if source is not self.collector:
                source.close()
            if bar is not None:
                bar.close()
            if self.logger is not None and hasattr(self.logger, "flush"):
                self.logger.flush()

    def compute_loss(self, sub_batch: TensorDictBase, method: str | None = None, **kwargs) -> TensorDictBase | Any:
        """The loss of ``sub_batch`` through the prepared (wrapped) module, or its ``method`` if named."""
        if method is None:
            return self.loss_module(sub_batch, **kwargs)
        return getattr(self.unwrapped_loss, method)(sub_batch, **kwargs)

    def request_stop(self, reason: str | None = None) -> None:
        """Stop at the next loop boundary (the end of the current iteration, after a checkpoint)."""
        self._stop_reason = reason or "request_stop() called"

    def log_scalars(self, scalars: dict[str, float]) -> None:
        """Write ``scalars`` at the current iteration (main process), e.g. from an evaluation hook."""
        if self.logger is not None and self.accelerator.is_main_process:
            for name, value in scalars.items():
                self.logger.log_scalar(name, value, step=self.iterations)

    def load_from_file(self, file: str | Path, **kwargs) -> "GRPOTrainer":
        """Load a checkpoint folder (resume) or a ``save_trainer_file`` torch payload (``weights_only=True``,
        ``mmap=True``, ``map_location="cpu"`` by default, each overridable) into this trainer. ``strict=False``
        tolerates a folder without this rank's trainer state, or a payload whose weights do not all fit.
        Returns the trainer."""
        path, strict = Path(file), kwargs.pop("strict", True)
        if path.is_dir():
            self._resume(path, strict=strict)
            return self
        payload = load_trainer_payload(path, **kwargs)
        if zero_stage(self.accelerator) == 3:
            raise CheckpointError(f"{path}: a single-file trainer payload cannot be loaded under ZeRO-3; resume "
                                  "from a checkpoint folder instead (checkpoint.resume).")
        missing, unexpected = self.unwrapped_loss.load_state_dict(payload["model"], strict=False)
        if strict and (missing or unexpected):
            raise CheckpointError(f"{path}: model weights do not fit (missing {missing[:5]}, unexpected "
                                  f"{unexpected[:5]}); pass strict=False to load what fits.")
        self.load_state_dict(payload["trainer"])
        return self

    def state_dict(self) -> dict:
        """This process's trainer state: counters, replay buffer, collector position, stepper (scaler)."""
        collector = self.collector.state_dict() if hasattr(self.collector, "state_dict") else None
        return {"frames": self.frames, "optim_steps": self.optim_steps, "iterations": self.iterations,
                "weight_version": self.weight_version, "dropped_batches": self.dropped_batches,
                "last_log_frames": float(self._last_log_frames), "collector": collector,
                "replay_buffer": self.replay_buffer.state_dict(), "stepper": self.stepper.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.frames, self.optim_steps, self.iterations = state["frames"], state["optim_steps"], state["iterations"]
        self.weight_version, self.dropped_batches = state["weight_version"], state["dropped_batches"]
        self._last_log_frames = state["last_log_frames"]
        if state["collector"] is not None:
            self.collector.load_state_dict(state["collector"])
        self.replay_buffer.load_state_dict(state["replay_buffer"])
        self.stepper.load_state_dict(state["stepper"])

    def save_checkpoint(self, reason: str = "requested") -> Path | None:
        """Save now (collective): the checkpoint folder, and ``save_trainer_file`` if set."""
        final = None
        with self._timed("checkpoint"):
            if self._checkpointer is not None:
                info = {"reason": reason, "frames": self.frames, "optim_steps": self.optim_steps,
                        "num_processes": self.accelerator.num_processes, "zero_stage": zero_stage(self.accelerator),
                        "signature": self._signature(), "metrics": self.history[-1] if self.history else {}}
                final = self._checkpointer.save(self.iterations, self.state_dict(), info, self._hf_assets())
            if self.save_trainer_file is not None:
                self._save_legacy_file()
        self._saved_at = self.iterations
        return final

    # ----------------------------------------------------------------------------------------- the loop

    def _iteration(self, rollout: TensorDict, bar) -> None:
        """One collected batch, every step of the loop in order; the hook stages are for users."""
        start = time.perf_counter()
        frames = rollout.numel() * self.accelerator.num_processes * self.frame_skip
        self.frames += frames
        self._batch_frames = frames
        self.iterations += 1
        kept = self.hooks.chain("post_collect", self, rollout)  # users may filter the rollout before it is stored
        if self.async_collection:
            kept = self._drop_stale(kept)  # generated with weights too many pushes old: none of it is used
        self._store_rollout(kept)  # with pi_old / reference logprobs when the loss needs them
        stats: dict[str, float] = {}
        if kept.numel() > 0:
            self.hooks.run("pre_optim", self)
            stats = self._optimise()  # async: weights pushed every weight_update_frequency optimizer steps
            if not self.async_collection:
                self._update_weights()  # sync: once per batch, then the buffer is emptied if asked
            self.hooks.run("post_optim", self)
        self._timings["iteration"] += time.perf_counter() - start
        self._log(rollout, stats)
        if bar is not None:
            bar.update(min(bar.total - bar.n, frames))
            bar.set_postfix(reward=f"{float(rollout[K.REWARD].mean()):.3f}", step_s=f"{time.perf_counter() - start:.2f}")
        self._checkpoint_when_due()
        self.hooks.run("post_iteration", self)

    def _needs_old_logprobs(self, rows: int) -> bool:
        """pi_old must be stored unless each row is used by exactly one optimizer step taken right after sampling."""
        steps = self.num_epochs * self._micro_batches(rows) // self.gradient_accumulation_steps
        return steps > 1 or not self.empty_replay_buffer_on_weight_update

    def _micro_batches(self, rows: int) -> int:  # per epoch
        return self.optim_steps_per_batch or math.ceil(rows / self.replay_buffer.batch_size)

    @torch.no_grad()
    def _store_rollout(self, rollout: TensorDict) -> None:
        """Add pi_old and reference logprobs (in micro-batch chunks, as the training forward computes them) and
        put the rollout in the replay buffer."""
        if rollout.numel() == 0:
            return
        loss = self.unwrapped_loss
        methods = []
        if self.async_collection:  # the behaviour policy is the engine's (older) weights: correct towards it
            rollout[K.OLD_LOGPROBS] = rollout[K.ENGINE_LOGPROBS]
        elif self._needs_old_logprobs(len(self.replay_buffer) + rollout.numel()) and hasattr(loss, "add_old_logprobs"):
            methods.append((K.OLD_LOGPROBS, loss.add_old_logprobs))
        if getattr(loss, "reference", None) is not None:
            methods.append((K.REF_LOGPROBS, loss.add_reference_logprobs))
        for key, add in methods:
            with self._timed(key), self.stepper.autocast():
                parts = []
                for start in range(0, rollout.numel(), self.replay_buffer.batch_size):
                    part = K.trim_padding(rollout[start : start + self.replay_buffer.batch_size]).to(self.device)
                    add(part)
                    parts.append(part.to("cpu"))
                rollout[key] = K.concat_rollouts(parts, pad_id=0)[key]
        self.replay_buffer.extend(rollout)
        self._check_accumulation(len(self.replay_buffer))

    def _check_accumulation(self, rows: int) -> None:
        micro, ga = self._micro_batches(rows), self.gradient_accumulation_steps
        if micro % ga:
            raise ValueError(
                f"GRPOTrainer: {micro} micro-batches per epoch ({rows} completions / batch_size="
                f"{self.replay_buffer.batch_size}) is not a multiple of gradient_accumulation_steps={ga}; "
                "make completions per batch = batch_size x accumulation x k."
            )

    def _drop_stale(self, rollout: TensorDict) -> TensorDict:
        """Async: a batch generated more than ``max_staleness`` pushes ago (on any process) is dropped (an empty
        rollout comes back)."""
        staleness = torch.tensor([float(self.weight_version - int(rollout[K.WEIGHT_VERSION].min()))],
                                 device=self.accelerator.device)
        staleness = float(self.accelerator.reduce(staleness, reduction="max")[0]) if self.accelerator.num_processes > 1 \
            else float(staleness[0])
        self._staleness = staleness
        if self.max_staleness is not None and staleness > self.max_staleness:
            self.dropped_batches += 1
            return rollout[:0]
        return rollout

    def _optimise(self) -> dict[str, float]:
        """num_epochs passes over the buffer; returns the mean of each scalar over the optimizer steps."""
        sums: dict[str, float] = defaultdict(float)
        steps, ga = 0, self.gradient_accumulation_steps
        for _ in range(self.num_epochs):
            if self.optim_steps_per_batch is None:
                micro_batches = list(self.replay_buffer)
            else:
                micro_batches = [self.replay_buffer.sample() for _ in range(self.optim_steps_per_batch)]
            for i in range(0, len(micro_batches), ga):
                stats = self._optimizer_step(micro_batches[i : i + ga])
                if self.async_collection and self.optim_steps % self.weight_update_frequency == 0:
                    self._update_weights()
                self.hooks.run("post_optim_step", self, stats)
                for key, value in stats.items():
                    sums[key] += value
                steps += 1
        return {key: value / steps for key, value in sums.items()}

    def _step_normalizer(self, micro_batches: list[TensorDict]) -> torch.Tensor:
        """The loss divisor of this optimizer step: its units over all processes (one all-reduce)."""
        units = sum(self.unwrapped_loss.units(mb.to(self.device)) for mb in micro_batches)
        total = self.accelerator.reduce(units.reshape(1).float(), reduction="sum")[0]
        return distributed_normalizer(total, self.accelerator.num_processes, self.gradient_accumulation_steps)

    def _optimizer_step(self, micro_batches: list[TensorDict]) -> dict[str, float]:
        has_units = hasattr(self.unwrapped_loss, "units")
        kwargs = {"normalizer": self._step_normalizer(micro_batches)} if has_units else {}
        stats: dict[str, float] = defaultdict(float)
        share = 1.0 / len(micro_batches)  # loss_* are shares of the step's objective over ga; diagnostics means
        for mb in micro_batches:
            with self.accelerator.accumulate(self.loss_module):
                with self._timed("forward_backward"):
                    with self.stepper.autocast():
                        out = self.compute_loss(mb.to(self.device), **kwargs)
                        loss = sum(out[k] for k in out.keys() if k.startswith("loss_"))
                    self.stepper.backward(loss)
                with self._timed("optimizer"):
                    stats.update(self.stepper.step())
            stats["loss"] += float(loss.detach()) * share
            for key in out.keys():
                stats[key] += float(out[key].detach().float()) * share
        self.optim_steps += 1
        return dict(stats)

    def _update_weights(self) -> None:
        """Push the weights to the engine (sync: once per collected batch), then empty the buffer if asked."""
        with self._timed("weight_sync"):
            if self.weight_sync_sender is not None:
                try:
                    self.weight_sync_sender.update_weights()
                except Exception:
                    self.save_checkpoint("weight sync failed")  # the engines' weights are unknown: keep the run
                    raise
            self.weight_version += 1
        if self.empty_replay_buffer_on_weight_update:
            self.replay_buffer.empty()

    def _checkpoint_when_due(self) -> None:
        """Save when this iteration's frames crossed a multiple of ``save_trainer_interval``."""
        every = self.save_trainer_interval
        if every is not None and self.frames // every > (self.frames - self._batch_frames) // every:
            self.save_checkpoint("interval")

    # ------------------------------------------------------------------------------- saving and stopping

    def _resume(self, path: Path, strict: bool = True) -> None:
        checkpointer = self._checkpointer or RunCheckpointer(self.accelerator, Checkpoint(Path(path).parent))
        state = checkpointer.load(path, signature=self._signature(), strict=strict)
        if state is not None:
            self.load_state_dict(state)
        self._saved_at = self.iterations
        if self.logger is not None and hasattr(self.logger, "resume_at"):
            self.logger.resume_at(self.iterations)
        logger.info("resumed from %s at iteration %d (%d frames)", path, self.iterations, self.frames)

    def _signature(self) -> str:
        return parameter_signature([(name, full_shape(p))
                                    for name, p in self.unwrapped_loss.named_parameters()])

    def _hf_assets(self) -> list:
        """What export needs besides weights: the policy's config and the tokenizer, when they exist."""
        policy = getattr(self.unwrapped_loss, "policy", None)
        return [a for a in (getattr(policy, "config", None), getattr(self.collector, "tokenizer", None))
                if hasattr(a, "save_pretrained")]

    def _save_legacy_file(self) -> None:
        weights = self.accelerator.get_state_dict(self.loss_module)  # collective under ZeRO-3; full on rank 0
        if self.accelerator.is_main_process:
            save_trainer_payload(self.save_trainer_file, weights, self.state_dict())

    def _should_stop(self) -> bool:
        """Every process takes the same decision: one all-reduce of the stop flags per iteration."""
        if self.accelerator.num_processes > 1 and any_process(self.accelerator, self._stop_reason is not None):
            self._stop_reason = self._stop_reason or "another process requested a stop"
        return self._stop_reason is not None or self.frames >= self.total_frames

    # --------------------------------------------------------------------------------------- reporting

    @contextmanager
    def _timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self._timings[phase] += time.perf_counter() - start

    def _progress(self):
        if not (self.progress_bar and self.accelerator.is_main_process):
            return None
        from tqdm.auto import tqdm

        return tqdm(total=self.total_frames, initial=min(self.frames, self.total_frames), desc="frames", unit="completion")

    def _log(self, rollout: TensorDict, stats: dict[str, float]) -> None:
        if self.frames - self._last_log_frames < self.log_interval and self.frames < self.total_frames:
            self._timings.clear()
            return
        self._last_log_frames = self.frames
        scalars = {"train/frames": float(self.frames), "train/lr": float(self.optimizer.param_groups[0]["lr"])}
        if self.auto_log_optim_steps:
            scalars["train/optim_steps"] = float(self.optim_steps)
        if self.async_collection:
            scalars["train/staleness"] = self._staleness
            scalars["train/dropped_batches"] = float(self.dropped_batches)
        scalars.update({f"train/{k}": v for k, v in mean_over_processes(self.accelerator, stats).items()})
        scalars.update(rollout_scalars(self.accelerator, rollout, with_rewards=self.log_rewards))
        self.hooks.run("log", self, rollout, scalars)
        if not self.log_kl:
            scalars = {k: v for k, v in scalars.items() if "kl" not in k}
        if self.log_timings:
            scalars.update({f"time/{phase}": seconds for phase, seconds in self._timings.items()})
            scalars.update({f"time/hook/{name}": seconds for name, seconds in self.hooks.seconds.items()})
        self._timings.clear()
        self.hooks.seconds.clear()
        self.history.append(scalars)
        self.log_scalars(scalars)
        self._log_samples(rollout)

    def _log_samples(self, rollout: TensorDict) -> None:
        """A few of this batch's completions as text (main process's rows), when a logger takes text."""
        tokenizer = getattr(self.collector, "tokenizer", None)
        if (self.log_samples and tokenizer is not None and hasattr(self.logger, "log_text")
                and self.accelerator.is_main_process and rollout.numel()):
            self.logger.log_text("samples", completion_samples(rollout, tokenizer, self.log_samples), self.iterations)


def _require(ok: bool, name: str, value, fix: str) -> None:
    if not ok:
        raise ValueError(f"GRPOTrainer: {name}={value!r} is invalid: {fix}.")


def _shard_collector(collector, acc) -> None:
    """A collector built for one process (GRPOCollector's default) takes this process's share of every batch
    under several; one split for another process count is an error. Otherwise every process would train on the
    same prompts and count the frames again."""
    world = getattr(collector, "world_size", None)
    if world is None or world == acc.num_processes:  # a collector of its own kind, or already split
        _require(world is None or collector.rank == acc.process_index, "collector.rank", getattr(collector, "rank", None),
                 f"this is process {acc.process_index}; pass rank=accelerator.process_index")
        return
    _require(world == 1, "collector.world_size", world,
             f"the accelerator runs {acc.num_processes} processes; build the collector with "
             f"world_size={acc.num_processes} and rank=accelerator.process_index, or leave both unset")
    collector.shard(acc.process_index, acc.num_processes, functools.partial(any_process, acc))
