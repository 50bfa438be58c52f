"""SGLang: the HTTP engine and the weight senders against launch/bench/sglang_standin, a loopback server built from
SGLang's own code and source (its request classes, auth decision, group join and session guards), for the oldest
and newest supported release."""
import hashlib
import logging

import pytest
import torch

from grpo_accel import batch
from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.logprobs import sequence_logprobs
from grpo_accel.recipe.wiring import SGLANG_NAMES
from grpo_accel.sglang.engine import SGLangEngine
from launching import free_port
from sglang_standin.source import VERSIONS
from sglang_standin.processes import NEWEST, control, fail_next, server_state
from trainer_utils import reset_accelerate_state
from weight_senders import distributed_sender


@pytest.fixture
def server(fresh_server):
    return fresh_server()


# ------------------------------------------------------------------------------------------- rollouts


def test_rollouts_carry_engine_logprobs_equal_to_the_trainer_forward(server, tokenizer, model_dir):
    from transformers import AutoModelForCausalLM

    engine = SGLangEngine([server, server], tokenizer, max_new_tokens=5, temperature=0.7)
    prompts = [tokenizer(p)["input_ids"] for p in ["1+2=", "3+3=", "12+4="]]
    td = engine.generate(prompts, group_size=4, seeds=[1, 2, 3])
    assert td.shape == (12,) and (td[batch.WEIGHT_VERSION] == 0).all()
    model = AutoModelForCausalLM.from_pretrained(model_dir)
    with torch.no_grad():
        teacher = sequence_logprobs(model, td[batch.PROMPT_IDS], td[batch.PROMPT_MASK], td[batch.COMPLETION_IDS],
                                    td[batch.COMPLETION_MASK], temperature=0.7)
    torch.testing.assert_close(td[batch.ENGINE_LOGPROBS], teacher, atol=1e-5, rtol=1e-5)
    for ids, mask, reason in zip(td[batch.COMPLETION_IDS], td[batch.COMPLETION_MASK], td[batch.FINISH_REASON]):
        n = int(mask.sum())
        assert (reason == batch.FINISH_STOP) == (ids[n - 1] == tokenizer.eos_token_id)
    again = engine.generate(prompts, group_size=4, seeds=[1, 2, 3])
    assert torch.equal(again[batch.COMPLETION_IDS], td[batch.COMPLETION_IDS]), "sampling_seed makes rollouts reproducible"


@pytest.mark.parametrize("version", VERSIONS)
def test_a_server_without_deterministic_inference_is_named_once(model_dir, servers, tokenizer, caplog, version):
    engine = SGLangEngine([servers.get(model_dir, version=version)], tokenizer, max_new_tokens=3)
    assert engine.generate([[7, 14, 8]], 2, seeds=[0]).shape == (2,)
    assert caplog.text.count("sampling_seed is ignored by") == 1
    assert "--enable-deterministic-inference" in caplog.text


def test_sglangs_validation_reaches_the_user(server):
    client = HTTPClient(server, retries=0)
    with pytest.raises(ServerError, match=r"HTTP 400: unknown field `beam_widthx`"):
        client.post("/generate", {"input_ids": [1, 2], "sampling_params": {"beam_widthx": 2}})
    with pytest.raises(ServerError, match="(?s)HTTP 400: .*shapes.*Field required"):
        client.post("/update_weights_from_distributed", {"names": ["a"], "dtypes": ["float32"]})
    with pytest.raises(ServerError, match="HTTP 404"):
        client.post("/update_weights_from_distributed_v2", {})


def test_transient_failures_are_retried_and_aborts_too(server, tokenizer):
    fail_next(server, "/generate", "http_500", times=2)
    engine = SGLangEngine([server], tokenizer, max_new_tokens=3, retries=3, backoff_s=0.01)
    assert engine.generate([[7, 14, 8, 17]], 2, seeds=[0]).shape == (2,)
    fail_next(server, "/generate", "http_500", times=5)
    with pytest.raises(ServerError, match="HTTP 500: injected failure"):
        SGLangEngine([server], tokenizer, max_new_tokens=3, retries=2, backoff_s=0.01).generate([[7]], 2)
    fail_next(server, "/generate", "abort")
    td = engine.generate([[7, 14, 8, 17]], 2, seeds=[0])
    assert (td[batch.FINISH_REASON] != batch.FINISH_ABORT).all(), "an aborted batch is generated again"
    fail_next(server, "/generate", "abort", times=9)
    with pytest.raises(ServerError, match="kept aborting without generating \\(Abort before prefill, status 503\\) "
                                          "after 3 retries"):
        engine.generate([[7]], 2)


