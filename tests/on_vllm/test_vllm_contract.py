"""Every request grpo_accel sends to vLLM, checked against vLLM 0.32.0's own route definitions and request classes
read in the server's venv (tests/helpers/vllm_contract.py), as the SGLang contract tests check SGLang's."""
import json
import subprocess

import pytest

from grpo_accel.vllm import api
from launching import ROOT
from vllm_server import vllm_python


@pytest.fixture(scope="module")
def check(tmp_path_factory):
    python, folder = vllm_python(), tmp_path_factory.mktemp("contract")

    def run(requests: list[tuple[str, dict]]) -> list[str]:
        path = folder / "requests.json"
        path.write_text(json.dumps(requests))
        out = subprocess.run([str(python), str(ROOT / "tests" / "helpers" / "vllm_contract.py"), str(path)],
                             capture_output=True, text=True, timeout=300, check=True)
        return json.loads(out.stdout.strip().splitlines()[-1])

    return run


def test_every_request_matches_vllms_own_definitions(check):
    sent = [api.completions([1, 2, 3], 4, 16, 0.7, 0.9, 5, 12, [7], "rid"),
            api.completions([1, 2], 1, 8, 1.0, 1.0, 0, None, [], "rid"), api.prompt_logprobs([1, 2, 3]),
            api.abort_requests(["cmpl-rid-0"]), *[api.pause(mode) for mode in api.PAUSE_MODES.values()],
            api.resume(), api.reload_weights("/tmp/w"), api.update_weight_version(3), api.sleep(1), api.wake_up()]
    assert {urlpath(path) for path, _ in sent} == {"/v1/completions", "/abort_requests", "/pause", "/resume",
                                                   "/collective_rpc", "/update_weight_version", "/sleep", "/wake_up"}
    assert check(sent) == []


def test_the_check_finds_what_vllm_would_ignore_or_refuse(check):
    path, body = api.completions([1, 2], 2, 8, 1.0, 1.0, 0, 3, [], "rid")
    assert check([(path, {**body, "max_new_tokens": 8}), ("/pause?mode=retract", {}),
                  ("/update_weight_version", {"version": "3"}),
                  ("/collective_rpc", {"method": "reload_weights", "kwargs": {"path": "/tmp/w"}})]) == [
        "/v1/completions: max_new_tokens is not a CompletionRequest field",
        "/pause: mode=retract is not one of ('abort', 'wait', 'keep')",
        "/update_weight_version: body key version is not declared",
        "/update_weight_version: body key new_version is required",
        "reload_weights takes no path"]


def urlpath(path: str) -> str:
    return path.split("?")[0]
