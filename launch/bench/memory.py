"""Memory per process, per ZeRO stage, over one run: the load, steady training and the first weight push.

    PYTHONPATH=. python launch/bench/memory.py [--model DIR] [--processes 4] [--batches 4] [--bucket-mb 64]
        [--configs zero0 zero1 zero2 zero3 zero3_offload] [--out memory.json]

Each accelerate config of ``--configs`` launches ``--processes`` processes of this file (``accelerate launch``); each
runs the recipe as ``grpo-accel train`` does (its thread and allocator settings, ``build_trainer``, ``train()``) on a
model folder (default: a Llama of SmolLM2-135M's shape, random weights, with a KL reference) against an SGLang
stand-in (launch/bench/sglang_standin with ``--kv-cache``), the trained weights pushed to it after every batch
over gloo in buckets of ``--bucket-mb``. Each process samples its anonymous memory (RssAnon) every 2 ms and prints
one line: its peak during the load (``build_trainer``: the policy, its reference, DeepSpeed's engine), during the
batches after the first (collection, logprob passes, the optimizer step: steady training), and during the first
weight push, with what that push added over the memory it started from. The push gathers one bucket at a time
under ZeRO-3 and casts it to bfloat16, so its addition should stay within about one bucket (at float32 while gathered).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]

CONFIGS = ("zero0", "zero1", "zero2", "zero3", "zero3_offload")
PROMPTS, GROUP, NEW_TOKENS = 4, 2, 8  # per batch over all processes: 8 completions of 8 tokens


def process_main(args) -> None:
    """One process of a launch: the run, its phases sampled; one JSON line."""
    from common import PhaseSampler, say

    from grpo_accel.recipe.build import build_trainer, close_parts
    from grpo_accel.config.loading import load_config
    from grpo_accel.runtime import start_process
    from grpo_accel.runtime.signals import exit_skipping_teardown

    start_process()  # threads per process, the allocator for the ZeRO stage
    cfg = load_config(None, [
        f"model.name_or_path={args.model}", "loss.kl_coef=0.1", "rollout.backend=sglang", f"rollout.urls=[{args.url}]",
        "weight_sync.backend=gloo", f"weight_sync.master_port={args.master_port}", f"weight_sync.bucket_mb={args.bucket_mb}",
        f"rollout.prompts_per_batch={PROMPTS}", f"rollout.group_size={GROUP}", f"rollout.max_new_tokens={NEW_TOKENS}",
        f"trainer.total_frames={PROMPTS * GROUP * args.batches}", "trainer.report_to=[]", "trainer.progress_bar=false",
        "trainer.log_samples=0", "checkpoint.interval_frames=null", f"output_dir={args.output_dir}"])
    sampler, starts = PhaseSampler(), {}

    def enter(kind: str, ahead: int = 0):  # the phase ``kind`` of the batch the trainer is in (or the next one)
        def hook(trainer, *_):
            phase = f"{kind} {trainer.iterations + ahead}"
            starts[phase] = sampler.enter(phase)
        return hook

    sampler.enter("load")
    trainer = build_trainer(cfg)
    trainer.register_op("pre_train", enter("batch", ahead=1), name="memory_first_batch")
    trainer.register_op("post_optim_step", enter("push"), name="memory_push")  # one optimizer step a batch
    trainer.register_op("post_optim", enter("after"), name="memory_after_push")
    trainer.register_op("post_iteration", enter("batch", ahead=1), name="memory_next_batch")
    trainer.train()
    peaks = sampler.stop()
    close_parts(trainer, "finished")
    assert trainer.optim_steps == trainer.iterations == args.batches, (trainer.optim_steps, trainer.iterations)
    steady = [peak for phase, peak in peaks.items() if phase.split()[0] in ("batch", "after")
              and 2 <= int(phase.split()[1]) <= args.batches]  # not the first batch, nor the final checkpoint
    say({"rank": trainer.accelerator.process_index, "load": peaks["load"], "steady": max(steady),
         "push": peaks["push 1"], "push_added": peaks["push 1"] - starts["push 1"],
         "push_reported": trainer.weight_sync_sender.stats()["weight_sync_peak_extra_bytes"]})
    trainer.accelerator.end_training()
    exit_skipping_teardown(0)


def launch(config: str, args, url: str) -> list[dict]:
    """One launch of ``config``; each process's line, by rank."""
    from common import free_port

    with tempfile.TemporaryDirectory() as out:
        command = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                   str(ROOT / "accelerate_configs" / f"{config}.yaml"), "--num_processes", str(args.processes),
                   "--main_process_port", str(free_port()), __file__, "--model", str(args.model), "--url", url,
                   "--master-port", str(free_port()), "--bucket-mb", str(args.bucket_mb), "--batches",
                   str(args.batches), "--output-dir", out]
        done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                              env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{config} failed:\n{done.stderr[-4000:]}")
    lines = [json.loads(line) for line in done.stdout.splitlines() if line.startswith('{"rank"')]
    return sorted(lines, key=lambda r: r["rank"])


def table(results: dict[str, list[dict]], bucket_mb: float) -> str:
    """Markdown: a row per config and process, MiB."""
    rows = ["| config | process | load peak | steady training peak | first push peak | added by the push |",
            "|---|---|---|---|---|---|"]
    for config, ranks in results.items():
        for r in ranks:
            rows.append(f"| `{config}.yaml` | {r['rank']} | {r['load'] >> 20} | {r['steady'] >> 20} | "
                        f"{r['push'] >> 20} | {r['push_added'] >> 20} |")
    return "\n".join(rows) + f"\n\n(MiB of anonymous memory; buckets of {bucket_mb:g} MB)\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (default: SmolLM2-135M's shape, random weights)")
    parser.add_argument("--processes", type=int, default=4)
    parser.add_argument("--batches", type=int, default=4, help="batches per run (the first is not steady)")
    parser.add_argument("--bucket-mb", type=float, default=64.0, help="weight_sync.bucket_mb")
    parser.add_argument("--configs", nargs="+", choices=CONFIGS, default=list(CONFIGS))
    parser.add_argument("--out", help="write the results as JSON here")
    # a launched process's own arguments
    parser.add_argument("--url", help=argparse.SUPPRESS)
    parser.add_argument("--master-port", type=int, help=argparse.SUPPRESS)
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    if args.url is not None:
        process_main(args)
        return {}
    if args.batches < 2:
        raise SystemExit("--batches must be at least 2: steady training is measured after the first batch")
    from common import standin

    from grpo_accel.tasks.tiny import save_smollm2_shaped

    with tempfile.TemporaryDirectory() as folder:
        args.model = Path(args.model) if args.model else save_smollm2_shaped(Path(folder) / "model")
        with standin(args.model, set(os.sched_getaffinity(0)), delay=0.0) as url:
            results = {config: launch(config, args, url) for config in args.configs}
    print(table(results, args.bucket_mb))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
