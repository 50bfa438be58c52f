"""Secrets among the settings: which settings hold one, where their values may come from, and the record of a run's
settings that never holds one.

A secret is a setting of ``SECRET_SETTINGS`` (SGLang's ``rollout.api_key`` and ``weight_sync.admin_api_key``, a
reward service's ``rewards[].api_key``) or, inside the free-form mappings ``FREE_FORM`` (a tracker's arguments, a
reward's kwargs: a reward model server's key goes there), any entry whose name says so (``SECRET_NAME``: api_key,
token, secret, password, credential, ...). A secret's value may be written ``${NAME}``: it is read from the
environment variable NAME when the run starts (:func:`expand_secrets`), so that a config file holds no key.

Whatever a run writes about its settings (``config.yaml``, every checkpoint's metadata, the trackers'
hyperparameters, the lines a resume prints) is :func:`record`: a reference stays as written (``${SGLANG_API_KEY}``),
a value given literally becomes ``"***"``. A resume compares records, so a key that changed, or that moved from the
file to the environment, is no conflict. The run's command line, which W&B and the run folder's lock keep, is
:func:`redact_text`'d.

Example:
    >>> cfg = load_config(None, ["rollout.api_key=${SGLANG_API_KEY}", "weight_sync.admin_api_key=ADMIN456"])
    >>> record(cfg)["rollout"]["api_key"], record(cfg)["weight_sync"]["admin_api_key"]
    ('${SGLANG_API_KEY}', '***')
"""
from __future__ import annotations

import dataclasses
import os
import re
from typing import Any, Iterator

from grpo_accel.config.checks import ConfigError

SECRET_SETTINGS = ("rollout.api_key", "weight_sync.admin_api_key", "rewards[].api_key", "hub.token")
"""Settings that hold a secret, a reward entry's fields as ``rewards[].field``."""
FREE_FORM = ("trainer.tracker_kwargs", "rewards[].kwargs")
"""Mappings whose entries the user names: a secret there is recognised by its name."""
NAMES = r"(?:api[_-]?key|token|secret|password|passwd|credentials?|bearer)"
SECRET_NAME = re.compile(rf"(?:^|[._-]){NAMES}(?:$|[._-])", re.IGNORECASE)
"""A name that says it holds a secret: one of NAMES as a word of it (hf_token, client_secret, api_key; not
max_tokens)."""
REDACTED = "***"
REFERENCE = re.compile(r"\$\{([A-Za-z_][A-Za-z0-9_]*)\}")


def is_secret(path: str) -> bool:
    """Whether the setting at ``path`` (``rollout.api_key``, ``rewards[0].api_key``,
    ``trainer.tracker_kwargs.wandb.api_key``) holds a secret."""
    general = re.sub(r"\[\d+\]", "[]", path)
    if general in SECRET_SETTINGS:
        return True
    return any(general.startswith(f + ".") for f in FREE_FORM) and bool(SECRET_NAME.search(general.rsplit(".", 1)[-1]))


def _leaves(node: Any, path: str = "") -> Iterator[tuple[Any, Any, str, Any]]:
    """(container, key, path, value) of every value under ``node``: a config's dataclasses, its dicts and lists."""
    if dataclasses.is_dataclass(node) and not isinstance(node, type):
        items = [(f.name, getattr(node, f.name)) for f in dataclasses.fields(node)]
    elif isinstance(node, dict):
        items = list(node.items())
    elif isinstance(node, list):
        items = list(enumerate(node))
    else:
        return
    for key, value in items:
        here = f"{path}[{key}]" if isinstance(node, list) else f"{path}.{key}" if path else str(key)
        if dataclasses.is_dataclass(value) or isinstance(value, (dict, list)):
            yield from _leaves(value, here)
        else:
            yield node, key, here, value


def _set(container: Any, key: Any, value: Any) -> None:
    if dataclasses.is_dataclass(container):
        setattr(container, key, value)
    else:
        container[key] = value


def expand_secrets(cfg) -> dict[str, str]:
    """Each secret of ``cfg`` written ``${NAME}`` replaced, in place, by environment variable NAME; returns
    ``{path: "${NAME}"}`` for :func:`record`. An unset variable is a ConfigError naming the setting."""
    references = {}
    for container, key, path, value in list(_leaves(cfg)):
        if not (isinstance(value, str) and is_secret(path) and (match := REFERENCE.fullmatch(value.strip()))):
            continue
        name = match.group(1)
        if name not in os.environ:
            raise ConfigError(f"{path}={value}: the environment has no variable {name}; export {name}=... where the "
                              "run starts (every process reads it), or give the value itself.")
        _set(container, key, os.environ[name])
        references[path] = value.strip()
    return references


def redact(settings: dict, references: dict[str, str] | None = None) -> dict:
    """``settings`` (a config as a dict) with each secret given literally as ``"***"`` and each one read from the
    environment as its reference; a value that is already either stays."""
    references = references or {}
    for container, key, path, value in list(_leaves(settings)):
        if value is None or not is_secret(path):
            continue
        if path in references:
            container[key] = references[path]
        elif not (value == REDACTED or (isinstance(value, str) and REFERENCE.fullmatch(value))):
            container[key] = REDACTED
    return settings


def record(cfg) -> dict:
    """The settings of ``cfg`` (a GRPOConfig) as a run writes them down: those that do something
    (``GRPOConfig.as_dict``), :func:`redact`'d."""
    return redact(cfg.as_dict(), getattr(cfg, "secret_references", {}))


SECRET_IN_TEXT = re.compile(rf"((?<![\w.-])(?:[\w\[\].-]*[._-])?{NAMES}(?:[._-][\w-]*)?[\"']?\s*[=:]\s*)"
                            r"(\$\{\w+\}|\"[^\"]*\"|'[^']*'|[^\s,}\]\"']+)", re.IGNORECASE)


def redact_text(text: str) -> str:
    """``text`` (a command line, an override such as ``rewards=[{name: remote, api_key: K}]``) with every value
    given to a setting named like a secret replaced by ``***`` (a ``${NAME}`` reference stays)."""
    return SECRET_IN_TEXT.sub(lambda m: m.group(0) if REFERENCE.fullmatch(m.group(2).strip("\"'"))
                              else m.group(1) + REDACTED, text)
