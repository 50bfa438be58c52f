"""How a collected batch is split: over processes, into micro-batches, into optimizer steps.

One value, :class:`BatchLayout`, holds the counts with their units in the names, and each rule about them lives
here once. The config (``launch/train.py``), ``GRPOCollector`` and ``GRPOTrainer`` all ask it; its errors name
the setting of whoever built it (``names``), the value and the fix.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Literal, Mapping

# the settings behind each count, as the Python API and the YAML config call them
API_NAMES = {"prompts": "prompts_per_batch", "micro_batch": "batch_size", "accumulation": "gradient_accumulation_steps",
             "sampled": "optim_steps_per_batch"}
CONFIG_NAMES = {"prompts": "rollout.prompts_per_batch", "micro_batch": "trainer.micro_batch_completions",
                "accumulation": "trainer.gradient_accumulation_steps", "sampled": "trainer.optim_steps_per_batch"}


@dataclass(frozen=True)
class BatchLayout:
    """The layout of one collected batch.

    Example (the README's default, 2 processes):
        >>> layout = BatchLayout(prompts=16, group_size=8, processes=2, accumulation=2)
        >>> layout.completions_per_process, layout.micro_batch, layout.optimizer_steps()
        (64, 32, 1)
    """

    prompts: int = 1  # per collected batch, all processes together
    group_size: int = 1  # completions per prompt
    processes: int = 1
    micro_batch_setting: int | Literal["auto"] = "auto"  # completions per micro-batch on one process
    accumulation: int = 1  # micro-batches per optimizer step
    epochs: int = 1  # passes over each collected batch
    sampled_micro_batches: int | None = None  # optim_steps_per_batch: micro-batches sampled per epoch instead
    names: Mapping[str, str] = field(default_factory=lambda: API_NAMES)

    def check_split(self) -> None:
        """The prompts must split evenly over the processes."""
        if self.prompts < self.processes or self.prompts % self.processes:
            raise ValueError(f"{self.names['prompts']}={self.prompts}: must be a positive multiple of the "
                             f"{self.processes} processes; use a multiple of {self.processes}.")

    @property
    def prompts_per_process(self) -> int:
        self.check_split()
        return self.prompts // self.processes

    @property
    def completions(self) -> int:  # per collected batch, all processes together
        return self.prompts * self.group_size

    @property
    def completions_per_process(self) -> int:
        return self.prompts_per_process * self.group_size

    @property
    def micro_batch(self) -> int:
        """Completions per micro-batch on one process: the setting, or for "auto" the process's share split into
        ``accumulation`` equal parts (raises when they are not)."""
        if self.micro_batch_setting != "auto":
            return self.micro_batch_setting
        share, ga = self.completions_per_process, self.accumulation
        if share % ga:
            raise ValueError(f"{self.names['accumulation']}={ga}: {self._share()}, which auto micro-batches split "
                             f"into {ga} equal parts only if it divides them: use one of {_divisors(share)}.")
        return share // ga

    def micro_batches(self, rows: int | None = None) -> int:
        """Micro-batches per epoch for ``rows`` completions on one process (default: the process's share); the
        last one holds the remainder."""
        rows = self.completions_per_process if rows is None else rows
        return self.sampled_micro_batches or math.ceil(rows / self.micro_batch)

    def optimizer_steps(self, rows: int | None = None) -> int:
        """Optimizer steps per collected batch of ``rows`` completions on one process."""
        return self.epochs * self.micro_batches(rows) // self.accumulation

    def check(self, rows: int | None = None) -> None:
        """Every optimizer step takes ``accumulation`` micro-batches: their count must be a multiple of it."""
        micro, ga, size = self.micro_batches(rows), self.accumulation, self.micro_batch
        if micro % ga == 0:
            return
        rows = self.completions_per_process if rows is None else rows
        if self.sampled_micro_batches:
            raise ValueError(f"{self.names['sampled']}={micro}: must be a multiple of {self.names['accumulation']}="
                             f"{ga} (each optimizer step takes that many micro-batches).")
        equal = [d for d in _divisors(rows) if (rows // d) % ga == 0]
        raise ValueError(f"{self.names['micro_batch']}={size}: {micro} micro-batches per epoch ({rows} completions / "
                         f"{size}) is not a multiple of {self.names['accumulation']}={ga}; make completions per "
                         f"process = micro-batch x accumulation x k (here one of {equal}, or auto).")

    def describe(self) -> str:
        size, micro, ga = self.micro_batch, self.micro_batches(), self.accumulation
        return (f"batch layout: {self.prompts} prompts x {self.group_size} = {self.completions} completions per collected batch; "
                f"{self.completions_per_process} per process in {micro} micro-batches of {size}; {ga} micro-batches "
                f"per optimizer step = {size * ga * self.processes} completions per optimizer step over "
                f"{self.processes} processes -> {self.optimizer_steps()} optimizer steps per collected batch")

    def _share(self) -> str:
        return (f"each process collects {self.completions_per_process} completions per collected batch "
                f"({self.names['prompts']} / processes x group size)")


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
