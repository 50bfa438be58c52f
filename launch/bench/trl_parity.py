"""Steps per second against Hugging Face TRL's GRPOTrainer on the same work, interleaved on this machine.

The work: the 82,496-parameter Qwen2 of ``grpo_accel.tasks.tiny.build_tiny_qwen2`` (random weights, character
tokenizer), prompts "a+b=" with a, b in 0..49, the answer_match and format_match rewards, 2 prompts x 4
completions per step, up to 32 new tokens, temperature 1, KL 0.04, learning rate 1e-4, float32 (TRL's bf16
default turned off), one process, one torch thread for training. Each round runs TRL, then the README's command
(``accelerate launch --config_file accelerate_configs/single_process.yaml launch/train.py`` with overrides for
this work and every other setting default; its step times are the wall-time gaps of its TensorBoard events),
then ``python launch/bench/bench.py --size tiny --loop ...`` for every variant and decoder asked for (none by
default); the table gives the median over rounds of each run's median step time, and the mean completion length
of the TRL and README-command runs (their policies learn apart, and a step's time follows its tokens).

TRL is not a dependency: install it in an environment of its own (same torch and transformers) and name its
python with ``--trl-python``:

    python -m venv /tmp/trl && /tmp/trl/bin/pip install torch==2.13.0 trl==1.16.0 tensordict
    PYTHONPATH=. python launch/bench/trl_parity.py --trl-python /tmp/trl/bin/python --rounds 3

``--baseline DIR`` adds, each round, the README's command from another checkout (a worktree of the previous
build: ``git worktree add /tmp/before HEAD~1``), run before or after this checkout's in alternating rounds, so a
change is measured against TRL and against what it replaces in one interleaved run.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

from common import ROOT, WORK, readme_command, tiny_model_folder


def trl_side(steps: int, warmup: int, model: str | None, threads: int) -> dict:
    """TRL's median step time on the work (run inside TRL's environment)."""
    import time

    import torch
    from datasets import Dataset
    from transformers import AutoTokenizer, TrainerCallback
    from trl import GRPOConfig, GRPOTrainer

    from grpo_accel.rewards import answer_match, format_match
    from grpo_accel.tasks.addition import addition_rows

    torch.set_num_threads(threads)
    folder = model or str(tiny_model_folder(tempfile.mkdtemp()))  # TRL builds its reference model from a path
    tokenizer = AutoTokenizer.from_pretrained(folder)
    ends: list[float] = []

    class StepEnds(TrainerCallback):
        def on_step_end(self, args, state, control, **kwargs):
            ends.append(time.perf_counter())

    config = GRPOConfig(
        output_dir=tempfile.mkdtemp(), per_device_train_batch_size=WORK["prompts"] * WORK["group"],
        num_generations=WORK["group"], max_completion_length=WORK["max_new_tokens"], beta=WORK["kl_coef"],
        learning_rate=WORK["lr"], temperature=1.0, use_cpu=True, bf16=False, max_steps=warmup + steps + 1, seed=0,
        logging_steps=10**6, save_strategy="no", report_to="none", disable_tqdm=True)
    trainer = GRPOTrainer(model=folder, reward_funcs=[answer_match, format_match], args=config,
                          train_dataset=Dataset.from_list(addition_rows(49)[0]), processing_class=tokenizer,
                          callbacks=[StepEnds()])
    trainer.train()
    steps_s = [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]
    lengths = [h["completions/mean_length"] for h in trainer.state.log_history if "completions/mean_length" in h]
    return {"step_s": statistics.median(steps_s), "completion_tokens_mean": lengths[-1] if lengths else None}


def command_side(steps: int, warmup: int, env: dict, model: str | None, root: Path = ROOT) -> dict:
    """The README's command on the work, from the checkout at ``root`` (its package first on the path): its median
    step from the wall times of its TensorBoard events."""
    from grpo_accel.reporting.event_files import read_scalars

    with tempfile.TemporaryDirectory() as folder:
        model, out = model or tiny_model_folder(Path(folder) / "model"), Path(folder) / "run"
        subprocess.run(readme_command(model, out, warmup + steps + 1, root=root), env={**env, "PYTHONPATH": str(root)},
                       capture_output=True, check=True, cwd=root)
        lengths = read_scalars(out / "tensorboard")["train/completion_length_mean"]
        return {"step_s": statistics.median(step_gaps(out / "tensorboard", warmup)),
                "completion_tokens_mean": statistics.mean(v for _, v in lengths)}


def step_gaps(log_dir: Path, warmup: int) -> list[float]:
    """Seconds between the logs of consecutive iterations (one log per iteration), after ``warmup`` of them."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    events = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    events.Reload()
    ends = [e.wall_time for e in events.Scalars("train/reward_mean")]
    return [b - a for a, b in zip(ends[warmup:], ends[warmup + 1:])]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--trl-python", help="python of an environment with trl installed")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--warmup", type=int, default=5)
    parser.add_argument("--variants", nargs="*", default=[], help="launch/bench/bench.py --loop variants to add")
    parser.add_argument("--decoders", nargs="+", default=["auto"], help="their rollout.decoder values")
    parser.add_argument("--model", help="a model folder (weights + tokenizer) instead of the tiny Qwen2, e.g. "
                                        "~/.cache/grpo_accel/models/smollm2-135m (the README command's side only)")
    parser.add_argument("--threads", type=int, default=1, help="torch threads of each side")
    parser.add_argument("--baseline", type=Path, help="another checkout of grpo_accel (e.g. a git worktree of the "
                                                      "previous build): its README command runs each round too, "
                                                      "before or after this one's, alternating")
    parser.add_argument("--side", choices=["trl"], help=argparse.SUPPRESS)  # internal: one TRL run, JSON out
    args = parser.parse_args(argv)
    if args.side == "trl":
        sys.stdout.write(json.dumps(trl_side(args.steps, args.warmup, args.model, args.threads)) + "\n")
        return 0
    if args.trl_python is None:
        parser.error("--trl-python is required (TRL is not a dependency of grpo_accel)")
    if args.model and args.variants:
        parser.error("--variants time launch/bench/bench.py's tiny model; with --model only TRL and the README's command run")
    if args.baseline is not None and not (args.baseline / "launch" / "train.py").is_file():
        parser.error(f"--baseline {args.baseline}: no launch/train.py there; give a checkout of grpo_accel, e.g. "
                     "`git worktree add /tmp/before <commit>`")
    commands = [("grpo_accel, the README's command", ROOT)]
    if args.baseline is not None:
        commands.append((f"grpo_accel, the README's command from {args.baseline}", args.baseline.resolve()))
    env = {**os.environ, "PYTHONPATH": str(ROOT), "GRPO_ACCEL_THREADS": str(args.threads)}
    side = ["--steps", str(args.steps), "--warmup", str(args.warmup), "--threads", str(args.threads),
            *(["--model", args.model] if args.model else [])]
    runs: dict[str, list[float]] = {}
    tokens: dict[str, list[float]] = {}  # each run's mean completion length, where the run reports it
    for round_ in range(args.rounds):
        out = subprocess.run([args.trl_python, __file__, "--side", "trl", *side], env=env, capture_output=True,
                             text=True, check=True, cwd=ROOT)
        results = {"TRL GRPOTrainer": json.loads(out.stdout.splitlines()[-1])}
        for name, root in commands if round_ % 2 == 0 else commands[::-1]:  # the order alternates between rounds
            results[name] = command_side(args.steps, args.warmup, env, args.model, root)
        for name in ("TRL GRPOTrainer", *(name for name, _ in commands)):
            runs.setdefault(name, []).append(results[name]["step_s"])
            if results[name]["completion_tokens_mean"] is not None:
                tokens.setdefault(name, []).append(results[name]["completion_tokens_mean"])
        for decoder in args.decoders if args.variants else []:
            with tempfile.NamedTemporaryFile(suffix=".json") as f:
                subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "bench.py"), "--size", "tiny", "--loop", *args.variants,
                                "--decoder", decoder, "--steps", str(args.steps), "--warmup", str(args.warmup),
                                "--prompts", str(WORK["prompts"]), "--group", str(WORK["group"]),
                                "--micro-batch", str(WORK["prompts"] * WORK["group"]),
                                "--max-new-tokens", str(WORK["max_new_tokens"]), "--kl-coef", str(WORK["kl_coef"]),
                                "--lr", str(WORK["lr"]), "--out", f.name], env=env, capture_output=True, check=True,
                               cwd=ROOT)
                for variant, r in json.loads(Path(f.name).read_text())["loop"].items():
                    runs.setdefault(f"grpo_accel {variant}, decoder {decoder}", []).append(r["step_s"])
    trl, width = statistics.median(runs["TRL GRPOTrainer"]), max(map(len, runs)) + 2
    sys.stdout.write(f"{'':<{width}}{'median step s':>14}{'x TRL':>8}{'tokens':>8}   per round (step s / tokens)\n")
    for name, values in runs.items():
        med, lengths = statistics.median(values), tokens.get(name)
        column = f"{statistics.mean(lengths):>8.1f}" if lengths else f"{'-':>8}"
        rounds = " ".join(f"{v:.4f}" + (f"/{t:.1f}" if lengths else "") for v, t in zip(values, lengths or values))
        sys.stdout.write(f"{name:<{width}}{med:>14.4f}{trl / med:>8.2f}{column}   {rounds}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
