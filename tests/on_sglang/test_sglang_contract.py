"""grpo_accel's SGLang client against SGLang's own source, release by release (the ends of the supported range).

The source is each release's wheel (launch/bench/sglang_standin/source.py): the request classes and the group join are SGLang's
code, run here; the routes, auth levels and session guards are read from its files.
"""
import subprocess
import sys

import pytest
import torch

from grpo_accel.sglang import api
from launching import ROOT, free_port
from sglang_standin.source import VERSIONS, SGLangSource


@pytest.fixture(scope="module", params=VERSIONS)
def source(request):
    return SGLangSource(request.param)


def every_request(session: bool):
    """One call of every body builder the client has, with realistic arguments."""
    requests = [
        api.generate([[1, 2, 3], [1, 2, 3]], [api.sampling_params(8, 0.7, 0.9, 0, seed=5),
                                              api.sampling_params(8, 0.0, 1.0, 20, seed=None, stop_token_ids=[5, 9])],
                     ["3f2a", "3f2b"]),
        api.prompt_logprobs(list(range(1, 33))), api.prompt_logprobs(list(range(1, 33)), dp_rank=1),
        api.abort_request("3f2a"), api.abort_all_requests(), api.release_memory_occupation(list(api.MEMORY_TAGS)),
        api.resume_memory_occupation(["kv_cache"]),
        *(api.pause_generation(mode) for mode in api.PAUSE_MODES), api.continue_generation(),
        api.init_weights_update_group("10.0.0.1", 29600, 1, 3, "weight_update_group-ab12cd34-1", "nccl"),
        api.destroy_weights_update_group("weight_update_group-ab12cd34-1"),
        api.update_weights_from_distributed(["model.embed_tokens.weight", "lm_head.weight"], ["bfloat16"] * 2,
                                            [[32, 8], [32, 8]], "weight_update_group-ab12cd34-1", False, False, 3),
        api.update_weights_from_distributed(["model.norm.weight"], ["float32"], [[8]], "weight_update_group-ab12cd34-1",
                                            True, True, 3),
        api.update_weights_from_tensor(["YWJj", "ZGVm"], True, 3),
        api.update_weights_from_disk("/shared/weights/version_000003", 3),
        api.get_weights_by_name("model.embed_tokens.weight", 4),
    ]
    if session:
        requests += [api.begin_weight_update(), api.end_weight_update()]
    return requests


def test_every_request_body_passes_sglangs_own_validation(source):
    session = "/begin_weight_update" in source.routes
    for path, body in every_request(session):
        route = source.routes.get(path)
        assert route is not None and "POST" in route.methods, f"SGLang {source.version} has no POST {path}"
        if path == "/generate":
            assert source.generate_contract_error(body) is None, body
            assert set(body) <= source.field_names("GenerateReqInput"), body
            continue
        fields = source.field_names(route.request_class)
        assert set(body) <= fields, f"{path}: {sorted(set(body) - fields)} are not fields of {route.request_class}"
        source.validate(route.request_class, body)  # raises with pydantic's message


def test_the_validation_used_here_refuses_what_sglang_refuses(source):
    """The checks above can fail: SGLang's classes refuse a missing field and a wrong type, its /generate
    contract an unknown sampling parameter."""
    with pytest.raises(ValueError, match="shapes"):
        source.validate("UpdateWeightsFromDistributedReqInput", {"names": ["a"], "dtypes": ["bfloat16"]})
    with pytest.raises(ValueError, match="flush_cache"):
        source.validate("UpdateWeightsFromDistributedReqInput",
                        {"names": ["a"], "dtypes": ["bfloat16"], "shapes": [[2]], "flush_cache": "sometimes"})
    assert "beam_widthx" in source.generate_contract_error({"input_ids": [1], "sampling_params": {"beam_widthx": 2}})


def test_the_client_knows_each_releases_weight_update_rules(source):
    info = api.ServerInfo.from_json("http://s", {"version": source.version_string})
    guards = source.session_guards
    assert info.needs_session == ("update_weights_from_distributed" in guards)
    assert ("/begin_weight_update" in source.routes) == info.needs_session
    if info.needs_session:  # the refusal grpo_accel prevents by opening a session, word for word
        assert guards["update_weights_from_distributed"].refuse_when == "closed"
        assert guards["begin_weight_update"].refuse_when == "open"
    # weight and pause endpoints take the admin key, /generate and /server_info the --api-key
    admin = ["/pause_generation", "/continue_generation", "/init_weights_update_group", "/destroy_weights_update_group",
             "/update_weights_from_distributed", "/update_weights_from_tensor", "/update_weights_from_disk",
             "/get_weights_by_name"] + (["/begin_weight_update", "/end_weight_update"] if info.needs_session else [])
    assert {p: source.routes[p].auth_level for p in admin} == dict.fromkeys(admin, "ADMIN_OPTIONAL")
    assert {p: source.routes[p].auth_level for p in ("/generate", "/server_info", "/health")} == \
        dict.fromkeys(("/generate", "/server_info", "/health"), "NORMAL")
    assert source.routes["/server_info"].methods == ("GET",)
    # the words grpo_accel recognises when a model does not implement /get_weights_by_name
    assert f'_create_error_response("{api.WEIGHTS_BY_NAME_MISSING}")' in source.text("sglang/srt/entrypoints/http_server.py")
    assert "LlamaForCausalLM" in source.weights_by_name_architectures
    assert "Qwen2ForCausalLM" not in source.weights_by_name_architectures
    # per-token weight versions in the answers, and the abort route the engine and a starting sender use
    assert info.reports_token_versions == (source.weight_versions is not None)
    assert source.routes["/abort_request"].auth_level == "ADMIN_OPTIONAL"


