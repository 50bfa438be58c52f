"""Start launch/bench/sglang_standin as a real server process on 127.0.0.1, and talk to its test-control routes.

Plain urllib here: the stand-in and everything that drives it stay apart from grpo_accel's own client."""
import contextlib
import json
import os
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request

from common import ROOT, free_port
from sglang_standin.source import source_dir

NEWEST = "0.5.23"


HEALTH_CHECK_TIMEOUT_S = "3"
"""SGLang's ``SGLANG_HEALTH_CHECK_TIMEOUT`` for the stand-ins (SGLang's default, 20 s, would make every test of a
server that does not generate wait that long)."""


class StandIn:
    """launch/bench/sglang_standin started as a process on a free port; ``wait_up`` waits until it answers."""

    def __init__(self, model_dir, *extra: str, version: str = NEWEST) -> None:
        source_dir(version)  # fetched once here, so that the server does not race to download it
        port = free_port()
        self.url = f"http://127.0.0.1:{port}"
        self.output = tempfile.TemporaryFile()  # not a pipe: a long-lived server must never block on a full one
        self.proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "bench" / "sglang_standin"), "--port", str(port),
                                      "--model", str(model_dir), "--sglang-version", version, *extra],
                                     stdout=self.output, stderr=subprocess.STDOUT,
                                     env={"SGLANG_HEALTH_CHECK_TIMEOUT": HEALTH_CHECK_TIMEOUT_S, **os.environ})

    def wait_up(self, timeout_s: float = 60) -> str:
        """Until the process answers (a test-control route: /health runs a generation, a second at least, and
        refuses a paused server, as SGLang's does)."""
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                urllib.request.urlopen(self.url + "/_standin/counts", timeout=5).read()
                return self.url
            except (urllib.error.URLError, ConnectionError):
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    self.proc.kill()
                    self.proc.wait()
                    self.output.seek(0)
                    said = self.output.read()[-4000:].decode(errors="replace")
                    self.stop()
                    raise AssertionError(f"stand-in did not start:\n{said}")
                time.sleep(0.1)

    def stop(self) -> None:
        self.proc.kill()
        self.proc.wait()
        self.output.close()


@contextlib.contextmanager
def standin_server(model_dir, *extra: str, version: str = NEWEST):
    server = StandIn(model_dir, *extra, version=version)
    try:
        yield server.wait_up()
    finally:
        server.stop()


class SharedServers:
    """Stand-ins shared by the tests of a module, one process per (model folder, release), started by ``start``
    or at first use; each use resets it (``POST /_standin/reset``) to a fresh server started with the flags it
    names. One that still has a request in flight (a test that failed midway), or that died, is restarted."""

    def __init__(self) -> None:
        self._servers: dict[tuple[str, str], StandIn] = {}

    def start(self, model_dir, version: str = NEWEST) -> None:
        if (str(model_dir), version) not in self._servers:
            self._servers[str(model_dir), version] = StandIn(model_dir, version=version)

    def get(self, model_dir, *flags: str, version: str = NEWEST) -> str:
        known = self._servers.get((str(model_dir), version))
        if known is not None and known.proc.poll() is not None:  # it died (as SGLang dies) in an earlier test
            self._servers.pop((str(model_dir), version)).stop()
        self.start(model_dir, version)
        url = self._servers[str(model_dir), version].wait_up()
        try:
            control(url, "/_standin/reset", {"flags": list(flags)})
        except urllib.error.HTTPError:
            self._servers.pop((str(model_dir), version)).stop()
            return self.get(model_dir, *flags, version=version)
        return url

    def close(self) -> None:
        for server in self._servers.values():
            server.stop()
        self._servers.clear()


def control(url: str, path: str, body: dict | None = None):
    """POST (with a body) or GET a stand-in route; the JSON answer (None for an empty one)."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        text = response.read()
        return json.loads(text) if text else None


def fail_next(url: str, path: str, how: str = "success_false", times: int = 1) -> None:
    control(url, "/_standin/fail", {"path": path, "how": how, "times": times})


def server_state(url: str) -> dict:
    return control(url, "/_standin/state")
