"""grpo_accel: GRPO training under Accelerate / DeepSpeed, modelled on torchrl's GRPOTrainer and GRPOLoss.

``import grpo_accel`` is cheap: the public names below are imported on first use.
"""
from __future__ import annotations

import importlib

__version__ = "0.1.0"

_EXPORTS = {
    "GRPOTrainer": "grpo_accel.trainer",
    "GRPOLoss": "grpo_accel.loss",
    "ReplayBuffer": "grpo_accel.trainer.buffer",
    "RewardSet": "grpo_accel.rewards",
    "GRPOCollector": "grpo_accel.rollout.collector",
    "EmbeddedEngine": "grpo_accel.embedded.engine",
    "TensorBoardLogger": "grpo_accel.reporting.event_files",
    "GRPOConfig": "grpo_accel.config.schema",
    "BatchLayout": "grpo_accel.layout",
    "load_config": "grpo_accel.config.loading",
    "build_trainer": "grpo_accel.recipe.build",
}

__all__ = list(_EXPORTS)


def __dir__() -> list[str]:
    return sorted({*globals(), *__all__})


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'grpo_accel' has no attribute {name!r}")
