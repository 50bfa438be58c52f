"""Shared by cli/, distributed/, recipe/, run/ and trainer/.

Process-level set-up: torch threads per process, the allocator, DeepSpeed's CPU op, stale build locks, signals
and the terminal, the exit."""
from __future__ import annotations

import contextlib
import logging
import os
import signal
import sys
import threading
import time
from pathlib import Path
from typing import Callable, Iterator

logger = logging.getLogger(__name__)


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


def skip_deepspeed_shm_op() -> None:
    """Keep DeepSpeed from JIT-compiling its shared-memory all-reduce (``deepspeed_shm_comm``) on CPU.

    DeepSpeed's torch backend builds that C++ op when its process group starts (``build_shm_op`` in
    deepspeed/comm/torch.py): 20-70 s on a machine's first launch, with a C++ compiler, under a build lock. Only
    ``inference_all_reduce`` (DeepSpeed-Inference's tensor parallelism) calls it; training's collectives go
    through the process group (gloo) either way. ``build_shm_op`` builds it only when
    ``deepspeed.ops.__compatible_ops__`` lists it (a dict DeepSpeed keeps in the module so that edits to it last):
    marked incompatible, nothing is built. On a GPU the op does not exist and this changes nothing.
    """
    import deepspeed.ops

    deepspeed.ops.__compatible_ops__["deepspeed_shm_comm"] = False


def extension_build_root() -> Path:
    """Where torch JIT-builds C++ extensions (DeepSpeed's ops among them): ``TORCH_EXTENSIONS_DIR`` or its default."""
    from torch.utils.cpp_extension import get_default_build_root

    return Path(os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root())


def lock_holders(path: Path, proc: Path = Path("/proc")) -> list[int]:
    """Pids of the processes that have ``path`` open. torch's builder keeps its lock file open while it builds,
    so a lock nobody holds was left by a builder that died. Linux only (elsewhere: [])."""
    target = os.path.realpath(path)
    holders = []
    for fd_dir in proc.glob("[0-9]*/fd"):
        try:
            if any(os.readlink(fd) == target for fd in fd_dir.iterdir()):
                holders.append(int(fd_dir.parent.name))
        except OSError:  # the process ended, or is not ours to inspect
            continue
    return holders


def command_line(pid: int) -> str:
    """The command line of ``pid`` ("?" where it cannot be read)."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
    except OSError:
        return "?"


def clear_stale_build_locks(root: Path | None = None, *, report_every_s: float = 10.0, poll_s: float = 0.5) -> list[Path]:
    """Remove torch build locks that no process holds; wait out held ones, saying every ``report_every_s`` who
    builds what. Returns the locks removed.

    torch waits on a build lock silently and forever, so one left by a builder that was killed (SIGKILL, OOM, a
    timeout) hung every later DeepSpeed launch with no output. A lock held by a process on another machine
    sharing this folder is not visible here; ``TORCH_EXTENSIONS_DIR`` per machine avoids sharing it.
    """
    if not Path("/proc/self/fd").is_dir():
        return []
    root = extension_build_root() if root is None else root
    removed = []
    for lock in sorted(root.glob("*/*/lock")):
        start = time.monotonic()
        next_report = start + report_every_s
        while lock.exists():
            before = _inode(lock)
            holders = lock_holders(lock)
            if not holders:
                if before is not None and _inode(lock) == before:  # not replaced by a new build meanwhile
                    lock.unlink(missing_ok=True)
                    removed.append(lock)
                    logger.warning("removed a stale build lock %s: no process holds it (its builder was killed); "
                                   "without this every DeepSpeed launch would wait on it forever", lock)
                continue
            if time.monotonic() >= next_report:
                logger.warning("waiting %.0f s so far for pid %s (%s) to finish building %s (lock %s)",
                               time.monotonic() - start, holders[0], command_line(holders[0]), lock.parent.name,
                               lock)
                next_report += report_every_s
            time.sleep(poll_s)
    return removed


def _inode(path: Path) -> tuple[int, int] | None:
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    return stat.st_ino, stat.st_ctime_ns


def exit_skipping_teardown(code: int) -> None:
    """Flush and leave without Python's teardown: gloo's aborts ~1 in 40 exits after the work is done
    (SIGABRT, "terminate called without an active exception"), which would turn a finished run into a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


@contextlib.contextmanager
def stop_on_signals(request_stop: Callable[[str], None]):
    """Inside the block, the first SIGTERM/SIGINT calls ``request_stop(reason)``; a second exits the process
    at once with code 128 + signal. Outside the main thread it does nothing (signals go to the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received = []

    def handler(signum, _frame):
        received.append(signum)
        name = signal.Signals(signum).name
        if len(received) > 1:
            os.write(2, f"second {name}: exiting without a checkpoint\n".encode())
            os._exit(128 + signum)
        request_stop(f"received {name}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


@contextlib.contextmanager
def terminal_foreground():
    """Inside the block, this process's own process group is the terminal's foreground, when a launcher in the
    foreground started it in the launcher's group (``accelerate launch`` with one process).

    Ctrl-C signals the terminal's foreground group. In the launcher's group it reaches Accelerate's launcher too,
    which prints a KeyboardInterrupt traceback and gives the shell back while the trainer is still saving. With
    the foreground here, Ctrl-C reaches the trainer (and its decode worker) alone: it saves and exits 0, and the
    launcher, never signalled, exits with that code. The launcher's group gets the terminal back at the end of the
    block. Ctrl-Z is ignored meanwhile: the shell waits on the launcher and could not resume a stopped trainer.
    Nothing changes without a terminal, in the background, for a process the shell started itself (a group
    leader), or under several processes (torch's agent starts every rank in a session of its own, without a
    terminal: there the agent forwards the signal, and prints its own traceback after the ranks have saved).
    """
    try:
        tty = os.open("/dev/tty", os.O_RDWR | os.O_NOCTTY)
    except OSError:  # no controlling terminal (nohup, SLURM, CI, a detached container)
        tty = None
    if tty is None:  # outside the handler: an error in the block must not read as raised while handling this one
        yield
        return
    launcher = os.getpgrp()
    try:
        if launcher == os.getpid() or os.tcgetpgrp(tty) != launcher:
            yield
            return
        os.setpgid(0, 0)
        _give_foreground(tty, os.getpgrp())
        previous = signal.signal(signal.SIGTSTP, signal.SIG_IGN)
        try:
            yield
        finally:
            signal.signal(signal.SIGTSTP, previous)
            _give_foreground(tty, launcher)
    finally:
        os.close(tty)


def _give_foreground(tty: int, group: int) -> None:
    """Make ``group`` the terminal's foreground (from a background group, which needs SIGTTOU ignored)."""
    previous = signal.signal(signal.SIGTTOU, signal.SIG_IGN)
    try:
        os.tcsetpgrp(tty, group)
    except OSError:  # the launcher's group is gone: the shell takes its terminal back itself
        pass
    finally:
        signal.signal(signal.SIGTTOU, previous)
