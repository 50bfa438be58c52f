"""GRPOTrainer's argument checks and set-up helpers: every bad argument is an error that names it, its value and
the fix, before anything runs."""
from __future__ import annotations

import functools

import torch

from grpo_accel import rules
from grpo_accel.distributed import any_process, make_accelerator, zero_stage
from grpo_accel.rules import check

AUTOCAST_MODES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def require(ok: bool, name: str, value, fix: str) -> None:
    rules.require(ok, name, value, f"{fix}.", owner="GRPOTrainer: ")


def check_arguments(a: dict) -> None:
    """The trainer's arguments (``a``: name -> value) on their own."""
    require(a["loss_module"] is not None, "loss_module", a["loss_module"], "pass a GRPOLoss (or a module returning loss_* keys)")
    require((a["optimizer"] is None) != (a["optimization_stepper"] is None), "optimizer", a["optimizer"],
            "pass exactly one of optimizer= and optimization_stepper=")
    for name in ("total_frames", "frame_skip", "num_epochs", "gradient_accumulation_steps", "weight_update_frequency",
                 "log_interval"):
        check("positive_count", name, a[name], owner="GRPOTrainer: ")
    check("optional_count", "optim_steps_per_batch", a["optim_steps_per_batch"], owner="GRPOTrainer: ")
    check("max_staleness", "max_staleness", a["max_staleness"], owner="GRPOTrainer: ")
    check("log_samples", "log_samples", a["log_samples"], owner="GRPOTrainer: ")
    every = a["save_trainer_interval"]
    check("optional_count", "save_trainer_interval", every, owner="GRPOTrainer: ")  # frames between saves
    require(every is None or a["checkpoint"] is not None or a["save_trainer_file"] is not None,
            "save_trainer_interval", every, "pass checkpoint= or save_trainer_file= to save")
    require(a["checkpoint_rotation"] is None or a["checkpoint"] is not None, "checkpoint_rotation",
            a["checkpoint_rotation"], "rotation needs checkpoint=Checkpoint(directory)")
    require(a["accelerator"] is not None or not a["mixed_precision"] or a["autocast_dtype"] in AUTOCAST_MODES,
            "autocast_dtype", a["autocast_dtype"], "use torch.bfloat16 or torch.float16")


def accelerator_for(a: dict):
    """The given accelerator, or one built from the arguments; checked against them and the collector."""
    acc = a["accelerator"] or make_accelerator(
        a["gradient_accumulation_steps"], AUTOCAST_MODES[a["autocast_dtype"]] if a["mixed_precision"] else "no")
    require(acc.gradient_accumulation_steps == a["gradient_accumulation_steps"], "gradient_accumulation_steps",
            a["gradient_accumulation_steps"], f"the given accelerator accumulates {acc.gradient_accumulation_steps}")
    asynchronous, engine = a["async_collection"], getattr(a["collector"], "engine", None)
    remote = getattr(engine, "remote", False)  # generation in other processes (servers) joins no collective
    require(not (asynchronous and zero_stage(acc) == 3 and not remote), "async_collection", asynchronous,
            "an engine in the trainer's process generates from ZeRO-3 shards that every process gathers together, "
            "which a background thread cannot join; use ZeRO-0/1/2, or an engine of its own (SGLang servers)")
    require(not (asynchronous and acc.num_processes > 1 and getattr(a["collector"], "dynamic_sampling", False)),
            "async_collection", asynchronous, "dynamic sampling agrees on its extra rounds over every process, which "
            "a background thread cannot do beside training; turn one of them off")
    engine_model = getattr(engine, "model", None)
    require(not (asynchronous and engine_model is getattr(a["loss_module"], "policy", object())), "async_collection",
            asynchronous, "the engine generates from the weights being trained; give it its own copy and a weight-sync sender")
    shard_collector(a["collector"], acc)
    return acc


def shard_collector(collector, acc) -> None:
    """A collector built for one process (GRPOCollector's default) takes this process's share of every batch
    under several; one split for another process count is an error. Otherwise every process would train on the
    same prompts and count the frames again."""
    world = getattr(collector, "world_size", None)
    if world is None or world == acc.num_processes:  # a collector of its own kind, or already split
        require(world is None or collector.rank == acc.process_index, "collector.rank", getattr(collector, "rank", None),
                f"this is process {acc.process_index}; pass rank=accelerator.process_index")
        return
    require(world == 1, "collector.world_size", world,
            f"the accelerator runs {acc.num_processes} processes; build the collector with "
            f"world_size={acc.num_processes} and rank=accelerator.process_index, or leave both unset")
    collector.shard(acc.process_index, acc.num_processes, functools.partial(any_process, acc))
