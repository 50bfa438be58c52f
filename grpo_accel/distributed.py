"""Distributed set-up in one place: checks before any process group starts, the Accelerator (truly distributed
on CPU), DeepSpeed values the trainer owns, collective flags, and the ZeRO-3 gather used wherever full
parameters are needed (generation, export, weight sync)."""
from __future__ import annotations

import contextlib
import functools
import json
import os
from pathlib import Path
from typing import Iterable, Iterator

OFFLOAD_KEYS = ("offload_optimizer", "offload_param")


class DistributedConfigError(ValueError):
    """A launcher / DeepSpeed configuration cannot work; the message names the file, the value and the fix."""


def launch_world_size() -> int:
    """Processes in the job, from the launcher's environment (1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def uses_deepspeed() -> bool:
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def read_deepspeed_file(path: str | Path) -> dict:
    """The DeepSpeed JSON at ``path``, validated (stage 0-3, offload only where DeepSpeed honours it)."""
    path = Path(path)
    if not path.is_file():
        raise DistributedConfigError(
            f"DeepSpeed config file {str(path)!r} does not exist (cwd {os.getcwd()!r}); point deepspeed_config_file "
            "in the accelerate config at one of ds_configs/*.json, and launch from the repository root."
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
    if not uses_deepspeed():
        return {}
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path or path.lower() == "none":
        stage = os.environ.get("ACCELERATE_DEEPSPEED_ZERO_STAGE", "2")
        if stage not in ("0", "1", "2", "3"):
            raise DistributedConfigError(f"accelerate config zero_stage={stage!r}; ZeRO stages are 0, 1, 2 or 3.")
        return {"zero_optimization": {"stage": int(stage)}}
    shipped = Path(__file__).resolve().parents[1] / path  # the checkout's ds_configs/, from any folder
    if not Path(path).is_absolute() and not Path(path).exists() and shipped.is_file():
        path = str(shipped)
        os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = path  # what the Accelerator made next will read
    return read_deepspeed_file(path)


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


def configure_deepspeed(ds_config: dict, *, micro_batch: int, accumulation: int, num_processes: int,
                        clip_norm: float | None, hidden_size: int | None) -> dict:
    """Write the values the trainer owns into the DeepSpeed config, so users never set them in two places.

    Batch sizes and accumulation come from the trainer; clipping from ``clip_norm`` (DeepSpeed clips inside its
    step); hidden-size-based ZeRO buckets left at "auto" are sized like Accelerate does for a bare model.
    """
    ds_config["train_micro_batch_size_per_gpu"] = micro_batch
    ds_config["gradient_accumulation_steps"] = accumulation
    ds_config["train_batch_size"] = micro_batch * accumulation * num_processes
    ds_config["gradient_clipping"] = float(clip_norm or 0.0)
    zero = ds_config.setdefault("zero_optimization", {})
    if hidden_size:
        sized = {"reduce_bucket_size": hidden_size * hidden_size,
                 "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                 "stage3_param_persistence_threshold": 10 * hidden_size}
        for key, value in sized.items():
            if zero.get(key) == "auto":
                zero[key] = value
    return ds_config


def configure_deepspeed_for(accelerator, module, *, micro_batch: int, accumulation: int,
                            clip_norm: float | None) -> None:
    """Under DeepSpeed, write the trainer's values into the plugin's config before ``prepare`` (else nothing).
    ``module`` (the loss) lends its policy's hidden size to the buckets left at "auto"."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    if plugin is not None:
        config = getattr(getattr(module, "policy", None), "config", None)
        configure_deepspeed(plugin.deepspeed_config, micro_batch=micro_batch, accumulation=accumulation,
                            num_processes=accelerator.num_processes, clip_norm=clip_norm,
                            hidden_size=getattr(config, "hidden_size", None))


