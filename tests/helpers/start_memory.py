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
import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "launch" / "bench"))
from common import PhaseSampler, anonymous_bytes, around, say  # noqa: E402  the bench's memory sampling


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
