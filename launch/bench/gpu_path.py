"""The GPU path's figures (issue 56), one JSON line each: generation against transformers' two non-vLLM paths, the
training phase's tokens/s and MFU in bf16 with gradient checkpointing, and the ZeRO-3 path's peak GPU memory.

    bash launch/bench/gpu_check.sh path        # all three on Qwen2.5-0.5B- and 1.5B-shaped models, < 8 minutes
    python launch/bench/gpu_path.py generate --sizes 0.5b 1.5b
    python launch/bench/gpu_path.py train --sizes 0.5b
    accelerate launch --config_file accelerate_configs/zero3.yaml --num_processes 1 launch/bench/gpu_path.py memory

Models are built from a config in code (random weights, the shapes of Qwen2.5-0.5B and -1.5B: a 151,936-token
vocabulary, tied embeddings) and saved to a temporary folder where a section trains them; prompts are random
tokens. ``generate``: ``--completions`` completions (``--group`` per prompt) of exactly ``--new-tokens`` tokens
(EOS is never sampled: it is masked) from ``--prompt-tokens``-token prompts, by the embedded engine
(``rollout.decoder=auto``, what a run uses), by transformers' ``generate`` (static-shape batch, its default cache)
and by transformers' continuous batching (``generate_batch``: paged attention, CUDA graphs; TRL 1.16's
``use_transformers_continuous_batching``); each warmed up once, then the median of ``--repeats``. ``train``: the
trainer's training phase on 64 completions x 512 tokens (``launch/bench/bench.py`` on the saved model: the
trainer ``launch/train.py`` builds, defaults left to follow the GPU: bf16 autocast, gradient checkpointing), its
tokens/s and MFU against the chip's bf16 peak (989 TFLOP/s dense on an H100/H200 SXM) and against a matmul
measured in the same run. ``memory``: ``torch.cuda.max_memory_allocated`` over two whole GRPO iterations of the
trainer ``launch/train.py`` builds, with and without gradient checkpointing (launch it under ZeRO-3).

On a CPU the same sections run (``--sizes tiny``, float32): tests/launched/test_bench.py keeps them working.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing

SHAPES = {  # Qwen2Config arguments
    "tiny": dict(vocab_size=512, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                 num_key_value_heads=2),
    "0.5b": dict(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                 num_attention_heads=14, num_key_value_heads=2),
    "1.5b": dict(vocab_size=151936, hidden_size=1536, intermediate_size=8960, num_hidden_layers=28,
                 num_attention_heads=12, num_key_value_heads=2),
}
BF16_PEAK = {"H100": 989.4e12, "H200": 989.4e12, "H800": 989.4e12, "A100": 312e12, "L40S": 362e12}
"""Dense bf16 tensor-core peak FLOP/s by the name in ``torch.cuda.get_device_name()`` (SXM parts; the vendors'
data sheets)."""


def device() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device()) if torch.cuda.is_available() else torch.device("cpu")


def build(size: str):
    """(tokenizer, model) of ``size``: the built-in character tokenizer (its pad and EOS ids) and a Qwen2 with
    random weights, bf16 on a GPU, float32 on a CPU."""
    from transformers import Qwen2Config, Qwen2ForCausalLM

    from grpo_accel.tasks.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = Qwen2Config(**SHAPES[size], tie_word_embeddings=True, max_position_embeddings=4096,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    dtype = torch.bfloat16 if device().type == "cuda" else torch.float32
    torch.manual_seed(0)
    with torch.device(device()):
        model = Qwen2ForCausalLM(config).to(dtype)
    return tokenizer, model.eval()


def parameters(model) -> int:
    return sum(p.numel() for p in model.parameters())


def synced(fn):
    """(result, seconds) of ``fn()``, the GPU's queue drained before and after."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    start = time.perf_counter()
    out = fn()
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    return out, time.perf_counter() - start


# ------------------------------------------------------------------------------------------------- generate

