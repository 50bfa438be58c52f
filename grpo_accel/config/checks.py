"""The config's error and its checks: every message names the key, the value and the fix. The rules on a value
are :mod:`grpo_accel.rules`' (the Python API checks through the same ones, with its own argument names)."""
from __future__ import annotations

from typing import Any

from grpo_accel.errors import UserError
from grpo_accel.rules import check, check_choice as choice, require


class ConfigError(UserError, ValueError):
    """A configuration value is missing, unknown or invalid; the message says which and how to fix it."""


def check_key(ok: bool, key: str, value: Any, fix: str) -> None:
    """Raise ``ConfigError("{key}={value!r}: {fix}")`` unless ``ok``."""
    require(ok, key, value, fix, ConfigError)


def check_rules(section: str, values: Any, **rules: str) -> None:
    """Each field named in ``rules`` kept to its rule in :mod:`grpo_accel.rules` (the one the API checks too)."""
    for name, rule in rules.items():
        check(rule, f"{section}.{name}", getattr(values, name), ConfigError)


def check_choice(key: str, value: Any, options) -> None:
    choice(key, value, options, ConfigError)
