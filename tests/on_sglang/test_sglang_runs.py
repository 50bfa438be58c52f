"""GRPO runs that sample from and sync weights to the SGLang stand-in (launch/bench/sglang_standin): ZeRO-3 with and
without LoRA, the disk path, a sync that keeps failing and its resume, an unreachable server, launch/sglang.sh.
The helpers here (a run's arguments, the weights a run ends with) serve test_sglang_load.py too."""
import json
import os
import subprocess

import pytest
import torch

from grpo_accel.http import ServerError
from launching import ROOT, TINY_FOLDER, free_port, launch
from sglang_standin.source import VERSIONS
from sglang_standin.processes import NEWEST, fail_next, server_state
from trainer_utils import train_in_process


def sglang_args(out, url, model_dir, *extra) -> list[str]:
    """launch/train.py's arguments for a small run that samples from the stand-in at ``url`` and syncs to it."""
    return [f"output_dir={out}", f"model.name_or_path={model_dir}", "rollout.backend=sglang", f"rollout.urls=[{url}]",
            "weight_sync.backend=gloo", "weight_sync.dtype=float32", "weight_sync.bucket_mb=0.05",
            "trainer.total_frames=384", "trainer.micro_batch_completions=64", "trainer.progress_bar=false",
            "checkpoint.interval_frames=null", *TINY_FOLDER, *extra]  # weight_sync.master_port: null, a free one


def final_policy(out):
    """The run's final weights as the engine serves them (a LoRA run's merged), by name."""
    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.lora import merged_model
    from grpo_accel.run.export import load_policy

    return merged_model(load_policy(Checkpoint(out / "checkpoints").complete()[-1])).state_dict()


def assert_server_holds_checkpoint(url, out):
    trained_weights = final_policy(out)
    for name, value in server_state(url)["params"].items():
        assert torch.equal(torch.tensor(value), trained_weights[name]), name  # float32 sync: bitwise


@pytest.mark.parametrize("version, load_format, lora", [(NEWEST, "per_tensor", ()),
                                                   (VERSIONS[0], "flattened_bucket", ("model.lora.r=4",))])
def test_zero3_grpo_run_keeps_the_server_weights_equal_to_the_trainer(tmp_path, model_dir, fresh_server, version,
                                                                      load_format, lora, monkeypatch, capsys):
    """Both load formats, with (0.5.23) and without (0.5.9) the update session, each through a refused update; the
    other two pairings run in-process above. The LoRA run pushes base + alpha/r * B A under the base names."""
    url, out = fresh_server(version), tmp_path / "run"
    fail_next(url, "/update_weights_from_distributed", "refuse")
    proc = launch("zero3.yaml", sglang_args(out, url, model_dir, f"weight_sync.load_format={load_format}", *lora))
    state = server_state(url)
    assert_server_holds_checkpoint(url, out)
    monkeypatch.syspath_prepend(str(ROOT / "launch" / "bench"))
    from check_sglang import main as check_sglang  # launch/bench/gpu_check.sh's verdicts, here on the stand-in

    capsys.readouterr()
    assert check_sglang(["--url", url, "--run", str(out)]) == 0
    verdicts = capsys.readouterr().out
    assert "pushing everything again" in proc.stderr
    assert state["weight_version"] == "3" and state["loads"] > 3 and state["groups"] == []
    assert [line.split()[:2] for line in verdicts.splitlines() if line[:4] in ("PASS", "FAIL", "SKIP")] == [
        ["PASS", "release:"], ["PASS", "weight"], ["PASS", "weights:"], ["PASS", "generations:"]], verdicts
    from grpo_accel.reporting.event_files import read_scalars

    versions = [v for _, v in read_scalars(out / "tensorboard")["train/weight_version_mean"]]
    assert versions == [0.0, 1.0, 2.0], "each batch was generated with the weights pushed after the previous one"
    checked = [body["name"] for path, body in state["requests"] if path == "/get_weights_by_name"]
    smallest_trained = (["model.layers.0.self_attn.q_proj.weight", "model.layers.0.self_attn.k_proj.weight"] if lora
                        else ["model.layers.0.input_layernorm.weight", "model.layers.0.post_attention_layernorm.weight"])
    assert checked[1:3] == smallest_trained  # a LoRA run's merged targets, else the first layer's norms
    assert len(checked) == 1 + 6, "asked once if it works; ZeRO-3 shards gathered and checked after every push"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["zero_stage"] == 3 and 0 < summary["weight_sync_peak_extra_bytes"] <= 2 * 0.05 * 2**20
    if lora:  # the adapter trained, and what the server holds is the merge, not the base
        from safetensors.torch import load_file

        base = load_file(str(model_dir / "model.safetensors"))["model.layers.0.self_attn.q_proj.weight"]
        served = torch.tensor(state["params"]["model.layers.0.self_attn.q_proj.weight"])
        assert not torch.equal(served, base)


