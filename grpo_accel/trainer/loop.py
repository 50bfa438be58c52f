"""GRPOTrainer: the GRPO loop under an ``accelerate.Accelerator``, with torchrl's constructor and methods.

One iteration (``_iteration``, in this order; the hook stages users register at in brackets, see
:mod:`grpo_accel.trainer.hooks`)::

    collector ──► rollout [N] (ids, masks, engine logprobs, rewards, advantages)
      [post_collect]   users may filter or replace the rollout
      drop it if stale (async); old / reference logprobs (only when needed) ─► replay buffer
      [pre_optim]      num_epochs x micro-batches ─► GRPOLoss ─► stepper (backward / accumulate / clip / step)
                       async: push weights every weight_update_frequency optimizer steps; [post_optim_step]
      sync: empty the buffer if asked, push weights (once per collected batch); [post_optim]
      rollout metrics + loss diagnostics; [log] ─► logger
      checkpoint every save_trainer_interval frames; [post_iteration] (evaluation, request_stop)
"""
from __future__ import annotations

import dataclasses
import logging
import time
from collections import defaultdict
from pathlib import Path
from typing import Any, Callable

import torch
from tensordict import TensorDict, TensorDictBase

from grpo_accel import batch
from grpo_accel.checkpoint import Checkpoint, module_signature
from grpo_accel.contracts import Collector, LossModule, OptimizationStepper, as_logger, as_weight_sender
from grpo_accel.distributed import any_process, configure_deepspeed_for
from grpo_accel.reporting.reporter import Reporter, ReportSettings
from grpo_accel.runtime.signals import stop_on_signals
from grpo_accel.trainer.args import accelerator_for, check_arguments, replay_buffer_for
from grpo_accel.trainer.background import BackgroundCollector, drop_stale
from grpo_accel.trainer.buffer import ReplayBuffer
from grpo_accel.trainer.checkpointer import TrainerFiles
from grpo_accel.trainer.hooks import Hooks
from grpo_accel.trainer.normalizer import add_in_chunks, step_normalizer
from grpo_accel.trainer.stepper import LearningRate, MixedPrecisionOptimizationStepper

logger = logging.getLogger(__name__)
COUNTERS = ("frames", "optim_steps", "iterations", "weight_version", "dropped_batches")  # saved in checkpoints