def make_accelerator(gradient_accumulation_steps: int = 1, mixed_precision: str = "no"):
    """An ``accelerate.Accelerator``; without a GPU it uses gloo so that several processes really form a group.

    (Without the explicit backend, accelerate on CPU leaves every DeepSpeed rank believing it is rank 0 of 1;
    with it in a single process, accelerate asks for a process group that was never started.)
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from grpo_accel.runtime import clear_stale_build_locks, skip_deepspeed_shm_op

    world = launch_world_size()
    cpu_only = not torch.cuda.is_available()
    if uses_deepspeed():  # DeepSpeed JIT-builds ops under torch's build lock
        clear_stale_build_locks()
        if cpu_only:
            skip_deepspeed_shm_op()
    if world > 1 and cpu_only and not uses_deepspeed():
        os.environ["ACCELERATE_USE_CPU"] = "true"  # a MULTI_GPU (DDP) config on CPU: MULTI_CPU over gloo
    handlers = [InitProcessGroupKwargs(backend="gloo")] if world > 1 and cpu_only else []
    accelerator = Accelerator(
        gradient_accumulation_steps=gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        kwargs_handlers=handlers,
    )
    if accelerator.num_processes != world or (world > 1 and accelerator.distributed_type.name == "NO"):
        raise RuntimeError(
            f"launched {world} processes but Accelerate sees {accelerator.num_processes} "
            f"({accelerator.distributed_type}); the processes would train alone. Check the accelerate config."
        )
    return accelerator


def any_process(accelerator, flag: bool) -> bool:
    """True on every process when ``flag`` is true on any (one all-reduce; collective)."""
    import torch

    return bool(accelerator.reduce(torch.tensor([float(flag)], device=accelerator.device), "sum")[0] > 0)


def zero_stage(accelerator) -> int:
    """The ZeRO stage of ``accelerator`` (0 without DeepSpeed)."""
    plugin = getattr(accelerator.state, "deepspeed_plugin", None)
    return int(plugin.zero_stage) if plugin is not None else 0


def full_shape(p) -> tuple[int, ...]:
    """A parameter's shape, whole even when ZeRO-3 keeps only a shard of it here."""
    return tuple(getattr(p, "ds_shape", p.shape))


def full_numel(p) -> int:
    """A parameter's element count, whole even when ZeRO-3 keeps only a shard of it here."""
    return getattr(p, "ds_numel", None) or p.numel()


def local_parameter_fraction(module) -> float:
    """Share of ``module``'s parameter elements stored on this rank (1.0 unless ZeRO-3 partitions them)."""
    local = total = 0
    for p in module.parameters():
        full = full_numel(p)
        local += p.ds_tensor.numel() if hasattr(p, "ds_tensor") else full
        total += full
    return local / max(total, 1)


def trainable_elements(module) -> int:
    """Parameter elements the optimizer updates (whole parameters, however ZeRO-3 splits them)."""
    return sum(full_numel(p) for p in module.parameters() if p.requires_grad)


def optimizer_state_bytes(optimizer) -> int:
    """Bytes of this process's optimizer state (Adam's moments), under Accelerate's and DeepSpeed's wrappers:
    the innermost torch optimizer holds the tensors (ZeRO: this rank's partition of them)."""
    while hasattr(optimizer, "optimizer"):
        optimizer = optimizer.optimizer
    return sum(t.numel() * t.element_size() for state in optimizer.state.values() for t in state.values()
               if hasattr(t, "element_size"))


@contextlib.contextmanager
def gathered_parameters(params: Iterable) -> Iterator[None]:
    """Full values of ``params`` (e.g. ``module.parameters()``) inside the block under ZeRO-3 (a collective:
    every rank must enter); a no-op for parameters that are not ZeRO-3 partitioned. Read-only: changes inside
    are discarded."""
    partitioned = [p for p in params if hasattr(p, "ds_id")]
    if not partitioned:
        yield
        return
    import deepspeed

    with deepspeed.zero.GatheredParameters(partitioned, modifier_rank=None):
        yield
