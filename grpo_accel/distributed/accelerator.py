"""The processes and the Accelerator: the one answer to "DeepSpeed? which ZeRO stage?", the DeepSpeed values the
trainer owns, collective flags, sizes of sharded parameters, and the ZeRO-3 gather used wherever full parameters
are needed (generation, export, weight sync).
"""
from __future__ import annotations

import contextlib
import os
from pathlib import Path
from typing import Iterable, Iterator


def launch_world_size() -> int:
    """Processes in the job, from the launcher's environment (1 when not launched)."""
    return int(os.environ.get("WORLD_SIZE", "1"))


def first_process() -> bool:
    """Rank 0 of the launch, from the launcher's environment (usable before any process group exists)."""
    return os.environ.get("RANK", "0") == "0"


# -- DeepSpeed? which ZeRO stage? ---------------------------------------------------------------------------
# Before the Accelerator exists the launcher's environment says; after, the accelerator does; where neither is at
# hand (generation inside a model's forward), transformers' record of the ZeRO-3 set-up does.


def deepspeed_launched() -> bool:
    """This process was launched with a DeepSpeed accelerate config (before any Accelerator exists)."""
    return os.environ.get("ACCELERATE_USE_DEEPSPEED", "false").lower() == "true"


def uses_deepspeed(accelerator) -> bool:
    """``accelerator`` runs DeepSpeed (any ZeRO stage, 0 included)."""
    return accelerator.state.deepspeed_plugin is not None


def zero_stage(accelerator) -> int:
    """The ZeRO stage of ``accelerator`` (0 without DeepSpeed)."""
    plugin = accelerator.state.deepspeed_plugin
    return int(plugin.zero_stage) if plugin is not None else 0


def zero3_partitioned() -> bool:
    """ZeRO-3 is set up in this process: models prepared here have their parameters gathered by hooks around each
    module's forward (transformers' record of DeepSpeed's config, for code that holds no accelerator)."""
    try:
        from transformers.integrations import is_deepspeed_zero3_enabled
    except ImportError:
        return False
    return is_deepspeed_zero3_enabled()


def zero3_collective() -> bool:
    """ZeRO-3 over several processes: every forward gathers parameters from all of them, so all must run it."""
    import torch.distributed as dist

    return dist.is_available() and dist.is_initialized() and dist.get_world_size() > 1 and zero3_partitioned()


# -- the Accelerator and DeepSpeed's values ------------------------------------------------------------------


def configure_deepspeed(ds_config: dict, *, micro_batch: int, accumulation: int, num_processes: int,
                        clip_norm: float | None, hidden_size: int | None) -> dict:
    """Write the values the trainer owns into the DeepSpeed config, so users never set them in two places.

    Batch sizes and accumulation come from the trainer; clipping from ``clip_norm`` (DeepSpeed clips inside its
    step); hidden-size-based ZeRO buckets left at "auto" are sized like Accelerate does for a bare model, and
    ZeRO-3's live parameters and reuse distance by :func:`zero3_live_elements`.
    """
    ds_config["train_micro_batch_size_per_gpu"] = micro_batch
    ds_config["gradient_accumulation_steps"] = accumulation
    ds_config["train_batch_size"] = micro_batch * accumulation * num_processes
    ds_config["gradient_clipping"] = float(clip_norm or 0.0)
    zero = ds_config.setdefault("zero_optimization", {})
    sized = {"stage3_max_live_parameters": zero3_live_elements(hidden_size),
             "stage3_max_reuse_distance": zero3_live_elements(hidden_size)}
    if hidden_size:
        sized |= {"reduce_bucket_size": hidden_size * hidden_size,
                  "stage3_prefetch_bucket_size": int(0.9 * hidden_size * hidden_size),
                  "stage3_param_persistence_threshold": 10 * hidden_size}
    for key, value in sized.items():
        if zero.get(key) == "auto":
            zero[key] = value
    return ds_config


DEEPSPEED_LIVE_ELEMENTS = 10**9  # DeepSpeed's default stage3_max_live_parameters and stage3_max_reuse_distance


