"""Run ``accelerate launch`` as a real subprocess: free port, timeout, every rank's output on failure."""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def run_in_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` in a process group of its own that is killed whole on timeout: killing only the
    launcher would leave its ranks running (and holding DeepSpeed's build lock)."""
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.communicate()
            raise
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def launch(config: str, script_args: list[str], *, timeout: float = 300, expect_ok: bool = True,
           launcher_args: list[str] = (), env: dict | None = None,
           script: tuple[str, ...] = (str(ROOT / "launch" / "train.py"),)) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file accelerate_configs/<config> <script> <script_args>``; the script is
    launch/train.py unless given (e.g. ``("-m", "grpo_accel.bench")``)."""
    cmd = [*ACCELERATE, "--config_file", str(ROOT / "accelerate_configs" / config),
           "--main_process_port", str(free_port()), *launcher_args, *script, *script_args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu", **(env or {})}
    proc = run_in_group(cmd, cwd=ROOT, env=full_env, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr (all ranks)\n{proc.stderr[-12000:]}")
    return proc
