"""Benchmark: every phase of a GRPO step against its limit, on a chosen model size.

    python launch/bench/bench.py --size 10m --steps 3 --warmup 1 --fixed-length --items --out bench.json
    accelerate launch --config_file accelerate_configs/zero3.yaml launch/bench/bench.py --size 10m --warmup 3

Per step: generation (embedded engine), rewards, the forward-only logprob pass (pi_old, as with
num_epochs > 1), and the training phase (GRPOTrainer's optimisation of the batch). Reported: median and
spread of each phase, generated tokens/s, training tokens/s, the training phase's achieved FLOP/s
(6 x parameters x tokens) over the peak measured in the same run by a matmul of the model's dtype and hidden
size (the MFU, on CPU as on GPU), peak memory per process, and the trainer's overhead: its training phase
over a bare forward/backward/step loop on the same micro-batches in the same run. Runs under every
accelerate config; ``--items`` adds each speed item before/after (``launch/bench/bench_items.py``).

``--loop sync async async+worker`` instead times whole ``GRPOTrainer`` iterations (collect, score, train, push)
of each variant, alternating the variants over ``--rounds`` in one process (one process only). Every trainer here,
the phases' included, is the one ``launch/train.py`` builds from a config (``recipe.build.build_trainer``); only
the reference the trainer is measured against, ``BareLoop``, is written by hand, being the loop without the trainer:

    python launch/bench/bench.py --size tiny --loop sync async+worker --prompts 2 --group 4 --kl-coef 0.04 --lr 1e-4

Not a test: numbers only.
"""
from __future__ import annotations

import argparse
import copy
import json
import resource
import shutil
import statistics
import sys
import tempfile
import time

import torch

from bench_items import items_table, measure_items, timed  # this folder is on the path: run as a script

from grpo_accel import batch
from grpo_accel.embedded.decode import DECODERS

SIZES = {  # hidden, layers, heads, intermediate: built-in Llama sizes (random weights); "tiny": build_tiny_qwen2
    "tiny": None,
    "1m": (128, 4, 4, 512),
    "10m": (256, 8, 8, 1024),
    "30m": (512, 8, 8, 2048),
    "100m": (768, 12, 12, 3072),
    "500m": (1024, 30, 16, 4096),
}


def peak_flops(hidden: int, dtype: torch.dtype, device: torch.device, seconds: float = 1.0) -> float:
    """FLOP/s of a [4096, h] x [h, h] matmul in ``dtype``, best of repeated runs for about ``seconds``."""
    a = torch.randn(4096, hidden, device=device, dtype=dtype)
    b = torch.randn(hidden, hidden, device=device, dtype=dtype)
    best, deadline = float("inf"), time.perf_counter() + seconds
    while time.perf_counter() < deadline:
        _, elapsed = timed(lambda: [a @ b for _ in range(4)])
        best = min(best, elapsed / 4)
    return 2 * 4096 * hidden * hidden / best


class BareLoop:
    """The reference: forward, token logprobs, a policy-gradient loss, backward, clip, step. Nothing else.

    One optimizer step per micro-batch, as the benchmark's trainer takes (gradient_accumulation_steps=1).

    Its model is prepared like the trainer's: by Accelerate, or under DeepSpeed by an engine of its own built
    from the trainer's resolved DeepSpeed config (an Accelerator drives a single DeepSpeed engine).
    """

    def __init__(self, accelerator, model, optimizer, clip_norm: float = 1.0) -> None:
        self.accelerator, self.clip_norm = accelerator, clip_norm
        plugin = accelerator.state.deepspeed_plugin
        if plugin is None:
            self.model, self.optimizer = accelerator.prepare(model, optimizer)
            self.engine = None
        else:
            import deepspeed

            self.engine, *_ = deepspeed.initialize(model=model, optimizer=optimizer,
                                                   config=copy.deepcopy(plugin.deepspeed_config))
            self.model = self.engine

    def step(self, micro_batches, temperature: float = 1.0) -> None:
        from grpo_accel.loss.paths import shared_forward
        from grpo_accel.logprobs import sequence_logprobs

        for mb in micro_batches:
            mask = mb[batch.COMPLETION_MASK].float()
            logp = sequence_logprobs(self.model, mb[batch.PROMPT_IDS], mb[batch.PROMPT_MASK], mb[batch.COMPLETION_IDS],
                                     mb[batch.COMPLETION_MASK], temperature, forward=shared_forward)
            loss = -(logp * mb[batch.ADVANTAGES][:, None] * mask).sum() / mask.sum()
            if self.engine is not None:  # DeepSpeed clips (gradient_clipping) inside its step
                self.engine.backward(loss)
                self.engine.step()
            else:
                self.accelerator.backward(loss)
                self.accelerator.clip_grad_norm_(self.model.parameters(), self.clip_norm)
                self.optimizer.step()
                self.optimizer.zero_grad()


