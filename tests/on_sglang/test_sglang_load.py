"""SGLang under load, against the stand-in paced like a large model (launch/bench/sglang_standin --decode-delay):
weight pushes that land while requests are in flight (partial rollouts, both pause modes), context limits,
requests sized for the work, a tensor-parallel server's ranks, dp attention, and a 2-process ZeRO-3 run that
collects asynchronously."""
import copy
import hashlib
import json
import logging
import threading
import time

import pytest
import torch

from grpo_accel import batch
from grpo_accel.data.prompts import DataError
from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.layout import BatchLayout
from grpo_accel.logprobs import sequence_logprobs
from grpo_accel.sglang.engine import SGLangEngine
from launching import launch
from sglang_standin.source import VERSIONS
from sglang_standin.processes import NEWEST, control, fail_next, server_state
from trainer_utils import train_in_process
from weight_senders import distributed_sender


def generated(url: str) -> int:
    return control(url, "/_standin/counts")["sampled"]


# ------------------------------------------------------------------------------------------ partial rollouts


@pytest.mark.parametrize("mode, version, pace", [("retract", NEWEST, "--deterministic"), ("abort", NEWEST, "--deterministic"),
                                                 ("abort", VERSIONS[0], "--deterministic"), ("retract", NEWEST, "--kv-cache")])
def test_pushes_during_generation_lose_no_token_and_each_token_keeps_its_weights_logprob(
        accelerator, model_dir, servers, tokenizer, mode, version, pace):
    """Three pushes land while 16 completions are generated in 4 requests. Every token the server drew is in the
    rollout (retract: the server keeps them; abort: they come back cut short and are continued); a row records
    the oldest and newest weights of its tokens, and every token's logprob is that of one of those versions. 0.5.23
    says which version drew each token (meta_info.weight_versions), so the engine reads /model_info only before
    its first request; 0.5.9 before each. With --kv-cache (launch/bench/overlap.py's stand-in: the running batch decodes
    on a cache, rows leave it as they finish, a retracted row is computed again) the same holds."""
    from transformers import AutoModelForCausalLM

    url = servers.get(model_dir, pace, "--decode-delay", "0.08", version=version)
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    sender = distributed_sender(accelerator, model, [url], pause_mode=mode)
    engine = SGLangEngine([url], tokenizer, max_new_tokens=16, request_size=4)
    versions = {0: copy.deepcopy(model)}

    def push_while_generating():
        while control(url, "/_standin/counts")["running"] < 4:  # a request of ours is being generated
            time.sleep(0.02)
        for version in (1, 2, 3):
            with torch.no_grad():
                for p in model.parameters():
                    p.add_(0.02 * torch.randn_like(p))
            sender.update_weights()
            versions[version] = copy.deepcopy(model)
            time.sleep(0.15)

    pusher = threading.Thread(target=push_while_generating)
    pusher.start()
    prompts = [tokenizer(p)["input_ids"] for p in ("1+2=", "3+3=", "12+4=", "2+0=")]
    td = engine.generate(prompts, group_size=4, seeds=[1, 2, 3, 4])
    pusher.join()
    counts = control(url, "/_standin/counts")
    sender.close()
    assert counts["sampled"] == int(td[batch.COMPLETION_MASK].sum()), "every token the server drew is in the rollout"
    assert (td[batch.FINISH_REASON] != batch.FINISH_ABORT).all()
    first, last = td[batch.WEIGHT_VERSION], td[batch.WEIGHT_VERSION_LAST]
    assert (last > first).any() and int(last.max()) <= 3, "partial rollouts, recorded as such"
    requests = sum(path == "/generate" for path, _ in server_state(url)["requests"])
    reads = sum(path == "/model_info" for path, _ in server_state(url)["requests"])
    assert reads == (0 if version == NEWEST else requests), "per-token versions where the server gives them"
    if mode == "retract":
        assert counts["aborted"] == 0 and counts["retracted"] > 0 and requests == 4
    else:
        assert counts["aborted"] > 0 and requests > 4, "aborted completions were continued, not sent again"
    with torch.no_grad():  # [versions, N, C]: each version's logprob of every token
        forwards = torch.stack([sequence_logprobs(versions[v], td[batch.PROMPT_IDS], td[batch.PROMPT_MASK],
                                                  td[batch.COMPLETION_IDS], td[batch.COMPLETION_MASK], temperature=1.0)
                                for v in range(4)])
    close = (forwards - td[batch.ENGINE_LOGPROBS]).abs() < 1e-4
    in_span = (torch.arange(4)[:, None] >= first) & (torch.arange(4)[:, None] <= last)  # [versions, N]
    matched = (close & in_span[..., None]).any(0)
    assert matched[td[batch.COMPLETION_MASK].bool()].all(), "each token's logprob is one of its row's versions'"


