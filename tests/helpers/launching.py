"""Run ``accelerate launch`` as a real subprocess: free port, timeout, every rank's output on failure."""
from __future__ import annotations

import contextlib
import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
ACCELERATE = [sys.executable, "-m", "accelerate.commands.launch"]
sys.path.insert(0, str(ROOT / "launch" / "bench"))
from common import free_port  # noqa: E402,F401  (the bench's; tests import it from here)


TINY_FOLDER = ("rollout.max_new_tokens=4", "optim.lr=3e-4")
"""The built-in tiny model's settings for a tiny model given as a folder: a model named by model.name_or_path
takes a pretrained model's defaults (grpo_accel.config.defaults), 256 new tokens over its 128-token context."""


def run_in_group(cmd: list[str], timeout: float, **kwargs) -> subprocess.CompletedProcess:
    """``subprocess.run`` that, on timeout, kills every process the command started and says where each was.

    Killing the launcher's process group is not enough: torch's elastic agent starts each rank in a session of
    its own, so ranks outlive it (holding DeepSpeed's build lock, and our output pipes, which left the wait for
    their output hanging forever). So the whole process tree is found by parentage, each process is sent SIGABRT
    first (``PYTHONFAULTHANDLER`` makes a Python process print its stack), then SIGKILL, and the error carries
    the output up to the kill.
    """
    env = {**(kwargs.pop("env", None) or os.environ), "PYTHONFAULTHANDLER": "1"}
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          env=env, **kwargs) as proc:
        try:
            stdout, stderr = proc.communicate(timeout=timeout)
        except BaseException as err:  # the timeout, or an interrupt while waiting: leave nothing running
            _kill_tree(proc.pid)
            try:
                stdout, stderr = proc.communicate(timeout=30)
            except subprocess.TimeoutExpired as late:  # a process outside the tree still holds a pipe
                stdout, stderr = _text(late.stdout), _text(late.stderr)
            if not isinstance(err, subprocess.TimeoutExpired):
                raise
            raise LaunchTimeout(cmd, timeout, output=stdout, stderr=stderr) from None
    return subprocess.CompletedProcess(cmd, proc.returncode, stdout, stderr)


def _family(pid: int) -> list:
    """``pid`` and every process under it (psutil), whatever session or group they are in; [] once it is gone."""
    import psutil

    try:
        root = psutil.Process(pid)
        return [*root.children(recursive=True), root]  # the ranks before their launcher
    except psutil.NoSuchProcess:
        return []


def sigkill_tree(pid: int) -> None:
    """SIGKILL ``pid`` and every process under it at once, as a lost node dies (the ranks of ``accelerate launch``
    live in sessions of their own: a killpg of the launcher's group leaves them running)."""
    import psutil

    family = _family(pid)
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(family, timeout=10)


class LaunchTimeout(subprocess.TimeoutExpired):
    """A command ran past its timeout; the message carries its processes' output (and stacks) at the kill."""

    def __str__(self) -> str:
        return (f"{super().__str__()}\n--- stdout\n{_text(self.stdout)[-4000:]}\n"
                f"--- stderr (all processes, with their stacks at the kill)\n{_text(self.stderr)[-16000:]}")


def _kill_tree(pid: int) -> None:
    """SIGABRT then SIGKILL to ``pid`` and all its descendants, whatever session or group they are in."""
    import psutil

    family = _family(pid)
    for process in family:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.send_signal(signal.SIGABRT)
    _, alive = psutil.wait_procs(family, timeout=5)
    for process in alive:
        with contextlib.suppress(psutil.NoSuchProcess):
            process.kill()
    psutil.wait_procs(alive, timeout=5)


def _text(output: bytes | str | None) -> str:
    return output.decode(errors="replace") if isinstance(output, bytes) else output or ""


# The README's training command of each of these configs runs as written (its arguments appended) in the test
# module named; test_readme.py runs the README's other commands.
README_RUNS_ELSEWHERE = {"ddp.yaml": "test_distributed.py", "zero1.yaml": "test_distributed.py",
                         "zero2.yaml": "test_distributed.py", "zero3.yaml": "test_distributed.py",
                         "zero3_offload.yaml": "test_distributed.py", "zero0.yaml": "test_episode_runs.py"}


DOCUMENTS = [ROOT / "README.md", *sorted((ROOT / "docs" / "pages").rglob("*.md"))]
"""Where the commands a user is shown live: the README and the documentation's pages."""


