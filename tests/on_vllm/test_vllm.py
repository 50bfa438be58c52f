"""A real vLLM server (0.32.0's CPU build, one per module: a start costs ~45 s): rollouts and their logprobs against
the trainer's recomputation, pushes from disk landing in the middle of generation (partial rollouts, both pause
modes), a colocated server's sleep and a restarted trainer waking it, a timed-out request aborted on the server,
start-up errors in one line, a ZeRO-3 run of two processes with async collection, a TRL file with use_vllm, and a
one-process run whose server is killed mid-run and started again before the resume. After every push the
server's own logprobs are compared with the trained weights: the weights themselves, not only the version it
reports. Tests that move the server's weights put the model it started with back (``restore``)."""
import dataclasses
import json
import os
import signal
import threading
import time

import pytest
import torch

from grpo_accel import batch
from grpo_accel.http import ServerError
from grpo_accel.logprobs import sequence_logprobs
from grpo_accel.vllm.engine import VLLMEngine
from launching import TINY_FOLDER, launch
from trainer_utils import train_in_process
from vllm_server import API_KEY, VLLMServer, save_vllm_model, vllm_python

PROBE = [1, 5, 6, 7, 15, 8, 17, 9, 10, 16, 11, 12, 4, 13, 14, 5, 7, 9]


@pytest.fixture(scope="module")
def model_folder(tmp_path_factory):
    return save_vllm_model(tmp_path_factory.mktemp("vllm_model"))


@pytest.fixture(scope="module")
def started(model_folder, tmp_path_factory):
    server = VLLMServer(vllm_python(), model_folder, tmp_path_factory.mktemp("vllm_log") / "server.log").start()
    yield server
    server.kill(signal.SIGTERM)


@pytest.fixture
def server(started):
    """The module's server, started again if an earlier test left it dead."""
    return started.revive()


def run_args(out, server, model_folder, *extra) -> list[str]:
    return [f"output_dir={out}", f"model.name_or_path={model_folder}", "rollout.backend=vllm",
            f"rollout.urls=[{server.url}]", f"rollout.api_key={API_KEY}", "weight_sync.method=disk",
            "weight_sync.dtype=float32", "weight_sync.bucket_mb=0.1", "trainer.progress_bar=false", *TINY_FOLDER,
            *extra]


def final_model(out):
    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.run.export import load_policy

    return load_policy(Checkpoint(out / "checkpoints").complete()[-1])


def model_logprobs(model, ids: list[int]) -> torch.Tensor:
    with torch.no_grad():
        logits = model(torch.tensor([ids])).logits[0, :-1]
    return torch.log_softmax(logits.float(), -1).gather(-1, torch.tensor(ids[1:])[:, None])[:, 0]


def assert_server_holds(server, model, initial=None):
    """The server computes what ``model`` computes (float32 pushes: to rounding), and not what ``initial`` does."""
    served = torch.tensor(server.prompt_logprobs(PROBE))
    gap = float((served - model_logprobs(model, PROBE)).abs().max())
    assert gap < 1e-4, f"the server's logprobs differ from the trained weights' by {gap}"
    if initial is not None:
        assert float((served - model_logprobs(initial, PROBE)).abs().max()) > 1e-3, "the weights did not move"


def restore(server, model_folder):
    """The server back on the model it was started with (version 0), for the next test's run."""
    server.post("/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": str(model_folder)}})
    server.post("/update_weight_version", {"new_version": "0"})


def metric(server, name: str = "vllm:num_requests_running") -> float:
    """One of the server's /metrics (by default the requests it runs now), summed over its engines."""
    import urllib.request

    with urllib.request.urlopen(server.url + "/metrics", timeout=30) as answer:
        lines = answer.read().decode().splitlines()
    return sum(float(line.rsplit(" ", 1)[1]) for line in lines if line.startswith(name))


def wait_idle(server) -> None:
    """Until the server neither runs nor queues a request (requests aborted a moment ago may still be draining)."""
    deadline = time.monotonic() + 60
    while metric(server) or metric(server, "vllm:num_requests_waiting"):
        assert time.monotonic() < deadline, "the server still runs requests 60 s after they were aborted"
        time.sleep(0.01)


# ------------------------------------------------------------------------------------------- rollouts