def test_keys_health_wait_and_unreachable_servers(model_dir, servers, tokenizer):
    url = servers.get(model_dir, "--api-key", "s3cret", "--startup-delay", "1.5")  # answers 503 for 1.5 s
    engine = SGLangEngine([url], tokenizer, max_new_tokens=2, api_key="s3cret", health_timeout_s=30)
    assert engine.generate([[7, 14]], 2).shape == (2,)
    asked = [path for path, _ in server_state(url)["requests"]]
    assert asked.count("/server_info") > 1 and asked.count("/health") == 1, "it waited for the server, then its health"
    # /health needs no key in SGLang: a wrong key is caught at /server_info, before the first batch; the message
    # names the engine's argument, or the config's key when the recipe built the engine (names=SGLANG_NAMES)
    with pytest.raises(ServerError, match=r"/server_info -> HTTP 401: Unauthorized; the server wants another "
                                          r"key: set api_key\."):
        SGLangEngine([url], tokenizer, max_new_tokens=2, api_key="wrong")
    with pytest.raises(ServerError, match=r"the server wants another key: set rollout.api_key\."):
        SGLangEngine([url], tokenizer, max_new_tokens=2, api_key="wrong", names=SGLANG_NAMES)
    with pytest.raises(ServerError, match=r"did not answer /server_info within 1 s.*urls is right, or raise health_timeout_s"):
        SGLangEngine([f"http://127.0.0.1:{free_port()}"], tokenizer, max_new_tokens=2, health_timeout_s=1)
    with pytest.raises(ServerError, match=r"did not answer /server_info within 1 s.*rollout.urls is right.*rollout.health_timeout_s"):
        SGLangEngine([f"http://127.0.0.1:{free_port()}"], tokenizer, max_new_tokens=2, health_timeout_s=1,
                     names=SGLANG_NAMES)


def test_waiting_for_a_server_says_what_it_waits_for(caplog):
    url = f"http://127.0.0.1:{free_port()}"
    with pytest.raises(ServerError, match="did not answer /health within 1 s"):
        HTTPClient(url, kind="SGLang server").wait_healthy(1, poll_s=0.05, report_every_s=0.25)
    reports = [r.getMessage() for r in caplog.records if "waiting for SGLang server" in r.getMessage()]
    assert 2 <= len(reports) <= 4, reports
    assert f"waiting for SGLang server {url}" in reports[0] and "nothing listens there yet" in reports[0]
    assert "s left of health_timeout_s" in reports[0]


# ------------------------------------------------------------------- weight senders, in this process


def trained(model, step=0.01):
    """Change every weight, as an optimizer step would."""
    with torch.no_grad():
        for p in model.parameters():
            p.add_(step)
    return model


def assert_server_holds(url, model):
    params = dict(model.named_parameters())
    state = server_state(url)["params"]
    assert state.keys() == params.keys()
    for name, value in state.items():
        assert torch.equal(torch.tensor(value), params[name].detach()), name


@pytest.mark.parametrize("version", VERSIONS)
@pytest.mark.parametrize("load_format", ["per_tensor", "flattened_bucket"])
def test_a_refused_update_gets_a_new_group_and_everything_is_pushed_again(accelerator, model_dir, fresh_server,
                                                                          version, load_format, caplog):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    url = fresh_server(version)
    sender = distributed_sender(accelerator, model, url, load_format=load_format)
    first_group = server_state(url)["groups"]
    sender.update_weights()
    assert_server_holds(url, model)
    trained(model)
    fail_next(url, "/update_weights_from_distributed", "refuse")  # refused before it received anything
    sender.update_weights()
    state = server_state(url)
    assert "pushing everything again" in caplog.text
    assert state["weight_version"] == "2" and not state["session_open"]
    assert state["groups"] != first_group and len(state["groups"]) == 1, "the group was made again"
    assert_server_holds(url, model)
    trained(model)
    fail_next(url, "/update_weights_from_distributed", "success_false")  # received, then failed to load
    sender.update_weights()
    assert_server_holds(url, model)
    sender.close()
    state = server_state(url)
    assert state["groups"] == [] and state["weight_version"] == "3"
    paths = [p for p, _ in state["requests"]]
    assert ("/begin_weight_update" in paths) == (version == NEWEST) and "/get_server_info" not in paths
    assert paths.count("/destroy_weights_update_group") == 3  # two rebuilds and the close; none at start
    assert paths.count("/get_weights_by_name") == 1 + 6, "asked once if it works, then 2 parameters after 3 pushes"


