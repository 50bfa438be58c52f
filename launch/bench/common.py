"""What the bench scripts share (and the tests that run them import): the checkout's root, a free port, the work's
tiny model and the README's command on it, a fresh SGLang stand-in (``sglang_standin/`` beside this file, built from
SGLang's own source; the tests run it too), and a process's anonymous memory sampled per phase, said as one JSON
line."""
from __future__ import annotations

import contextlib
import json
import os
import socket
import subprocess
import sys
import tempfile
import threading
import time
import urllib.request
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
WORK = {"prompts": 2, "group": 4, "max_new_tokens": 32, "kl_coef": 0.04, "lr": 1e-4}
"""The work every comparison runs (see trl_parity.py's docstring)."""
STANDIN = Path(__file__).resolve().parent / "sglang_standin"  # run as a program
SGLANG_VERSION = "0.5.23"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def tiny_model_folder(folder: str | Path) -> Path:
    """The tiny Qwen2 of the work, saved with its tokenizer in ``folder``."""
    from grpo_accel.tasks.tiny import build_char_tokenizer, build_tiny_qwen2

    tokenizer = build_char_tokenizer()
    build_tiny_qwen2(tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)


def readme_command(model: str | Path, out: Path, batches: int, *overrides: str, root: Path = ROOT) -> list[str]:
    """The README's command on the work, ``batches`` iterations long, writing to ``out``, from the checkout at
    ``root`` (this environment's ``accelerate``)."""
    return [str(Path(sys.executable).parent / "accelerate"), "launch", "--config_file",
            str(root / "accelerate_configs" / "single_process.yaml"), str(root / "launch" / "train.py"),
            f"model.name_or_path={model}", "data.max_operand=49",
            f"rollout.prompts_per_batch={WORK['prompts']}", f"rollout.group_size={WORK['group']}",
            f"rollout.max_new_tokens={WORK['max_new_tokens']}", f"loss.kl_coef={WORK['kl_coef']}",
            f"optim.lr={WORK['lr']}", f"trainer.total_frames={batches * WORK['prompts'] * WORK['group']}",
            f"output_dir={out}", *overrides]


@contextlib.contextmanager
def standin(model: Path, cores: set[int], delay: float):
    """A fresh stand-in on ``cores``, its URL while it runs."""
    port = free_port()
    log = tempfile.TemporaryFile()
    proc = subprocess.Popen([sys.executable, str(STANDIN), "--port", str(port), "--model", str(model),
                             "--sglang-version", SGLANG_VERSION, "--kv-cache", "--decode-delay", str(delay)],
                            stdout=log, stderr=subprocess.STDOUT, preexec_fn=lambda: os.sched_setaffinity(0, cores))
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 120
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    log.seek(0)
                    raise SystemExit(f"the stand-in did not start:\n{log.read()[-3000:].decode(errors='replace')}")
                time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait()
        log.close()


def anonymous_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


class PhaseSampler:
    """Each phase's peak of this process's anonymous memory, sampled every ``every_s`` seconds on a thread."""

    def __init__(self, every_s: float = 0.002) -> None:
        self.phase, self.peaks, self.every_s = "start", {}, every_s
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._sample, daemon=True)
        self.thread.start()

    def enter(self, phase: str) -> int:
        """Begin ``phase``; returns the anonymous memory now (counted in the phase that ends)."""
        now = self._record()
        self.phase = phase
        return now

    def stop(self) -> dict[str, int]:
        self.done.set()
        self.thread.join()
        self._record()
        return self.peaks

    def _record(self) -> int:
        now = anonymous_bytes()
        self.peaks[self.phase] = max(self.peaks.get(self.phase, 0), now)
        return now

    def _sample(self) -> None:
        while not self.done.is_set():
            self._record()
            time.sleep(self.every_s)


def say(result: dict) -> None:
    """``result`` as one JSON line on stdout in one write: the processes share the pipe, and a line written whole
    (under the pipe's 4 KiB) is never cut by another's (print's text and newline are two writes, unbuffered)."""
    line = (json.dumps(result) + "\n").encode()
    assert len(line) < 4096, "longer lines may interleave"
    os.write(sys.stdout.fileno(), line)


def around(owner, name: str, sampler: PhaseSampler, phase: str, after: str, held: dict) -> None:
    """``owner.name`` runs in ``phase``, then ``after`` begins; ``held[phase]``: the memory held when it was called
    and when it returned."""
    function = getattr(owner, name)

    def timed(*args, **kwargs):
        before = sampler.enter(phase)
        try:
            return function(*args, **kwargs)
        finally:
            held[phase] = (before, sampler.enter(after))

    setattr(owner, name, timed)