def test_rollouts_carry_logprobs_equal_to_the_trainer_forward_and_follow_the_seeds(server, model_folder, tokenizer,
                                                                                   capsys):
    from transformers import AutoModelForCausalLM

    engine = VLLMEngine([server.url], tokenizer, max_new_tokens=6, temperature=0.7, api_key=API_KEY)
    assert engine.context_limit == 127 and "vLLM 0.32.0" in engine.description
    info = engine.servers[0]  # started with --no-enable-chunked-prefill; the CPU build's defaults are refused:
    assert (info.device, info.chunk_tokens, info.max_num_seqs) == ("cpu", None, 128)
    with pytest.raises(ServerError, match=r"chunked prefill at --max-num-batched-tokens 2048: .* Restart it with "
                       r"--no-enable-chunked-prefill, or with --max-num-batched-tokens 16384 \(--max-num-seqs 128 x "
                       r"--max-model-len 128\), which no step can exceed\.$"):
        dataclasses.replace(info, chunk_tokens=2048).check_prefill()
    dataclasses.replace(info, chunk_tokens=16384).check_prefill()
    prompts = [tokenizer(p)["input_ids"] for p in ["1+2=", "3+3=", "12+4="]]
    td = engine.generate(prompts, group_size=4, seeds=[1, 2, 3])
    assert td.shape == (12,) and (td[batch.WEIGHT_VERSION] == 0).all()
    model = AutoModelForCausalLM.from_pretrained(model_folder)
    with torch.no_grad():
        ours = sequence_logprobs(model, td[batch.PROMPT_IDS], td[batch.PROMPT_MASK], td[batch.COMPLETION_IDS],
                                 td[batch.COMPLETION_MASK], temperature=0.7)
    mask = td[batch.COMPLETION_MASK].bool()
    gap = float((td[batch.ENGINE_LOGPROBS] - ours)[mask].abs().max())
    with capsys.disabled():
        print(f"\nvLLM logprobs against the trainer's recomputation: max |difference| {gap:.2e} over "
              f"{int(mask.sum())} tokens")
    assert gap < 1e-4
    for ids, n, reason in zip(td[batch.COMPLETION_IDS], mask.sum(-1), td[batch.FINISH_REASON]):
        assert (reason == batch.FINISH_STOP) == (ids[n - 1] == tokenizer.eos_token_id)
    again = engine.generate(prompts[2:], group_size=4, seeds=[3])
    assert torch.equal(again[batch.COMPLETION_IDS][:, :6], td[batch.COMPLETION_IDS][8:, :6]), \
        "completion j of a prompt with seed s draws with s * G + j, whatever else is in the batch"


def test_a_push_in_the_middle_of_generation_makes_partial_rollouts(server, model_folder, tokenizer, accelerator,
                                                                   tmp_path):
    """Both pause modes: keep (in-flight requests freeze and go on with the new weights) and abort (they come back
    cut short and are continued); the server holds the pushed weights after each push, checked by its logprobs."""
    from transformers import AutoModelForCausalLM

    from grpo_accel.vllm.servers import VLLMDiskSender

    model = AutoModelForCausalLM.from_pretrained(model_folder)
    initial = AutoModelForCausalLM.from_pretrained(model_folder)
    engine = VLLMEngine([server.url], tokenizer, max_new_tokens=100, api_key=API_KEY)
    prompts = [tokenizer(f"{i}+{i}=")["input_ids"] for i in range(64)]  # 512 completions: more than run at once
    for version, mode in enumerate(("retract", "abort"), start=1):
        sender = VLLMDiskSender(accelerator, model, [server.url], tmp_path / "weights", dtype=torch.float32,
                                api_key=API_KEY, pause_mode=mode, keep=1)
        rollout = {}
        wait_idle(server)
        tokens = metric(server, "vllm:generation_tokens_total")
        worker = threading.Thread(target=lambda: rollout.update(td=engine.generate(prompts, 8, seeds=list(range(64)))))
        worker.start()
        # the push lands once the 128 running requests hold 20 tokens each on average: more than the CPU build's
        # default --max-num-batched-tokens (2048) to prefill again after /pause clears their KV cache
        while metric(server, "vllm:generation_tokens_total") < tokens + 2560 and worker.is_alive():
            time.sleep(0.005)
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01)
        sender.push(version)
        worker.join()
        td = rollout["td"]
        partial = td[batch.WEIGHT_VERSION_LAST] > td[batch.WEIGHT_VERSION]
        assert partial.any(), f"{mode}: no completion was generated across the push"
        assert (td[batch.FINISH_REASON] != batch.FINISH_ABORT).all()
        assert set(td[batch.WEIGHT_VERSION_LAST].tolist()) <= {version - 1, version}
        assert_server_holds(server, model, initial)
        assert server.get("/weight_info") == {"weight_version": str(version)}
    assert [p.name for p in (tmp_path / "weights").iterdir()] == ["version_000002"], "keep=1"

    sender.release_memory()  # colocated: asleep while the trainer optimises (the CPU build keeps its memory)
    assert server.get("/is_sleeping") == {"is_sleeping": True}
    restarted = VLLMDiskSender(accelerator, model, [server.url], tmp_path / "weights", dtype=torch.float32,
                               api_key=API_KEY)
    assert restarted.stale, "a trainer started again finds the server asleep: it pushes before it collects"
    restarted.push(3)
    assert server.get("/is_sleeping") == {"is_sleeping": False} and server.get("/weight_info")["weight_version"] == "3"
    assert_server_holds(server, model, initial)
    restore(server, model_folder)


