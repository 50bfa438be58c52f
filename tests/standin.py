"""Start tests/sglang_standin.py as a real server process on 127.0.0.1."""
import contextlib
import subprocess
import sys

from grpo_accel.rollout.http import HTTPClient
from launching import ROOT, free_port


@contextlib.contextmanager
def standin_server(model_dir, *extra: str):
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "tests" / "sglang_standin.py"), "--port", str(port),
                             "--model", str(model_dir), *extra], stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                            text=True)
    url = f"http://127.0.0.1:{port}"
    try:
        try:
            HTTPClient(url, api_key=_key(extra)).wait_healthy(60, poll_s=0.2)
        except Exception:
            proc.kill()
            raise AssertionError("stand-in did not start:\n" + proc.communicate()[0][-4000:])
        yield url
    finally:
        proc.kill()
        proc.wait()


def _key(extra):
    return extra[extra.index("--api-key") + 1] if "--api-key" in extra else None