def test_disk_path(tmp_path, model_dir, fresh_server):
    """In this process (one process: the launched runs above and below cover several)."""
    url, out = fresh_server(), tmp_path / "run"
    train_in_process(sglang_args(out, url, model_dir, "weight_sync.method=disk",
                                              "trainer.micro_batch_completions=128"))
    state = server_state(url)
    assert_server_holds_checkpoint(url, out)
    assert state["weight_version"] == "3" and state["loads"] == 3
    assert len(list((out / "weights").glob("version_*"))) == 2  # older pushes are deleted


def test_a_sync_that_keeps_failing_stops_with_a_checkpoint_and_the_resume_pushes_first(tmp_path, model_dir,
                                                                                       fresh_server):
    """Under ZeRO-2 (2 processes): the first push fails twice, so the run stops with an error and a checkpoint
    after batch 1, every process together; its resume pushes that checkpoint's weights (one failed bucket,
    pushed again) before it generates batch 2."""
    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.reporting.event_files import read_scalars

    url, out = fresh_server(), tmp_path / "run"
    fail_next(url, "/update_weights_from_distributed", times=2)
    failed = launch("zero2.yaml", sglang_args(out, url, model_dir), expect_ok=False)
    assert failed.returncode != 0 and "weights could not be pushed after 2 attempts" in failed.stderr
    last = Checkpoint(out / "checkpoints").complete()[-1]
    assert last.name == "step_00000001"
    assert json.loads((last / "metadata.json").read_text())["reason"] == "weight sync failed"
    assert server_state(url)["weight_version"] == "default"
    fail_next(url, "/update_weights_from_distributed", "success_false")
    resumed = launch("zero2.yaml", sglang_args(out, url, model_dir, "checkpoint.resume=auto"))
    state = server_state(url)
    assert_server_holds_checkpoint(url, out)
    versions = [int(body["weight_version"]) for path, body in state["requests"]
                if path == "/update_weights_from_distributed" and body["weight_version"] is not None]
    assert versions == [1, 2, 3] and state["weight_version"] == "3"  # version 1 first, at the resume
    assert "pushing everything again" in resumed.stderr and state["groups"] == []
    weight_versions = read_scalars(out / "tensorboard")["train/weight_version_mean"]  # batch 1 ended in the error
    assert weight_versions == [(2, 1.0), (3, 2.0)], "batch 2 was generated with the weights pushed at the resume"


def test_unreachable_server_at_start_is_a_clear_error(tmp_path, model_dir):
    with pytest.raises(ServerError, match="did not answer /server_info within 1 s"):
        train_in_process(sglang_args(tmp_path / "run", f"http://127.0.0.1:{free_port()}", model_dir,
                                                  "rollout.health_timeout_s=1"))


def test_launch_script_wires_servers_to_the_trainer():
    env = {**os.environ, "DRY_RUN": "1", "MODEL": "m", "SERVER_GPUS": "0 1", "TRAIN_GPUS": "2,3,4", "PYTHON": "py"}
    lines = subprocess.run(["bash", str(ROOT / "launch" / "sglang.sh"), "trainer.total_frames=9"], env=env,
                           capture_output=True, text=True, check=True, timeout=60).stdout.splitlines()
    server = "py -m sglang.launch_server --model-path m --enable-deterministic-inference --port"
    assert lines[:2] == [f"CUDA_VISIBLE_DEVICES=0 {server} 30000", f"CUDA_VISIBLE_DEVICES=1 {server} 30001"]
    assert "--num_processes 3" in lines[2] and "rollout.urls=[http://127.0.0.1:30000,http://127.0.0.1:30001]" in lines[2]
    assert lines[2].endswith("trainer.total_frames=9")