# -------------------------------------------------------------------------------------------- context limits


@pytest.mark.parametrize("version", VERSIONS)
def test_requests_stay_inside_the_servers_context_and_its_schedulers_limits(model_dir, servers, tokenizer, version):
    """SGLang's two sets of limits, each as its source has it: the tokenizer manager's context rule, and the
    scheduler's max_req_len = min(context - 1, pool - 1) with max_req_input_len = max_req_len - 5 (a longer prompt
    fails the whole request with 400, max_new_tokens is cut without a word). The engine keeps every sequence within
    max_req_input_len, so that a pool smaller than the context refuses nothing."""
    url = servers.get(model_dir, "--deterministic", "--context-length", "24", version=version)
    client = HTTPClient(url, retries=0)
    info = client.get("/server_info")
    assert (info["max_total_num_tokens"], info["max_req_input_len"]) == (16384, 18)
    # SGLang's own rule: 0.5.9 refuses a request that fills the context, 0.5.23 only one that overflows it ...
    full = {"input_ids": [7] * 16, "sampling_params": {"max_new_tokens": 8, "ignore_eos": True}}
    if version == "0.5.9":
        with pytest.raises(ServerError, match="HTTP 400: Requested token count exceeds the model's maximum context "
                                              "length of 24 tokens. You requested a total of 24 tokens"):
            client.post("/generate", full)
    else:  # ... and then the scheduler cuts it to max_req_len - prompt - 1 tokens, silently
        assert client.post("/generate", full)["meta_info"]["finish_reason"] == {"type": "length", "length": 6}
    with pytest.raises(ServerError, match=r"The input \(24 tokens\) is longer than the model's context length"):
        client.post("/generate", {"input_ids": [7] * 24, "sampling_params": {"max_new_tokens": 1}})
    with pytest.raises(ServerError, match=r"HTTP 400: Input length \(18 tokens\) exceeds the maximum allowed length "
                                          r"\(18 tokens\)"):  # one prompt too long fails the batch
        client.post("/generate", {"input_ids": [[7] * 4, [7] * 18], "sampling_params": {"max_new_tokens": 1}})
    # a KV pool smaller than the context: max_req_len 19, max_req_input_len 14
    control(url, "/_standin/reset", {"flags": ["--deterministic", "--context-length", "24", "--max-total-tokens", "20"]})
    engine = SGLangEngine([url], tokenizer, max_new_tokens=8)
    assert (engine.context_length, engine.context_limit) == (24, 14)
    td = engine.generate([[7] * 10, [7] * 14, [7] * 4], 1, seeds=[0, 1, 2])
    lengths = td[batch.COMPLETION_MASK].sum(-1).tolist()
    assert lengths[0] <= 4 and lengths[1] == 0 and int(td[batch.FINISH_REASON][1]) == batch.FINISH_LENGTH
    sent = [(len(ids), p["max_new_tokens"]) for path, body in server_state(url)["requests"] if path == "/generate"
            for ids, p in zip(body["input_ids"], body["sampling_params"])]
    assert sorted(sent) == [(4, 8), (10, 4)], "budgets cut to the limit; a full sequence is not sent at all"


def test_a_prompt_that_can_never_fit_is_refused_before_the_first_batch(model_dir, servers, tokenizer):
    from grpo_accel.recipe.build import COLLECTOR_NAMES
    from grpo_accel.rewards import RewardSet, answer_match
    from grpo_accel.rollout.collector import GRPOCollector

    engine = SGLangEngine([servers.get(model_dir, "--context-length", "24")], tokenizer, max_new_tokens=8)
    rows = [{"prompt": "1+2=", "answer": "3"}, {"prompt": "1+2+3+4+5+6+7+8=", "answer": "36"}]
    with pytest.raises(DataError, match=r"^max_new_tokens=8: the longest prompt \(row 1, \d+ tokens\) .* "
                                        r"exceed the 18 tokens .*or max_prompt_tokens \(now None\)"):
        GRPOCollector(engine, tokenizer, rows, RewardSet({"a": answer_match}), layout=BatchLayout(2, 2))
    with pytest.raises(DataError, match=r"^rollout.max_new_tokens=8: the longest prompt \(row 1, \d+ tokens\) .* "
                                        r"exceed the 18 tokens .*rollout.max_prompt_tokens"):  # as the recipe builds it
        GRPOCollector(engine, tokenizer, rows, RewardSet({"a": answer_match}), layout=BatchLayout(2, 2),
                      names=COLLECTOR_NAMES)


