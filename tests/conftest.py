"""Shared fixtures: the built-in tiny tokenizer/model (no downloads) and small rollouts."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))


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
    """SmolLM2-135M-Instruct as a Hugging Face folder, converted once per machine (python -m grpo_accel.models)."""
    from grpo_accel.models import convert

    folder = Path(os.environ.get("GRPO_ACCEL_MODEL_CACHE", Path.home() / ".cache" / "grpo_accel" / "models"))
    folder = folder / "smollm2-135m"
    return folder if (folder / "config.json").exists() else convert("smollm2-135m", folder)
