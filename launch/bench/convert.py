"""A checkpoint resumed on another process count: the conversion's time and each process's memory.

    PYTHONPATH=. python launch/bench/convert.py [--model DIR] [--cases zero3:4:2 zero2:2:4] [--out convert.json]

Each case ``CONFIG:SAVED:RESUMED`` trains one batch under ``accelerate_configs/CONFIG.yaml`` on SAVED processes
(``launch/train.py``, a model folder with its KL reference: by default a Llama of SmolLM2-135M's shape with random
weights), then launches RESUMED processes of this file, each of which builds the same run and loads that
checkpoint (``GRPOTrainer.load_from_file``: the main process converts it to its portable form, every process loads
its share), sampling its anonymous memory (RssAnon) every 2 ms. Each process prints one line: its peak before the
load (the built run) and during it; the main process also the conversion's seconds and the portable form's bytes.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
sys.path[:0] = [str(ROOT), str(Path(__file__).parent)]


def settings(model: Path, out: Path) -> list[str]:
    return [f"model.name_or_path={model}", "loss.kl_coef=0.1", "rollout.prompts_per_batch=4", "rollout.group_size=2",
            "rollout.max_new_tokens=2", "trainer.total_frames=8", "trainer.report_to=[]", "trainer.progress_bar=false",
            "trainer.log_samples=0", f"output_dir={out}"]


def process_main(args) -> None:
    """One process of the resumed launch: build, then load the checkpoint, sampled; one JSON line."""
    from common import PhaseSampler, say

    from grpo_accel.recipe.build import build_trainer
    from grpo_accel.config.loading import load_config
    from grpo_accel.runtime import start_process
    from grpo_accel.runtime.signals import exit_skipping_teardown
    from grpo_accel.checkpoint import converted, file_manifest

    start_process()  # threads per process, the allocator for the ZeRO stage
    cfg = load_config(None, [*settings(Path(args.model), Path(args.output_dir)), "checkpoint.resume=auto",
                             "trainer.total_frames=16"])  # one batch more than saved: a resume, not a finished run
    sampler = PhaseSampler()
    sampler.enter("build")
    trainer = build_trainer(cfg)
    path = trainer.checkpoint.resume_path()
    sampler.enter("load")
    start = time.perf_counter()
    trainer.load_from_file(path)
    seconds = time.perf_counter() - start
    peaks = sampler.stop()
    acc = trainer.accelerator
    line = {"rank": acc.process_index, "built": peaks["build"], "load_peak": peaks["load"], "load_s": round(seconds, 2)}
    if acc.is_main_process:
        made = json.loads((converted(path) / "portable.json").read_text())
        line.update(convert_s=made["seconds"], portable_bytes=sum(file_manifest(converted(path)).values()))
    say(line)
    acc.wait_for_everyone()
    exit_skipping_teardown(0)


def run(command: list[str], what: str) -> str:
    done = subprocess.run(command, capture_output=True, text=True, cwd=ROOT,
                          env={**os.environ, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"})
    if done.returncode != 0:
        raise SystemExit(f"{what} failed:\n{done.stderr[-4000:]}")
    return done.stdout


def case(spec: str, model: Path) -> list[dict]:
    """Save under CONFIG on SAVED processes, resume on RESUMED: each resumed process's line, by rank."""
    from common import free_port

    config, saved, resumed = spec.split(":")
    launcher = [sys.executable, "-m", "accelerate.commands.launch", "--config_file",
                str(ROOT / "accelerate_configs" / f"{config}.yaml")]
    with tempfile.TemporaryDirectory() as out:
        run([*launcher, "--num_processes", saved, "--main_process_port", str(free_port()),
             str(ROOT / "launch" / "train.py"), *settings(model, Path(out))], f"{spec}: the saved run")
        said = run([*launcher, "--num_processes", resumed, "--main_process_port", str(free_port()), __file__,
                    "--model", str(model), "--output-dir", out], f"{spec}: the resume")
    lines = [json.loads(line) for line in said.splitlines() if line.startswith('{"rank"')]
    return sorted(lines, key=lambda r: r["rank"])


def table(results: dict[str, list[dict]]) -> str:
    rows = ["| saved -> resumed | process | built (MiB) | peak while loading (MiB) | load (s) | conversion (s) | "
            "portable form (MB) |", "|---|---|---|---|---|---|---|"]
    for spec, ranks in results.items():
        config, saved, resumed = spec.split(":")
        for r in ranks:
            extra = (f"{r['convert_s']:.1f} | {r['portable_bytes'] / 1e6:.0f}" if "convert_s" in r else " | ")
            rows.append(f"| {config}, {saved} -> {resumed} processes | {r['rank']} | {r['built'] >> 20} | "
                        f"{r['load_peak'] >> 20} | {r['load_s']:.1f} | {extra} |")
    return "\n".join(rows) + "\n"


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", help="a model folder (default: SmolLM2-135M's shape, random weights)")
    parser.add_argument("--cases", nargs="+", default=["zero3:4:2", "zero2:2:4"], help="CONFIG:SAVED:RESUMED")
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--output-dir", help=argparse.SUPPRESS)  # a launched process's own
    args = parser.parse_args(argv)
    if args.output_dir is not None:
        process_main(args)
        return {}
    from grpo_accel.tasks.tiny import save_smollm2_shaped

    with tempfile.TemporaryDirectory() as folder:
        model = Path(args.model) if args.model else save_smollm2_shaped(Path(folder) / "model")
        results = {spec: case(spec, model) for spec in args.cases}
    print(table(results))
    if args.out:
        Path(args.out).write_text(json.dumps(results, indent=2))
    return results


if __name__ == "__main__":
    main()