def test_episodes_that_fill_the_context_end_length_on_both_engines(servers, tmp_path):
    """Episodes (tests/helpers/episode_env.py's Countdown, up to 3 turns) on a context too short for all their turns:
    each later turn gets the room left, and an episode whose context is full ends with finish reason "length"
    without a request past the context, on SGLang and embedded (the model's max_position_embeddings) alike."""
    from transformers import AutoModelForCausalLM

    from episode_env import Countdown, chat_tokenizer, short_turn_model
    from grpo_accel.embedded.engine import EmbeddedEngine
    from grpo_accel.rollout.episodes import EpisodeRunner

    tok = chat_tokenizer()
    rows = [{"prompt": p, "answer": "0"} for p in ("22+2=", "3+33=", "55*5")]  # 2 or 3 turns each
    probe = EpisodeRunner(EmbeddedEngine(short_turn_model(tok), tok, max_new_tokens=6), tok, Countdown, max_turns=3)
    longest = max(len(ids) for ids in probe.encode(rows).ids)
    context = longest + 14  # room for about two turns
    folder = tmp_path / "short_turns"
    short_turn_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    url = servers.get(folder, "--deterministic", "--context-length", str(context))
    model = AutoModelForCausalLM.from_pretrained(folder)
    model.config.max_position_embeddings = context - 1  # the same limit for the embedded engine
    for engine in (SGLangEngine([url], tok, max_new_tokens=6), EmbeddedEngine(model, tok, max_new_tokens=6)):
        runner = EpisodeRunner(engine, tok, Countdown, max_turns=3)
        td, episodes = runner.run(rows, runner.encode(rows), group_size=2, seeds=[1, 2, 3])
        total = td[batch.PROMPT_MASK].sum(-1) + td[batch.COMPLETION_MASK].sum(-1)
        assert int(total.max()) <= context - 1
        cut = [ep for ep in episodes if ep.finish == batch.FINISH_LENGTH]
        assert cut and all(ep.turns < 3 or ep.messages[-1]["role"] == "assistant" for ep in cut)
    sent = [len(ids) + p["max_new_tokens"] for path, body in server_state(url)["requests"] if path == "/generate"
            for ids, p in zip(body["input_ids"], body["sampling_params"])]
    assert max(sent) <= context - 1
    # and a run on such episodes trains on (launch/train.py in this process)
    from grpo_accel.reporting.event_files import read_scalars

    data, out = tmp_path / "rows.jsonl", tmp_path / "run"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows * 2))
    assert train_in_process([f"output_dir={out}", f"model.name_or_path={folder}", f"data.path={data}",
                             "rollout.backend=sglang", f"rollout.urls=[{url}]", "weight_sync.backend=gloo",
                             "weight_sync.dtype=float32",
                             "rollout.environment=tests.helpers.episode_env:Countdown", "rollout.max_turns=3",
                             "rollout.max_new_tokens=6", "rollout.prompts_per_batch=3", "rollout.group_size=2",
                             "trainer.total_frames=18", "trainer.progress_bar=false", "rewards=[{name: env_reward}]",
                             "checkpoint.interval_frames=null"]) == 0
    truncated = [v for _, v in read_scalars(out / "tensorboard")["train/truncated_fraction"]]
    assert len(truncated) == 3 and max(truncated) > 0


# ------------------------------------------------------------------------------------ requests sized for work


