"""A process's share of the machine: torch threads per process and how glibc's malloc treats the memory torch
frees (kept for the next step, or handed back under ZeRO-3 and while a model loads)."""
from __future__ import annotations

import contextlib
import os
from typing import Iterator


def available_cores() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def configure_threads() -> int:
    """Give each local process cores / local processes torch threads (oversubscription is 10-20x slower).

    ``GRPO_ACCEL_THREADS`` wins, then an ``OMP_NUM_THREADS`` the user set. ``accelerate launch`` sets
    OMP_NUM_THREADS=1 in every process by itself when the config does not say ``use_cpu``
    (``accelerate/commands/launch.py``, ``_validate_launch_command``), which left a one-process CPU run on one
    core: under accelerate launch a 1 is taken as its default, not as a choice. Returns the thread count set.
    """
    import torch

    omp = os.environ.get("OMP_NUM_THREADS")
    accelerate_default = omp == "1" and "ACCELERATE_DYNAMO_BACKEND" in os.environ  # set by accelerate launch
    if os.environ.get("GRPO_ACCEL_THREADS"):
        threads = int(os.environ["GRPO_ACCEL_THREADS"])
    elif omp and not accelerate_default:
        threads = int(omp)
    else:
        local = int(os.environ.get("LOCAL_WORLD_SIZE", os.environ.get("ACCELERATE_NUM_PROCESSES", "1")) or 1)
        threads = max(1, available_cores() // max(1, local))
    torch.set_num_threads(threads)
    return threads


MALLOC_MMAP_THRESHOLD, MALLOC_TRIM_THRESHOLD = -3, -1  # mallopt's parameter numbers (glibc's malloc.h)


def keep_freed_memory(mmap_threshold: int = 2**30, trim_threshold: int = 2**31 - 1) -> bool:
    """Have glibc's malloc keep the memory torch frees for its next allocations instead of handing it back.

    A training step allocates and frees the same activations, logits and gradients every time. By default glibc
    serves blocks above its mmap threshold (128 KiB, rising to at most 32 MiB) with fresh ``mmap`` pages and
    gives the top of its heap back beyond 128 KiB free, so each step's tensors are new pages that the kernel
    faults in and zeroes one 4 KiB page at a time: SmolLM2-135M's forward + backward + AdamW step faulted
    300,000-450,000 pages (1.2-1.8 GB), and first-touching 1.3 GB took 0.32-0.38 s here against 0.05 s to refill
    it. With both thresholds raised (``mallopt``), freed blocks are reused: 325-7,763 faults a step after 3 steps,
    and the heap stops growing once it holds what a step needs (SmolLM2 steps of random lengths: peak RSS
    +5.8 %). Blocks above ``mmap_threshold`` still get their own pages. Returns whether glibc took both settings (False
    where the C library is not glibc); inherited by processes forked after it. Both values are C ints.
    """
    global _KEPT
    mallopt = _glibc_function("mallopt")
    kept = mallopt is not None and bool(mallopt(MALLOC_MMAP_THRESHOLD, mmap_threshold)) and bool(
        mallopt(MALLOC_TRIM_THRESHOLD, trim_threshold))
    _KEPT = (mmap_threshold, trim_threshold) if kept else None
    return kept


_KEPT: tuple[int, int] | None = None  # keep_freed_memory's thresholds while in force
GLIBC_START_THRESHOLD = 128 * 1024  # glibc's starting mmap and trim thresholds (malloc.c, DEFAULT_MMAP_THRESHOLD_MIN)


def configure_allocator(zero3: bool) -> bool:
    """How glibc's malloc treats the memory torch frees, for a run partitioned by ZeRO-3 or not; returns whether
    freed memory is kept.

    Not ZeRO-3: kept for the next step (:func:`keep_freed_memory`). ZeRO-3: handed back, with glibc's starting
    thresholds held (128 KiB; glibc's own rise, which keeps blocks up to 32 MiB in the heap, stays off). Under
    ZeRO-3 every forward gathers each module's whole weights and frees them again; kept, those blocks and the
    fragments between them stayed in the heap. 4 processes with a SmolLM2-sized Llama and a KL reference, to the
    end of an 8-token first generation: peaks 1,709-1,937 MiB kept, 1,281-1,283 MiB handed back (at 4 MiB /
    64 MiB thresholds 1,489-1,600). The cost is page faults on a CPU: that generation took 37.4 s handed back
    against 22.2 s kept (tests/launched/test_zero3_load.py, docs/pages/benchmarks.md). A GPU's tensors do not go
    through malloc.
    """
    global _KEPT
    if not zero3:
        return keep_freed_memory()
    mallopt = _glibc_function("mallopt")
    if mallopt is not None:
        mallopt(MALLOC_MMAP_THRESHOLD, GLIBC_START_THRESHOLD)
        mallopt(MALLOC_TRIM_THRESHOLD, GLIBC_START_THRESHOLD)
    _KEPT = None
    return False


@contextlib.contextmanager
def freed_memory_returned(mmap_threshold: int = 2**20) -> Iterator[None]:
    """Inside the block, glibc gives blocks above ``mmap_threshold`` pages of their own and hands them back when
    they are freed; after it, :func:`keep_freed_memory`'s settings again (if they were in force) and the heap's
    free memory handed back.

    For loading a model under ZeRO-3: ``zero.Init`` makes each weight whole, broadcasts it and keeps only this
    process's shard. With freed memory kept, those whole weights stayed in the heap: 4 processes loading 957 MB
    of weights (policy and reference) each held 770-1040 MB more after the load; with this, 257 MB (their
    quarter and 18 MB), 320 MB at the peak (tests/launched/test_zero3_load.py).
    """
    mallopt = _glibc_function("mallopt")
    if mallopt is None:
        yield
        return
    mallopt(MALLOC_MMAP_THRESHOLD, mmap_threshold)
    try:
        yield
    finally:
        if _KEPT is not None:
            keep_freed_memory(*_KEPT)
        else:
            mallopt(MALLOC_MMAP_THRESHOLD, GLIBC_START_THRESHOLD)  # its own rise stays off
        release_freed_memory()


def release_freed_memory() -> None:
    """Hand the memory malloc keeps (see :func:`keep_freed_memory`) back to the system now (``malloc_trim``), so
    that the resident set counts live memory only: a measurement of one block's peak RSS starts from it."""
    trim = _glibc_function("malloc_trim")
    if trim is not None:
        trim(0)


def _glibc_function(name: str):
    """``name`` from the C library through ctypes, or None where the library or the function is not there."""
    import ctypes
    import ctypes.util

    try:
        return getattr(ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6"), name)
    except (OSError, AttributeError):
        return None
