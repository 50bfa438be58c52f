"""What the trainer reports: phase timings, one scalar dict per logged iteration, completion samples as text and
the progress (a bar on a terminal, a log line every ``PROGRESS_LINE_S`` seconds in a log file). The trainer
calls :meth:`Reporter.log_iteration` once per iteration; the scalars go to the
logger (a :class:`~grpo_accel.contracts.Logger`).
"""
from __future__ import annotations

import logging
import math
import sys
import time
from collections import defaultdict
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Callable

import torch
from tensordict import TensorDict

from grpo_accel import batch
from grpo_accel.reporting.metrics import mean_over_processes, rollout_scalars, sample_rows

log = logging.getLogger(__name__)
PROGRESS_LINE_S = 10.0
"""Without a terminal (a log file, SLURM, CI) progress is a line this often: a bar's redraws would pile up."""


@dataclass
class ReportSettings:
    """The trainer's logging arguments (torchrl's names)."""

    log_interval: int = 1  # frames between logs
    log_first: bool = True  # log the first iteration whatever log_interval says (TRL's logging_first_step)
    log_timings: bool = False
    auto_log_optim_steps: bool = True
    log_rewards: bool = True
    log_kl: bool = True
    log_samples: int = 3  # completions written as text per log
    progress_bar: bool = False
    kl_outputs: tuple[str, ...] = ()  # the loss's KL keys (LossModule.kl_outputs): what log_kl=False leaves out