def test_a_request_that_times_out_is_aborted_on_the_server_before_it_is_sent_again(server, tokenizer, caplog):
    engine = VLLMEngine([server.url], tokenizer, max_new_tokens=100, api_key=API_KEY, request_timeout_s=0.02,
                        retries=1, backoff_s=0.01)
    posted = server.log.read_text().count("POST /abort_requests")
    prompts = [tokenizer(f"{i}*{i}=")["input_ids"] for i in range(24)]
    # paused, the server holds every request: none answers in time (running, the tiny model's completions could end
    # at EOS within the 0.02 s, as one CI run saw)
    server.post("/pause?mode=keep", {})
    try:
        with pytest.raises(ServerError, match="did not answer within 0.02 s"):
            engine.generate(prompts, 4, seeds=list(range(24)))
    finally:
        server.post("/resume", {})
    assert "aborted there and sent again, retry 1/1" in caplog.text
    assert server.log.read_text().count("POST /abort_requests") > posted
    # the id it aborts by is the one vLLM gives the request's prompt: the request ends there. Sent while the server
    # is paused, so it waits in the scheduler until the abort (running, its 124 tokens outran the abort in CI runs);
    # with a wrong id it would run to its length after /resume. Aborted while waiting, its stream ends without a
    # chunk (a running one's ends with finish reason "abort")
    wait_idle(server)
    chunks, errors = [], []
    body = {"prompt": [1, 5, 6], "max_tokens": 124, "ignore_eos": True, "request_id": "long-running"}

    def read():
        try:
            chunks.extend(event["choices"] for event in server.stream("/v1/completions", body))
        except Exception as exc:  # noqa: BLE001 - said by the assertion below
            errors.append(exc)

    reader = threading.Thread(target=read)
    server.post("/pause?mode=keep", {})
    try:
        reader.start()
        time.sleep(1)  # the request reaches the engine (milliseconds)
        engine._abort(engine.clients[0], "long-running")
    finally:
        server.post("/resume", {})
    reader.join(timeout=60)
    ended = [c[0]["finish_reason"] for c in chunks if c and c[0].get("finish_reason")]
    assert not reader.is_alive() and errors == [] and ended in ([], ["abort"]) and len(chunks) < 124, \
        (errors, ended, len(chunks))


def test_an_unreachable_server_is_named(tokenizer):
    from launching import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match=f"vLLM server {url} did not answer /health within 1 s"):
        VLLMEngine([url], tokenizer, max_new_tokens=2, health_timeout_s=1)


def test_a_wrong_key_and_a_prompt_past_the_context_are_one_line_each(server, model_folder, tmp_path):
    with pytest.raises(ServerError) as wrong:
        train_in_process(run_args(tmp_path / "a", server, model_folder, "rollout.api_key=wrong"))
    assert "HTTP 401" in str(wrong.value) and "set rollout.api_key" in str(wrong.value)
    with pytest.raises(Exception) as long:
        train_in_process(run_args(tmp_path / "b", server, model_folder, "rollout.max_new_tokens=126",
                                  "trainer.total_frames=128"))
    assert "rollout.max_new_tokens=126" in str(long.value) and "vLLM: the servers' shortest --max-model-len" in \
        str(long.value) and "--max-model-len" in str(long.value)
    for error in (wrong.value, long.value):
        assert "\n" not in str(error)


# ------------------------------------------------------------------------------------------------ runs