def test_the_check_reads_the_smallest_trained_weights(accelerator, model_dir, servers):
    """A server lists a whole parameter to answer /get_weights_by_name (SGLang's llama.py ``get_weights_by_name``:
    ``.numpy().tolist()[:truncate_size]``; SmolLM2's embedding took seconds), so a push checks the smallest
    weights that training changes: a frozen one is never read, nor the embedding; a vector is compared whole."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    model.model.norm.weight.requires_grad_(False)
    url = servers.get(model_dir, "--deterministic")
    sender = distributed_sender(accelerator, model, url)
    sender.update_weights()
    asked = [body for path, body in server_state(url)["requests"] if path == "/get_weights_by_name"]
    sizes = {name: p.numel() for name, p in model.named_parameters() if p.requires_grad}
    assert len(asked) == 1 + 2 and {b["name"] for b in asked} <= {n for n, size in sizes.items() if size == min(sizes.values())}
    assert all(b["truncate_size"] == sizes[b["name"]] for b in asked[1:])  # vectors: every element compared
    assert model.model.norm.weight.numel() == min(sizes.values())  # the frozen one would have been a candidate
    sender.close()


def test_verification_catches_a_server_that_did_not_load(accelerator, model_dir, qwen_dir, servers, caplog):
    """A server that answers success without holding the pushed weights: by /get_weights_by_name (Llama), and
    by the probe logprobs for a model that does not implement it (Qwen2), said once."""
    from transformers import AutoModelForCausalLM

    from grpo_accel.sglang.sender import WeightSyncError

    for folder, expected in ((model_dir, "differs from the trainer's"), (qwen_dir, "probe logprobs differ")):
        model = AutoModelForCausalLM.from_pretrained(folder)
        url = servers.get(folder, "--deterministic")
        sender = distributed_sender(accelerator, model, url)
        sender.update_weights()
        trained(model, 0.05)
        sender.update_weights()
        assert_server_holds(url, model)
        trained(model, 0.05)
        fail_next(url, "/update_weights_from_distributed", "ignore", times=100)
        with pytest.raises(WeightSyncError, match=expected):
            sender.update_weights()
        sender.close()
    assert caplog.text.count("does not implement /get_weights_by_name") == 1


def test_the_group_join_failure_names_the_store_and_the_servers(accelerator, model_dir, servers):
    from grpo_accel.sglang.sender import WeightSyncError

    url, port = servers.get(model_dir), free_port()  # the hung join ends at the next reset
    fail_next(url, "/init_weights_update_group", "hang")
    with pytest.raises(WeightSyncError) as info:
        distributed_sender(accelerator, torch.nn.Linear(2, 2), url, master_port=port, timeout_s=2)
    message = str(info.value)
    assert "the weight-update group 'weight_update_group-" in message and "did not form within 2 s" in message
    assert f"TCP store 127.0.0.1:{port}, keys under 'weight_update_group-" in message
    assert f"{url} as ranks 1..1" in message and "connecting to master_address:master_port" in message


def test_the_groups_port_is_a_free_one_unless_set_and_a_taken_one_is_one_line(accelerator, model_dir, servers,
                                                                                caplog):
    """Issue 74 items 18 and 8: a fixed port (29600) made two trainers on one host collide; a join refused at once
    read "did not form within 2 s"."""
    import socket

    from grpo_accel.sglang.sender import WeightSyncError

    url = servers.get(model_dir)
    with caplog.at_level(logging.INFO):
        sender = distributed_sender(accelerator, torch.nn.Linear(2, 2), url, master_port=None)
    port = sender.transport.group.port
    assert (f"weight-update group at 127.0.0.1:{port} (this trainer's address on the route to {url}: set "
            "master_address to choose another; a free port: master_port is null)") in caplog.text
    sender.close()
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        busy = taken.getsockname()[1]
        with pytest.raises(WeightSyncError) as info:
            distributed_sender(accelerator, torch.nn.Linear(2, 2), url, master_port=busy)
    assert str(info.value) == (f"master_port={busy}: the weight-update group's store cannot listen on "
                               f"127.0.0.1:{busy} (address already in use); choose another port, or null for a free "
                               "one.")
    fail_next(url, "/init_weights_update_group", "http_500", times=5)  # the server fails the join at once
    with pytest.raises(WeightSyncError, match=r"the weight-update group '[^']+' could not form \(\d\.\d s\): "):
        distributed_sender(accelerator, torch.nn.Linear(2, 2), url, timeout_s=20)


@pytest.mark.parametrize("flag", ["--dp-size", "--pp-size"])
def test_servers_whose_updates_sglang_refuses_are_refused_before_any_push(accelerator, model_dir, servers, flag):
    url = servers.get(model_dir, flag, "2")
    with pytest.raises(RuntimeError, match=f"runs with {flag} 2"):
        distributed_sender(accelerator, torch.nn.Linear(2, 2), url)
    assert "/init_weights_update_group" not in [p for p, _ in server_state(url)["requests"]]


def test_admin_key_for_weight_endpoints(accelerator, model_dir, servers):
    """SGLang's auth levels: with --admin-api-key set, weight endpoints refuse the --api-key."""
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(model_dir)
    url = servers.get(model_dir, "--api-key", "user", "--admin-api-key", "admin")
    with pytest.raises(ServerError, match=r"HTTP 401.*set weight_sync.admin_api_key \(or rollout.api_key when"):
        # the trainer's side of the refused join waits out timeout_s in a thread: 3 s, not a pending wait at exit
        distributed_sender(accelerator, model, url, api_key="user", timeout_s=3, names=SGLANG_NAMES)
    sender = distributed_sender(accelerator, model, url, api_key="user", admin_api_key="admin")
    sender.update_weights()
    assert_server_holds(url, model)
    sender.close()