def test_a_share_goes_out_as_bounded_requests_each_retried_alone(model_dir, servers, tokenizer, caplog):
    caplog.set_level(logging.INFO, "grpo_accel.server_rollouts")  # the line every server engine writes
    url = servers.get(model_dir, "--deterministic", "--decode-delay", "0.1")
    fail_next(url, "/generate", "http_500")  # the first request to arrive fails once
    engine = SGLangEngine([url], tokenizer, max_new_tokens=6, request_size=2, backoff_s=0.01, report_every_s=0.2)
    td = engine.generate([[7, 14], [8, 17], [9, 3]], 2, seeds=[0, 1, 2])
    assert td.shape == (6,)
    sizes = [len(body["input_ids"]) for path, body in server_state(url)["requests"] if path == "/generate"]
    assert sizes == [2, 2, 2, 2], "three requests of 2 completions, one of them sent again alone"
    lines = [r.getMessage() for r in caplog.records if "requests outstanding" in r.getMessage()]
    assert lines and f"{url}: " in lines[0] and "of 3 requests outstanding" in lines[0]
    slow = SGLangEngine([url], tokenizer, max_new_tokens=30, retries=0, request_timeout_s=0.3)
    with pytest.raises(ServerError, match="/generate: the server took the request but did not answer within"):
        slow.generate([[7, 14]], 2)


# --------------------------------------------------------------------------- tensor parallel and dp attention


def test_a_tp2_server_and_a_dp_attention_server_receive_the_trainers_weights_bitwise(accelerator, model_dir,
                                                                                    servers):
    """A server emulating TP 2 joins the weight-update group as ranks 1 and 2 (its second rank a process of its
    own, receiving every broadcast); a dp-attention server (--dp-size 2 --enable-dp-attention, which SGLang
    serves weight updates to) as rank 3."""
    from transformers import AutoModelForCausalLM

    tp = servers.get(model_dir, "--tp-size", "2")
    dp = servers.get(model_dir, "--dp-size", "2", "--enable-dp-attention", version=VERSIONS[0])
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        for p in model.parameters():
            p.add_(0.01)
    sender = distributed_sender(accelerator, model, [tp, dp], load_format="flattened_bucket")
    sender.update_weights()
    expected = control(tp, "/_standin/digest")
    ours = {n: hashlib.sha256(p.detach().float().numpy().tobytes()).hexdigest() for n, p in model.named_parameters()}
    assert expected == ours and control(dp, "/_standin/digest") == ours
    assert control(tp, "/_standin/tp_digests") == [ours], "TP rank 1 received every tensor too"
    joins = [next(b for p, b in server_state(u)["requests"] if p == "/init_weights_update_group") for u in (tp, dp)]
    assert [(j["rank_offset"], j["world_size"]) for j in joins] == [(1, 4), (3, 4)]
    sender.close()


# ------------------------------------------------------------------ asynchronous collection under ZeRO-3


def test_zero3_async_run_with_four_pushes_per_batch_keeps_every_token(tmp_path, model_dir, servers):
    """2 processes, ZeRO-3, SGLang, trainer.async_collection=true: each batch of 32 completions trains in 4
    optimizer steps, each followed by a push, while the next batch is generated (a decode step lasts 0.2 s). The
    run finishes, the server holds the trainer's final weights bitwise, no token was aborted or drawn for
    nothing, and the partial rollouts are in the metrics."""
    from grpo_accel.reporting.event_files import read_scalars
    from test_sglang_runs import assert_server_holds_checkpoint, sglang_args

    url, out = servers.get(model_dir, "--deterministic", "--decode-delay", "0.2"), tmp_path / "run"
    proc = launch("zero3.yaml", sglang_args(
        out, url, model_dir, "trainer.total_frames=128", "rollout.prompts_per_batch=8", "rollout.group_size=4",
        "rollout.max_new_tokens=8", "rollout.request_size=4", "trainer.micro_batch_completions=4",
        "trainer.async_collection=true", "trainer.max_staleness=null", "weight_sync.pause_mode=retract"))
    assert_server_holds_checkpoint(url, out)
    assert proc.stderr.count("batch layout: ") == 1 and proc.stderr.count("SGLang servers: ") == 1, "said once"
    counts = control(url, "/_standin/counts")
    scalars = read_scalars(out / "tensorboard")
    lengths = [v for _, v in scalars["train/completion_length_mean"]]
    assert len(lengths) == 4 and counts["aborted"] == 0 and counts["sampled"] == counts["returned"]
    assert counts["retracted"] > 0, "pushes landed while requests were in flight"
    summary = json.loads((out / "summary.json").read_text())
    assert summary["weight_version"] == 16 and server_state(url)["weight_version"] == "16"
    partial = [v for _, v in scalars["train/partial_rollout_fraction"]]
    assert max(partial) > 0 and max(v for _, v in scalars["train/weight_version_spread_max"]) >= 1
    assert max(v for _, v in scalars["train/staleness"]) >= 3, "batches were generated while 4 pushes went by"


