"""Start tests/sglang_standin.py as a real server process on 127.0.0.1, and talk to its test-control routes.

Plain urllib here: the stand-in and everything that drives it stay apart from grpo_accel's own client."""
import contextlib
import json
import subprocess
import sys
import time
import urllib.error
import urllib.request

from launching import ROOT, free_port
from sglang_source import source_dir

NEWEST = "0.5.23"


@contextlib.contextmanager
def standin_server(model_dir, *extra: str, version: str = NEWEST):
    source_dir(version)  # fetched once here, so that the server does not race to download it
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "sglang_standin.py"), "--port", str(port),
                             "--model", str(model_dir), "--sglang-version", version, *extra],
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                urllib.request.urlopen(url + "/health", timeout=5).read()
                break
            except (urllib.error.URLError, ConnectionError):
                if proc.poll() is not None or time.monotonic() > deadline:
                    proc.kill()
                    raise AssertionError("stand-in did not start:\n" + proc.communicate()[0][-4000:])
                time.sleep(0.2)
        yield url
    finally:
        proc.kill()
        proc.wait()


def control(url: str, path: str, body: dict | None = None):
    """POST (with a body) or GET a stand-in route; the JSON answer."""
    data = None if body is None else json.dumps(body).encode()
    request = urllib.request.Request(url + path, data=data, headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=60) as response:
        return json.loads(response.read())


def fail_next(url: str, path: str, how: str = "success_false", times: int = 1) -> None:
    control(url, "/_standin/fail", {"path": path, "how": how, "times": times})


def server_state(url: str) -> dict:
    return control(url, "/_standin/state")
