"""DeepSpeed's C++ ops on a machine without a GPU: the shared-memory op kept from compiling, and torch build locks
left by a killed builder removed (torch waits on them silently and forever)."""
from __future__ import annotations

import logging
import os
import time
from pathlib import Path

logger = logging.getLogger(__name__)


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
