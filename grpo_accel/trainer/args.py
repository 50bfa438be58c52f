"""GRPOTrainer's argument checks and set-up helpers: every bad argument is an error that names it, its value and
the fix, before anything runs."""
from __future__ import annotations

import torch

from grpo_accel import rules
from grpo_accel.contracts import Collector, LossModule, OptimizationStepper
from grpo_accel.distributed import make_accelerator, zero_stage
from grpo_accel.rules import check
from grpo_accel.trainer.buffer import ReplayBuffer

AUTOCAST_MODES = {torch.bfloat16: "bf16", torch.float16: "fp16"}


def require(ok: bool, name: str, value, fix: str) -> None:
    rules.require(ok, name, value, f"{fix}.", owner="GRPOTrainer: ")


def check_arguments(a: dict) -> None:
    """The trainer's arguments (``a``: name -> value) on their own."""
    require(isinstance(a["collector"], Collector), "collector", type(a["collector"]).__name__,
            "pass a grpo_accel.contracts.Collector, e.g. GRPOCollector")
    require(isinstance(a["loss_module"], LossModule), "loss_module", a["loss_module"],
            "pass a GRPOLoss, or a loss that subclasses grpo_accel.contracts.LossModule")
    require((a["optimizer"] is None) != (a["optimization_stepper"] is None), "optimizer", a["optimizer"],
            "pass exactly one of optimizer= and optimization_stepper=")
    stepper = a["optimization_stepper"]
    require(stepper is None or isinstance(stepper, OptimizationStepper), "optimization_stepper", stepper,
            "subclass grpo_accel.contracts.OptimizationStepper (MixedPrecisionOptimizationStepper is one)")
    for name in ("total_frames", "frame_skip", "num_epochs", "gradient_accumulation_steps", "weight_update_frequency",
                 "log_interval"):
        check("positive_count", name, a[name], owner="GRPOTrainer: ")
    check("optional_count", "optim_steps_per_batch", a["optim_steps_per_batch"], owner="GRPOTrainer: ")
    check("optional_count", "batch_size", a["batch_size"], owner="GRPOTrainer: ")
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
    """The given accelerator, or one built from the arguments; checked against them and the collector. ``seed``
    seeds every random stream first (Accelerate's ``set_seed``)."""
    if a["seed"] is not None:
        from accelerate.utils import set_seed

        set_seed(a["seed"])
    acc = a["accelerator"] or make_accelerator(
        a["gradient_accumulation_steps"], AUTOCAST_MODES[a["autocast_dtype"]] if a["mixed_precision"] else "no")
    require(acc.gradient_accumulation_steps == a["gradient_accumulation_steps"], "gradient_accumulation_steps",
            a["gradient_accumulation_steps"], f"the given accelerator accumulates {acc.gradient_accumulation_steps}")
    check_collector(a["collector"], acc)
    check_temperature(a["collector"].engine, a["loss_module"])
    check_completion_budget(a["collector"], a["loss_module"])
    if a["async_collection"]:
        check_async(a["collector"], a["loss_module"], acc)
    return acc


def check_collector(collector: Collector, acc) -> None:
    """Each process collects its own share of every batch: the collector's layout is split over this run's
    processes and it collects this process's share (sharding is the collector's builder's explicit choice)."""
    layout = collector.layout
    require(layout.processes == acc.num_processes, "collector.layout.processes", layout.processes,
            f"the accelerator runs {acc.num_processes} processes; build the BatchLayout with "
            "processes=accelerator.num_processes (each process then collects its share of every batch)")
    require(collector.rank == acc.process_index, "collector.rank", collector.rank,
            f"this is process {acc.process_index}; build the collector with rank=accelerator.process_index")


def check_temperature(engine, loss_module: LossModule) -> None:
    """The loss takes logprobs at the temperature the engine samples at (the importance ratio and pi_old compare
    the two): checked once here, where the parts meet, for the Python API and the config alike."""
    sampled, taken = None if engine is None else engine.temperature, loss_module.temperature
    require(sampled is None or taken is None or float(sampled) == float(taken), "loss_module.temperature", taken,
            f"the collector's engine samples at temperature {sampled}; build the loss with temperature={sampled} "
            "(GRPOLoss(..., temperature=...)) so that its logprobs are the engine's")


def check_completion_budget(collector: Collector, loss_module: LossModule) -> None:
    """A loss that divides by a completion budget (Dr. GRPO) divides by the one the collector's completions have:
    checked once here, where the parts meet, as the temperature is."""
    budget, taken = collector.completion_budget, loss_module.max_completion_tokens
    require(budget is None or taken is None or int(budget) == int(taken), "loss_module.max_completion_tokens", taken,
            f"the collector's completions hold up to {budget} tokens (its engine's max_new_tokens, or a multi-turn "
            f"episode's budget); build the loss with max_completion_tokens={budget} so that it divides by theirs")


def check_async(collector: Collector, loss_module: LossModule, acc) -> None:
    """What a background thread generating beside training cannot do."""
    engine = collector.engine
    require(not (zero_stage(acc) == 3 and engine is not None and not engine.remote), "async_collection", True,
            "an engine in the trainer's process generates from ZeRO-3 shards that every process gathers together, "
            "which a background thread cannot join; use ZeRO-0/1/2, or an engine of its own (SGLang servers)")
    require(not collector.collective, "async_collection", True, "the collector agrees with the other processes "
            "while it collects (dynamic sampling's extra rounds), which a background thread cannot do beside "
            "training; turn one of them off")
    require(engine is None or engine.model is None or engine.model is not loss_module.policy, "async_collection",
            True, "the engine generates from the weights being trained; give it its own copy and a weight-sync sender")


def replay_buffer_for(a: dict, layout) -> ReplayBuffer:
    """The user's replay buffer or a new one, drawing micro-batches of ``batch_size`` completions (default: the
    buffer's own, else the process's share over the accumulation steps), checked against the layout."""
    buffer, accumulation = a["replay_buffer"], a["gradient_accumulation_steps"]
    micro_batch = a["batch_size"] or (buffer.batch_size if buffer is not None else layout.auto_micro_batch(accumulation))
    buffer = buffer or ReplayBuffer(micro_batch, seed=a["seed"])
    buffer.batch_size = micro_batch
    layout.check_steps(micro_batch, accumulation, a["optim_steps_per_batch"])
    return buffer
