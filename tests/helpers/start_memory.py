"""Launched by tests/launched/test_zero3_load.py: each process runs the recipe from its start to the end of its first
generation, as ``grpo-accel train`` does (its thread and allocator settings, ``build_trainer``, then the collector's
first batch, which is how ``train()`` begins), and prints one JSON line: its anonymous memory (RssAnon, sampled
every 2 ms) at the start and its peak in each phase, before and after the load, and the share of the parameters it
holds.

The phases: ``load`` (``build_policy``: the policy and its KL reference), ``parts`` (the rest of the build: the
engine, the collector, the optimizer), ``prepare`` (Accelerate's ``prepare``: DeepSpeed's engine and its optimizer's
buffers), ``generation`` (the first batch: the collector's rollouts and rewards). Anonymous memory, not the resident
set: the first process reads the checkpoint through a memory map, whose pages are the page cache every process
shares, not memory a process holds.
"""
import json
import os
import sys
import threading
import time


def anonymous_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


class PhaseSampler:
    """Each phase's peak of this process's anonymous memory, sampled every ``every_s`` seconds on a thread."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.phase, self.peaks, self.every_s = "start", {}, every_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def enter(self, phase: str) -> int:
        """Begin ``phase``; returns the anonymous memory now (counted in the phase that ends)."""
        now = self._record()
        self.phase = phase
        return now

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.thread.join()
        self._record()
        return self.peaks

    def _record(self) -> int:
        now = anonymous_bytes()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), now)
        return now

    def _sample(self) -> None:
        while not self.done.is_set():
            self._record()
            time.sleep(self.every_s)


def say(result: dict) -> None:
    """``result`` as one JSON line on stdout in one write: the processes share the pipe, and a line written whole
    (under the pipe's 4 KiB) is never cut by another's (print's text and newline are two writes, unbuffered)."""
    line = (json.dumps(result) + "\n").encode()
    assert len(line) < 4096, "longer lines may interleave"
    os.write(sys.stdout.fileno(), line)


def around(owner, name: str, sampler: PhaseSampler, phase: str, after: str, held: dict) -> None:
    """``owner.name`` runs in ``phase``, then ``after`` begins; ``held[phase]``: the memory held when it was called
    and when it returned."""
    function = getattr(owner, name)

    def timed(*args, **kwargs):
        before = sampler.enter(phase)
        try:
            return function(*args, **kwargs)
        finally:
            held[phase] = (before, sampler.enter(after))

    setattr(owner, name, timed)


def main(folder: str, *overrides: str) -> None:
    import accelerate
    import deepspeed  # noqa: F401  imported before the baseline, as the trainer has by then
    import torch
    import transformers  # noqa: F401

    import grpo_accel.recipe.parts as parts
    from grpo_accel.distributed import local_parameter_fraction
    from grpo_accel.recipe.build import build_trainer
    from grpo_accel.config.loading import load_config
    from grpo_accel.runtime import start_process

    _, kept = start_process()  # as grpo-accel train starts
    cfg = load_config(None, [f"model.name_or_path={folder}", "loss.kl_coef=0.1", "rollout.max_new_tokens=2",
                             "rollout.prompts_per_batch=4", "rollout.group_size=2", "trainer.total_frames=8",
                             f"output_dir={os.environ['RUN_FOLDER']}", *overrides])
    sampler, held = PhaseSampler(), {}
    base = anonymous_bytes()
    around(parts, "build_policy", sampler, "load", "parts", held)
    around(accelerate.Accelerator, "prepare", sampler, "prepare", "parts", held)
    trainer = build_trainer(cfg)
    sampler.enter("generation")
    next(iter(trainer.collector))
    peaks = sampler.stop()
    policy = trainer.unwrapped_loss.policy
    reference = trainer.unwrapped_loss.reference
    say({"rank": trainer.accelerator.process_index, "processes": trainer.accelerator.num_processes, "base": base,
         "peaks": peaks, "load": held["load"], "freed_memory_kept": kept, "policy_share": local_parameter_fraction(policy),
         "reference_share": local_parameter_fraction(reference)  # LoRA's: the policy with its adapter off
         if isinstance(reference, torch.nn.Module) else None})


if __name__ == "__main__":
    main(*sys.argv[1:])