# ------------------------------------------------------------------------------------------ another host


def test_servers_on_another_host_get_the_weights_with_no_address_set(tmp_path, model_dir):
    """Trainer (2 processes, ZeRO-3) and servers on two "machines" (network namespaces, tests/helpers/netns.py): a
    server emulating TP 2 and a 0.5.9 one on 10.231.0.2, the trainer on 10.231.0.1 with no address given; it
    hosts the weight-update group at its own address on the route to the servers, which receive its weights
    bitwise (the TP server's second rank too)."""
    import subprocess
    import sys

    from launching import ROOT
    from netns import two_hosts
    from test_sglang_runs import final_policy, sglang_args

    with two_hosts() as hosts:
        address = hosts.addresses[1]
        urls = [f"http://{address}:30000", f"http://{address}:30001"]
        servers = [subprocess.Popen([*hosts.prefix(1), sys.executable, str(ROOT / "launch" / "bench" / "sglang_standin"),
                                     "--host", address, "--port", url.rsplit(":", 1)[1], "--model", str(model_dir),
                                     "--sglang-version", version, "--deterministic", *flags],
                                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                   for url, version, flags in ((urls[0], NEWEST, ("--tp-size", "2")), (urls[1], VERSIONS[0], ()))]
        try:
            for url in urls:
                hosts.wait_healthy(1, url)
            out = tmp_path / "run"
            proc = launch("zero3.yaml", sglang_args(out, ",".join(urls), model_dir),
                          prefix=hosts.prefix(0, gloo_interface=False))
            assert f"weight-update group at {hosts.addresses[0]}:" in proc.stderr
            expected = {n: hashlib.sha256(p.float().numpy().tobytes()).hexdigest()
                        for n, p in final_policy(out).items()}
            for url in urls:
                assert hosts.control(1, url, "/_standin/digest") == expected, url
            assert hosts.control(1, urls[0], "/_standin/tp_digests") == [expected]
        finally:
            for server in servers:
                server.kill()
                server.wait()


# ------------------------------------------------------------------------------------------ colocated servers


def test_colocated_servers_free_their_memory_while_the_trainer_trains(tmp_path, model_dir, servers):
    """rollout.colocate=true against a server with --enable-memory-saver: after every collection the server is
    paused and frees its KV cache, weights and CUDA graphs; the push takes back the weights and CUDA graphs, loads
    the weights, takes back the KV cache, and only then lets it generate (SGLang's order; the stand-in dies, as
    SGLang does, on generation or loading into freed memory and on a release while requests run), and a server
    without the flag is refused at start."""
    from grpo_accel.config.checks import ConfigError
    from test_sglang_runs import assert_server_holds_checkpoint, sglang_args

    url, out = servers.get(model_dir, "--deterministic", "--enable-memory-saver"), tmp_path / "run"
    train_in_process(sglang_args(out, url, model_dir, "rollout.colocate=true"))
    assert_server_holds_checkpoint(url, out)
    memory = {"/release_memory_occupation": "release", "/resume_memory_occupation": "resume"}
    calls = []
    for path, body in server_state(url)["requests"]:
        name = memory.get(path) or {"/generate": "generate", "/update_weights_from_distributed": "load",
                                    "/pause_generation": "pause", "/continue_generation": "continue"}.get(path)
        label = f"{name} {','.join(body['tags'])}" if path in memory else name
        if name is not None and (not calls or calls[-1] != label):
            calls.append(label)
    one_batch = ["generate", "pause", "release kv_cache,weights,cuda_graph", "resume weights,cuda_graph", "pause",
                 "load", "resume kv_cache", "continue"]
    assert calls[:16] == one_batch * 2 and calls.count("release kv_cache,weights,cuda_graph") == 3
    from grpo_accel.config.loading import load_config

    with pytest.raises(ConfigError, match="colocated servers free their memory while the trainer trains"):
        load_config(None, ["rollout.backend=sglang", "rollout.urls=[http://h:1]", "rollout.colocate=true",
                           "trainer.async_collection=true"])
    plain = servers.get(model_dir, "--deterministic")
    with pytest.raises(ConfigError, match=f"rollout.colocate=true: {plain} runs without --enable-memory-saver"):
        train_in_process(sglang_args(tmp_path / "refused", plain, model_dir, "rollout.colocate=true"))