def readme_commands() -> list[str]:
    """The commands of the README's and the docs' bash blocks, each once: continuations joined, comments dropped."""
    commands = []
    for document in DOCUMENTS:
        for block in re.findall(r"```bash\n(.*?)```", document.read_text(), re.S):
            for command in block.replace("\\\n", " ").splitlines():
                command = re.sub(r"\s+#.*$", "", command).strip()
                if command and not command.startswith("#"):
                    commands.append(re.sub(r"\s+", " ", command))
    return list(dict.fromkeys(commands))


def run_as_written(command: str, script_args: list[str], *, timeout: float = 300,
                   env: dict | None = None) -> subprocess.CompletedProcess:
    """A README command run by bash from the checkout exactly as written, ``script_args`` appended (and ``env``
    added to the environment); it must succeed."""
    full = f"{command} {' '.join(shlex.quote(a) for a in script_args)}"
    proc = run_in_group(["bash", "-c", full], cwd=ROOT, env={**os.environ, "PYTHONUNBUFFERED": "1", **(env or {})},
                        timeout=timeout)
    if proc.returncode != 0:
        raise AssertionError(f"{full}\nexit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr (all ranks)\n{proc.stderr[-12000:]}")
    return proc


def launch_as_in_readme(config: str, script_args: list[str], *, timeout: float = 300,
                        env: dict | None = None) -> subprocess.CompletedProcess:
    """The README's own command for training under ``accelerate_configs/<config>``, run as written."""
    command = f".venv/bin/accelerate launch --config_file accelerate_configs/{config} launch/train.py"
    assert command in readme_commands(), f"the README no longer has {command!r}"
    return run_as_written(command, script_args, timeout=timeout, env={"DS_ACCELERATOR": "cpu", **(env or {})})


def launch(config: str, script_args: list[str], *, timeout: float = 300, expect_ok: bool = True,
           launcher_args: list[str] = (), env: dict | None = None,
           script: tuple[str, ...] = (str(ROOT / "launch" / "train.py"),),
           prefix: list[str] = (), cwd: Path = ROOT) -> subprocess.CompletedProcess:
    """``accelerate launch --config_file accelerate_configs/<config> <script> <script_args>``; the script is
    launch/train.py unless given (e.g. ``("launch/bench/bench.py",)``); ``prefix`` runs it elsewhere (another network
    namespace: tests/helpers/netns.py), ``cwd`` from another folder."""
    cmd = [*prefix, *ACCELERATE, "--config_file", str(ROOT / "accelerate_configs" / config),
           "--main_process_port", str(free_port()), *launcher_args, *script, *script_args]
    full_env = {**os.environ, "PYTHONUNBUFFERED": "1", "DS_ACCELERATOR": "cpu", **(env or {})}
    proc = run_in_group(cmd, cwd=cwd, env=full_env, timeout=timeout)
    if expect_ok and proc.returncode != 0:
        raise AssertionError(f"{' '.join(cmd)}\nexit {proc.returncode}\n--- stdout\n{proc.stdout[-6000:]}\n"
                             f"--- stderr (all ranks)\n{proc.stderr[-12000:]}")
    return proc


def launch_training(config: str, script_args: list[str], **kw) -> subprocess.CompletedProcess:
    """launch/train.py launched under ``config``: through the README's own command where README_RUNS_ELSEWHERE
    names the config (so that command is run as written), else with :func:`launch`."""
    runner = launch_as_in_readme if config in README_RUNS_ELSEWHERE else launch
    return runner(config, script_args, **kw)


@contextlib.contextmanager
def reward_server(*args: str):
    """``launch/reward_server.py --reward answer_match --port P *args`` running, healthy: yields (its base URL, the
    process); killed at the end."""
    import time
    import urllib.request

    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "reward_server.py"), "--reward", "answer_match",
                             "--port", str(port), *args], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 60
    try:
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=2).read()
                break
            except OSError:
                assert proc.poll() is None and time.monotonic() < deadline, proc.stderr.read().decode()[-3000:]
                time.sleep(0.2)
        yield url, proc
    finally:
        proc.kill()
        proc.wait()


def wait_for_training(stderr, timeout: float = 120) -> None:
    """Until the run's first generation (its decode path is said then): training has begun."""
    deadline = time.monotonic() + timeout
    while "decode: " not in stderr.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)