def run(args) -> dict | None:
    """Measure; the result on the main process, None on the others."""
    from grpo_accel.distributed import full_numel, launch_world_size, zero_stage
    from grpo_accel.recipe.build import build_trainer, close_parts
    from grpo_accel.rollout.collector import score_rollout
    from grpo_accel.runtime import start_process

    if (args.items or args.loop) and launch_world_size() > 1:
        raise SystemExit(f"launch/bench/bench.py: {'--items' if args.items else '--loop'} measures on one process; run it "
                         "without accelerate launch or with accelerate_configs/single_process.yaml.")
    threads, _ = start_process()
    dtype = getattr(torch, args.dtype)
    tokenizer, model = _tokenizer_and_model(args)
    model = model.to(dtype)
    n_params = sum(full_numel(p) for p in model.parameters())
    hidden = model.config.hidden_size
    folder = args.model or tempfile.mkdtemp(prefix="bench-model-")  # every trainer's model: the same weights
    if not args.model:
        model.save_pretrained(folder)
        tokenizer.save_pretrained(folder)
    made = [] if args.model else [folder]  # removed at the end
    if args.loop:
        result = {"size": args.model or args.size, "parameters": n_params, "threads": threads, "decoder": args.decoder,
                  "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens,
                  "kl_coef": args.kl_coef, "lr": args.lr, "steps": args.steps, "rounds": args.rounds,
                  "loop": loop(args, folder)}
        for path in made:
            shutil.rmtree(path, ignore_errors=True)
        return result
    # The trainer launch/train.py builds, without its extras; the phases are called on its parts one by one.
    out = tempfile.mkdtemp(prefix="bench-run-")
    made.append(out)
    trainer = build_trainer(_config(args, folder, out, [
        f"model.dtype={args.dtype}", f"loss.packing={str(args.packing).lower()}", f"trainer.total_frames={10**9}",
        *WITHOUT_EXTRAS]))
    accelerator, collector = trainer.accelerator, trainer.collector
    engine, rows, rewards = collector.engine, collector.rows, collector.rewards
    engine.settings.min_new_tokens = args.max_new_tokens if args.fixed_length else 0
    device = accelerator.device
    # The reference: a bare forward/backward/step loop on the same micro-batches, written here by hand because it
    # is what the trainer is measured against (no collector, replay buffer, hooks nor logging).
    from transformers import AutoModelForCausalLM

    bare_model = AutoModelForCausalLM.from_pretrained(folder, torch_dtype=dtype)
    bare = BareLoop(accelerator, bare_model, torch.optim.AdamW(bare_model.parameters(), lr=args.lr, fused=True))
    phases: dict[str, list[float]] = {k: [] for k in ("generate", "reward", "logprob_pass", "train", "bare_train")}
    tokens = {"generated": [], "trained": []}
    for step in range(args.warmup + args.steps):
        indices = [(step * args.prompts + i) % len(rows) for i in range(args.prompts)]
        prompts = [collector.prompts.ids[i] for i in indices]
        td, t_gen = timed(lambda: engine.generate(prompts, args.group, seeds=list(range(len(prompts)))))
        scores, t_rew = timed(lambda: score_rollout(td, [rows[i] for i in indices], collector.prompts.take(indices),
                                                       args.group, tokenizer, rewards))
        td.update(scores)
        td[batch.ADVANTAGES] = torch.randn(td.shape[0])
        td = td.to(device)
        _, t_lp = timed(lambda: torch.no_grad()(trainer.unwrapped_loss.add_old_logprobs)(batch.trim_padding(td)))
        trainer.replay_buffer.extend(td)
        micro = [mb.to(device) for mb in trainer.replay_buffer]  # the bare loop's micro-batches: the same rows
        _, t_train = timed(trainer.optimise)
        trainer.replay_buffer.empty()
        _, t_bare = timed(lambda: bare.step(micro))
        if step >= args.warmup:
            for name, value in zip(phases, (t_gen, t_rew, t_lp, t_train, t_bare)):
                phases[name].append(value)
            tokens["generated"].append(int(td[batch.COMPLETION_MASK].sum()))
            tokens["trained"].append(int(td[batch.COMPLETION_MASK].sum() + td[batch.PROMPT_MASK].sum()))
    peak = peak_flops(hidden, dtype, device)
    median = {k: statistics.median(v) for k, v in phases.items()}
    trained = statistics.median(tokens["trained"])
    flops_train = 6 * n_params * trained
    result = {
        "size": args.model or args.size, "parameters": n_params, "dtype": args.dtype, "device": str(device), "threads": threads,
        "processes": accelerator.num_processes, "distributed_type": accelerator.distributed_type.name,
        "zero_stage": zero_stage(accelerator), "packing": args.packing,
        "prompts": args.prompts, "group": args.group, "max_new_tokens": args.max_new_tokens, "steps": args.steps,
        "phase_median_s": median,
        "phase_spread_s": {k: [min(v), max(v)] for k, v in phases.items()},
        "generated_tokens_per_s": statistics.median(tokens["generated"]) / median["generate"],
        "train_tokens_per_s": trained / median["train"],
        "peak_flops": peak,
        "mfu_train": flops_train / median["train"] / peak,
        "mfu_bare": flops_train / median["bare_train"] / peak,
        "mfu_logprob_pass": 2 * n_params * trained / median["logprob_pass"] / peak,
        "trainer_overhead": median["train"] / median["bare_train"],
        "trainer_overhead_s": median["train"] - median["bare_train"],
        "peak_memory_mb_per_process": _peak_memory_per_process(accelerator, device),
    }
    if args.items:
        items = measure_items(trainer.unwrapped_loss.policy, engine, prompts, args.group, td, median,
                              device, threads)
        result["items"] = [it.to_json() for it in items]
    close_parts(trainer)
    for path in made:
        shutil.rmtree(path, ignore_errors=True)
    return result if accelerator.is_main_process else None


