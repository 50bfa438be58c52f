"""Process-level set-up, the one start-up every entry point makes (:func:`start_process`): threads and the allocator
(``resources.py``), DeepSpeed's CPU op and stale build locks (``build_locks.py``), signals, the terminal and the
exit (``signals.py``)."""
from __future__ import annotations


def start_process() -> tuple[int, bool]:
    """What a process that trains does first, whichever entry point started it (``grpo-accel train``,
    ``launch/api_example.py``, the bench scripts): torch threads from the cores this process's share of the machine
    has, and glibc's malloc set for the launch config's ZeRO stage (read from ``accelerate launch``'s environment).
    Returns (threads set, whether freed memory is kept)."""
    from grpo_accel.distributed.deepspeed_files import launched_zero_stage
    from grpo_accel.runtime.resources import configure_allocator, configure_threads

    return configure_threads(), configure_allocator(zero3=launched_zero_stage() == 3)
