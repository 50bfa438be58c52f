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
import time
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Callable

import torch
from tensordict import TensorDict, TensorDictBase

from grpo_accel import batch as K
from grpo_accel.buffer import ReplayBuffer
from grpo_accel.distributed import configure_deepspeed
from grpo_accel.loss import distributed_normalizer

logger = logging.getLogger(__name__)

# Spec parameters whose behaviour lands with a later issue: setting them to anything but the default raises.
_NOT_YET = {
    "optimization_stepper": None,
    "save_trainer_interval": None,
    "save_trainer_file": None,
    "checkpoint": None,
    "checkpoint_rotation": None,
    "checkpoint_metadata": None,
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
        self.frames = self.optim_steps = self.iterations = 0
        self.history: list[dict[str, float]] = []  # every logged scalar dict, in order
        self._stop_reason: str | None = None
        self._last_log_frames = -math.inf
        self._timings: dict[str, float] = defaultdict(float)

    # ------------------------------------------------------------------------------------------ public API

    @property
    def unwrapped_loss(self) -> torch.nn.Module:
        """The loss module without Accelerate/DeepSpeed wrappers (its methods compute old/ref logprobs)."""
        return self.accelerator.unwrap_model(self.loss_module)

    def train(self) -> None:
        """Collect, optimise and push weights until ``total_frames`` completions or ``request_stop``."""
        bar = self._progress()
        for rollout in self.collector:
            start = time.perf_counter()
            self.frames += rollout.numel() * self.accelerator.num_processes * self.frame_skip
            self.iterations += 1
            self._store(rollout)
            stats = self._optimise()
            with self._timed("weight_sync"):
                self._update_weights()
            self._timings["iteration"] += time.perf_counter() - start
            self._log(rollout, stats)
            if bar is not None:
                bar.update(min(bar.total - bar.n, rollout.numel() * self.accelerator.num_processes * self.frame_skip))
                bar.set_postfix(reward=f"{float(rollout[K.REWARD].mean()):.3f}", step_s=f"{time.perf_counter() - start:.2f}")
            if self._stop_reason is not None or self.frames >= self.total_frames:
                break
        if bar is not None:
            bar.close()
        if self._stop_reason is not None:
            logger.warning("training stopped early after %d frames: %s", self.frames, self._stop_reason)
        if self.logger is not None and hasattr(self.logger, "flush"):
            self.logger.flush()

    def compute_loss(self, sub_batch: TensorDictBase, method: str | None = None, **kwargs) -> TensorDictBase | Any:
        """The loss of ``sub_batch`` through the prepared (wrapped) module, or its ``method`` if named."""
        if method is None:
            return self.loss_module(sub_batch, **kwargs)
        return getattr(self.unwrapped_loss, method)(sub_batch, **kwargs)

    def load_from_file(self, file: str | Path, **kwargs) -> "GRPOTrainer":
        raise NotImplementedError("GRPOTrainer.load_from_file is not implemented yet (checkpointing issue).")

    def request_stop(self, reason: str | None = None) -> None:
        """Stop at the next loop boundary (after the current optimisation loop and weight push)."""
        self._stop_reason = reason or "request_stop() called"

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
