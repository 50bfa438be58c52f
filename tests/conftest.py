"""Shared fixtures: the built-in tiny tokenizer/model (no downloads) and small rollouts."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
# tests/ by what they exercise: units/ (functions and parts in this process), launched/ (real launches of several
# processes), on_sglang/ (against the SGLang stand-in, launch/bench/sglang_standin), on_vllm/ (against a real vLLM
# server), user/ (as a user meets it: the README, the docs, the command, errors); the helpers every folder imports
# by name live in helpers/
sys.path[:0] = [str(ROOT / "tests" / "helpers"), str(ROOT / "launch" / "bench")]
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
# The caller's thread setting would reach every run the tests launch and change what they check (threads per
# process = cores / processes): tests that want one set it themselves.
os.environ.pop("GRPO_ACCEL_THREADS", None)
# The processes the tests start import DeepSpeed without MLflow (tests/helpers/without_mlflow); those that report
# to it take the folder off again (tests/helpers/tracker_stores.py)
from tracker_stores import WITHOUT_MLFLOW  # noqa: E402

os.environ["PYTHONPATH"] = os.pathsep.join(p for p in (WITHOUT_MLFLOW, os.environ.get("PYTHONPATH")) if p)


@pytest.fixture(scope="session")
def tokenizer():
    from grpo_accel.tasks.tiny import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture
def tiny_model(tokenizer):
    from grpo_accel.tasks.tiny import build_tiny_model

    return build_tiny_model(tokenizer, seed=0)


@pytest.fixture(scope="session")
def smollm2():
    """SmolLM2-135M-Instruct as a Hugging Face folder, converted once per machine (grpo-accel models)."""
    from grpo_accel.cli.models import convert

    folder = Path(os.environ.get("GRPO_ACCEL_MODEL_CACHE", Path.home() / ".cache" / "grpo_accel" / "models"))
    folder = folder / "smollm2-135m"
    return folder if (folder / "config.json").exists() else convert("smollm2-135m", folder)


# ----------------------------------------------------------------- SGLang stand-ins shared by the session

def save_model(path, model, tokenizer):
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(scope="session")
def model_dir(tmp_path_factory, tokenizer):
    """The built-in tiny Llama: SGLang's Llama implements /get_weights_by_name."""
    from grpo_accel.tasks.tiny import build_tiny_model

    return save_model(tmp_path_factory.mktemp("llama"), build_tiny_model(tokenizer, seed=0), tokenizer)


@pytest.fixture(scope="session")
def qwen_dir(tmp_path_factory, tokenizer):
    """A tiny Qwen2: SGLang's Qwen2 does not implement /get_weights_by_name."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    torch.manual_seed(0)
    config = Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
                         pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id)
    return save_model(tmp_path_factory.mktemp("qwen2"), Qwen2ForCausalLM(config), tokenizer)


@pytest.fixture(scope="session")
def servers(model_dir):
    """The SGLang stand-ins (launch/bench/sglang_standin) the tests share: one process per model and release (a start
    costs ~3 s), started at the first test that asks."""
    from sglang_standin.source import VERSIONS
    from sglang_standin.processes import SharedServers

    shared = SharedServers()
    for version in VERSIONS:
        shared.start(model_dir, version)  # both at once: their start-ups overlap
    yield shared
    shared.close()


@pytest.fixture
def fresh_server(servers, model_dir):
    """``fresh_server(version)``: the URL of the shared stand-in of that release, serving the tiny Llama with
    --deterministic, reset to its state at start (a start costs ~3 s; a reset nothing)."""
    from sglang_standin.processes import NEWEST

    return lambda version=NEWEST: servers.get(model_dir, "--deterministic", version=version)


@pytest.fixture
def accelerator():
    """A one-process CPU Accelerator, its global state reset after the test."""
    from accelerate import Accelerator

    from trainer_utils import reset_accelerate_state

    yield Accelerator(cpu=True)
    reset_accelerate_state()
