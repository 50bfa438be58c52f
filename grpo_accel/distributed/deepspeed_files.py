"""The DeepSpeed JSON files (``ds_configs/``): read and checked before any process group starts, so that a bad
file is one line naming the file, the value and the fix, not a traceback on every rank."""
from __future__ import annotations

import functools
import json
import os
from pathlib import Path

from grpo_accel.distributed.accelerator import deepspeed_launched, resolve_deepspeed_file
from grpo_accel.errors import UserError

OFFLOAD_KEYS = ("offload_optimizer", "offload_param")


class DistributedConfigError(UserError, ValueError):
    """A launcher / DeepSpeed configuration cannot work; the message names the file, the value and the fix."""


def read_deepspeed_file(path: str | Path) -> dict:
    """The DeepSpeed JSON at ``path``, validated (stage 0-3, offload only where DeepSpeed honours it)."""
    path = Path(path)
    if not path.is_file():
        raise DistributedConfigError(
            f"DeepSpeed config file {str(path)!r} does not exist (cwd {os.getcwd()!r}); point deepspeed_config_file "
            "in the accelerate config at an existing file: absolute, relative to the folder the launch starts from, "
            "or ds_configs/<name>.json (the checkout's own, found from any folder)."
        )
    try:
        cfg = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DistributedConfigError(f"DeepSpeed config file {str(path)!r} is not valid JSON: {exc}.") from exc
    if not isinstance(cfg, dict):
        raise DistributedConfigError(f"DeepSpeed config file {str(path)!r} must hold a JSON object.")
    validate_deepspeed_config(cfg, str(path))
    return cfg


def validate_deepspeed_config(cfg: dict, source: str) -> None:
    check_deepspeed_keys(cfg, source)
    zero = cfg.get("zero_optimization", {})
    stage = zero.get("stage", 0)
    if stage not in (0, 1, 2, 3):
        raise DistributedConfigError(f"{source}: zero_optimization.stage={stage!r}; ZeRO stages are 0, 1, 2 or 3.")
    offload = {k: zero[k].get("device", "none") for k in OFFLOAD_KEYS if isinstance(zero.get(k), dict)}
    if offload.get("offload_param", "none") != "none" and stage != 3:
        raise DistributedConfigError(
            f"{source}: offload_param needs ZeRO stage 3 but stage={stage}; DeepSpeed would ignore it. "
            "Use ds_configs/zero3_offload.json, or remove offload_param."
        )
    if offload.get("offload_optimizer", "none") != "none" and stage == 0:
        raise DistributedConfigError(
            f"{source}: offload_optimizer needs ZeRO stage 1-3 but stage=0. Raise the stage or remove it."
        )
    if offload and cfg.get("zero_force_ds_cpu_optimizer", True) is not False:
        raise DistributedConfigError(
            f"{source}: CPU offload without \"zero_force_ds_cpu_optimizer\": false makes Accelerate swap in "
            "DeepSpeedCPUAdam (minutes of compilation, different optimizer); add that key set to false."
        )
    if "optimizer" in cfg:
        raise DistributedConfigError(
            f"{source}: has an \"optimizer\" block; grpo_accel passes a torch optimizer (set in optim.*), so remove it."
        )


def preflight() -> dict:
    """Checks the launch before any process group starts; returns the DeepSpeed config ({} without DeepSpeed).

    Offload is chosen by the DeepSpeed file alone (one place); asking for it where the stage cannot honour it
    is an error here rather than a silent no-op in DeepSpeed.
    """
    if not deepspeed_launched():
        return {}
    path = resolve_deepspeed_file()
    if path is None:
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        if stage not in ("0", "1", "2", "3"):
            raise DistributedConfigError(f"accelerate config zero_stage={stage!r}; ZeRO stages are 0, 1, 2 or 3.")
        return {"zero_optimization": {"stage": int(stage)}}
    return read_deepspeed_file(path)


def launched_zero_stage() -> int:
    """The ZeRO stage this launch runs (0 without DeepSpeed), from its DeepSpeed file, before any process group
    exists (the file checked as :func:`preflight` checks it)."""
    return int(preflight().get("zero_optimization", {}).get("stage", 0))


def check_deepspeed_keys(cfg: dict, source: str) -> None:
    """Misspelt keys, named with the file and the nearest valid key before any process starts (DeepSpeed itself
    fails on every rank with a pydantic traceback that never names the file, or ignores the key). The
    ``zero_optimization`` block and its offload blocks are checked against DeepSpeed's own config models (which
    forbid unknown keys); a top-level key is refused when it is not one DeepSpeed names but close to one."""
    import difflib

    from deepspeed.runtime.zero.config import DeepSpeedZeroConfig
    from deepspeed.runtime.zero.offload_config import (DeepSpeedZeroOffloadOptimizerConfig,
                                                       DeepSpeedZeroOffloadParamConfig)

    def refuse(key: str, where: str, valid, near: list[str]) -> None:
        hint = f"did you mean {where}{near[0]}?" if near else f"valid keys there: {', '.join(sorted(valid))}."
        raise DistributedConfigError(f"{source}: {where}{key} is not a DeepSpeed setting; {hint} Fix it in that "
                                     "file (DeepSpeed would refuse it on every process, or ignore it).")

    zero = cfg.get("zero_optimization")
    blocks = [("zero_optimization.", zero, DeepSpeedZeroConfig)] if isinstance(zero, dict) else []
    for name, model in (("offload_param", DeepSpeedZeroOffloadParamConfig),
                        ("offload_optimizer", DeepSpeedZeroOffloadOptimizerConfig)):
        if isinstance(zero, dict) and isinstance(zero.get(name), dict):
            blocks.append((f"zero_optimization.{name}.", zero[name], model))
    for where, block, model in blocks:
        valid = set(model.model_fields) | {f.alias for f in model.model_fields.values() if f.alias}
        for key in block:
            if key not in valid:
                refuse(key, where, valid, difflib.get_close_matches(key, valid, n=1, cutoff=0.6))
    top = _deepspeed_names()
    for key in cfg:
        near = [] if key in top else difflib.get_close_matches(key, top, n=1, cutoff=0.85)
        if near:
            refuse(key, "", top, near)


@functools.cache
def _deepspeed_names() -> frozenset[str]:
    """The setting names DeepSpeed's constants and config modules define (``NAME = "..."``, from its source)."""
    import ast

    import deepspeed

    names = set()
    for path in Path(deepspeed.__file__).parent.rglob("*.py"):
        if "constants" not in path.name and path.name != "config.py":
            continue
        for node in ast.parse(path.read_text()).body:
            if (isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)
                    and all(isinstance(t, ast.Name) and t.id.isupper() for t in node.targets)):
                names.add(node.value.value)
    return frozenset(names)