class Reporter:
    """Timings and metrics of one trainer. ``history`` holds every logged scalar dict, in order.

    Example:
        >>> reporter = Reporter(accelerator, TensorBoardLogger("runs/tb"), ReportSettings(log_timings=True))
        >>> with reporter.timed("generate"):
        ...     rollout = engine.generate(prompts, 8)
    """

    def __init__(self, accelerator, logger, settings: ReportSettings, tokenizer=None) -> None:
        self.accelerator, self.logger, self.settings, self.tokenizer = accelerator, logger, settings, tokenizer
        self.history: list[dict[str, float]] = []
        self.timings: dict[str, float] = defaultdict(float)  # seconds per phase of this iteration (cleared after
        # each, logged or not: a log shows its own iteration's phases)
        self.last_log_frames: float = -math.inf if settings.log_first else 0.0
        self._unlogged: tuple | None = None  # _write's arguments of an iteration between two logs
        self.tokens_seen = 0.0  # prompt and completion tokens of every batch so far, all processes (TRL's num_tokens)
        self.bar = None  # the progress bar while training (on a terminal)
        self._lines: tuple[int, float] | None = None  # without one: (total frames, time of the next line)

    @contextmanager
    def timed(self, phase: str):
        start = time.perf_counter()
        try:
            yield
        finally:
            self.timings[phase] += time.perf_counter() - start

    def start_progress(self, total: int, frames: int) -> None:
        """A tqdm bar over frames on the main process when ``progress_bar`` is set; a line every
        ``PROGRESS_LINE_S`` seconds instead when stderr is not a terminal."""
        if not (self.settings.progress_bar and self.accelerator.is_main_process):
            return
        if not sys.stderr.isatty():
            self._lines = (total, time.monotonic() + PROGRESS_LINE_S)
            return
        from tqdm.auto import tqdm

        self.bar = tqdm(total=total, initial=min(frames, total), desc="frames", unit="completion")

    def advance(self, frames: int, rollout: TensorDict, seconds: float, done: int = 0) -> None:
        """``frames`` more collected (``done`` so far in all); the batch took ``seconds``."""
        reward = f"{float(rollout[batch.REWARD].mean()):.3f}"
        if self.bar is not None:  # one redraw per batch
            self.bar.set_postfix(reward=reward, step_s=f"{seconds:.2f}", refresh=False)
            self.bar.update(min(self.bar.total - self.bar.n, frames))
        elif self._lines is not None and time.monotonic() >= self._lines[1]:
            total = self._lines[0]
            log.info("progress: %d of %d frames (%.0f%%), reward %s, %.2f s per batch", done, total,
                     100 * done / total, reward, seconds)
            self._lines = (total, time.monotonic() + PROGRESS_LINE_S)

    def flush(self) -> None:
        """What the logger holds, written (a checkpoint's curves are on disk with it)."""
        if self.logger is not None:
            self.logger.flush()

    def resume_at(self, step: int) -> None:
        """Training resumed after ``step``: the logger drops what an interrupted run logged after it."""
        if self.logger is not None:
            self.logger.resume_at(step)

    def close(self) -> None:
        """The bar closed and the logger flushed (the end of ``train``)."""
        if self.bar is not None:
            self.bar.close()
            self.bar = None
        if self.logger is not None:
            self.logger.flush()

    def log_iteration(self, rollout: TensorDict, stats: dict[str, float], counters: dict[str, float], step: int,
                      final: bool, log_hook: Callable[[dict[str, float]], None], hook_seconds: dict[str, float]) -> None:
        """Log one iteration when ``log_interval`` frames passed since the last log (or at the end).

        ``counters``: ``train/*`` values of the trainer (frames first); ``stats``: the optimizer steps' means;
        ``log_hook(scalars)`` runs the users' log hooks, which may add scalars."""
        frames = counters["frames"]
        self._count_tokens(rollout)  # every batch, logged or not: collective
        counters = {**counters, "num_tokens": self.tokens_seen}
        if frames - self.last_log_frames < self.settings.log_interval and not final:
            self.timings.clear()
            self._unlogged = (rollout, stats, counters, step, log_hook, hook_seconds)
            return
        self._write(rollout, stats, counters, step, log_hook, hook_seconds)

    def _count_tokens(self, rollout: TensorDict) -> None:
        mine = 0.0 if not rollout.numel() else float(rollout[batch.PROMPT_MASK].sum()
                                                     + rollout[batch.COMPLETION_MASK].sum())
        if self.accelerator.num_processes > 1:
            mine = float(self.accelerator.reduce(torch.tensor(mine, device=self.accelerator.device), "sum"))
        self.tokens_seen += mine

    def _write(self, rollout: TensorDict, stats: dict[str, float], counters: dict[str, float], step: int,
               log_hook: Callable[[dict[str, float]], None], hook_seconds: dict[str, float]) -> None:
        """One iteration's scalars, logged (collective: the rollout's statistics are over every process)."""
        s = self.settings
        self.last_log_frames, self._unlogged = counters["frames"], None
        scalars = {f"train/{name}": float(value) for name, value in counters.items()
                   if name != "optim_steps" or s.auto_log_optim_steps}
        scalars.update({f"train/{k}": v for k, v in mean_over_processes(self.accelerator, stats).items()})
        scalars.update(rollout_scalars(self.accelerator, rollout, with_rewards=s.log_rewards))
        log_hook(scalars)
        if not s.log_kl:
            left_out = {f"train/{key}" for key in s.kl_outputs}
            scalars = {k: v for k, v in scalars.items() if k not in left_out}
        if s.log_timings:
            scalars.update({f"time/{phase}": seconds for phase, seconds in self.timings.items()})
            scalars.update({f"time/hook/{name}": seconds for name, seconds in hook_seconds.items()})
        self.timings.clear()
        hook_seconds.clear()
        self.history.append(scalars)
        self.log_scalars(scalars, step)
        self._log_samples(rollout, step)

    def log_unlogged(self) -> None:
        """Log the last iteration if it fell between two logs: training stopped early (a signal, request_stop), and
        the batch it stopped at logs as the last batch does. Collective: every process calls it."""
        if self._unlogged is not None:
            self._write(*self._unlogged)

    def state_dict(self) -> dict[str, float]:
        """What a checkpoint keeps of the logging: where the last log was, the tokens seen (the same on every
        process)."""
        return {"last_log_frames": float(self.last_log_frames), "tokens_seen": self.tokens_seen}

    def load_state_dict(self, state: dict) -> None:
        self.last_log_frames = state["last_log_frames"]
        self.tokens_seen = state.get("tokens_seen", 0.0)  # checkpoints before num_tokens was logged: from 0

    def log_scalars(self, scalars: dict[str, float], step: int) -> None:
        if self.logger is not None and self.accelerator.is_main_process:
            self.logger.log_scalars(scalars, step)

    def _log_samples(self, rollout: TensorDict, step: int) -> None:
        """A few of this batch's completions (main process's rows): a table or text, as the logger takes them."""
        n = self.settings.log_samples
        if (n and self.tokenizer is not None and self.logger is not None
                and self.accelerator.is_main_process and rollout.numel()):
            self.logger.log_samples(sample_rows(rollout, tokenizer=self.tokenizer, n=n), step)
