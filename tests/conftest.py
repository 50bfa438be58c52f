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