def test_versions_in_and_out_of_the_supported_range(caplog):
    assert api.parse_version("0.5.10.post1") == (0, 5, 10) and api.parse_version("0.6.0.dev3+g1a2b") == (0, 6, 0)
    with pytest.raises(RuntimeError, match=r"runs SGLang 0\.5\.8; grpo_accel supports 0\.5\.9 to 0\.5\.23"):
        api.ServerInfo.from_json("http://s", {"version": "0.5.8.post1"}).check_supported()
    api.ServerInfo.from_json("http://s", {"version": "0.5.30"}).check_supported()
    assert "newer than the newest release checked here (0.5.23)" in caplog.text
    with pytest.raises(ValueError, match="no 'version'"):
        api.ServerInfo.from_json("http://s", {"tp_size": 1})
    assert api.ServerInfo.from_json("http://s", {"version": "0.5.21"}).needs_session
    assert not api.ServerInfo.from_json("http://s", {"version": "0.5.20"}).needs_session


@pytest.mark.parametrize("field, flag", [("dp_size", "--dp-size"), ("pp_size", "--pp-size")])
def test_topologies_sglang_cannot_update_are_refused_up_front(field, flag):
    info = api.ServerInfo.from_json("http://s", {"version": "0.5.23", field: 2})
    with pytest.raises(RuntimeError, match=f"runs with {flag} 2"):
        info.check_weight_updates()


def test_dp_attention_and_disk_updates_are_served_at_any_dp_size():
    """SGLang asserts ``dp_size == 1 or enable_dp_attention`` for distributed/tensor updates and nothing of the
    kind for disk updates (the sources cited in grpo_accel.sglang.api)."""
    replicas = api.ServerInfo.from_json("http://s", {"version": "0.5.9", "dp_size": 2})
    with pytest.raises(RuntimeError, match="unless it runs --enable-dp-attention"):
        replicas.check_weight_updates("tensor")
    replicas.check_weight_updates("disk")
    api.ServerInfo.from_json("http://s", {"version": "0.5.9", "dp_size": 2, "enable_dp_attention": True}
                             ).check_weight_updates("distributed")


JOINER = """
import os, sys, torch, torch.distributed as dist
sys.path.insert(0, {tests!r})
from sglang_standin.source import SGLangSource
pg = SGLangSource({version!r}).init_custom_process_group(backend="gloo", init_method="tcp://127.0.0.1:{port}",
                                                        world_size=2, rank=1, group_name={name!r})
t = torch.empty(4)
dist.broadcast(t, src=0, group=pg)
print(t.tolist(), flush=True)
dist.destroy_process_group(pg)
os._exit(0)  # gloo's teardown at interpreter exit aborted now and then (SIGABRT, "terminate called without an
# active exception") after the broadcast had arrived: what launch/ does too (runtime.signals.exit_skipping_teardown)
"""


def test_the_trainer_and_sglangs_own_join_meet_in_one_group(source):
    """SGLang's init_custom_process_group (its code, run in a second process) joins the group the trainer hosts
    and receives a broadcast: both sides use the same store keys."""
    from grpo_accel.sglang.group import WeightUpdateGroup

    port = free_port()
    group = WeightUpdateGroup("gloo", "127.0.0.1", port, 2, "weight_update_group", timeout_s=60)
    name = group.new_name()
    code = JOINER.format(tests=str(ROOT / "launch" / "bench"), version=source.version, port=port, name=name)
    server = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        group.join(name)
        group.broadcast(torch.arange(4.0) + 1).wait()
        out, err = server.communicate(timeout=60)
    finally:  # nothing left waiting in this process, whatever happened
        server.kill()
        group.leave(abort=True)
    assert out.strip() == "[1.0, 2.0, 3.0, 4.0]", err
    assert server.returncode == 0, err
    assert group.new_name() != name, "a group made after a failure never reuses the old one's keys"


def test_a_weight_version_is_our_int_and_sglangs_string_only_in_its_requests_and_answers():
    """Issue 51: the version went int -> str -> int under seven names; it is the trainer's int everywhere but the
    JSON SGLang reads and writes (its ``weight_version`` fields are strings, "default" before any update)."""
    route, body = api.update_weights_from_disk("/w/version_000003", 3)
    assert body["weight_version"] == "3"
    assert [api.weight_version(v) for v in ("7", "default", None, 7)] == [7, 0, 0, 7]