def _tokenizer_and_model(args):
    """(tokenizer, model): a saved model folder (``--model``) or a built-in size (random weights)."""
    from grpo_accel.tasks.tiny import TinyModelSpec, build_char_tokenizer, build_tiny_model, build_tiny_qwen2

    if args.model is not None:  # weights and tokenizer, e.g. from save_pretrained
        from grpo_accel.recipe.parts import build_tokenizer_and_model
        from grpo_accel.config.schema import ModelConfig

        return build_tokenizer_and_model(ModelConfig(name_or_path=args.model, dtype=args.dtype))
    tokenizer = build_char_tokenizer()
    if args.size == "tiny":
        return tokenizer, build_tiny_qwen2(tokenizer, seed=0)
    hidden, layers, heads, inter = SIZES[args.size]
    return tokenizer, build_tiny_model(tokenizer, TinyModelSpec(hidden, layers, heads, inter, max_positions=256), seed=0)


WITHOUT_EXTRAS = ["trainer.report_to=[]", "trainer.progress_bar=false", "trainer.log_samples=0",
                  "checkpoint.interval_frames=null"]
"""The launcher's extras off: trackers, the progress bar, logged samples, checkpoints."""
LOOP_VARIANTS = {
    "sync": WITHOUT_EXTRAS,
    "async": [*WITHOUT_EXTRAS, "trainer.async_collection=true"],
    "async+worker": [*WITHOUT_EXTRAS, "trainer.async_collection=true", "rollout.embedded_worker=true"],
    "launcher": [],
}
"""Each variant's settings on the loop's work, every trainer built by ``launch/train.py``'s builder
(``grpo_accel.recipe.build.build_trainer``): sync, async (``trainer.async_collection``) and async+worker
(``rollout.embedded_worker``) without the launcher's extras; launcher with every other setting default (TensorBoard,
progress, samples, checkpoints), on the same work as sync."""


