"""The benchmark runs and reports every number it promises (values are not judged here: it is not a test of speed).

One-process runs call launch/bench/bench.py's ``main`` in this process (a subprocess adds only ~4 s of imports); the
multi-process run is a real ``accelerate launch``."""
import json
import re
import subprocess
import sys

import pytest

from launching import ROOT, launch
from trainer_utils import main_in_process

BENCH = str(ROOT / "launch" / "bench" / "bench.py")
SMALL = ["--size", "1m", "--steps", "2", "--warmup", "1", "--prompts", "2", "--group", "4", "--max-new-tokens", "8",
         "--micro-batch", "4"]
ITEMS = {"old logprobs from the rollout", "no reference pass at kl_coef=0", "micro-batch trimmed to its longest row",
         "padding-free packed training", "chunked logprobs: peak memory", "chunked logprobs: time",
         "generation batched over prompts x group", "decode loop (rollout.decoder=fast)",
         "episodes' later turns: prompt prefilled once", "generation stops when all finished",
         "torch threads from the cores", "decode loop in inference mode", "fused AdamW step", "decode loop's lean forward",
         "decode loop's fused projections", "decode loop's C step", "decode loop's packed weights", "shared prompts, the rollout's prompts", "shared prompts, prompts 8x longer"}


def check_result(result: dict, processes: int) -> None:
    assert set(result["phase_median_s"]) == {"generate", "reward", "logprob_pass", "train", "bare_train"}
    assert all(v > 0 for v in result["phase_median_s"].values())
    assert 0 < result["mfu_train"] and 0 < result["mfu_bare"] and result["peak_flops"] > 0
    assert result["trainer_overhead"] > 0
    assert result["processes"] == processes and len(result["peak_memory_mb_per_process"]) == processes
    assert all(mb > 0 for mb in result["peak_memory_mb_per_process"])


def bench(capsys, tmp_path, *args) -> tuple[dict, str]:
    """launch/bench/bench.py's ``main(args)`` in this process: its JSON result and what it printed."""
    out = tmp_path / "bench.json"
    assert main_in_process("bench", [*args, "--out", str(out)]) == 0
    return json.loads(out.read_text()), capsys.readouterr().out


