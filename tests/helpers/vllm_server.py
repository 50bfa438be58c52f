"""A real vLLM server for the tests: vLLM 0.32.0's CPU build from the venv ``launch/vllm_setup.sh`` builds, started
as a user starts it (``python -m vllm.entrypoints.openai.api_server`` with ``VLLM_SERVER_DEV_MODE=1``) on
127.0.0.1, stopped with its whole process group (its engine core and worker are processes of their own)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import time
import urllib.request
from pathlib import Path

from launching import ROOT, free_port

API_KEY = "vllm-test-key"
START_S = 300.0  # a start took 30-85 s on this machine's two cores, more while a launch runs beside it


def vllm_python() -> Path:
    """The server's interpreter, its venv built (or found built) by the repo's script."""
    subprocess.run(["bash", str(ROOT / "launch" / "vllm_setup.sh")], check=True, timeout=1200)
    return ROOT / ".venv-vllm" / "bin" / "python"


def save_vllm_model(folder: Path) -> Path:
    """The built-in tiny Llama with 2 heads of 32 (vLLM's CPU attention takes head sizes 32, 64, 80, ... only;
    the built-in 4 heads of 16 kill its engine at the first request), and the character tokenizer."""
    from grpo_accel.tasks.tiny import TinyModelSpec, build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer()
    build_tiny_model(tokenizer, TinyModelSpec(num_heads=2), seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


class VLLMServer:
    """One server process; ``start`` (again, after ``kill``) on the same port."""

    def __init__(self, python: Path, model: Path, log: Path, *flags: str) -> None:
        self.python, self.model, self.log, self.flags = python, model, log, flags
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.proc: subprocess.Popen | None = None

    def start(self) -> VLLMServer:
        env = {**os.environ, "VLLM_SERVER_DEV_MODE": "1", "VLLM_CPU_KVCACHE_SPACE": "1", "OMP_NUM_THREADS": "1",
               "VLLM_LOGGING_LEVEL": "WARNING",
               "VLLM_RPC_BASE_PATH": str(self.log.parent)}  # its ZMQ sockets: a killed server leaves them behind
        command = [str(self.python), "-m", "vllm.entrypoints.openai.api_server", "--model", str(self.model),
                   "--host", "127.0.0.1", "--port", str(self.port), "--max-model-len", "128", "--dtype", "float32",
                   "--logprobs-mode", "processed_logprobs", "--api-key", API_KEY,
                   # no torch.compile of the model: it took 30 of a cold start's 63 s here; the routes, the scheduler
                   # and the weight loading the tests check are the same
                   "--enforce-eager",
                   # the CPU build stops when it prefills a seeded request in parts (ServerInfo.check_prefill)
                   "--no-enable-chunked-prefill", *self.flags]
        with open(self.log, "ab") as log:
            self.proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT, env=env,
                                         start_new_session=True)
        deadline = time.monotonic() + START_S
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"vLLM exited with {self.proc.returncode}:\n{self.log.read_text()[-4000:]}")
            if self.healthy():
                return self
            time.sleep(1)
        self.kill()
        raise RuntimeError(f"vLLM did not answer /health within {START_S:.0f} s:\n{self.log.read_text()[-4000:]}")

    def kill(self, sig: int = signal.SIGKILL) -> None:
        """The server and its engine processes (those left by a server that died too)."""
        if self.proc is not None:
            try:
                os.killpg(self.proc.pid, sig)
            except ProcessLookupError:
                pass
            self.proc.wait(timeout=60)
        self.proc = None

    def healthy(self) -> bool:
        """``/health`` answers 200 (503 once its engine stopped; refused once it died)."""
        try:
            with urllib.request.urlopen(self.url + "/health", timeout=5):
                return True
        except OSError:
            return False

    def revive(self) -> VLLMServer:
        """Started again if it died or does not answer ``/health`` (a test that stopped its engine fails alone,
        not every test after it on a dead server); as it was otherwise."""
        if self.healthy():
            return self
        self.kill()
        return self.start()

    def post(self, path: str, body: dict, key: str | None = API_KEY) -> dict:
        with urllib.request.urlopen(self._posting(path, body, key), timeout=60) as answer:
            return json.loads(answer.read())

    def stream(self, path: str, body: dict):
        """POST ``body`` with ``stream`` on: each server-sent event's JSON, as it arrives."""
        with urllib.request.urlopen(self._posting(path, {**body, "stream": True}), timeout=60) as answer:
            for line in answer:
                if line.startswith(b"data: {"):
                    yield json.loads(line[len(b"data: "):])

    def _posting(self, path: str, body: dict, key: str | None = API_KEY) -> urllib.request.Request:
        headers = {"Content-Type": "application/json", **({"Authorization": f"Bearer {key}"} if key else {})}
        return urllib.request.Request(self.url + path, json.dumps(body).encode(), headers, method="POST")

    def get(self, path: str) -> dict:
        request = urllib.request.Request(self.url + path, headers={"Authorization": f"Bearer {API_KEY}"})
        with urllib.request.urlopen(request, timeout=60) as answer:
            return json.loads(answer.read())

    def prompt_logprobs(self, ids: list[int]) -> list[float]:
        """The server's logprob of each token of ``ids`` after the first: what its weights compute."""
        choice = self.post("/v1/completions", {"prompt": ids, "max_tokens": 1, "prompt_logprobs": 0})["choices"][0]
        return [next(iter(p.values()))["logprob"] for p in choice["prompt_logprobs"][1:]]