def loop(args, folder: str) -> dict[str, dict]:
    """Whole GRPOTrainer iterations per variant: each round runs every variant for ``warmup + steps`` iterations
    from the same initial weights and seed; the step time is the wall time between iteration ends (the wait for
    a background batch included). Returns per variant: median step, generation and optimisation times, mean
    completion tokens, and the first iteration's time (compilation, worker start)."""
    times: dict[str, dict[str, list[float]]] = {
        v: {"step": [], "generate": [], "optimise": [], "tokens": [], "first": []} for v in args.loop}
    threads = torch.get_num_threads()
    for _ in range(args.rounds):
        for variant in args.loop:
            trainer, close = _loop_trainer(args, variant, folder)
            ends: list[float] = []
            trainer.register_op("post_iteration", lambda t: ends.append(time.perf_counter()), "bench_step_end")
            start = time.perf_counter()
            try:
                trainer.train()
            finally:
                close()
                torch.set_num_threads(threads)  # a decode worker's engine took half of them
            got = times[variant]
            got["first"].append(ends[0] - start)
            steps = [b - a for a, b in zip(ends[args.warmup:], ends[args.warmup + 1:])]
            got["step"] += steps
            measured = trainer.history[args.warmup + 1:]
            got["generate"] += [h["time/generate"] for h in measured]
            got["optimise"] += [h["time/iteration"] for h in measured]
            got["tokens"] += [h["train/completion_length_mean"] for h in measured]
    return {v: {"step_s": statistics.median(t["step"]), "steps_per_s": 1 / statistics.median(t["step"]),
                "generate_s": statistics.median(t["generate"]), "optimise_s": statistics.median(t["optimise"]),
                "completion_tokens_mean": statistics.mean(t["tokens"]), "first_iteration_s": statistics.median(t["first"]),
                "measured_steps": len(t["step"])} for v, t in times.items()}


def _config(args, folder: str, out: str, settings: list[str]):
    """The config of the benchmark's work: the saved model, the built-in addition task, its batch and lengths."""
    from grpo_accel.config.loading import load_config

    return load_config(None, [
        f"model.name_or_path={folder}", "data.max_operand=49", f"rollout.prompts_per_batch={args.prompts}",
        f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.max_new_tokens}",
        f"rollout.decoder={args.decoder}", f"loss.kl_coef={args.kl_coef}", f"optim.lr={args.lr}",
        f"trainer.micro_batch_completions={args.micro_batch}", "trainer.log_timings=true", f"output_dir={out}",
        *settings])


def _loop_trainer(args, variant: str, folder: str):
    """The trainer ``launch/train.py`` builds for the loop's work with ``variant``'s settings, in a fresh run folder;
    and what closes it."""
    from grpo_accel.recipe.build import build_trainer, close_parts

    out = tempfile.mkdtemp(prefix="bench-run-")
    frames = (args.warmup + args.steps + 1) * args.prompts * args.group
    trainer = build_trainer(_config(args, folder, out, [f"trainer.total_frames={frames}", *LOOP_VARIANTS[variant]]))

    def close() -> None:  # as launch/train.py does after train()
        close_parts(trainer)
        shutil.rmtree(out, ignore_errors=True)

    return trainer, close


def _peak_memory_per_process(accelerator, device: torch.device) -> list[float]:
    """Peak memory of each process in MB (CUDA allocator peak, or the resident-set high-water mark)."""
    mine = (torch.cuda.max_memory_allocated() / 2**20 if device.type == "cuda"
            else resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024)
    return [float(x) for x in accelerator.gather(torch.tensor([mine], device=device)).tolist()]


