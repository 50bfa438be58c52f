"""How well generation on SGLang overlaps training: the README's command, synchronous and with
``trainer.async_collection``, for each weight transport, on the work of launch/bench/trl_parity.py.

    PYTHONPATH=. python launch/bench/overlap.py [--model DIR] [--steps 20] [--warmup 3] [--methods distributed disk]
        [--modes sync async] [--decode-delay S] [--out overlap.json]
    PYTHONPATH=. python launch/bench/overlap.py --report RUN_DIR [RUN_DIR ...]

Each run gets a fresh SGLang stand-in (launch/bench/sglang_standin with ``--kv-cache``: its scheduler decodes the
running batch on a KV cache, one token per request per step, the pace of a real server for the model, which it
holds in float32) on this machine's last core, as a server on a machine of its own; the README's command
(``trainer.log_timings=true``, weights pushed with ``weight_sync.method``) runs on the other cores, one torch
thread per core. Per batch, from the run's TensorBoard events: the step (wall time between two iterations' logs),
generation (``time/generate``, the collector's, concurrent with training when asynchronous), training (the
iteration's time, ``time/iteration``, less the push) and the push (``time/weight_sync``: pause, transfer,
load, check, continue). ``overlap`` is the median over batches of step / max(generation, training): 1.0 is
perfect overlap, a synchronous run's is 1 + min / max plus the push's share. ``--report`` gives the same
table for runs of your own (any run logged with ``trainer.log_timings=true``, one log per iteration), e.g.
against real servers on a cluster.
"""
from __future__ import annotations

import argparse
import contextlib
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from common import ROOT, free_port, readme_command, standin, tiny_model_folder


def batch_times(log_dir: Path, warmup: int) -> dict[str, list[float]]:
    """Seconds per batch after ``warmup`` of them: step, generate, train, push (see the module's docstring)."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    tags = set(events.Tags()["scalars"])
    missing = {"time/generate", "time/iteration"} - tags
    if missing:
        raise SystemExit(f"{log_dir}: no {sorted(missing)} scalars; run with trainer.log_timings=true")

    def series(tag: str) -> list[float]:
        return [e.value for e in events.Scalars(tag)] if tag in tags else [0.0] * len(events.Scalars("time/iteration"))

    ends = [e.wall_time for e in events.Scalars("time/iteration")]
    push = series("time/weight_sync")
    train = [i - p for i, p in zip(series("time/iteration"), push)]
    first = warmup + 1  # a step is the gap to the previous log: the first one after warmup has one
    return {"step": [b - a for a, b in zip(ends[warmup:], ends[first:])], "generate": series("time/generate")[first:],
            "train": train[first:], "push": push[first:]}


def summary(times: dict[str, list[float]]) -> dict:
    """Medians per batch, the overlap (step / max(generation, training)) and the push's share of the step."""
    per_batch = list(zip(times["step"], times["generate"], times["train"], times["push"]))
    if not per_batch:
        raise SystemExit("no batch after the warmup: train longer or lower --warmup")
    return {**{f"{name}_s": statistics.median(values) for name, values in times.items()},
            "overlap": statistics.median(s / max(g, t) for s, g, t, _ in per_batch),
            "push_share": statistics.median(p / s for s, _, _, p in per_batch), "batches": len(per_batch),
            "per_batch": times}


def measure(model: Path, mode: str, method: str, args, cores: tuple[set[int], set[int]]) -> dict:
    """One run of the README's command against a fresh stand-in; its summary."""
    trainer_cores, server_cores = cores
    with tempfile.TemporaryDirectory() as folder, standin(model, server_cores, args.decode_delay) as url:
        out = Path(folder) / "run"
        command = readme_command(model, out, args.warmup + args.steps + 1, "rollout.backend=sglang",
                                 f"rollout.urls=[{url}]", f"weight_sync.method={method}", "weight_sync.backend=gloo",
                                 f"weight_sync.master_port={free_port()}", "trainer.log_timings=true",
                                 f"trainer.async_collection={str(mode == 'async').lower()}",
                                 )
        env = {**os.environ, "PYTHONPATH": str(ROOT), "GRPO_ACCEL_THREADS": str(len(trainer_cores))}
        done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=ROOT,
                              preexec_fn=lambda: os.sched_setaffinity(0, trainer_cores))
        if done.returncode != 0:
            raise SystemExit(f"{mode} / {method} failed:\n{done.stderr[-3000:]}")
        return summary(batch_times(out / "tensorboard", args.warmup))


def split_cores() -> tuple[set[int], set[int]]:
    """This machine's cores: the last for the server, the others for the trainer (all, when it has one)."""
    cores = sorted(os.sched_getaffinity(0))
    return (set(cores[:-1]) or set(cores), {cores[-1]})


def table(results: dict[str, dict]) -> str:
    head = f"{'run':<24}{'step s':>9}{'generate s':>12}{'train s':>9}{'push s':>9}{'overlap':>9}{'push share':>12}\n"
    return head + "".join(f"{name:<24}{r['step_s']:>9.3f}{r['generate_s']:>12.3f}{r['train_s']:>9.3f}"
                          f"{r['push_s']:>9.3f}{r['overlap']:>9.2f}{r['push_share']:>12.2f}\n"
                          for name, r in results.items())


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (default: launch/bench/trl_parity.py's tiny Qwen2)")
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--warmup", type=int, default=3)
    parser.add_argument("--modes", nargs="+", choices=["sync", "async"], default=["sync", "async"])
    parser.add_argument("--methods", nargs="+", choices=["distributed", "disk"], default=["distributed", "disk"])
    parser.add_argument("--decode-delay", type=float, default=0.0, help="the stand-in's seconds per step at least")
    parser.add_argument("--report", nargs="+", type=Path, help="summarise these run folders instead")
    parser.add_argument("--out", type=Path, help="write the results as JSON here")
    args = parser.parse_args(argv)
    if args.report:
        results = {str(run): summary(batch_times(run / "tensorboard", args.warmup)) for run in args.report}
    else:
        cores = split_cores()
        with tempfile.TemporaryDirectory() as folder:
            model = Path(args.model) if args.model else tiny_model_folder(Path(folder) / "model")
            results = {f"{mode}, {method}": measure(model, mode, method, args, cores)
                       for method in args.methods for mode in args.modes}
    sys.stdout.write(table(results))
    if args.out:
        args.out.write_text(json.dumps(results, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
