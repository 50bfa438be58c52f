"""Shared by contracts.py, recipe/, rollout/ and run/.

How a collected batch is split: over processes, into micro-batches, into optimizer steps.

One value per run, :class:`BatchLayout`: the recipe makes it from the config (``grpo_accel.recipe.build``), a
Python API user makes it by hand; the collector and the trainer are handed it and only read it. It holds the
batch's shape (prompts x group size over processes); the trainer's own settings (micro-batch size, accumulation,
epochs, sampled micro-batches: torchrl's arguments) go into its methods, so each rule that ties them to the
batch lives here once. Its errors name the settings as whoever built it calls them (``names``).
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Mapping

from grpo_accel.rules import check

API_NAMES = {"prompts": "prompts", "group_size": "group_size", "processes": "processes", "micro_batch": "batch_size",
             "accumulation": "gradient_accumulation_steps", "sampled": "optim_steps_per_batch"}
"""The settings behind each count, as the Python API calls them (the layout's fields, GRPOTrainer's arguments)."""


@dataclass(frozen=True)
class BatchLayout:
    """The shape of one collected batch: ``prompts`` x ``group_size`` completions, split over ``processes``.

    Example (the README's default under 2 processes, 2 micro-batches per optimizer step):
        >>> layout = BatchLayout(prompts=16, group_size=8, processes=2)
        >>> layout.completions_per_process, layout.auto_micro_batch(2), layout.optimizer_steps(32, 2)
        (64, 32, 1)
    """

    prompts: int  # per collected batch, all processes together
    group_size: int  # completions per prompt
    processes: int = 1
    names: Mapping[str, str] = field(default_factory=lambda: API_NAMES, compare=False, repr=False)

    def __post_init__(self) -> None:
        check("positive_count", self.names["prompts"], self.prompts)
        check("group_size", self.names["group_size"], self.group_size)
        check("positive_count", self.names["processes"], self.processes)
        if self.prompts % self.processes:
            raise ValueError(f"{self.names['prompts']}={self.prompts}: must be a positive multiple of the "
                             f"{self.processes} processes; use a multiple of {self.processes}.")

    @property
    def prompts_per_process(self) -> int:
        return self.prompts // self.processes

    @property
    def completions(self) -> int:  # per collected batch, all processes together
        return self.prompts * self.group_size

    @property
    def completions_per_process(self) -> int:
        return self.prompts_per_process * self.group_size

    def auto_micro_batch(self, accumulation: int) -> int:
        """Completions per micro-batch when the process's share is split into ``accumulation`` equal parts (one
        optimizer step per epoch); raises when they are not equal."""
        share = self.completions_per_process
        if share % accumulation:
            raise ValueError(f"{self.names['accumulation']}={accumulation}: each process collects {share} "
                             f"completions per collected batch ({self.names['prompts']} / processes x group size), "
                             f"which auto micro-batches split into {accumulation} equal parts only if it divides "
                             f"them: use one of {_divisors(share)}.")
        return share // accumulation

    def micro_batches(self, micro_batch: int, sampled: int | None = None, rows: int | None = None) -> int:
        """Micro-batches of ``micro_batch`` completions per epoch over ``rows`` completions on one process (default:
        its share; the last micro-batch holds the remainder), or ``sampled`` of them when set."""
        rows = self.completions_per_process if rows is None else rows
        return sampled or math.ceil(rows / micro_batch)

    def optimizer_steps(self, micro_batch: int, accumulation: int, epochs: int = 1, sampled: int | None = None,
                        rows: int | None = None) -> int:
        """Optimizer steps per collected batch of ``rows`` completions on one process (default: its share)."""
        return epochs * self.micro_batches(micro_batch, sampled, rows) // accumulation

    def check_steps(self, micro_batch: int, accumulation: int, sampled: int | None = None,
                    rows: int | None = None) -> None:
        """Every optimizer step takes ``accumulation`` micro-batches: their count must be a multiple of it."""
        micro = self.micro_batches(micro_batch, sampled, rows)
        if micro % accumulation == 0:
            return
        rows = self.completions_per_process if rows is None else rows
        if sampled:
            raise ValueError(f"{self.names['sampled']}={sampled}: must be a multiple of {self.names['accumulation']}="
                             f"{accumulation} (each optimizer step takes that many micro-batches).")
        equal = [d for d in _divisors(rows) if (rows // d) % accumulation == 0]
        raise ValueError(f"{self.names['micro_batch']}={micro_batch}: {micro} micro-batches per epoch ({rows} "
                         f"completions / {micro_batch}) is not a multiple of {self.names['accumulation']}="
                         f"{accumulation}; make completions per process = micro-batch x accumulation x k (here one "
                         f"of {equal}, or auto).")

    def micro_batch_sizes(self, micro_batch: int, sampled: int | None = None) -> list[int]:
        """Completions in each micro-batch of one epoch on one process: its share cut into ``micro_batch``-sized
        pieces, the last holding the remainder; ``sampled`` micro-batches of ``micro_batch`` each when set."""
        if sampled:
            return [micro_batch] * sampled
        share = self.completions_per_process
        return [min(micro_batch, share - start) for start in range(0, share, micro_batch)]

    def describe(self, micro_batch: int, accumulation: int, epochs: int = 1, sampled: int | None = None) -> str:
        """The layout in one line, as it runs: a short last micro-batch and the optimizer steps it makes smaller
        are named as they are ("4 of 7 and 1 of 4"; "14, 14 and 4 completions")."""
        sizes = self.micro_batch_sizes(micro_batch, sampled)
        steps = [sum(sizes[i : i + accumulation]) * self.processes for i in range(0, len(sizes), accumulation)]
        per_step = (f"{steps[0]} completions per optimizer step" if len(set(steps)) == 1 else
                    f"{_counted(steps)} completions in its optimizer steps")
        return (f"batch layout: {self.prompts} prompts x {self.group_size} = {self.completions} completions per "
                f"collected batch; {self.completions_per_process} per process in {_pieces(sizes)}; {accumulation} "
                f"micro-batches per optimizer step = {per_step} over {self.processes} processes -> "
                f"{self.optimizer_steps(micro_batch, accumulation, epochs, sampled)} optimizer steps per collected "
                "batch")


def resized_split(saved: BatchLayout, micro_batch: int, accumulation: int, layout: BatchLayout,
                  epochs: int = 1, sampled: int | None = None) -> tuple[int, int]:
    """The (micro-batch, accumulation) that keep ``saved``'s batch on ``layout``'s processes: the same completions
    per optimizer step and optimizer steps per collected batch, the micro-batch kept where it can be, else the
    accumulation. Raises ValueError naming the settings and the process counts that keep it."""
    found = _split_keeping(saved, micro_batch, accumulation, layout, epochs, sampled)
    if found is not None:
        return found
    names, step = saved.names, micro_batch * accumulation * saved.processes
    counts = [n for n in _divisors(saved.prompts) if _split_keeping(
        saved, micro_batch, accumulation, BatchLayout(saved.prompts, saved.group_size, n), epochs, sampled)]
    raise ValueError(f"{step} completions per optimizer step ({names['micro_batch']}={micro_batch} x "
                     f"{names['accumulation']}={accumulation} x {saved.processes} processes) cannot be kept over "
                     f"{layout.processes} processes (no {names['micro_batch']} x {names['accumulation']} makes "
                     f"{step / layout.processes:g} per process); resume on one of {counts} processes.")


def _split_keeping(saved: BatchLayout, micro_batch: int, accumulation: int, layout: BatchLayout, epochs: int,
                   sampled: int | None) -> tuple[int, int] | None:
    step = micro_batch * accumulation * saved.processes
    steps = saved.optimizer_steps(micro_batch, accumulation, epochs, sampled)
    if step % layout.processes:
        return None
    share = step // layout.processes  # completions per process in one optimizer step
    for micro, ga in ((micro_batch, share // micro_batch), (share // accumulation, accumulation), (share, 1)):
        if micro < 1 or ga < 1 or micro * ga != share:
            continue
        if layout.micro_batches(micro, sampled) % ga == 0 and \
                layout.optimizer_steps(micro, ga, epochs, sampled) == steps:
            return micro, ga
    return None


def _pieces(sizes: list[int]) -> str:
    """[7, 7, 7, 7, 4] -> "5 micro-batches: 4 of 7 and 1 of 4"; [8, 8] -> "2 micro-batches of 8"."""
    if len(set(sizes)) == 1:
        return f"{len(sizes)} micro-batches of {sizes[0]}"
    return f"{len(sizes)} micro-batches: {len(sizes) - 1} of {sizes[0]} and 1 of {sizes[-1]}"


def _counted(values: list[int]) -> str:
    """[14, 14, 4] -> "14, 14 and 4"."""
    return ", ".join(map(str, values[:-1])) + f" and {values[-1]}"


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]
