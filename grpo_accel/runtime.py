"""Process-level set-up: torch threads per process and an Accelerator that is truly distributed on CPU."""
from __future__ import annotations

import logging
import os

logger = logging.getLogger(__name__)


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def configure_threads() -> int:
    """Give each local process cores / local processes torch threads (oversubscription is 10-20x slower).

    An explicit ``OMP_NUM_THREADS`` wins. Returns the thread count set.
    """
    import torch

    if os.environ.get("OMP_NUM_THREADS"):
        threads = int(os.environ["OMP_NUM_THREADS"])
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("ACCELERATE_NUM_PROCESSES", "1")) or 1)
        threads = max(1, available_cores() // max(1, local))
    torch.set_num_threads(threads)
    return threads


def make_accelerator(gradient_accumulation_steps: int = 1, mixed_precision: str = "no"):
    """An ``accelerate.Accelerator``; without a GPU it uses gloo so that several processes really form a group.

    (Without the explicit backend, accelerate on CPU leaves every DeepSpeed rank believing it is rank 0 of 1;
    with it in a single process, accelerate asks for a process group that was never started.)
    """
    import torch
    from accelerate import Accelerator
    from accelerate.utils import InitProcessGroupKwargs

    distributed = int(os.environ.get("WORLD_SIZE", "1")) > 1
    handlers = [InitProcessGroupKwargs(backend="gloo")] if distributed and not torch.cuda.is_available() else []
    return Accelerator(
        gradient_accumulation_steps=gradient_accumulation_steps,
        mixed_precision=mixed_precision,
        kwargs_handlers=handlers,
    )