def table(result: dict) -> str:
    if "loop" in result:
        return loop_table(result)
    lines = [f"model {result['size']} ({result['parameters'] / 1e6:.1f}M params, {result['dtype']}, "
             f"{result['device']}, {result['threads']} threads), {result['prompts']} prompts x {result['group']} "
             f"per process, {result['processes']} process(es), {result['distributed_type']} ZeRO-"
             f"{result['zero_stage']}{', packed' if result['packing'] else ''}",
             f"{'phase':<14}{'median s':>10}{'min s':>10}{'max s':>10}"]
    for name, med in result["phase_median_s"].items():
        lo, hi = result["phase_spread_s"][name]
        lines.append(f"{name:<14}{med:>10.4f}{lo:>10.4f}{hi:>10.4f}")
    lines += [f"generated tokens/s {result['generated_tokens_per_s']:.0f}   training tokens/s "
              f"{result['train_tokens_per_s']:.0f}",
              f"MFU train {result['mfu_train']:.3f}   bare loop {result['mfu_bare']:.3f}   logprob pass "
              f"{result['mfu_logprob_pass']:.3f}   (peak {result['peak_flops'] / 1e9:.1f} GFLOP/s measured)",
              f"trainer overhead {result['trainer_overhead']:.3f} x bare Accelerate loop "
              f"({result['trainer_overhead_s'] * 1e3:+.1f} ms per batch)   peak memory per process "
              + " / ".join(f"{mb:.0f}" for mb in result["peak_memory_mb_per_process"]) + " MB"]
    if "items" in result:

        lines += ["", items_table(result["items"])]
    return "\n".join(lines)


def loop_table(result: dict) -> str:
    lines = [f"model {result['size']} ({result['parameters']:,} params, {result['threads']} threads), "
             f"{result['prompts']} prompts x {result['group']}, up to {result['max_new_tokens']} new tokens, kl_coef "
             f"{result['kl_coef']}, decoder {result['decoder']}, {result['rounds']} rounds x {result['steps']} steps",
             f"{'variant':<14}{'step s':>9}{'steps/s':>9}{'generate s':>12}{'optimise s':>12}{'tokens':>8}{'first s':>9}"]
    for name, r in result["loop"].items():
        lines.append(f"{name:<14}{r['step_s']:>9.4f}{r['steps_per_s']:>9.1f}{r['generate_s']:>12.4f}"
                     f"{r['optimise_s']:>12.4f}{r['completion_tokens_mean']:>8.1f}{r['first_iteration_s']:>9.2f}")
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--size", choices=list(SIZES), default="1m",
                        help="built-in size (random weights): tiny = the 82k Qwen2 of the TRL comparison, else Llama")
    parser.add_argument("--model", help="a model folder (weights + tokenizer) to benchmark instead of --size")
    parser.add_argument("--steps", type=int, default=5)
    parser.add_argument("--warmup", type=int, default=2)
    parser.add_argument("--prompts", type=int, default=8)
    parser.add_argument("--group", type=int, default=8)
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--micro-batch", type=int, default=64, help="completions per micro-batch")
    parser.add_argument("--fixed-length", action="store_true", help="generate exactly max-new-tokens per completion")
    parser.add_argument("--dtype", choices=["float32", "bfloat16"], default="float32")
    parser.add_argument("--packing", action="store_true", help="train with GRPOLoss(packing=True) (padding-free)")
    parser.add_argument("--items", action="store_true",
                        help="also measure each speed item before/after in this run (one process)")
    parser.add_argument("--decoder", choices=DECODERS, default="auto",
                        help="the embedded engine's decode path (rollout.decoder)")
    parser.add_argument("--loop", nargs="+", choices=LOOP_VARIANTS,
                        help="time whole trainer iterations of these variants instead of the phases")
    parser.add_argument("--rounds", type=int, default=1, help="--loop: alternate the variants this many times")
    parser.add_argument("--kl-coef", type=float, default=0.0, help="KL weight (> 0 adds the reference pass)")
    parser.add_argument("--lr", type=float, default=1e-5, help="AdamW learning rate")
    parser.add_argument("--out", help="write the result as JSON here")
    args = parser.parse_args(argv)
    result = run(args)
    if result is None:  # not the main process
        return 0
    sys.stdout.write(table(result) + "\n")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=2)
    return 0


if __name__ == "__main__":
    from grpo_accel.runtime.signals import exit_skipping_teardown

    exit_skipping_teardown(main())