def zero3_live_elements(hidden_size: int | None) -> int:
    """ZeRO-3's "auto" ``stage3_max_live_parameters`` and ``stage3_max_reuse_distance``: 30 x hidden^2 elements,
    about two and a half decoder layers of a Llama-family model (each ~12 x hidden^2: the layer in use, the next
    one prefetched, and what the end of the forward leaves for the start of the backward), at most DeepSpeed's
    default of 1e9 (which it is for a model without a hidden size).

    DeepSpeed keeps a gathered parameter whole while it is used again within the reuse distance and prefetches
    while fewer than the live count are gathered: at 1e9 elements a model below a billion parameters stayed
    gathered whole through every step, its reference's too: 4 processes training a SmolLM2-sized Llama with a
    KL reference peaked at 2,363-2,581 MiB each in a step; at 30 x hidden^2, 1,688-1,726 MiB
    (launch/bench/memory.py, docs/pages/benchmarks.md)."""
    if not hidden_size:
        return DEEPSPEED_LIVE_ELEMENTS
    return min(30 * hidden_size * hidden_size, DEEPSPEED_LIVE_ELEMENTS)


def configure_deepspeed_for(accelerator, model, *, micro_batch: int, accumulation: int,
                            clip_norm: float | None) -> None:
    """Under DeepSpeed, write the trainer's values into the plugin's config before ``prepare`` (else nothing).
    ``model`` (the policy, or None) lends its hidden size to the buckets left at "auto"."""
    plugin = accelerator.state.deepspeed_plugin
    if plugin is not None:
        config = getattr(model, "config", None)  # a transformers model's, if it is one
        configure_deepspeed(plugin.deepspeed_config, micro_batch=micro_batch, accumulation=accumulation,
                            num_processes=accelerator.num_processes, clip_norm=clip_norm,
                            hidden_size=getattr(config, "hidden_size", None))


def resolve_deepspeed_file() -> str | None:
    """The launch's DeepSpeed file (``ACCELERATE_DEEPSPEED_CONFIG_FILE``) as a path that exists from here, or
    None without one. A relative path that is not there from the current folder but names one of the shipped files
    (``ds_configs/zero2.json``, :mod:`grpo_accel.shipped`) becomes that file's absolute path, in the environment
    too: the Accelerator reads it there. Done by :func:`make_accelerator`, which the launcher and the Python API
    share."""
    path = os.environ.get("ACCELERATE_DEEPSPEED_CONFIG_FILE")
    if not path or path.lower() == "none":
        return None
    from grpo_accel.shipped import shipped_deepspeed_file

    shipped = shipped_deepspeed_file(path)
    if not Path(path).is_absolute() and not Path(path).exists() and shipped is not None:
        path = os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] = str(shipped)
    return path


def make_accelerator(gradient_accumulation_steps: int = 1, mixed_precision: str = "no"):
    """An ``accelerate.Accelerator``; without a GPU it uses gloo so that several processes really form a group.

    (Without the explicit backend, accelerate on CPU leaves every DeepSpeed rank believing it is rank 0 of 1;
    with it in a single process, accelerate asks for a process group that was never started.)
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    from grpo_accel.runtime.build_locks import clear_stale_build_locks, skip_deepspeed_shm_op

    world = launch_world_size()
    cpu_only = not torch.cuda.is_available()
    if deepspeed_launched():  # DeepSpeed JIT-builds ops under torch's build lock
        resolve_deepspeed_file()
        clear_stale_build_locks()
        if cpu_only:
            skip_deepspeed_shm_op()
    if world > 1 and cpu_only and not deepspeed_launched():
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


# -- collectives and ZeRO-3 shards ---------------------------------------------------------------------------


def any_process(flag: bool) -> bool:
    """True on every process when ``flag`` is true on any: one all-reduce over the default process group (a
    collective: every process must call it). Without a group of several processes, ``flag`` itself."""
    import torch
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() == 1:
        return bool(flag)
    cuda = dist.get_backend() == "nccl"  # NCCL reduces CUDA tensors only (a mixed backend takes CPU ones)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    count = torch.tensor([float(flag)], device=device)
    dist.all_reduce(count)
    return bool(count[0] > 0)


def full_shape(p) -> tuple[int, ...]:
    """A parameter's shape, whole even when ZeRO-3 keeps only a shard of it here."""
    return tuple(getattr(p, "ds_shape", p.shape))


def full_numel(p) -> int:
    """A parameter's element count, whole even when ZeRO-3 keeps only a shard of it here."""
    return getattr(p, "ds_numel", None) or p.numel()


def local_numel(p) -> int:
    """A parameter's elements stored on this rank: its ZeRO-3 shard, or the whole of it."""
    return p.ds_tensor.numel() if hasattr(p, "ds_tensor") else p.numel()


def local_parameter_fraction(module) -> float:
    """Share of ``module``'s parameter elements stored on this rank (1.0 unless ZeRO-3 partitions them)."""
    params = list(module.parameters())
    return sum(local_numel(p) for p in params) / max(sum(full_numel(p) for p in params), 1)


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