def test_two_servers_get_consecutive_ranks(accelerator, model_dir, fresh_server):
    from transformers import AutoModelForCausalLM

    model = trained(AutoModelForCausalLM.from_pretrained(model_dir))
    a, b = fresh_server(), fresh_server(VERSIONS[0])
    sender = distributed_sender(accelerator, model, [a, b], load_format="flattened_bucket")
    sender.update_weights()
    for url, rank in ((a, 1), (b, 2)):
        assert_server_holds(url, model)
        init = next(body for path, body in server_state(url)["requests"] if path == "/init_weights_update_group")
        assert (init["rank_offset"], init["world_size"]) == (rank, 3)
    sender.close()


def test_a_real_pretrained_llama_round_trips_in_bfloat16(accelerator, smollm2, servers):
    """SmolLM2-135M-Instruct (tied embeddings, grouped-query attention) pushed in bfloat16, as a GPU run would."""
    from transformers import AutoModelForCausalLM

    model = trained(AutoModelForCausalLM.from_pretrained(smollm2), 1e-3)
    url = servers.get(smollm2)
    sender = distributed_sender(accelerator, model, url, dtype=torch.bfloat16, bucket_mb=64)
    sender.update_weights()
    digest = control(url, "/_standin/digest")
    sender.close()
    expected = {n: hashlib.sha256(p.detach().to(torch.bfloat16).float().numpy().tobytes()).hexdigest()
                for n, p in model.named_parameters()}
    assert digest == expected  # the server holds the bfloat16 of every trained weight


def test_tensor_path_needs_sglang_and_a_gpu(tokenizer):
    from accelerate import Accelerator

    from grpo_accel.sglang.from_tensor import TensorWeightSender
    from grpo_accel.tasks.tiny import build_tiny_model

    with pytest.raises((ImportError, RuntimeError), match="sglang|GPU"):
        TensorWeightSender(Accelerator(), build_tiny_model(tokenizer), ["http://127.0.0.1:1"])
    reset_accelerate_state()
