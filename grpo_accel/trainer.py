"""GRPOTrainer: the synchronous GRPO loop under an ``accelerate.Accelerator`` (torchrl's API).

One iteration::

    collector ──► rollout [N] (ids, masks, engine logprobs, rewards, advantages)
       └─► old / reference logprobs (no grad, only when needed) ─► replay buffer
             └─► num_epochs x micro-batches ─► GRPOLoss ─► backward / accumulate / clip / optimizer.step
                   └─► weight push (once per collected batch) ─► log
"""
from __future__ import annotations

import logging
import math
import os
import signal
import threading
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
from tensordict import TensorDict, TensorDictBase

from grpo_accel import batch as K
from grpo_accel.buffer import ReplayBuffer
from grpo_accel.checkpoint import Checkpoint, CheckpointError, RunCheckpointer, parameter_signature
from grpo_accel.distributed import configure_deepspeed, zero_stage
from grpo_accel.loss import distributed_normalizer

logger = logging.getLogger(__name__)

# Spec parameters whose behaviour lands with a later issue: setting them to anything but the default raises.
_NOT_YET = {
    "optimization_stepper": None,
    "async_collection": False,
}


class GRPOTrainer:
    """A trainer for LLM alignment with GRPO-style objectives (see ../docs and the README's parameter table).

    A *frame* is one completion: ``total_frames`` counts completions collected over all processes.

    Example:
        >>> trainer = GRPOTrainer(collector=collector, total_frames=12_800, loss_module=GRPOLoss(model),
        ...                       optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
        ...                       replay_buffer=ReplayBuffer(batch_size=64),
        ...                       empty_replay_buffer_on_weight_update=True)
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
        checkpoint=None,
        checkpoint_rotation=None,
        checkpoint_metadata: Callable | None = None,
        num_epochs: int = 1,
        async_collection: bool = False,
        log_timings: bool = False,
        auto_log_optim_steps: bool = True,
        log_rewards: bool = True,
        log_kl: bool = True,
        *,
        accelerator=None,
    ) -> None:
        given = locals()
        for name, default in _NOT_YET.items():
            if given[name] != default:
                raise NotImplementedError(f"GRPOTrainer: {name}={given[name]!r} is not implemented yet; leave it at {default!r}.")
        _require(loss_module is not None, "loss_module", loss_module, "pass a GRPOLoss (or a module returning loss_* keys)")
        _require(optimizer is not None, "optimizer", optimizer, "pass a torch optimizer over the policy's parameters")
        _require(total_frames > 0, "total_frames", total_frames, "count of completions to collect, > 0")
        _require(frame_skip >= 1, "frame_skip", frame_skip, "use 1 for LLM tasks")
        _require(num_epochs >= 1, "num_epochs", num_epochs, "use 1 or more passes per collected batch")
        _require(gradient_accumulation_steps >= 1, "gradient_accumulation_steps", gradient_accumulation_steps, "use 1 or more")
        _require(optim_steps_per_batch is None or optim_steps_per_batch >= 1, "optim_steps_per_batch",
                 optim_steps_per_batch, "use None (whole buffer once per epoch) or a positive count")
        _require(weight_update_frequency == 1, "weight_update_frequency", weight_update_frequency,
                 "it only applies with async_collection=True (not implemented yet); sync mode pushes once per batch")
        _require(log_interval >= 1, "log_interval", log_interval, "frames between logs, >= 1")
        _require(save_trainer_interval is None or save_trainer_interval >= 1, "save_trainer_interval",
                 save_trainer_interval, "frames between saves: None (only at the end) or >= 1")
        _require(save_trainer_interval is None or checkpoint is not None or save_trainer_file is not None,
                 "save_trainer_interval", save_trainer_interval, "pass checkpoint= or save_trainer_file= to save")
        _require(checkpoint_rotation is None or checkpoint is not None, "checkpoint_rotation", checkpoint_rotation,
                 "rotation needs checkpoint=Checkpoint(directory)")
        if seed is not None:
            from accelerate.utils import set_seed

            set_seed(seed)
        self.accelerator = accelerator or _accelerator(gradient_accumulation_steps, mixed_precision, autocast_dtype)
        _require(self.accelerator.gradient_accumulation_steps == gradient_accumulation_steps,
                 "gradient_accumulation_steps", gradient_accumulation_steps,
                 f"the given accelerator accumulates {self.accelerator.gradient_accumulation_steps}; make them agree")
        self.collector, self.total_frames, self.frame_skip = collector, total_frames, frame_skip
        self.optim_steps_per_batch, self.num_epochs = optim_steps_per_batch, num_epochs
        self.weight_sync_sender = weight_sync_sender
        self.empty_replay_buffer_on_weight_update = empty_replay_buffer_on_weight_update
        self.replay_buffer = replay_buffer or ReplayBuffer(batch_size or collector.completions_per_batch, seed=seed)
        if batch_size is not None:
            self.replay_buffer.batch_size = batch_size
        self.gradient_accumulation_steps, self.clip_norm = gradient_accumulation_steps, clip_norm
        self.logger, self.log_interval, self.progress_bar = logger, log_interval, progress_bar
        self.log_timings, self.auto_log_optim_steps = log_timings, auto_log_optim_steps
        self.log_rewards, self.log_kl = log_rewards, log_kl
        self._configure_deepspeed(loss_module)
        self.loss_module, self.optimizer = self.accelerator.prepare(loss_module, optimizer)
        self.device = torch.device(device) if device is not None else self.accelerator.device
        self.checkpoint, self.save_trainer_interval = checkpoint, save_trainer_interval
        self.save_trainer_file = Path(save_trainer_file) if save_trainer_file is not None else None
        self._checkpointer = (RunCheckpointer(self.accelerator, checkpoint, checkpoint_rotation, checkpoint_metadata)
                              if checkpoint is not None else None)
        self.frames = self.optim_steps = self.iterations = 0
        self.history: list[dict[str, float]] = []  # every logged scalar dict, in order
        self._stop_reason: str | None = None
        self._signals = 0
        self._saved_at = -1
        self._last_log_frames = -math.inf
        self._timings: dict[str, float] = defaultdict(float)

    # ------------------------------------------------------------------------------------------ public API

    @property
    def unwrapped_loss(self) -> torch.nn.Module:
        """The loss module without Accelerate/DeepSpeed wrappers (its methods compute old/ref logprobs)."""
        return self.accelerator.unwrap_model(self.loss_module)

    def train(self) -> None:
        """Collect, optimise and push weights until ``total_frames`` completions or ``request_stop``.

        With a ``checkpoint`` whose ``resume`` is set, training first continues from it. SIGTERM/SIGINT on
        any process stop every process at the same loop boundary, after a checkpoint; a second signal exits.
        """
        if self.checkpoint is not None and (path := self.checkpoint.resume_path()) is not None:
            self._resume(path)
        bar = self._progress()
        with self._preemption_handlers():
            for rollout in self.collector:
                start = time.perf_counter()
                frames = rollout.numel() * self.accelerator.num_processes * self.frame_skip
                self.frames += frames
                self.iterations += 1
                self._store(rollout)
                stats = self._optimise()
                with self._timed("weight_sync"):
                    self._update_weights()
                self._timings["iteration"] += time.perf_counter() - start
                self._log(rollout, stats)
                if bar is not None:
                    bar.update(min(bar.total - bar.n, frames))
                    bar.set_postfix(reward=f"{float(rollout[K.REWARD].mean()):.3f}",
                                    step_s=f"{time.perf_counter() - start:.2f}")
                if self._save_due(frames):
                    self.save_checkpoint("interval")
                if self._should_stop():
                    break
            if self._stop_reason is not None:
                logger.warning("training stopped early after %d frames: %s", self.frames, self._stop_reason)
            if self._saved_at != self.iterations and self.iterations > 0:
                self.save_checkpoint(self._stop_reason or "end of training")
        if bar is not None:
            bar.close()
        if self.logger is not None and hasattr(self.logger, "flush"):
            self.logger.flush()

    def compute_loss(self, sub_batch: TensorDictBase, method: str | None = None, **kwargs) -> TensorDictBase | Any:
        """The loss of ``sub_batch`` through the prepared (wrapped) module, or its ``method`` if named."""
        if method is None:
            return self.loss_module(sub_batch, **kwargs)
        return getattr(self.unwrapped_loss, method)(sub_batch, **kwargs)

    def load_from_file(self, file: str | Path, **kwargs) -> "GRPOTrainer":
        """Load a checkpoint folder (resume; ``strict=False`` tolerates a missing trainer state) or a
        ``save_trainer_file`` torch payload (``weights_only=True``, ``mmap=True``, ``map_location="cpu"`` by
        default, each overridable) into this trainer. Returns the trainer."""
        path = Path(file)
        if path.is_dir():
            self._resume(path, strict=kwargs.get("strict", True))
            return self
        payload = torch.load(path, weights_only=kwargs.get("weights_only", True), mmap=kwargs.get("mmap", True),
                             map_location=kwargs.get("map_location", "cpu"))
        if zero_stage(self.accelerator) == 3:
            raise CheckpointError(f"{path}: a single-file trainer payload cannot be loaded under ZeRO-3; resume "
                                  "from a checkpoint folder instead (checkpoint.resume).")
        missing, unexpected = self.unwrapped_loss.load_state_dict(payload["model"], strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{path}: model weights do not fit (missing {missing[:5]}, unexpected {unexpected[:5]}).")
        self.load_state_dict(payload["trainer"])
        return self

    def state_dict(self) -> dict:
        """This process's trainer state: counters, replay buffer, collector position (and weight version)."""
        collector = self.collector.state_dict() if hasattr(self.collector, "state_dict") else None
        return {"frames": self.frames, "optim_steps": self.optim_steps, "iterations": self.iterations,
                "last_log_frames": float(self._last_log_frames), "collector": collector,
                "replay_buffer": self.replay_buffer.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.frames, self.optim_steps, self.iterations = state["frames"], state["optim_steps"], state["iterations"]
        self._last_log_frames = state["last_log_frames"]
        if state["collector"] is not None:
            self.collector.load_state_dict(state["collector"])
        self.replay_buffer.load_state_dict(state["replay_buffer"])

    def save_checkpoint(self, reason: str = "requested") -> Path | None:
        """Save now (collective): the checkpoint folder, and ``save_trainer_file`` if set."""
        if self.checkpoint is None and self.save_trainer_file is None:
            return None
        with self._timed("checkpoint"):
            final = None
            if self._checkpointer is not None:
                info = {"reason": reason, "frames": self.frames, "optim_steps": self.optim_steps,
                        "num_processes": self.accelerator.num_processes, "zero_stage": zero_stage(self.accelerator),
                        "signature": self._signature(), "metrics": self.history[-1] if self.history else {}}
                final = self._checkpointer.save(self.iterations, self.state_dict(), info, self._hf_assets())
            if self.save_trainer_file is not None:
                self._save_legacy_file()
        self._saved_at = self.iterations
        return final

    def request_stop(self, reason: str | None = None) -> None:
        """Stop at the next loop boundary (after the current optimisation loop and weight push)."""
        self._stop_reason = reason or "request_stop() called"

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
        return parameter_signature([(name, tuple(getattr(p, "ds_shape", p.shape)))
                                    for name, p in self.unwrapped_loss.named_parameters()])

    def _hf_assets(self) -> list:
        """What export needs besides weights: the policy's config and the tokenizer, when they exist."""
        policy = getattr(self.unwrapped_loss, "policy", None)
        return [a for a in (getattr(policy, "config", None), getattr(self.collector, "tokenizer", None))
                if hasattr(a, "save_pretrained")]

    def _save_legacy_file(self) -> None:
        weights = self.accelerator.get_state_dict(self.loss_module)  # collective under ZeRO-3; full on rank 0
        if self.accelerator.is_main_process:
            tmp = self.save_trainer_file.with_name(self.save_trainer_file.name + ".tmp")
            tmp.parent.mkdir(parents=True, exist_ok=True)
            torch.save({"model": weights, "trainer": self.state_dict()}, tmp)
            os.replace(tmp, self.save_trainer_file)

    def _save_due(self, frames_this_batch: int) -> bool:
        if self.save_trainer_interval is None:
            return False
        return self.frames // self.save_trainer_interval > (self.frames - frames_this_batch) // self.save_trainer_interval

    def _should_stop(self) -> bool:
        """Every process takes the same decision: one all-reduce of the stop flags per iteration."""
        local = torch.tensor([float(self._stop_reason is not None)], device=self.accelerator.device)
        if self.accelerator.num_processes > 1 and bool(self.accelerator.reduce(local, reduction="sum")[0] > 0):
            self._stop_reason = self._stop_reason or "another process requested a stop"
        return self._stop_reason is not None or self.frames >= self.total_frames

    @contextmanager
    def _preemption_handlers(self):
        """First SIGTERM/SIGINT: stop at the next loop boundary with a checkpoint. Second: exit at once."""
        if threading.current_thread() is not threading.main_thread():
            yield
            return

        def handler(signum, _frame):
            self._signals += 1
            if self._signals > 1:
                os.write(2, f"second {signal.Signals(signum).name}: exiting without a checkpoint\n".encode())
                os._exit(128 + signum)
            self.request_stop(f"received {signal.Signals(signum).name}")

        previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
        try:
            yield
        finally:
            for sig, old in previous.items():
                signal.signal(sig, old)

    # ----------------------------------------------------------------------------------------- the loop

    def _configure_deepspeed(self, loss_module: torch.nn.Module) -> None:
        """Under DeepSpeed, the trainer's batch size, accumulation and clipping go into its config."""
        plugin = getattr(self.accelerator.state, "deepspeed_plugin", None)
        if plugin is None:
            return
        config = getattr(getattr(loss_module, "policy", None), "config", None)
        configure_deepspeed(
            plugin.deepspeed_config, micro_batch=self.replay_buffer.batch_size,
            accumulation=self.gradient_accumulation_steps, num_processes=self.accelerator.num_processes,
            clip_norm=self.clip_norm, hidden_size=getattr(config, "hidden_size", None),
        )

    def _needs_old_logprobs(self, rows: int) -> bool:
        """pi_old must be stored unless each row is used by exactly one optimizer step taken right after sampling."""
        steps = self.num_epochs * self._micro_batches(rows) // self.gradient_accumulation_steps
        return steps > 1 or not self.empty_replay_buffer_on_weight_update

    def _micro_batches(self, rows: int) -> int:
        return self.optim_steps_per_batch or math.ceil(rows / self.replay_buffer.batch_size)

    @torch.no_grad()
    def _store(self, rollout: TensorDict) -> None:
        """Add old/reference logprobs (in micro-batch chunks, as the training forward computes them), then store."""
        loss = self.unwrapped_loss
        methods = []
        if self._needs_old_logprobs(len(self.replay_buffer) + rollout.numel()) and hasattr(loss, "add_old_logprobs"):
            methods.append(("old_logprobs", loss.add_old_logprobs))
        if getattr(loss, "reference", None) is not None:
            methods.append(("ref_logprobs", loss.add_reference_logprobs))
        for phase, add in methods:
            with self._timed(phase), self.accelerator.autocast():
                parts = []
                for start in range(0, rollout.numel(), self.replay_buffer.batch_size):
                    part = K.trim_padding(rollout[start : start + self.replay_buffer.batch_size]).to(self.device)
                    add(part)
                    parts.append(part.to("cpu"))
                merged = K.concat_rollouts(parts, pad_id=0)
                rollout[phase] = merged[phase]
        self.replay_buffer.extend(rollout)
        micro = self._micro_batches(len(self.replay_buffer))
        if micro % self.gradient_accumulation_steps:
            raise ValueError(
                f"{micro} micro-batches per epoch ({len(self.replay_buffer)} completions / batch_size="
                f"{self.replay_buffer.batch_size}) is not a multiple of gradient_accumulation_steps="
                f"{self.gradient_accumulation_steps}; make completions per batch = batch_size x accumulation x k."
            )

    def _optimise(self) -> dict[str, float]:
        """num_epochs passes over the buffer; returns the mean of each scalar over the optimizer steps."""
        sums: dict[str, float] = defaultdict(float)
        steps = 0
        ga = self.gradient_accumulation_steps
        for _ in range(self.num_epochs):
            if self.optim_steps_per_batch is None:
                micro_batches = list(self.replay_buffer)
            else:
                micro_batches = [self.replay_buffer.sample() for _ in range(self.optim_steps_per_batch)]
            for i in range(0, len(micro_batches), ga):
                for key, value in self._optimizer_step(micro_batches[i : i + ga]).items():
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
        normalizer = self._step_normalizer(micro_batches) if has_units else None
        stats: dict[str, float] = defaultdict(float)
        for mb in micro_batches:
            mb = mb.to(self.device)
            with self.accelerator.accumulate(self.loss_module):
                with self._timed("forward_backward"):
                    out = self.compute_loss(mb, normalizer=normalizer) if has_units else self.compute_loss(mb)
                    loss = sum(out[k] for k in out.keys() if k.startswith("loss_"))
                    self.accelerator.backward(loss)
                with self._timed("optimizer"):
                    if self.accelerator.sync_gradients and self.clip_norm:
                        grad_norm = self.accelerator.clip_grad_norm_(self.loss_module.parameters(), self.clip_norm)
                        if grad_norm is not None:
                            stats["grad_norm"] = float(grad_norm)
                    self.optimizer.step()
                    self.optimizer.zero_grad()
            # Every micro-batch's loss_* is its share of the step's objective over ga (the normaliser was
            # scaled by ga), and diagnostics are per-micro-batch means: both average with weight 1/ga.
            share = 1.0 / len(micro_batches)
            stats["loss"] += float(loss.detach()) * share
            for key in out.keys():
                stats[key] += float(out[key].detach().float()) * share
        self.optim_steps += 1
        return dict(stats)

    def _update_weights(self) -> None:
        """Sync mode: push once per collected batch, then empty the buffer if asked."""
        if self.weight_sync_sender is not None:
            self.weight_sync_sender.update_weights()
        if self.empty_replay_buffer_on_weight_update:
            self.replay_buffer.empty()

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

        return tqdm(total=self.total_frames, desc="frames", unit="completion")

    def _log(self, rollout: TensorDict, stats: dict[str, float]) -> None:
        if self.frames - self._last_log_frames < self.log_interval and self.frames < self.total_frames:
            self._timings.clear()
            return
        self._last_log_frames = self.frames
        scalars = {"train/frames": float(self.frames)}
        if self.auto_log_optim_steps:
            scalars["train/optim_steps"] = float(self.optim_steps)
        mean_stats = self._mean_over_processes(stats)
        for key, value in mean_stats.items():
            if self.log_kl or "kl" not in key:
                scalars[f"train/{key}"] = value
        scalars.update(self._rollout_scalars(rollout))
        if self.log_timings:
            scalars.update({f"time/{phase}": seconds for phase, seconds in self._timings.items()})
        self._timings.clear()
        self.history.append(scalars)
        if self.logger is not None and self.accelerator.is_main_process:
            for name, value in scalars.items():
                self.logger.log_scalar(name, value, step=self.iterations)

    def _mean_over_processes(self, stats: dict[str, float]) -> dict[str, float]:
        if not stats:
            return {}
        keys = sorted(stats)
        values = torch.tensor([stats[k] for k in keys], device=self.accelerator.device)
        values = self.accelerator.reduce(values, reduction="mean")
        return dict(zip(keys, values.tolist()))

    def _rollout_scalars(self, rollout: TensorDict) -> dict[str, float]:
        """Reward and completion statistics over every process's rollout."""
        keys = [K.REWARD] + [(K.REWARDS, name) for name in rollout[K.REWARDS].keys()]
        local = torch.stack(
            [rollout[k].float() for k in keys]
            + [rollout[K.COMPLETION_MASK].sum(-1).float(), (rollout[K.FINISH_REASON] == K.FINISH_LENGTH).float(),
               rollout[K.WEIGHT_VERSION].float()],
            dim=1,
        ).to(self.accelerator.device)  # [n, k]
        every = self.accelerator.gather(local)  # [n * processes, k]
        n_rewards = len(keys)
        out = {
            "train/completion_length_mean": float(every[:, n_rewards].mean()),
            "train/truncated_fraction": float(every[:, n_rewards + 1].mean()),
            "train/weight_version_mean": float(every[:, n_rewards + 2].mean()),
        }
        if self.log_rewards:
            out["train/reward_mean"] = float(every[:, 0].mean())
            out["train/reward_std"] = float(every[:, 0].std())
            for j, key in enumerate(keys[1:], start=1):
                out[f"train/reward/{key[1]}_mean"] = float(every[:, j].mean())
                out[f"train/reward/{key[1]}_std"] = float(every[:, j].std())
        return out


def _accelerator(gradient_accumulation_steps: int, mixed_precision: bool, autocast_dtype: torch.dtype):
    from grpo_accel.runtime import make_accelerator

    if not mixed_precision:
        mode = "no"
    elif autocast_dtype == torch.bfloat16:
        mode = "bf16"
    elif autocast_dtype == torch.float16:
        mode = "fp16"
    else:
        raise ValueError(f"GRPOTrainer: autocast_dtype={autocast_dtype} is not supported; use torch.bfloat16 or torch.float16.")
    return make_accelerator(gradient_accumulation_steps, mode)


def _require(ok: bool, name: str, value, fix: str) -> None:
    if not ok:
        raise ValueError(f"GRPOTrainer: {name}={value!r} is invalid: {fix}.")
