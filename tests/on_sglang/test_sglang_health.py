"""SGLang's /health as its source answers it (a one-token generation, held back while busy or, in 0.5.9, while
memory is released; never run while paused), and a trainer started against a server its killed predecessor left
paused and released: it brings the server back before it waits for health."""
import json
import time
import urllib.error
import urllib.request

import pytest

from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.sglang.engine import SGLangEngine
from launching import free_port
from sglang_standin.source import VERSIONS
from sglang_standin.processes import NEWEST, control, server_state
from test_sglang_runs import assert_server_holds_checkpoint, sglang_args
from test_sglang_scheduler import counts, distributed_sender, post_async


def health(url: str) -> tuple[int, float]:
    """GET /health: its status and how long it took."""
    start = time.monotonic()
    try:
        urllib.request.urlopen(url + "/health", timeout=60).read()
        return 200, time.monotonic() - start
    except urllib.error.HTTPError as exc:
        return exc.code, time.monotonic() - start


def test_the_standins_health_check_is_sglangs_one_token_generation(model_dir, servers):
    """/health as SGLang answers it (srt/entrypoints/http_server.py ``health_generate``; when the scheduler holds the
    check back, srt/managers/scheduler.py ``process_input_requests``): 200 after a generation (a second at least,
    and no token counted as the clients'), 200 while busy (answered at the next batch result), 503 after
    SGLANG_HEALTH_CHECK_TIMEOUT while paused; with memory released and not paused, 0.5.9 holds it back (503) and
    0.5.23 runs it, on freed memory: the server dies."""
    from sglang_standin.processes import HEALTH_CHECK_TIMEOUT_S, StandIn

    timeout = float(HEALTH_CHECK_TIMEOUT_S)
    for version in VERSIONS:
        url = servers.get(model_dir, "--enable-memory-saver", "--decode-delay", "0.05", version=version)
        code, took = health(url)
        assert code == 200 and 1.0 <= took < 2.0 and counts(url)["sampled"] == 0
        busy = post_async(url, {"input_ids": [7, 14], "sampling_params": {"max_new_tokens": 60, "ignore_eos": True}})
        while counts(url)["sampled"] == 0:
            time.sleep(0.02)
        assert health(url)[0] == 200 and "answer" not in busy, "held back, answered at the next batch result"
        busy["thread"].join()
        control(url, "/pause_generation", {"mode": "retract"})
        code, took = health(url)
        assert code == 503 and timeout <= took < timeout + 1.5, "a paused server does not run it"
        control(url, "/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]})
        assert health(url)[0] == 503
        control(url, "/continue_generation", {})
        if version == "0.5.9":
            assert health(url)[0] == 503, "0.5.9 holds it back while memory is released"
        else:  # 0.5.23 runs it on the freed KV cache and weights: the scheduler dies, and the server with it
            server = StandIn(model_dir, "--enable-memory-saver", version=version)
            url = server.wait_up()
            try:
                control(url, "/release_memory_occupation", {"tags": ["kv_cache"]})
                with pytest.raises(OSError):
                    health(url)
                assert server.proc.wait(timeout=10) != 0
            finally:
                server.stop()


def test_a_paused_released_server_without_a_record_is_one_line_with_the_fix(model_dir, servers, tokenizer,
                                                                          accelerator):
    """A colocated server left paused with memory released by someone this run has no record of: the sender
    cannot know what to resume (resuming a tag it holds kills it), so it leaves it alone, and the engine's wait
    for health ends in one line that says what the server is and what brings it back."""
    from transformers import AutoModelForCausalLM

    url = servers.get(model_dir, "--enable-memory-saver")
    control(url, "/pause_generation", {"mode": "retract"})
    control(url, "/release_memory_occupation", {"tags": ["kv_cache", "weights", "cuda_graph"]})
    sender = distributed_sender(accelerator, AutoModelForCausalLM.from_pretrained(model_dir), [url])
    assert not sender.stale and counts(url)["released"] == sorted(["kv_cache", "weights", "cuda_graph"])
    engine = SGLangEngine([url], tokenizer, max_new_tokens=2, health_timeout_s=1)
    with pytest.raises(ServerError) as caught:
        engine.generate([[7, 14]], 2)
    message = str(caught.value)
    assert "\n" not in message and message.startswith(f"SGLang server {url} did not answer /health within 1 s")
    assert "it is paused, or has memory released" in message and "otherwise restart the server" in message
    assert ("/continue_generation", {}) not in server_state(url)["requests"], "it was left alone"
    sender.close()


KILLED_AT = {  # the call held on the server until the trainer is killed, and the server's state then
    "release": ("/release_memory_occupation", ("pass", "hold")),  # batch 2's release: paused, everything released
    "pause": ("/pause_generation", ("pass", "pass", "hold")),  # batch 2's pause before its release: paused only
}


@pytest.mark.parametrize("killed_at, version", [("release", version) for version in VERSIONS] + [("pause", NEWEST)])
def test_a_colocated_zero3_run_brings_back_the_server_its_sigkilled_predecessor_left(tmp_path, model_dir, servers,
                                                                                    version, killed_at):
    """A 2-process ZeRO-3 colocated run is SIGKILLed right after its second memory release (or the pause before
    it), leaving the server paused (and released). SGLang's /health, a one-token generation, then answers 503
    (it waits while paused; 0.5.9 also drops it while memory is released), so the restarted trainer
    (``checkpoint.resume=auto``) brings the server back before it waits for health: what its record says is held
    is continued at start; what is released is taken back, loaded and continued by its first push, in SGLang's
    order. The run finishes, and the server ends on the final checkpoint's weights with nothing released. The
    releases differ where memory is released (0.5.9 holds /health back, 0.5.23 runs it on freed memory): both are
    killed after the release; a pause alone is the same in both, so it runs on the newest."""
    import os
    import subprocess

    from launching import ACCELERATE, ROOT, launch, sigkill_tree

    url, out = servers.get(model_dir, "--deterministic", "--enable-memory-saver", version=version), tmp_path / "run"
    path, calls = KILLED_AT[killed_at]
    for how in calls:
        control(url, "/_standin/fail", {"path": path, "how": how})
    args = sglang_args(out, url, model_dir, "rollout.colocate=true", "checkpoint.interval_frames=128",
                       "trainer.total_frames=256")  # killed in batch 2 of 2: the resumed run trains it
    cmd = [*ACCELERATE, "--config_file", str(ROOT / "accelerate_configs" / "zero3.yaml"), "--main_process_port",
           str(free_port()), str(ROOT / "launch" / "train.py"), *args]
    with subprocess.Popen(cmd, cwd=ROOT, env={**os.environ, "DS_ACCELERATOR": "cpu"}, stdout=subprocess.DEVNULL,
                          stderr=subprocess.PIPE, text=True, start_new_session=True) as proc:
        deadline = time.monotonic() + 240
        while sum(p == path for p, _ in server_state(url)["requests"]) < len(calls):
            assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read()[-3000:]
            time.sleep(0.1)
        sigkill_tree(proc.pid)
        proc.wait()
    control(url, "/_standin/unhold")
    left = ["cuda_graph", "kv_cache", "weights"] if killed_at == "release" else []
    assert counts(url)["released"] == left
    assert json.loads((out / "sglang_memory.json").read_text())[url]["released"] == left
    with pytest.raises(ServerError, match="HTTP 503"):  # paused (and released): SGLang's health check fails
        HTTPClient(url).get("/health", retries=0)
    mark = len(server_state(url)["requests"])
    launch("zero3.yaml", args + ["checkpoint.resume=auto", "rollout.health_timeout_s=30"])
    assert_server_holds_checkpoint(url, out)
    asked = [(p, b.get("tags")) for p, b in server_state(url)["requests"][mark:]]
    first_health = asked.index(("/health", None))
    if killed_at == "release":  # taken back in SGLang's order by the resumed run's first push, then health
        memory = [a for a in asked[:first_health] if "memory" in a[0]]
        assert memory == [("/resume_memory_occupation", ["weights", "cuda_graph"]),
                          ("/resume_memory_occupation", ["kv_cache"])]
    assert ("/continue_generation", None) in asked[:first_health]
    assert counts(url)["released"] == []  # and it answers: it did not die
