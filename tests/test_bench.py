"""The benchmark runs and reports every number it promises (values are not judged here: it is not a test of speed)."""
import json
import subprocess
import sys

from launching import ROOT


def test_benchmark_reports_phases_mfu_and_overhead(tmp_path):
    out = tmp_path / "bench.json"
    proc = subprocess.run([sys.executable, "-m", "grpo_accel.bench", "--size", "1m", "--steps", "2", "--warmup", "1",
                           "--prompts", "2", "--group", "4", "--max-new-tokens", "8", "--micro-batch", "4",
                           "--out", str(out)], cwd=ROOT, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    result = json.loads(out.read_text())
    assert set(result["phase_median_s"]) == {"generate", "reward", "logprob_pass", "train", "bare_train"}
    assert all(v > 0 for v in result["phase_median_s"].values())
    assert 0 < result["mfu_train"] and 0 < result["mfu_bare"] and result["peak_flops"] > 0
    assert result["trainer_overhead"] > 0 and result["peak_memory_mb"] > 0
    assert result["parameters"] > 1e6 and "trainer overhead" in proc.stdout and "MFU train" in proc.stdout


def test_gpu_check_script_refuses_without_a_gpu():
    import torch

    if torch.cuda.is_available():
        return
    proc = subprocess.run(["bash", str(ROOT / "launch" / "gpu_check.sh")], capture_output=True, text=True,
                          env={"PYTHON": sys.executable, "PATH": "/usr/bin:/bin"})
    assert proc.returncode != 0 and "no CUDA device" in proc.stderr
