"""The comparison a resume makes between the settings its checkpoint saved and the run's: what must match, what may
change (and is said), what a named model's run never compares.

Example:
    >>> resume_conflicts(saved["config"], record(cfg))   # [] when the run may continue that checkpoint
"""
from __future__ import annotations

import re

from grpo_accel.config.loading import RENAMED, flatten_keys, to_dict
from grpo_accel.config.rollout_schema import RewardConfig
from grpo_accel.config.defaults import BUILT_IN_MODEL_SIZES
from grpo_accel.config.schema import GRPOConfig

# Settings a resumed run must share with its checkpoint (anything else, e.g. total_frames, may change).
RESUME_MUST_MATCH = ("model.", "data.", "rollout.prompts_per_batch", "rollout.group_size", "rollout.max_new_tokens",
                     "rollout.temperature", "loss.", "rewards")
RESUME_MAY_DIFFER = ("model.gradient_checkpointing", "model.attn_implementation", "model.trust_remote_code",
                     "rewards[].url", "rewards[].api_key", "rewards[].timeout_s", "rewards[].retries",
                     "rewards[].processes")
"""Settings under RESUME_MUST_MATCH that change how a run computes, not what it computes: recomputing activations
(turned on after an out-of-memory), the attention kernels (the same attention, other rounding), running a model's
own code, and where and how patiently a reward is asked for (a service that moved, a new key, a longer time limit,
more retries, more worker processes). A reward entry's fields are ``rewards[].field``. Still refused: the weights'
dtype and revision, LoRA, every loss, data and sampling setting, a reward's name, weight, kwargs, fallback and
model."""


def resume_conflicts(saved: dict, current: dict) -> list[str]:
    """``key: saved -> current`` for every RESUME_MUST_MATCH setting that differs (RESUME_MAY_DIFFER's aside)."""
    return [change for key, change in _differences(saved, current) if _must_match(key)]


RESUME_MAY_CHANGE_SILENTLY = ("checkpoint.resume",)  # how a resume is asked for: changed by every resume


def changed_settings(saved: dict, current: dict) -> list[str]:
    """``key: saved -> current`` for the settings a resume may change (e.g. ``optim.lr``) that it does change."""
    return [change for key, change in _differences(saved, current)
            if not _must_match(key) and key not in RESUME_MAY_CHANGE_SILENTLY]


def _must_match(key: str) -> bool:
    return key.startswith(RESUME_MUST_MATCH) and re.sub(r"\[\d+\]", "[]", key) not in RESUME_MAY_DIFFER


def _differences(saved: dict, current: dict) -> list[tuple[str, str]]:
    """(key, ``key: saved -> current``) for every setting whose value differs, in key order; each reward entry's
    fields apart (``rewards[0].url``)."""
    a = {RENAMED.get(k, k): v for k, v in flatten_keys(saved).items()}
    # a setting added since the checkpoint was saved had its default there
    a = {**{k: v for k, v in flatten_keys(to_dict(GRPOConfig())).items() if k != "rewards"}, **a}
    if isinstance(a.get("rewards"), list):  # entries saved before a reward setting existed have its default
        defaults = to_dict(RewardConfig())
        a["rewards"] = [{**{k: v for k, v in defaults.items() if k not in ("name", "weight", "kwargs")}, **r}
                        for r in a["rewards"]]
    a, b = _entries(a), _entries(flatten_keys(current))
    if a.get("model.name_or_path") is not None or b.get("model.name_or_path") is not None:
        for key in BUILT_IN_MODEL_SIZES:  # nothing to a named model (a checkpoint saved before they were left out holds them)
            a.pop(f"model.{key}", None), b.pop(f"model.{key}", None)
    return [(k, f"{k}: {a.get(k)!r} -> {b.get(k)!r}") for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]


def _entries(flat: dict) -> dict:
    """``flat`` with the reward list as one key per entry and field: ``rewards[0].name``, ``rewards[0].url``, ..."""
    out = {k: v for k, v in flat.items() if k != "rewards"}
    for i, entry in enumerate(flat.get("rewards") or []):
        out.update({f"rewards[{i}].{k}": v for k, v in entry.items()})
    return out