class GRPOTrainer:
    """A trainer for LLM alignment with GRPO-style objectives; docs/pages/api.md maps every parameter to a test.

    A *frame* is one completion: ``total_frames`` counts completions collected over all processes. The parts are
    those of :mod:`grpo_accel.contracts`; the batch's split is the collector's ``layout`` (read, never rebuilt), and
    ``batch_size`` defaults to the process's share over ``gradient_accumulation_steps`` (one optimizer step per
    epoch). Beyond the spec: ``accelerator`` (use this one instead of creating one), ``max_staleness`` (async
    mode: batches generated with weights more than this many pushes old are dropped; None keeps all) and
    ``log_samples`` (completions logged as text per log), ``log_first`` (log the first iteration whatever
    ``log_interval`` says; false: the first log comes after ``log_interval`` frames) and ``lr_scheduler`` (a
    torch LR scheduler over ``optimizer``, stepped once per optimizer step and saved with the checkpoints).

    Example:
        >>> trainer = GRPOTrainer(collector=collector, total_frames=12_800, loss_module=GRPOLoss(model),
        ...                       optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        ...                       replay_buffer=ReplayBuffer(batch_size=64),
        ...                       empty_replay_buffer_on_weight_update=True)
        >>> trainer.register_op("post_iteration", lambda t: print(t.frames))
        >>> trainer.train()
    """

    def __init__(
        self, collector: Collector, total_frames: int, frame_skip: int = 1, optim_steps_per_batch: int | None = None,
        loss_module: LossModule | None = None, optimizer: torch.optim.Optimizer | None = None,
        optimization_stepper: OptimizationStepper | None = None, weight_sync_sender=None,
        weight_update_frequency: int = 1,
        empty_replay_buffer_on_weight_update: bool = False, replay_buffer: ReplayBuffer | None = None,
        batch_size: int | None = None, device: torch.device | str | None = None, mixed_precision: bool = False,
        autocast_dtype: torch.dtype = torch.bfloat16, gradient_accumulation_steps: int = 1, logger=None,
        clip_norm: float | None = 1.0, progress_bar: bool = False, seed: int | None = None,
        save_trainer_interval: int | None = None, log_interval: int = 1, save_trainer_file: str | Path | None = None,
        checkpoint: Checkpoint | None = None, checkpoint_rotation=None,
        checkpoint_metadata: Callable[[], dict] | None = None, num_epochs: int = 1, async_collection: bool = False,
        log_timings: bool = False, auto_log_optim_steps: bool = True, log_rewards: bool = True, log_kl: bool = True,
        *, accelerator=None, max_staleness: int | None = 1, log_samples: int = 3, lr_scheduler=None,
        log_first: bool = True,
    ) -> None:
        args = {name: value for name, value in locals().items() if name != "self"}
        check_arguments(args)
        self.accelerator = acc = accelerator_for(args)  # seeded; checked against the arguments and the layout
        self.collector, self.total_frames, self.frame_skip = collector, total_frames, frame_skip
        self.optim_steps_per_batch, self.num_epochs = optim_steps_per_batch, num_epochs
        self.weight_sync_sender = as_weight_sender(weight_sync_sender)
        self.weight_update_frequency = weight_update_frequency
        self.empty_replay_buffer_on_weight_update = empty_replay_buffer_on_weight_update
        self.layout, self.gradient_accumulation_steps = collector.layout, gradient_accumulation_steps
        self.replay_buffer = replay_buffer_for(args, self.layout)
        self.logger, self.async_collection, self.max_staleness = as_logger(logger), async_collection, max_staleness
        settings = ReportSettings(**{f.name: args[f.name] for f in dataclasses.fields(ReportSettings)  # same names
                                     if f.name in args}, kl_outputs=loss_module.kl_outputs)
        self.reporter = Reporter(acc, self.logger, settings, collector.tokenizer)
        self.stepper = optimization_stepper or MixedPrecisionOptimizationStepper(optimizer, clip_norm, mixed_precision,
                                                                                 autocast_dtype)
        configure_deepspeed_for(acc, loss_module.policy, micro_batch=self.replay_buffer.batch_size,
                                accumulation=gradient_accumulation_steps, clip_norm=clip_norm)
        self.loss_module, self.stepper.optimizer = acc.prepare(loss_module, self.stepper.optimizer)
        self.unwrapped_loss = acc.unwrap_model(self.loss_module)  # kept: ~1 ms a call (Accelerate reads metadata)
        self.stepper.bind(acc, self.loss_module)
        self.lr_scheduler, self.rate = lr_scheduler, LearningRate(self.stepper.optimizer, lr_scheduler)
        if lr_scheduler is not None:
            acc.register_for_checkpointing(lr_scheduler)  # saved and restored with the accelerator's state
        self.device = torch.device(device) if device is not None else acc.device
        self.checkpoint, self.save_trainer_interval = checkpoint, save_trainer_interval
        self._files = TrainerFiles(acc, checkpoint, checkpoint_rotation, checkpoint_metadata, save_trainer_file)
        self.frames = self.optim_steps = self.iterations = self.weight_version = self.dropped_batches = 0
        self.stop_reason: str | None = None  # why training stopped early (a signal, request_stop, another process)
        self._saved_at, self._staleness, self._background = -1, 0.0, None
        self.hooks = Hooks()  # the users' stages; the loop's own steps are called in _iteration

    @property
    def optimizer(self) -> torch.optim.Optimizer:
        return self.stepper.optimizer

    @property
    def history(self) -> list[dict[str, float]]:
        """Every logged scalar dict, in order."""
        return self.reporter.history

    def register_op(self, stage: str, op: Callable, name: str | None = None) -> str:
        """Run ``op(trainer, ...)`` at ``stage`` (see :mod:`grpo_accel.trainer.hooks`); returns the hook's name."""
        return self.hooks.register(stage, op, name)

    def train(self) -> None:
        """Collect, optimise and push weights until ``total_frames`` completions or ``request_stop``.

        With a ``checkpoint`` whose ``resume`` is set, training first continues from it. SIGTERM/SIGINT on
        any process stop every process at the same loop boundary, after a checkpoint; a second signal exits.
        """
        resumed = self.checkpoint is not None and (path := self.checkpoint.resume_path()) is not None
        if resumed:
            self._resume(path)
            if self.frames >= self.total_frames:  # a finished run resumed: not one more batch
                logger.info("nothing to train: %s holds %d of total_frames=%d", path, self.frames, self.total_frames)
                return
        sender = self.weight_sync_sender
        if sender is not None and (resumed or sender.stale):  # the engine's weights are unknown to a new process
            sender.push(self.weight_version)
        self.hooks.run("pre_train", self)
        self.reporter.start_progress(self.total_frames, self.frames)
        self._background = BackgroundCollector(self.collector) if self.async_collection else None
        source = self._background or self.collector
        try:
            with stop_on_signals(self.request_stop):
                for rollout in source:
                    self._iteration(rollout)
                    if self._should_stop():
                        break
                if self.stop_reason is not None:  # the batch it stopped at logs, as the last batch does
                    self.reporter.log_unlogged()
                    logger.warning("training stopped early after %d frames: %s", self.frames, self.stop_reason)
                if self._saved_at != self.iterations and self.iterations > 0:
                    self.save_checkpoint(self.stop_reason or "end of training")
            self.hooks.run("post_train", self)
        finally:
            if self._background is not None:
                self._background.close()
            self.reporter.close()

    def compute_loss(self, sub_batch: TensorDictBase, method: str | None = None, **kwargs) -> TensorDictBase | Any:
        """The loss of ``sub_batch`` through the prepared (wrapped) module, or its ``method`` if named."""
        if method is None:
            return self.loss_module(sub_batch, **kwargs)
        return getattr(self.unwrapped_loss, method)(sub_batch, **kwargs)

    def request_stop(self, reason: str | None = None) -> None:
        """Stop at the next loop boundary (the end of the current iteration, after a checkpoint)."""
        self.stop_reason = reason or "request_stop() called"

    def log_scalars(self, scalars: dict[str, float]) -> None:
        """Write ``scalars`` at the current iteration (main process), e.g. from an evaluation hook."""
        self.reporter.log_scalars(scalars, self.iterations)

    def load_from_file(self, file: str | Path, **kwargs) -> "GRPOTrainer":
        """Load a checkpoint folder (resume) or a ``save_trainer_file`` torch payload (``weights_only=True``,
        ``mmap=True``, ``map_location="cpu"`` by default, each overridable) into this trainer; returns it.
        ``strict=False`` tolerates a folder without this rank's trainer state or a payload whose weights don't fit."""
        path, strict = Path(file), kwargs.pop("strict", True)
        if path.is_dir():
            self._resume(path, strict=strict)
        else:
            self.load_state_dict(self._files.load_file(path, self.unwrapped_loss, strict, **kwargs))
        return self

    def state_dict(self) -> dict:
        """This process's trainer state: counters, replay buffer, collector position (async: after the batches
        trained on, so the batch being drawn is collected again at a resume), stepper (scaler)."""
        position = self._background and self._background.position  # None before a batch is handed out
        return {**{name: getattr(self, name) for name in COUNTERS}, **self.reporter.state_dict(),
                "collector": position or self.collector.state_dict(), "replay_buffer": self.replay_buffer.state_dict(),
                "stepper": self.stepper.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        for name in COUNTERS:
            setattr(self, name, state[name])
        self.reporter.load_state_dict(state)
        self.collector.load_state_dict(state["collector"])
        self.replay_buffer.load_state_dict(state["replay_buffer"])
        self.stepper.load_state_dict(state["stepper"])

    def save_checkpoint(self, reason: str = "requested") -> Path | None:
        """Save now (collective): the checkpoint folder, and ``save_trainer_file`` if set."""
        info = {"reason": reason, "frames": self.frames, "optim_steps": self.optim_steps,  # + the saving layout
                "signature": module_signature(self.unwrapped_loss), "metrics": self.history[-1] if self.history else {}}
        with self.reporter.timed("checkpoint"):
            final = self._files.save(self.iterations, self.state_dict(), info, self.loss_module,
                                     self.unwrapped_loss.policy, self.collector.tokenizer)
        self._saved_at = self.iterations
        self.reporter.flush()  # the curves up to a checkpoint are on disk with it (a resume purges after it)
        if final is not None:
            self.hooks.run("post_checkpoint", self, final)
        return final

    def _iteration(self, rollout: TensorDict) -> None:
        """One collected batch, every step of the loop in order; the hook stages are for users."""
        start = time.perf_counter()
        frames = rollout.numel() * self.accelerator.num_processes * self.frame_skip
        self.frames += frames
        self.iterations += 1
        kept = self.hooks.chain("post_collect", self, rollout)  # users may filter the rollout before it is stored
        if self.async_collection:  # generated with weights too many pushes old: none of it is used
            kept, self._staleness, dropped = drop_stale(self.accelerator, self.weight_version, kept, self.max_staleness)
            self.dropped_batches += dropped
        self._store_rollout(kept)  # with pi_old / reference logprobs when the loss needs them
        stats: dict[str, float] = {}
        if kept.numel() > 0:
            self.hooks.run("pre_optim", self)
            stats = self.optimise()  # async: weights pushed every weight_update_frequency optimizer steps
            if not self.async_collection:
                self._update_weights()  # sync: once per batch, then the buffer is emptied if asked
            self.hooks.run("post_optim", self)
        self.reporter.timings["iteration"] += time.perf_counter() - start
        self._log(rollout, stats)
        self.reporter.advance(frames, rollout, time.perf_counter() - start, self.frames)
        every = self.save_trainer_interval  # save when this batch's frames crossed a multiple of it
        if every is not None and self.frames // every > (self.frames - frames) // every:
            self.save_checkpoint("interval")
        self.hooks.run("post_iteration", self)

    @torch.no_grad()
    def _store_rollout(self, rollout: TensorDict) -> None:
        """pi_old and reference logprobs (in micro-batches, as the training forward), then the replay buffer."""
        if rollout.numel() == 0:
            return
        loss = self.unwrapped_loss
        methods = []
        if self.async_collection and not loss.corrects_engine:  # pi_old: the engine's (older) weights that sampled
            rollout[batch.OLD_LOGPROBS] = rollout[batch.ENGINE_LOGPROBS]
        elif loss.uses_old_logprobs and (  # unless each row serves one optimizer step right after sampling
                self.async_collection or not self.empty_replay_buffer_on_weight_update
                or self._optimizer_steps(len(self.replay_buffer) + rollout.numel()) > 1):
            methods.append((batch.OLD_LOGPROBS, loss.add_old_logprobs))
        if loss.reference is not None:
            methods.append((batch.REF_LOGPROBS, loss.add_reference_logprobs))
        for key, add in methods:
            with self.reporter.timed(key), self.stepper.autocast():
                add_in_chunks(add, rollout, key, self.replay_buffer.batch_size, self.device)
        self.replay_buffer.extend(rollout)
        self.layout.check_steps(self.replay_buffer.batch_size, self.gradient_accumulation_steps,
                                self.optim_steps_per_batch, rows=len(self.replay_buffer))

    def _optimizer_steps(self, rows: int) -> int:
        """Optimizer steps that ``rows`` completions in the buffer would take."""
        return self.layout.optimizer_steps(self.replay_buffer.batch_size, self.gradient_accumulation_steps,
                                           self.num_epochs, self.optim_steps_per_batch, rows=rows)

    def optimise(self) -> dict[str, float]:
        """The optimizer steps of one collected batch: ``num_epochs`` passes over the replay buffer (or
        ``optim_steps_per_batch`` sampled micro-batches each). Returns each scalar's mean over the steps."""
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

    def _optimizer_step(self, micro_batches: list[TensorDict]) -> dict[str, float]:
        normalizer = step_normalizer(self.unwrapped_loss, micro_batches, self.accelerator,
                                     self.gradient_accumulation_steps, self.device)  # the step's loss divisor
        stats: dict[str, float] = defaultdict(float)
        share = 1.0 / len(micro_batches)  # loss_* are shares of the step's objective over ga; diagnostics means
        for mb in micro_batches:
            with self.accelerator.accumulate(self.loss_module):
                with self.reporter.timed("forward_backward"):
                    with self.stepper.autocast():
                        out = self.compute_loss(mb.to(self.device), normalizer=normalizer)
                        loss = sum(out[k] for k in out.keys() if k.startswith("loss_"))
                    self.stepper.backward(loss)
                with self.reporter.timed("optimizer"):
                    stats.update(self.stepper.step())
            stats["loss"] += float(loss.detach()) * share
            for key in out.keys():
                stats[key] += float(out[key].detach().float()) * share
        self.optim_steps += 1
        self.rate.step()
        return dict(stats)

    def _update_weights(self) -> None:
        """The trained weights become the next version (the buffer emptied if asked), pushed to the engine (sync:
        once per batch); a failed push saves a checkpoint of that state (its resume pushes first) and raises."""
        self.weight_version += 1
        if self.empty_replay_buffer_on_weight_update:
            self.replay_buffer.empty()
        with self.reporter.timed("weight_sync"):
            if self.weight_sync_sender is not None:
                try:
                    self.weight_sync_sender.push(self.weight_version)
                except Exception:
                    self.save_checkpoint("weight sync failed")  # the engines' weights are unknown: keep the run
                    raise

    def _resume(self, path: Path, strict: bool = True) -> None:
        state = self._files.load_folder(path, module_signature(self.unwrapped_loss), strict, module=self.loss_module,
                                        optimizer=self.optimizer, pad_id=self.replay_buffer.pad_id)
        if state is not None:
            self.load_state_dict(state)
        for saved, given in self.rate.restore():  # the rates this run was given win over the checkpoint's
            logger.info("learning rate: the checkpoint's peak %g -> %g, this run's, from its first step", saved, given)
        self._saved_at = self.iterations
        self.reporter.resume_at(self.iterations)
        logger.info("resumed from %s at iteration %d (%d frames)%s", path, self.iterations, self.frames,
                    "; the batch being collected at the save is collected again" if self.async_collection else "")

    def _should_stop(self) -> bool:
        """Every process takes the same decision: one all-reduce of the stop flags per iteration."""
        if self.accelerator.num_processes > 1 and any_process(self.stop_reason is not None):
            self.stop_reason = self.stop_reason or "another process requested a stop"
        return self.stop_reason is not None or self.frames >= self.total_frames

    def _log(self, rollout: TensorDict, stats: dict[str, float]) -> None:
        counters = {"frames": self.frames, "lr": self.rate.last, "optim_steps": self.optim_steps}
        if self.async_collection:
            counters.update(staleness=self._staleness, dropped_batches=self.dropped_batches)
        self.reporter.log_iteration(rollout, stats, counters, self.iterations, self.frames >= self.total_frames,
                                    lambda scalars: self.hooks.run("log", self, rollout, scalars), self.hooks.seconds)
