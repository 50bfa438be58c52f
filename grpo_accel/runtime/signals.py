"""Signals, the terminal and the exit: SIGTERM/SIGINT as a stop request, Ctrl-C reaching the trainer rather than its
launcher, and an exit that skips Python's teardown."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time
from typing import Callable


def exit_skipping_teardown(code: int) -> None:
    """Flush and leave without Python's teardown: gloo's aborts ~1 in 40 exits after the work is done
    (SIGABRT, "terminate called without an active exception"), which would turn a finished run into a failure."""
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


RELAYED_WITHIN_S = 1.0
"""A second signal this soon after the first is the same stop, relayed: a launcher forwards the signal it got to
the trainer, which got it too when the whole group was signalled (Ctrl-C, a scheduler's SIGTERM to every process
of a job): Accelerate's one-process launcher (1.16 and later) sends SIGTERM, torch's elastic agent the signal."""


@contextlib.contextmanager
def stop_on_signals(request_stop: Callable[[str], None]):
    """Inside the block, the first SIGTERM/SIGINT calls ``request_stop(reason)``; a second, unless it comes within
    ``RELAYED_WITHIN_S`` of the first, exits the process at once with code 128 + signal. Outside the main thread it
    does nothing (signals go to the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    received: list[float] = []
    ends_after = launcher_kills_after()

    def handler(signum, _frame):
        name, now = signal.Signals(signum).name, time.monotonic()
        if received and now - received[0] < RELAYED_WITHIN_S:
            return  # the launcher relaying the stop already asked for
        received.append(now)
        if len(received) > 1:
            os.write(2, f"second {name}: exiting without a checkpoint\n".encode())
            os._exit(128 + signum)
        if ends_after is not None:  # written, not logged: a handler must not wait for the logging lock
            os.write(2, f"received {name}: the launcher (Accelerate {ends_after[1]}) ends this process "
                        f"{ends_after[0]:.0f} s after it relays a signal: the stop saves a checkpoint if this batch "
                        "ends by then, else a resume starts from the last complete one (checkpoints are never "
                        "half-written)\n".encode())
        request_stop(f"received {name}")

    previous = {sig: signal.signal(sig, handler) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, old in previous.items():
            signal.signal(sig, old)


def launcher_kills_after() -> tuple[float, str] | None:
    """(seconds, Accelerate's version) when this process is the trainer of Accelerate's one-process launcher of a
    release that SIGKILLs it that long after relaying a signal (1.16's ``_terminate_process_tree``: 5 s); else None."""
    import importlib.metadata

    if "TORCHELASTIC_RUN_ID" in os.environ:  # several processes: torch's agent started it (it waits 30 s)
        return None
    try:
        parent = open(f"/proc/{os.getppid()}/cmdline", "rb").read().split(b"\0")
        version = importlib.metadata.version("accelerate")
    except (OSError, importlib.metadata.PackageNotFoundError):
        return None
    launched = any(part.endswith((b"accelerate", b"accelerate.commands.launch")) for part in parent)
    major, minor = (int(x) for x in version.split(".")[:2])
    return (5.0, version) if launched and (major, minor) >= (1, 16) else None


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