def test_zero3_run_with_async_collection_keeps_the_server_on_the_trained_weights(server, model_folder, tmp_path):
    from transformers import AutoModelForCausalLM

    out = tmp_path / "run"
    launch("zero3.yaml", run_args(out, server, model_folder, "trainer.total_frames=384",
                                  "trainer.async_collection=true", "checkpoint.interval_frames=null"))
    summary = json.loads((out / "summary.json").read_text())
    assert summary["zero_stage"] == 3 and summary["num_processes"] == 2 and summary["weight_version"] == 3
    assert server.get("/weight_info") == {"weight_version": "3"}
    assert_server_holds(server, final_model(out), AutoModelForCausalLM.from_pretrained(model_folder))
    restore(server, model_folder)


def test_a_trl_file_with_use_vllm_trains_from_the_vllm_server(server, model_folder, tmp_path, caplog):
    """TRL's server mode as a TRL user writes it (host and port), the key and float32 pushes in grpo_accel's
    sections of the same file."""
    import logging

    import yaml

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(3) for b in range(3)))
    host, port = server.url.removeprefix("http://").split(":")
    config = tmp_path / "trl.yaml"
    config.write_text(yaml.safe_dump({
        "model_name_or_path": str(model_folder), "dataset_name": str(data), "output_dir": str(tmp_path / "run"),
        "reward_funcs": ["grpo_accel.rewards.answer_match"], "use_vllm": True, "vllm_mode": "server",
        "vllm_server_host": host, "vllm_server_port": int(port), "max_steps": 2, "per_device_train_batch_size": 8,
        "num_generations": 4, "max_completion_length": 4, "learning_rate": 3e-4, "bf16": False,
        "report_to": ["tensorboard"], "rollout": {"api_key": API_KEY}, "weight_sync": {"dtype": "float32"}}))
    with caplog.at_level(logging.INFO):
        assert train_in_process(["--config", str(config), "trainer.progress_bar=false"]) == 0
    said = next(r.getMessage() for r in caplog.records if "holds TRL's settings" in r.getMessage())
    assert f"-> rollout.urls=['{server.url}']" in said and "-> rollout.backend=vllm" in said
    assert server.get("/weight_info") == {"weight_version": "2"}
    assert_server_holds(server, final_model(tmp_path / "run"))
    restore(server, model_folder)


def test_a_server_killed_mid_run_stops_it_with_a_checkpoint_and_the_resume_restores_its_weights(server, model_folder,
                                                                                                 tmp_path):
    """One process, sync collection. The server dies after the first checkpoint; the run stops with the error and
    keeps its checkpoints; the server comes back with the model it started with, and the resume pushes the restored
    weights first (a new trainer cannot know what a server holds), then trains to the end."""
    import subprocess

    from launching import ACCELERATE, ROOT, free_port

    out = tmp_path / "run"
    args = run_args(out, server, model_folder, "trainer.total_frames=1024", "checkpoint.interval_frames=128",
                    "rollout.request_retries=1", "rollout.health_timeout_s=5")
    config = ROOT / "accelerate_configs" / "single_process.yaml"
    proc = subprocess.Popen([*ACCELERATE, "-q", "--config_file", str(config), "--main_process_port", str(free_port()),
                             str(ROOT / "launch" / "train.py"), *args],
                            cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "DS_ACCELERATOR": "cpu"})
    deadline = time.monotonic() + 120
    while not (out / "checkpoints" / "step_00000002").is_dir():
        assert proc.poll() is None and time.monotonic() < deadline, proc.communicate()[1][-4000:]
        time.sleep(0.2)
    server.kill()
    _, stderr = proc.communicate(timeout=120)
    assert proc.returncode != 0
    last = stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and server.url in last and "cannot reach the server" in last, stderr[-3000:]
    saved = sorted(p.name for p in (out / "checkpoints").iterdir() if p.name.startswith("step_"))
    assert len(saved) >= 2, saved

    server.start()
    from transformers import AutoModelForCausalLM

    initial = AutoModelForCausalLM.from_pretrained(model_folder)
    assert_server_holds(server, initial)  # a restarted server holds the model it was started with
    resumed = launch("single_process.yaml", run_args(out, server, model_folder, "trainer.total_frames=1024",
                                                     "checkpoint.interval_frames=128", "checkpoint.resume=auto"))
    assert "resumed from" in resumed.stderr
    final = final_model(out)
    assert json.loads((out / "summary.json").read_text())["weight_version"] == 8
    assert server.get("/weight_info") == {"weight_version": "8"}
    assert_server_holds(server, final, initial)
