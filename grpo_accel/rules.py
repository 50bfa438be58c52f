"""Shared by checkpoint.py, cli/, config/, data/, http.py, layout.py, loss/, recipe/, reporting/, rewards/,
rollout/, sglang/, trainer/ and vllm/.

Each rule about a setting's value, once. The YAML config (``grpo_accel.config.schema``, naming its keys) and the
Python API (``GRPOLoss``, ``GRPOTrainer``, the collector, ..., naming their arguments) check through
:func:`check`, so a value is refused with the same reason and fix whichever way it was given.

Example:
    >>> check("kl_coef", "loss.kl_coef", -1.0)
    Traceback (most recent call last):
    ValueError: loss.kl_coef=-1.0: must be >= 0 (0 turns the KL term off).
"""
from __future__ import annotations

from typing import Any, Callable, Mapping, NamedTuple


DTYPES = ("float32", "bfloat16", "float16")
"""Weights' dtypes a setting may name (a reward model's, the weight push's, an export's)."""
TRAINING_DTYPES = ("float32", "bfloat16")
"""``model.dtype``: float16 weights train without loss scaling; ``trainer.mixed_precision=fp16`` autocasts."""


class Rule(NamedTuple):
    ok: Callable[[Any], bool]
    fix: str  # the reason and the fix, after "name=value: "


def _at_least(n: int, what: str = "") -> Rule:
    return Rule(lambda v: v >= n, f"must be >= {n}{what}")


def _none_or_at_least(n: int, what: str) -> Rule:
    return Rule(lambda v: v is None or v >= n, f"use null (None: {what}) or >= {n}")


RULES: dict[str, Rule] = {
    # counts
    "positive_count": _at_least(1),
    "non_negative_count": _at_least(0),
    "optional_count": _none_or_at_least(1, "no limit"),
    "model_count": _none_or_at_least(1, "follows the model, grpo_accel.config.defaults"),
    # rollouts
    "group_size": Rule(lambda v: v >= 2, "GRPO compares completions within a group, so a group needs at least 2; "
                                         "use 2 or more (8-16 is common)"),
    "temperature": Rule(lambda v: v > 0, "must be > 0 (GRPO samples; the loss divides the logits by it)"),
    "top_p": Rule(lambda v: 0 < v <= 1, "must be in (0, 1]; 1.0 turns it off"),
    "top_k": _at_least(0, "; 0 turns it off"),
    "max_turns": Rule(lambda v: v >= 1, "an episode needs at least one model turn; use >= 1"),
    "seconds": Rule(lambda v: v > 0, "must be > 0 seconds"),
    "optional_seconds": Rule(lambda v: v is None or v > 0, "use null (no limit) or > 0 seconds"),
    # loss
    "clip_epsilon": Rule(lambda v: v > 0, "must be > 0 (e.g. 0.2 below, 0.28 above)"),
    "kl_coef": Rule(lambda v: v >= 0, "must be >= 0 (0 turns the KL term off)"),
    "tis_cap": _none_or_at_least(1, "off"),
    # rewards
    "reward_processes": _at_least(0, " (0: in the trainer's process)"),
    # trainer and checkpoints
    "max_staleness": _none_or_at_least(0, "keep every batch"),
    "log_samples": _at_least(0, " (0: none)"),
    "keep_last": _at_least(1, " (the newest is always kept)"),
    "best_mode": Rule(lambda v: v in ("max", "min"), "use 'max' or 'min'"),
}


def setting(names: Mapping[str, str] | None, name: str) -> str:
    """What whoever built a part calls its argument ``name``: its own name unless ``names`` says otherwise. The
    recipe passes the config's keys (e.g. ``{"timeout_s": "weight_sync.timeout_s"}``), so that a part's message
    reads right from the Python API and from a YAML file alike."""
    return (names or {}).get(name, name)


def require(ok: bool, name: str, value: Any, fix: str, error: type[Exception] = ValueError, owner: str = "") -> None:
    """Raise ``error("{owner}{name}={value!r}: {fix}")`` unless ``ok``: every setting's error reads this way."""
    if not ok:
        raise error(f"{owner}{name}={value!r}: {fix}")


def check_choice(name: str, value: Any, options, error: type[Exception] = ValueError, owner: str = "") -> None:
    """Raise ``error("{owner}{name}={value!r}: must be one of [...].")`` unless ``value`` is one of ``options``
    (e.g. a registry's keys: the loss's aggregations, estimators and importance levels)."""
    require(value in options, name, value, f"must be one of {list(options)}.", error, owner)


def check(rule: str, name: str, value: Any, error: type[Exception] = ValueError, owner: str = "") -> None:
    """Raise ``error("{owner}{name}={value!r}: {fix}.")`` unless ``value`` keeps ``RULES[rule]``."""
    require(RULES[rule].ok(value), name, value, f"{RULES[rule].fix}.", error, owner)
