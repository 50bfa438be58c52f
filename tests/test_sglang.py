"""SGLang: the HTTP engine and the weight senders against a strict loopback stand-in (tests/sglang_standin.py)."""
import json

import pytest
import torch

from grpo_accel import batch as K
from grpo_accel.logprobs import sequence_logprobs
from grpo_accel.rollout.http import HTTPClient, ServerError
from grpo_accel.rollout.sglang import SGLangEngine
from launching import ROOT, free_port, launch
from standin import standin_server


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory, tokenizer):
    from grpo_accel.tasks.tiny import build_tiny_model

    path = tmp_path_factory.mktemp("model")
    build_tiny_model(tokenizer, seed=0).save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="module")
def server(model_dir):
    with standin_server(model_dir) as url:
        yield url


def test_rollouts_carry_engine_logprobs_equal_to_the_trainer_forward(server, tokenizer, model_dir):
    from transformers import AutoModelForCausalLM

    engine = SGLangEngine([server, server], tokenizer, max_new_tokens=5, temperature=0.7)
    prompts = [tokenizer(p)["input_ids"] for p in ["1+2=", "3+3=", "12+4="]]
    td = engine.generate(prompts, group_size=4, seeds=[1, 2, 3])
    assert td.shape == (12,) and (td[K.WEIGHT_VERSION] == 0).all()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        teacher = sequence_logprobs(model, td[K.PROMPT_IDS], td[K.PROMPT_MASK], td[K.COMPLETION_IDS],
                                    td[K.COMPLETION_MASK], temperature=0.7)
    torch.testing.assert_close(td[K.ENGINE_LOGPROBS], teacher, atol=1e-5, rtol=1e-5)
    for ids, mask, reason in zip(td[K.COMPLETION_IDS], td[K.COMPLETION_MASK], td[K.FINISH_REASON]):
        n = int(mask.sum())
        assert (reason == K.FINISH_STOP) == (ids[n - 1] == tokenizer.eos_token_id)
    again = engine.generate(prompts, group_size=4, seeds=[1, 2, 3])
    assert torch.equal(again[K.COMPLETION_IDS], td[K.COMPLETION_IDS]), "sampling_seed makes rollouts reproducible"


def test_strict_server_rejections_reach_the_user(server):
    client = HTTPClient(server, retries=0)
    with pytest.raises(ServerError, match=r"HTTP 400: unknown sampling params \['beam_width'\]"):
        client.post("/generate", {"input_ids": [1, 2], "sampling_params": {"beam_width": 2}})
    with pytest.raises(ServerError, match="not both or neither"):
        client.post("/generate", {"text": "1", "input_ids": [1]})
    with pytest.raises(ServerError, match="sampling_params has 1 entries for a batch of 2"):
        client.post("/generate", {"input_ids": [[1], [2]], "sampling_params": [{}]})


def test_transient_failures_are_retried_and_aborts_too(server, tokenizer):
    client = HTTPClient(server)
    client.post("/_standin/fail", {"path": "/generate", "times": 2, "how": "http_500"})
    engine = SGLangEngine([server], tokenizer, max_new_tokens=3, retries=3, backoff_s=0.01)
    assert engine.generate([[7, 14, 8, 17]], 2, seeds=[0]).shape == (2,)
    client.post("/_standin/fail", {"path": "/generate", "times": 5, "how": "http_500"})
    with pytest.raises(ServerError, match="HTTP 500: injected failure"):
        SGLangEngine([server], tokenizer, max_new_tokens=3, retries=2, backoff_s=0.01).generate([[7]], 2)
    client.post("/_standin/fail", {"path": "/generate", "times": 1, "how": "abort"})
    td = engine.generate([[7, 14, 8, 17]], 2, seeds=[0])
    assert (td[K.FINISH_REASON] != K.FINISH_ABORT).all(), "an aborted batch is generated again"
    client.post("/_standin/fail", {"path": "/generate", "times": 9, "how": "abort"})
    with pytest.raises(ServerError, match="kept aborting \\(Abort before prefill, status 503\\) after 3 retries"):
        engine.generate([[7]], 2)


def test_api_key_and_health_wait(model_dir, tokenizer):
    with standin_server(model_dir, "--api-key", "s3cret", "--startup-delay", "1.5") as url:
        engine = SGLangEngine([url], tokenizer, max_new_tokens=2, api_key="s3cret", health_timeout_s=30)
        assert engine.generate([[7, 14]], 2).shape == (2,)
        with pytest.raises(ServerError, match="HTTP 401.*check rollout.api_key"):
            SGLangEngine([url], tokenizer, max_new_tokens=2, api_key="wrong")
    with pytest.raises(ServerError, match=r"was not healthy after 1 s.*rollout.urls"):
        SGLangEngine([f"http://127.0.0.1:{free_port()}"], tokenizer, max_new_tokens=2, health_timeout_s=1)


# ------------------------------------------------------------------- GRPO runs that sync weights to it


def sglang_run(tmp_path, url, model_dir, config="zero3.yaml", *extra, expect_ok=True):
    out = tmp_path / "run"
    proc = launch(config, [f"output_dir={out}", f"model.name_or_path={model_dir}", "rollout.backend=sglang",
                           f"rollout.urls=[{url}]", "weight_sync.backend=gloo", f"weight_sync.master_port={free_port()}",
                           "weight_sync.dtype=float32", "weight_sync.bucket_mb=0.05", "trainer.total_frames=384",
                           "trainer.micro_batch_completions=64", "trainer.progress_bar=false",
                           "checkpoint.interval_frames=null", *extra], expect_ok=expect_ok)
    return out, proc