def generation_paths(model, tokenizer, args) -> dict:
    """Each generation path: a callable drawing the section's completions and returning how many tokens it made."""
    from transformers import GenerationConfig

    from grpo_accel.embedded.engine import EmbeddedEngine

    prompts_n = args.completions // args.group
    generator = torch.Generator().manual_seed(0)
    prompts = torch.randint(10, model.config.vocab_size, (prompts_n, args.prompt_tokens), generator=generator)
    rows = prompts.repeat_interleave(args.group, 0).to(device())  # [completions, prompt_tokens]
    never_eos = [[tokenizer.eos_token_id]]  # masked: every completion runs to the budget
    engine = EmbeddedEngine(model, tokenizer, max_new_tokens=args.new_tokens)
    engine.settings.min_new_tokens = args.new_tokens

    def embedded() -> int:
        td = engine.generate(prompts.tolist(), args.group, seeds=list(range(prompts_n)))
        return int(td["completion_mask"].sum())

    def generate() -> int:
        out = model.generate(input_ids=rows, attention_mask=torch.ones_like(rows), do_sample=True,
                             max_new_tokens=args.new_tokens, min_new_tokens=args.new_tokens, bad_words_ids=never_eos,
                             pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
        return int(out[:, rows.shape[1]:].numel())

    config = GenerationConfig(max_new_tokens=args.new_tokens, do_sample=True, eos_token_id=-1,  # no id ends one
                              pad_token_id=tokenizer.pad_token_id)

    def continuous() -> int:
        out = model.generate_batch(inputs=rows.tolist(), generation_config=config)
        return sum(len(o.generated_tokens) for o in out.values())

    paths = {"embedded": embedded, "generate": generate, "continuous_batching": continuous}
    return {name: paths[name] for name in args.methods}


def section_generate(args) -> None:
    for size in args.sizes:
        tokenizer, model = build(size)
        result = {"section": "generate", "size": size, "parameters": parameters(model), "device": str(device()),
                  "completions": args.completions, "prompt_tokens": args.prompt_tokens, "new_tokens": args.new_tokens}
        for name, path in generation_paths(model, tokenizer, args).items():
            _, first = synced(path)  # compilation, CUDA graph capture, the paged cache's allocation
            runs = [synced(path) for _ in range(args.repeats)]
            seconds = statistics.median(s for _, s in runs)
            result[name] = {"tokens": runs[0][0], "seconds": round(seconds, 4), "first_seconds": round(first, 2),
                            "tokens_per_s": round(runs[0][0] / seconds, 1)}
        fastest = max(args.methods, key=lambda n: result[n]["tokens_per_s"])
        result["fastest"] = fastest
        print(json.dumps(result), flush=True)
        del model
        if torch.cuda.is_available():
            torch.cuda.empty_cache()


# --------------------------------------------------------------------------------------------- train, memory

def saved(size: str, folder: Path) -> Path:
    tokenizer, model = build(size)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def section_train(args) -> None:
    """launch/bench/bench.py's phases on the saved model: the training phase of the trainer launch/train.py builds
    (bf16 autocast and gradient checkpointing follow the GPU), 64 completions x 512 tokens."""
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import bench

    for size in args.sizes:
        with tempfile.TemporaryDirectory(prefix="gpu-path-") as tmp:
            folder = saved(size, Path(tmp) / "model")
            out = Path(tmp) / "bench.json"
            dtype = "bfloat16" if device().type == "cuda" else "float32"
            bench.main(["--model", str(folder), "--dtype", dtype, "--steps", str(args.repeats), "--warmup", "1",
                        "--prompts", str(args.completions // args.group), "--group", str(args.group),
                        "--max-new-tokens", str(args.train_tokens), "--fixed-length",
                        "--micro-batch", str(args.micro_batch), "--out", str(out)])
            got = json.loads(out.read_text())
        peak = next((v for k, v in BF16_PEAK.items() if k in torch.cuda.get_device_name()), None) \
            if torch.cuda.is_available() else None
        flops = 6 * got["parameters"] * got["train_tokens_per_s"]
        print(json.dumps({"section": "train", "size": size, "parameters": got["parameters"], "device": got["device"],
                          "completions": args.completions, "completion_tokens": args.train_tokens,
                          "train_s": round(got["phase_median_s"]["train"], 4),
                          "train_tokens_per_s": round(got["train_tokens_per_s"], 1),
                          "mfu_vs_bf16_peak": round(flops / peak, 4) if peak else None,
                          "mfu_vs_measured_matmul": round(got["mfu_train"], 4),
                          "generated_tokens_per_s": round(got["generated_tokens_per_s"], 1),
                          "peak_memory_mb": got["peak_memory_mb_per_process"]}), flush=True)


def section_memory(args) -> None:
    """Two whole GRPO iterations of the trainer launch/train.py builds, under the launch's accelerate config (ZeRO-3
    on one GPU in gpu_check.sh), with ``--gradient-checkpointing``: the peak GPU memory. The model is saved once in
    ``--folder``/SIZE (by the first process; the others wait for it)."""
    from grpo_accel.distributed import first_process, zero_stage
    from grpo_accel.recipe.build import build_trainer, close_parts
    from grpo_accel.config.loading import load_config

    size = args.sizes[0]
    folder = Path(args.folder) / size
    if first_process() and not (folder / "config.json").exists():
        saved(size, folder)
    while not (folder / "config.json").exists():
        time.sleep(0.5)
    cfg = load_config(None, [
        f"model.name_or_path={folder}", f"output_dir={Path(args.folder) / f'run-{size}-{args.gradient_checkpointing}'}",
        "overwrite=true", "data.max_operand=49", f"rollout.prompts_per_batch={args.completions // args.group}",
        f"rollout.group_size={args.group}", f"rollout.max_new_tokens={args.train_tokens}",
        f"trainer.micro_batch_completions={args.micro_batch}", f"trainer.total_frames={2 * args.completions}",
        "trainer.report_to=[]", "trainer.progress_bar=false", "checkpoint.interval_frames=null",
        "trainer.log_samples=0", f"model.gradient_checkpointing={args.gradient_checkpointing}"])
    trainer = build_trainer(cfg)
    trainer.train()
    close_parts(trainer)
    peak = torch.cuda.max_memory_allocated() / 2**20 if torch.cuda.is_available() else None
    if trainer.accelerator.is_main_process:
        print(json.dumps({"section": "memory", "size": size, "zero_stage": zero_stage(trainer.accelerator),
                          "processes": trainer.accelerator.num_processes, "mixed_precision": cfg.trainer.mixed_precision,
                          "gradient_checkpointing": cfg.model.gradient_checkpointing, "peak_gpu_mb": peak,
                          "iterations": trainer.iterations, "completions": args.completions,
                          "completion_tokens": args.train_tokens}), flush=True)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("section", choices=["generate", "train", "memory"])
    parser.add_argument("--sizes", nargs="+", choices=list(SHAPES), default=["0.5b", "1.5b"])
    parser.add_argument("--completions", type=int, default=64)
    parser.add_argument("--group", type=int, default=8, help="completions per prompt")
    parser.add_argument("--prompt-tokens", type=int, default=128, help="generate: tokens per prompt")
    parser.add_argument("--new-tokens", type=int, default=256, help="generate: tokens per completion")
    parser.add_argument("--train-tokens", type=int, default=512, help="train, memory: tokens per completion")
    parser.add_argument("--micro-batch", type=int, default=16, help="train, memory: completions per micro-batch")
    parser.add_argument("--repeats", type=int, default=2, help="timed runs after the warm-up")
    parser.add_argument("--folder", default="runs/gpu_path", help="memory: where the model and its run are saved")
    parser.add_argument("--gradient-checkpointing", choices=["true", "false"], default="true", help="memory")
    parser.add_argument("--methods", nargs="+", default=["embedded", "generate", "continuous_batching"],
                        choices=["embedded", "generate", "continuous_batching"], help="generate: the paths to time")
    args = parser.parse_args(argv)
    {"generate": section_generate, "train": section_train, "memory": section_memory}[args.section](args)
    return 0


if __name__ == "__main__":
    sys.exit(main())
