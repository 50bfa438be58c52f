"""Distributed set-up in one room: the Accelerator (truly distributed on CPU), ZeRO stages and collectives
(:mod:`grpo_accel.distributed.accelerator`), and the user's DeepSpeed files read and checked before any process group
starts (:mod:`grpo_accel.distributed.deepspeed_files`).
"""
from grpo_accel.distributed.accelerator import (
    launch_world_size, first_process, deepspeed_launched, uses_deepspeed, zero_stage, zero3_partitioned,
    zero3_collective, configure_deepspeed, configure_deepspeed_for, resolve_deepspeed_file, make_accelerator,
    any_process, full_shape, full_numel, local_numel, local_parameter_fraction, trainable_elements,
    optimizer_state_bytes, gathered_parameters,
)

__all__ = [
    "launch_world_size", "first_process", "deepspeed_launched", "uses_deepspeed", "zero_stage",
    "zero3_partitioned", "zero3_collective", "configure_deepspeed", "configure_deepspeed_for",
    "resolve_deepspeed_file", "make_accelerator", "any_process", "full_shape", "full_numel", "local_numel",
    "local_parameter_fraction", "trainable_elements", "optimizer_state_bytes", "gathered_parameters",
]