def server_state(url):
    return HTTPClient(url).get("/_standin/state")


def final_policy(out):
    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.export import checkpoint_state_dict, policy_weights

    return policy_weights(checkpoint_state_dict(Checkpoint(out / "checkpoints").complete()[-1]))


@pytest.mark.parametrize("layout", ["per_tensor", "flattened_bucket"])
def test_zero3_grpo_run_keeps_the_server_weights_equal_to_the_trainer(tmp_path, model_dir, layout):
    with standin_server(model_dir) as url:
        out, proc = sglang_run(tmp_path, url, model_dir, "zero3.yaml", f"weight_sync.layout={layout}")
        state = server_state(url)
    assert state["weight_version"] == "3" and state["updates"] > 3  # 3 pushes, several buckets each
    trained = final_policy(out)
    for name, value in state["params"].items():
        assert torch.equal(torch.tensor(value), trained[name]), name  # float32 sync: bitwise
    from grpo_accel.tracking import read_scalars

    versions = [v for _, v in read_scalars(out / "tensorboard")["train/weight_version_mean"]]
    assert versions == [0.0, 1.0, 2.0], "each batch was generated with the weights pushed after the previous one"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["zero_stage"] == 3 and 0 < summary["weight_sync_peak_extra_bytes"] <= 2 * 0.05 * 2**20


def test_disk_path(tmp_path, model_dir):
    with standin_server(model_dir) as url:
        out, _ = sglang_run(tmp_path, url, model_dir, "single_process.yaml", "weight_sync.method=disk",
                            "trainer.micro_batch_completions=128")
        state = server_state(url)
    assert state["weight_version"] == "3" and state["updates"] == 3
    trained = final_policy(out)
    assert all(torch.equal(torch.tensor(v), trained[n]) for n, v in state["params"].items())
    assert len(list((out / "weights").glob("version_*"))) == 2  # older pushes are deleted


def test_failed_update_is_pushed_again_and_a_new_trainer_reconnects(tmp_path, model_dir):
    with standin_server(model_dir) as url:
        HTTPClient(url).post("/_standin/fail", {"path": "/update_weights_from_distributed", "times": 1})
        out, proc = sglang_run(tmp_path, url, model_dir, "zero2.yaml")
        state = server_state(url)
        assert "pushing everything again" in proc.stderr and state["weight_version"] == "3"
        trained = final_policy(out)
        assert all(torch.equal(torch.tensor(v), trained[n]) for n, v in state["params"].items())
        # a resumed trainer meets the group the first one left behind: it is destroyed and made again
        sglang_run(tmp_path, url, model_dir, "zero2.yaml", "checkpoint.resume=auto", "trainer.total_frames=512")
        assert server_state(url)["weight_version"] == "1"  # the new trainer's first push


def test_persistent_failure_stops_with_an_error_and_a_checkpoint(tmp_path, model_dir):
    with standin_server(model_dir) as url:
        HTTPClient(url).post("/_standin/fail", {"path": "/update_weights_from_distributed", "times": 100})
        out, proc = sglang_run(tmp_path, url, model_dir, "zero2.yaml", expect_ok=False)
    assert proc.returncode != 0 and "weights could not be pushed after 2 attempts" in proc.stderr
    from grpo_accel.checkpoint import Checkpoint

    last = Checkpoint(out / "checkpoints").complete()[-1]
    assert json.loads((last / "metadata.json").read_text())["reason"] == "weight sync failed"


def test_unreachable_server_at_start_is_a_clear_error(tmp_path, model_dir):
    out, proc = sglang_run(tmp_path, f"http://127.0.0.1:{free_port()}", model_dir, "single_process.yaml",
                           "rollout.health_timeout_s=1", expect_ok=False)
    assert "was not healthy after 1 s" in proc.stderr


def test_launch_script_wires_servers_to_the_trainer():
    import os
    import subprocess

    env = {**os.environ, "DRY_RUN": "1", "MODEL": "m", "SERVER_GPUS": "0 1", "TRAIN_GPUS": "2,3,4", "PYTHON": "py"}
    lines = subprocess.run(["bash", str(ROOT / "launch" / "sglang.sh"), "trainer.total_frames=9"], env=env,
                           capture_output=True, text=True, check=True).stdout.splitlines()
    assert lines[:2] == ["CUDA_VISIBLE_DEVICES=0 py -m sglang.launch_server --model-path m --port 30000",
                         "CUDA_VISIBLE_DEVICES=1 py -m sglang.launch_server --model-path m --port 30001"]
    assert "--num_processes 3" in lines[2] and "rollout.urls=[http://127.0.0.1:30000,http://127.0.0.1:30001]" in lines[2]
    assert lines[2].endswith("trainer.total_frames=9")


def test_tensor_path_needs_sglang_and_a_gpu(tokenizer):
    from accelerate import Accelerator

    from grpo_accel.tasks.tiny import build_tiny_model
    from grpo_accel.weight_sync.sglang import TensorWeightSender

    with pytest.raises((ImportError, RuntimeError), match="sglang|GPU"):
        TensorWeightSender(Accelerator(), build_tiny_model(tokenizer), ["http://127.0.0.1:1"])


@pytest.mark.skipif(not torch.cuda.is_available(), reason="NCCL and CUDA IPC need a GPU")
def test_gpu_only_paths_need_a_gpu():  # run on a GPU machine with SGLang installed
    pytest.importorskip("sglang")