def test_benchmark_reports_phases_mfu_overhead_and_speed_items(tmp_path, capsys, monkeypatch):
    monkeypatch.setattr("grpo_accel.embedded.packed.PACK_MIN_BYTES", 0)  # the 1m model packed too: its row is shown
    result, printed = bench(capsys, tmp_path, *SMALL, "--items")
    check_result(result, processes=1)
    assert 1e6 < result["parameters"] < 2e6  # the 1m built-in size
    assert "trainer overhead" in printed and "MFU train" in printed and "speed item" in printed
    items = {it["name"]: it for it in result["items"]}
    assert set(items) == ITEMS and all(it["before"] > 0 and it["after"] > 0 for it in items.values())
    memory = items["chunked logprobs: peak memory"]  # memory, unlike time, is not noise: the copy must be gone
    assert memory["unit"] == "MB" and memory["after"] < 0.6 * memory["before"], memory
    width = [int(re.search(r"(\d+)-token prompts", items[f"shared prompts, {name}"]["how"]).group(1))
             for name in ("the rollout's prompts", "prompts 8x longer")]
    assert width[1] == 8 * width[0], width


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory, tokenizer):
    """The built-in tiny Llama (0.1M parameters) saved with its tokenizer."""
    from grpo_accel.tasks.tiny import build_tiny_model

    folder = tmp_path_factory.mktemp("model")
    build_tiny_model(tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_benchmark_runs_under_accelerate_launch_with_zero3(tmp_path, model_folder):
    """ZeRO-3 (what the multi-process numbers in the README are); DDP runs the same code with stage 0."""
    out = tmp_path / "bench.json"
    proc = launch("zero3.yaml", [*SMALL, "--model", str(model_folder), "--packing", "--out", str(out)],
                  script=(BENCH,))
    result = json.loads(out.read_text())
    check_result(result, processes=2)
    assert result["zero_stage"] == 3 and result["packing"] is True
    assert proc.stdout.count("trainer overhead") == 1  # the main process reports


def test_benchmark_takes_a_model_folder(tmp_path, model_folder, capsys):
    from transformers import AutoModelForCausalLM

    result, _ = bench(capsys, tmp_path, *SMALL, "--model", str(model_folder), "--decoder", "generate")
    check_result(result, processes=1)
    assert result["size"] == str(model_folder)
    assert result["parameters"] == AutoModelForCausalLM.from_pretrained(model_folder).num_parameters()


def test_loop_times_whole_iterations_of_each_variant(tmp_path, capsys):
    """The launcher row is launch/train.py's trainer (recipe-built, defaults) on the sync row's work: the same
    weights, prompts and keys, so the same completions."""
    result, printed = bench(capsys, tmp_path, "--size", "tiny", "--loop", "sync", "async",
                            "async+worker", "launcher", "--steps", "3", "--warmup", "1", "--prompts", "2", "--group", "2",
                            "--max-new-tokens", "12", "--micro-batch", "4", "--kl-coef", "0.04", "--lr", "1e-4")
    assert result["parameters"] == 82496 and result["kl_coef"] == 0.04  # the TRL comparison's Qwen2
    assert list(result["loop"]) == ["sync", "async", "async+worker", "launcher"]
    for variant in result["loop"].values():
        assert variant["measured_steps"] == 3 and 0 < variant["generate_s"] and 0 < variant["step_s"]
        assert 1 <= variant["completion_tokens_mean"] <= 12
    assert result["loop"]["launcher"]["completion_tokens_mean"] == result["loop"]["sync"]["completion_tokens_mean"]
    assert "async+worker" in printed and "launcher" in printed and "steps/s" in printed


def test_items_refuse_several_processes(monkeypatch):
    monkeypatch.syspath_prepend(str(ROOT / "launch" / "bench"))
    from bench import main

    monkeypatch.setenv("WORLD_SIZE", "2")  # what accelerate launch sets in each of 2 processes
    with pytest.raises(SystemExit, match="--items measures on one process"):
        main([*SMALL, "--items"])


@pytest.mark.skipif(__import__("torch").cuda.is_available(), reason="checks the refusal on a machine without a GPU")
def test_gpu_check_script_refuses_without_a_gpu():
    def run(*args):
        return subprocess.run(["bash", str(ROOT / "launch" / "bench" / "gpu_check.sh"), *args], capture_output=True, text=True,
                              env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"}, timeout=120)

    bench, sglang, other = run("bench"), run("sglang"), run("nonsense")
    for needs_cuda in (bench, run("gsm8k"), run("shared"), run("path")):
        assert needs_cuda.returncode != 0 and "no CUDA device" in needs_cuda.stderr
    assert sglang.returncode != 0 and "FAIL  no GPU (nvidia-smi lists none)" in sglang.stdout
    assert other.returncode == 2 and "usage: bash launch/bench/gpu_check.sh bench|sglang|gsm8k|shared|path" in other.stderr


GPU_PATH = str(ROOT / "launch" / "bench" / "gpu_path.py")
TINY_WORK = ["--sizes", "tiny", "--completions", "8", "--group", "4", "--micro-batch", "8", "--repeats", "1"]


def sections(output: str) -> list[dict]:
    return [json.loads(line) for line in output.splitlines() if line.startswith('{"section"')]


def test_the_gpu_paths_figures_run_on_a_cpu(tmp_path):
    """gpu_check.sh path's sections, small, on this CPU (they have never run on a GPU here: what it prints there is
    the figure): each path generates exactly its tokens, the training phase reports its MFU, the memory section
    runs the built trainer under ZeRO-3. Continuous batching takes ~25 s to start on a CPU, so it is left to the
    GPU."""
    def run(*args):
        proc = subprocess.run([sys.executable, GPU_PATH, *args, *TINY_WORK], capture_output=True, text=True,
                              cwd=ROOT, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        return sections(proc.stdout)

    [generated] = run("generate", "--prompt-tokens", "8", "--new-tokens", "8", "--methods", "embedded", "generate")
    assert generated["embedded"]["tokens"] == generated["generate"]["tokens"] == 8 * 8  # every completion at its budget
    assert generated["fastest"] in ("embedded", "generate")
    [trained] = run("train", "--train-tokens", "8")
    assert trained["train_tokens_per_s"] > 0 and trained["mfu_vs_measured_matmul"] > 0
    proc = launch("zero3.yaml", ["memory", *TINY_WORK, "--train-tokens", "8", "--folder", str(tmp_path)],
                  launcher_args=["--num_processes", "1"], script=(GPU_PATH,))
    [memory] = sections(proc.stdout)
    assert memory["zero_stage"] == 3 and memory["iterations"] == 2 and memory["gradient_checkpointing"] is True


def test_the_trl_comparison_reads_a_runs_steps_from_its_event_files(tmp_path, monkeypatch):
    """launch/bench/trl_parity.py times the README's command by the wall times of its TensorBoard events."""
    import time

    from grpo_accel.reporting.event_files import TensorBoardLogger

    monkeypatch.syspath_prepend(str(ROOT / "launch" / "bench"))
    from trl_parity import step_gaps

    logger = TensorBoardLogger(tmp_path)
    for step in range(1, 6):
        logger.log_scalars({"train/reward_mean": 0.5, "train/loss": 1.0}, step)
        time.sleep(0.1 * step)
    logger.close()
    gaps = step_gaps(tmp_path, warmup=1)
    assert len(gaps) == 3 and all(0.1 * k <= g < 0.1 * k + 0.5 for k, g in zip((2, 3, 4), gaps)), gaps  # after warmup


def test_the_overlap_table_reads_each_batch_from_its_event_files(tmp_path, monkeypatch):
    """launch/bench/overlap.py: a step is the gap between two iterations' logs, training is the iteration less its
    push, the overlap is the median of step / max(generation, training), the push's share the median of push /
    step; the warmup's batches are left out."""
    import time

    from grpo_accel.reporting.event_files import TensorBoardLogger

    monkeypatch.syspath_prepend(str(ROOT / "launch" / "bench"))
    from overlap import batch_times, summary

    logger = TensorBoardLogger(tmp_path)
    logged = [(0.5, 0.05, 0.1, 0.02), (0.2, 0.10, 0.2, 0.05), (0.3, 0.30, 0.1, 0.05), (0.25, 0.1, 0.15, 0.0)]
    for step, (wait, generate, iteration, push) in enumerate(logged, start=1):
        time.sleep(wait)
        logger.log_scalars({"time/generate": generate, "time/iteration": iteration, "time/weight_sync": push}, step)
    logger.close()
    times = batch_times(tmp_path, warmup=1)
    assert times["generate"] == pytest.approx([0.3, 0.1], abs=1e-6) and times["push"] == pytest.approx([0.05, 0.0])
    assert times["train"] == pytest.approx([0.05, 0.15], abs=1e-6)  # the iteration less its push
    assert all(w <= g < w + 0.3 for w, g in zip((0.3, 0.25), times["step"])), times["step"]  # gaps after the warmup
    s = summary(times)
    steps = times["step"]
    assert s["overlap"] == pytest.approx((steps[0] / 0.3 + steps[1] / 0.15) / 2, rel=1e-5)
    assert s["push_share"] == pytest.approx((0.05 / steps[0] + 0.0) / 2, rel=1e-5) and s["batches"] == 2


def test_the_overlap_measurement_runs_each_mode_and_transport(tmp_path):
    """launch/bench/overlap.py end to end, small: the README's command against a fresh --kv-cache stand-in, once
    synchronous pushing over a gloo group and once asynchronous pushing through the disk (each mode and each
    transport once, as the script runs them; every pairing trains in tests/on_sglang); every batch pushed weights."""
    for mode, method in (("sync", "distributed"), ("async", "disk")):
        out = tmp_path / f"overlap-{mode}.json"
        run = subprocess.run([sys.executable, str(ROOT / "launch" / "bench" / "overlap.py"), "--steps", "2",
                              "--warmup", "1", "--modes", mode, "--methods", method, "--out", str(out)],
                             capture_output=True, text=True, cwd=ROOT, timeout=600)
        assert run.returncode == 0, run.stderr[-3000:]
        results = json.loads(out.read_text())
        assert list(results) == [f"{mode}, {method}"]
        for name, r in results.items():
            assert r["batches"] == 2 and min(r["per_batch"]["push"]) > 0, name
            assert r["generate_s"] > 0 and r["train_s"] > 0 and 0 < r["push_share"] < 1, name
            assert name in run.stdout, run.stdout  # the printed table has a row for the run


def test_the_trl_comparison_runs_the_readme_command_from_a_baseline_checkout(tmp_path, monkeypatch, capsys):
    """``--baseline``: the README's command from another checkout (its launch/train.py and accelerate config, this
    environment's accelerate, that checkout first on the path), timed as this one's; a folder without
    launch/train.py is refused by name."""
    import os
    from pathlib import Path

    monkeypatch.syspath_prepend(str(ROOT / "launch" / "bench"))
    import trl_parity

    command = trl_parity.readme_command("m", tmp_path / "out", 3, root=tmp_path)
    assert command[0] == str(Path(sys.executable).parent / "accelerate")
    assert command[3:5] == [str(tmp_path / "accelerate_configs" / "single_process.yaml"), str(tmp_path / "launch" / "train.py")]
    result = trl_parity.command_side(2, 0, {**os.environ, "GRPO_ACCEL_THREADS": "1"}, None, root=ROOT)
    assert result["step_s"] > 0 and 0 < result["completion_tokens_mean"] <= 32
    with pytest.raises(SystemExit):
        trl_parity.main(["--trl-python", sys.executable, "--baseline", str(tmp_path)])
    assert f"--baseline {tmp_path}: no launch/train.py there" in capsys.readouterr().err


def test_the_memory_table_measures_each_phase_of_each_process(model_folder, monkeypatch, capsys):
    """launch/bench/memory.py, small: 2 processes under ZeRO-3 (every config of --configs runs the same code under
    its own accelerate config) train the tiny Llama against an SGLang stand-in; every process reports its load,
    steady-training and first-push peaks, and the push's gather holds at most one bucket's weights at a time (0.05
    MB at bfloat16, of a 0.4 MB model): gathered at float32 (twice the bucket) and their bfloat16 copies (once)."""
    monkeypatch.syspath_prepend(str(ROOT / "launch" / "bench"))
    from memory import main

    bucket_mb = 0.05
    results = main(["--model", str(model_folder), "--processes", "2", "--batches", "2", "--bucket-mb",
                    str(bucket_mb), "--configs", "zero3"])
    assert list(results) == ["zero3"]
    ranks = results["zero3"]
    assert [r["rank"] for r in ranks] == [0, 1]
    assert all(0 < r["load"] <= r["steady"] and r["push"] > 0 for r in ranks), ranks
    assert all(0 < r["push_reported"] <= 3 * bucket_mb * 1e6 for r in ranks), ranks
    assert "| `zero3.yaml` | 1 |" in capsys.readouterr().out


def test_the_conversion_table_measures_each_resumed_process(model_folder, monkeypatch, capsys):
    """launch/bench/convert.py, small: the tiny Llama saved by 2 processes under ZeRO-3 and resumed by 1; the main
    process converts (its seconds and the portable form's bytes), every process reports its memory."""
    monkeypatch.syspath_prepend(str(ROOT / "launch" / "bench"))
    from convert import main

    results = main(["--model", str(model_folder), "--cases", "zero3:2:1"])
    [line] = results["zero3:2:1"]
    assert line["rank"] == 0 and 0 < line["built"] <= line["load_peak"] and line["convert_s"] > 0
    assert 3 * 4 * 84544 <= line["portable_bytes"] < 2e6  # fp32 weights and two moments of 84,544 parameters
    assert "| zero3, 2 -> 1 processes | 0 |" in capsys.readouterr().out
