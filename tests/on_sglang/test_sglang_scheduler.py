"""SGLang as its scheduler behaves (launch/bench/sglang_standin/scheduler.py): a KV pool that admits what it holds and queues the
rest, aborts that answer waiting requests with nothing, dp ranks that answer one by one, requests that time out,
and colocated servers that die where SGLang dies; and the client and trainer making progress on all of it."""
import json
import threading
import time
import urllib.error
import urllib.request

import pytest
import torch

from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.sglang.engine import SGLangEngine
from sglang_standin.source import VERSIONS
from sglang_standin.processes import NEWEST, control, fail_next, server_state
from test_sglang_runs import assert_server_holds_checkpoint, sglang_args
from trainer_utils import train_in_process
from weight_senders import distributed_sender


def counts(url: str) -> dict:
    return control(url, "/_standin/counts")


def post_async(url: str, body: dict) -> dict:
    """POST /generate in a thread; the dict gets "answer" when it comes back ("error" if it does not)."""
    result: dict = {}

    def run():
        request = urllib.request.Request(url + "/generate", data=json.dumps(body).encode(),
                                         headers={"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(request, timeout=60) as response:
                result["answer"] = json.loads(response.read())
        except OSError as exc:  # a server that died
            result["error"] = exc

    result["thread"] = threading.Thread(target=run)
    result["thread"].start()
    return result


# ------------------------------------------------------------------------------- the stand-in's scheduler


@pytest.mark.parametrize("version", VERSIONS)
def test_the_pool_admits_what_it_holds_queues_the_rest_and_retracts_under_pressure(model_dir, servers, version):
    """16 completions of 4 + 30 tokens on a pool of 96 tokens: a few run at once (prompt + remaining budget must fit
    what the running ones leave, their budgets counted at new_token_ratio), the rest wait; as the running ones
    grow past their reservation the pool runs out and the newest go back to the queue, keeping their tokens.
    Every completion still gets its 30 tokens, and the pool never held more than 96."""
    url = servers.get(model_dir, "--deterministic", "--max-total-tokens", "96", version=version)
    answer = HTTPClient(url, retries=0).post("/generate", {
        "input_ids": [[7, 14, 8, 17]] * 16, "return_logprob": True,
        "sampling_params": [{"max_new_tokens": 30, "ignore_eos": True, "sampling_seed": i} for i in range(16)]})
    seen = counts(url)
    assert [len(item["output_ids"]) for item in answer] == [30] * 16
    assert all(len(item["meta_info"]["output_token_logprobs"]) == 30 for item in answer), "retracted rows keep theirs"
    assert 1 < seen["peak"]["running"] < 16 and seen["peak"]["waiting"] > 0 and seen["peak"]["kv_tokens"] <= 96
    assert seen["retracted"] > 0 and seen["sampled"] == seen["returned"] == 16 * 30


def test_an_abort_answers_waiting_requests_with_nothing_and_running_ones_after_a_token(model_dir, servers):
    """SGLang's abort paths (Scheduler.abort_request, TokenizerManager._handle_abort_req): pausing with mode=abort
    while 8 completions share a pool that runs 2: the waiting ones come back at once with no token ("Abort in
    waiting queue", no status), the running ones after one more decode step ("Aborted"); the pause is answered once
    nothing is in flight, which SGLang checks every second; a /generate sent meanwhile waits for the continue."""
    url = servers.get(model_dir, "--deterministic", "--max-total-tokens", "64", "--decode-delay", "0.05")
    pending = post_async(url, {"input_ids": [[7, 14, 8, 17]] * 8, "return_logprob": True,
                               "sampling_params": {"max_new_tokens": 24, "ignore_eos": True}})
    while counts(url)["sampled"] < 6:
        time.sleep(0.02)
    began = time.monotonic()
    control(url, "/pause_generation", {"mode": "abort"})
    paused_for = time.monotonic() - began
    pending["thread"].join()
    later = post_async(url, {"input_ids": [7, 14], "sampling_params": {"max_new_tokens": 2}})
    time.sleep(0.3)
    assert "answer" not in later, "a request sent while paused waits"
    control(url, "/continue_generation", {})
    later["thread"].join()
    reasons = [(item["meta_info"]["finish_reason"], len(item["output_ids"])) for item in pending["answer"]]
    waiting = [n for reason, n in reasons if reason == {"type": "abort", "message": "Abort in waiting queue"}]
    running = [n for reason, n in reasons if reason == {"type": "abort", "message": "Aborted", "status_code": None,
                                                        "err_type": None}]
    assert waiting and running and len(waiting) + len(running) == 8
    assert set(waiting) == {0} and min(running) >= 2
    assert paused_for >= 1.0, "abort mode answers after its next look at the reader lock, a second later"


# ------------------------------------------------------------------------------------ abort mode in a run


def test_abort_mode_finishes_with_a_pool_smaller_than_a_batch_and_a_push_at_every_optimizer_step(tmp_path, model_dir,
                                                                                                servers):
    """The run that died on a real SGLang 0.5.9 server: weight_sync.pause_mode=abort, asynchronous collection,
    four optimizer steps per batch each followed by a push, while the next batch of 32 completions is generated on
    a pool that holds a few of them at a time. Every push aborts the queue (those requests come back with nothing
    and are sent again, not counted as failures, since the server's weights moved) and the running ones (continued
    from what they had); the run finishes, every token drawn is in a rollout, and the server ends on the trainer's
    weights."""
    from grpo_accel.reporting.event_files import read_scalars

    url = servers.get(model_dir, "--deterministic", "--decode-delay", "0.04", "--max-total-tokens", "128",
                      version=VERSIONS[0])
    out = tmp_path / "run"
    train_in_process(sglang_args(
        out, url, model_dir, "trainer.total_frames=96", "rollout.prompts_per_batch=8", "rollout.group_size=4",
        "rollout.max_new_tokens=16", "rollout.request_size=8", "trainer.micro_batch_completions=8",
        "trainer.async_collection=true", "trainer.max_staleness=null", "weight_sync.pause_mode=abort",
        "rollout.request_retries=1"))
    assert_server_holds_checkpoint(url, out)
    seen = counts(url)
    assert seen["peak"]["waiting"] > 0 and seen["peak"]["kv_tokens"] <= 128, "the queue was in use"
    assert seen["aborted"] > 0 and seen["sampled"] == seen["returned"]
    scalars = read_scalars(out / "tensorboard")
    assert max(v for _, v in scalars["train/partial_rollout_fraction"]) > 0
    assert json.loads((out / "summary.json").read_text())["weight_version"] == 12


# ------------------------------------------------------------------------------------------------- dp ranks


def digests(model) -> dict:
    import hashlib

    return {n: hashlib.sha256(p.detach().float().numpy().tobytes()).hexdigest() for n, p in model.named_parameters()}


@pytest.mark.parametrize("version", VERSIONS)
def test_dp2_servers_are_checked_rank_by_rank_after_distributed_and_disk_pushes(accelerator, model_dir, qwen_dir,
                                                                              servers, tmp_path, version):
    """With two dp ranks /get_weights_by_name answers a list, one entry per rank (0.5.9
    tokenizer_communicator_mixin.py, 0.5.23 tokenizer_control_mixin.py ``get_weights_by_name``), and 0.5.23
    reports --dp-size 2 --enable-dp-attention as attn_dp_size 2. Distributed pushes to a dp-attention server and
    disk pushes to a plain dp-2 server are verified on each rank; a rank that kept its old weights is named; a
    model class without the method answers [null, null] and is probed on each rank in turn."""
    from transformers import AutoModelForCausalLM

    from grpo_accel.sglang.from_disk import DiskWeightSender
    from grpo_accel.sglang.sender import WeightSyncError

    dp_attention = servers.get(model_dir, "--dp-size", "2", "--enable-dp-attention", version=version)
    info = HTTPClient(dp_attention).get("/server_info")
    assert (info["dp_size"], info.get("attn_dp_size", 1)) == ((1, 2) if version == NEWEST else (2, 1))
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    sender = distributed_sender(accelerator, model, [dp_attention], verify_tensors=3)
    assert sender.servers[0].dp_ranks == 2
    sender.update_weights()
    assert control(dp_attention, "/_standin/dp_digests") == [digests(model)] * 2
    fail_next(dp_attention, "/update_weights_from_distributed", "ignore_dp1", times=100)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.1)
    with pytest.raises(WeightSyncError, match=r"\(dp rank 1\): model\.\S+ differs from the trainer's"):
        sender.update_weights()
    sender.close()

    plain = servers.get(model_dir, "--dp-size", "2", version=version)  # replicas: served disk updates only
    disk = DiskWeightSender(accelerator, model, [plain], tmp_path / "weights", dtype=torch.float32)
    disk.update_weights()
    assert control(plain, "/_standin/dp_digests") == [digests(model)] * 2

    qwen = servers.get(qwen_dir, "--dp-size", "2", "--enable-dp-attention", version=version)
    assert HTTPClient(qwen).post("/get_weights_by_name", {"name": "lm_head.weight"}) == [None, None]
    qwen_model = AutoModelForCausalLM.from_pretrained(qwen_dir)
    probed = distributed_sender(accelerator, qwen_model, [qwen])
    probed.update_weights()
    ranks = [body.get("data_parallel_rank") for path, body in server_state(qwen)["requests"] if path == "/generate"]
    assert ranks == [0, 1], "one probe per dp rank"
    probed.close()


# ------------------------------------------------------------------------------------- timed-out requests


def test_a_request_that_times_out_is_aborted_on_the_server_before_it_is_sent_again(model_dir, servers, tokenizer):
    """SGLang goes on generating a request whose client gave up (it looks for a closed connection only while a
    request waits, every 4 s: TokenizerManager._wait_one_response), so the engine aborts every timed-out request
    by its rids before sending it again; once it gives up, nothing of it runs on the server."""
    url = servers.get(model_dir, "--deterministic", "--decode-delay", "0.1")
    engine = SGLangEngine([url], tokenizer, max_new_tokens=30, retries=1, request_timeout_s=0.25, backoff_s=0.01)
    with pytest.raises(ServerError, match="/generate: the server took the request but did not answer within"):
        engine.generate([[7, 14, 8]], 2, seeds=[0])
    requests = server_state(url)["requests"]
    sent = [body["rid"] for path, body in requests if path == "/generate"]
    aborted = [body["rid"] for path, body in requests if path == "/abort_request"]
    assert len(sent) == 2 and aborted == [rid for rids in sent for rid in rids]
    time.sleep(0.5)  # an aborted running request ends after one more step
    left = counts(url)
    assert left["running"] == left["waiting"] == 0 and left["aborted"] >= 1
    time.sleep(0.3)
    assert counts(url)["sampled"] == left["sampled"], "nothing generates for the requests given up"


# ------------------------------------------------------------------------------------------ colocated servers


def test_the_standin_dies_where_sglangs_scheduler_dies(model_dir):
    """A memory release while a request runs trips SGLang's assertion, a resume of a tag that is not released its
    KeyError (offload_tags.remove): the scheduler process raises and the server goes down with it."""
    from sglang_standin.processes import StandIn

    for calls in ([("/release_memory_occupation", {"tags": ["kv_cache"]})],
                  [("/release_memory_occupation", {"tags": ["kv_cache"]}),
                   ("/resume_memory_occupation", {"tags": ["weights"]})]):
        server = StandIn(model_dir, "--enable-memory-saver", "--decode-delay", "0.1")
        url = server.wait_up()
        try:
            if len(calls) == 1:  # a release while a request runs
                post_async(url, {"input_ids": [7, 14], "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}})
                while counts(url)["sampled"] == 0:
                    time.sleep(0.02)
            for path, body in calls[:-1]:
                control(url, path, body)
            with pytest.raises(OSError):  # the connection closes without an answer
                control(url, *calls[-1])
            assert server.proc.wait(timeout=10) != 0
        finally:
            server.stop()


def test_a_released_memory_record_is_read_back_only_for_the_same_start_of_a_server(model_dir, servers, tmp_path):
    """No SGLang route says which tags a server has released, so the sender records them (before each call) beside
    the run; a new trainer reads them back for the server that wrote them, and not once it was restarted."""
    from grpo_accel.sglang import api
    from grpo_accel.sglang.memory import ServerMemory

    url = servers.get(model_dir, "--enable-memory-saver")
    client = HTTPClient(url)
    record = tmp_path / "sglang_memory.json"
    memory = ServerMemory([client], [api.read_server_info(client)], record)
    memory.release(api.MEMORY_TAGS)
    assert counts(url)["released"] == sorted(api.MEMORY_TAGS)
    again = ServerMemory([client], [api.read_server_info(client)], record)  # a trainer started after a kill
    assert again.released[url] == set(api.MEMORY_TAGS)
    again.resume(("weights", "cuda_graph"))
    assert json.loads(record.read_text())[url]["released"] == ["kv_cache"]
    control(url, "/_standin/reset", {"flags": ["--enable-memory-saver"]})  # the server restarted
    assert ServerMemory([client], [api.read_server_info(client)], record).holds_all(url)


def test_a_push_that_fails_half_way_resumes_each_server_only_what_it_still_has_released(accelerator, model_dir,
                                                                                         servers):
    """Two colocated servers; the first push's resume fails on one of them (an error answer: it resumed nothing)
    while the other resumed. The next attempt resumes only the one that did not (resuming the other again would
    kill it), and both end on the trainer's weights with all their memory back."""
    from transformers import AutoModelForCausalLM

    urls = [servers.get(model_dir, "--enable-memory-saver", version=v) for v in VERSIONS]
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    sender = distributed_sender(accelerator, model, urls)
    sender.release_memory()
    fail_next(urls[1], "/resume_memory_occupation", "http_500")
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.05)
    sender.update_weights()
    for url in urls:
        assert control(url, "/_standin/digest") == digests(model) and counts(url)["released"] == []
    resumes = [[b["tags"] for p, b in server_state(url)["requests"] if p == "/resume_memory_occupation"] for url in urls]
    assert resumes == [[["weights", "cuda_graph"], ["kv_cache"]],
                       [["weights", "cuda_graph"], ["weights", "cuda_graph"], ["kv_cache"]]]
    sender.close()
