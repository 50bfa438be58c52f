"""Shared by rewards/, server_rollouts.py, sglang/ and vllm/.

A small JSON-over-HTTP client for inference servers and reward services: bearer key, bounded retries with backoff,
clear errors."""
from __future__ import annotations

import http.client
import json
import logging
import time
import urllib.error
import urllib.request
from typing import Mapping

from grpo_accel.errors import UserError
from grpo_accel.rules import setting

logger = logging.getLogger(__name__)


class ServerError(UserError, RuntimeError):
    """The server answered with an error (message included; ``status`` is the HTTP status) or could not be
    reached (``status`` None)."""

    def __init__(self, message: str, status: int | None = None) -> None:
        super().__init__(message)
        self.status = status


class HTTPClient:
    """``post``/``get`` JSON to one server. 5xx answers and connection errors are retried ``retries`` times with
    exponential backoff (``backoff_s`` doubling); 4xx answers are the caller's fault and raise at once with the
    server's message. ``api_key`` goes out as a bearer token; a 401/403 names ``key_setting``, the setting that
    holds the key; ``kind`` is what messages call the server (e.g. "SGLang server")."""

    def __init__(self, url: str, api_key: str | None = None, timeout_s: float = 600.0, retries: int = 3,
                 backoff_s: float = 0.5, key_setting: str = "api_key", kind: str = "server") -> None:
        self.url, self.api_key, self.timeout_s = url.rstrip("/"), api_key, timeout_s
        self.retries, self.backoff_s, self.key_setting, self.kind = retries, backoff_s, key_setting, kind

    def _request(self, method: str, path: str, body: dict | None, retries: int | None = None,
                 timeout_s: float | None = None):
        data = None if body is None else json.dumps(body).encode()
        headers = {"Content-Type": "application/json"}
        if self.api_key:
            headers["Authorization"] = f"Bearer {self.api_key}"
        attempts = 1 + (self.retries if retries is None else retries)
        timeout_s = self.timeout_s if timeout_s is None else timeout_s  # this request's, else the client's
        for attempt in range(attempts):
            request = urllib.request.Request(self.url + path, data=data, headers=headers, method=method)
            try:
                with urllib.request.urlopen(request, timeout=timeout_s) as response:
                    text = response.read().decode()
                    return json.loads(text) if text.strip().startswith(("{", "[")) else text
            except urllib.error.HTTPError as exc:
                message = _error_message(exc)
                if exc.code in (401, 403):
                    raise ServerError(f"{method} {self.url}{path} -> HTTP {exc.code}: {message}; the server wants "
                                      f"{'another' if self.api_key else 'a'} key: set {self.key_setting}.",
                                      exc.code) from exc
                if exc.code < 500 or attempt == attempts - 1:
                    raise ServerError(f"{method} {self.url}{path} -> HTTP {exc.code}: {message}", exc.code) from exc
                logger.warning("%s %s%s -> HTTP %d (%s); retry %d/%d", method, self.url, path, exc.code, message,
                               attempt + 1, attempts - 1)
            except TimeoutError as exc:  # connected and sent; the answer did not come (urllib wraps connect errors)
                if attempt == attempts - 1:
                    raise ServerError(f"{method} {self.url}{path}: the server took the request but did not answer "
                                      f"within {timeout_s:g} s ({attempts} attempt{'s' * (attempts > 1)})") from exc
                logger.warning("%s %s%s: no answer within %g s; retry %d/%d", method, self.url, path, timeout_s,
                               attempt + 1, attempts - 1)
            except (urllib.error.URLError, ConnectionError, http.client.HTTPException) as exc:
                # refused or reset; or (HTTPException: IncompleteRead) a server that died while it answered
                failed = ("the server closed the connection before its answer was whole"
                          if isinstance(exc, http.client.HTTPException) and not isinstance(exc, ConnectionError)
                          else "cannot reach the server")
                if attempt == attempts - 1:
                    raise ServerError(f"{method} {self.url}{path}: {failed} ({exc})") from exc
                logger.warning("%s %s%s failed (%s); retry %d/%d", method, self.url, path, exc, attempt + 1, attempts - 1)
            time.sleep(self.backoff_s * 2**attempt)
        raise AssertionError("unreachable")

    def post(self, path: str, body: dict, retries: int | None = None):
        return self._request("POST", path, body, retries)

    def get(self, path: str, retries: int | None = None, timeout_s: float | None = None):
        return self._request("GET", path, None, retries, timeout_s)

    def wait_for(self, path: str, timeout_s: float, poll_s: float = 0.5, report_every_s: float = 10.0,
                 names: Mapping[str, str] | None = None, request_timeout_s: float | None = None):
        """``GET path`` until it answers 200 (the answer is returned), or raise after ``timeout_s`` naming the URL;
        a 4xx (a wrong key) raises at once; each GET may take ``request_timeout_s`` (default: the client's). Says
        what it waits for every ``report_every_s``; ``names`` says what the settings it names (urls,
        health_timeout_s) are called (:func:`grpo_accel.rules.setting`)."""
        urls, timeout = setting(names, "urls"), setting(names, "health_timeout_s")
        start = time.monotonic()
        deadline, report_at = start + timeout_s, start + report_every_s
        last = None
        while time.monotonic() < deadline:
            try:
                return self.get(path, retries=0, timeout_s=request_timeout_s)
            except ServerError as exc:
                if exc.status is not None and exc.status < 500:
                    raise
                last = exc
            now = time.monotonic()
            if now >= report_at:
                hint = (f" (connection refused: nothing listens there yet; is the server started, is {urls} right?)"
                        if "refused" in str(last).lower() else "")
                logger.warning("waiting for %s %s: %s%s; %.0f s left of %s", self.kind, self.url, last, hint,
                               deadline - now, timeout)
                report_at = now + report_every_s
            time.sleep(poll_s)
        raise ServerError(f"{self.kind} {self.url} did not answer {path} within {timeout_s:.0f} s (last error: "
                          f"{last}); check that it is running and {urls} is right, or raise {timeout}.")

    def wait_healthy(self, timeout_s: float, poll_s: float = 0.5, report_every_s: float = 10.0,
                     names: Mapping[str, str] | None = None, request_timeout_s: float | None = None) -> None:
        """:meth:`wait_for` ``/health``: in SGLang a one-token generation, which a paused server, or (0.5.9) one
        with memory released, never runs (503); in vLLM the engine's liveness. It needs no key: it proves nothing of one."""
        self.wait_for("/health", timeout_s, poll_s, report_every_s, names, request_timeout_s)


def _error_message(exc: urllib.error.HTTPError) -> str:
    """SGLang's and vLLM's error bodies: {"error": {"message"}}, {"error": "Unauthorized"}, {"success": false, "message"},
    FastAPI's {"detail"}."""
    try:
        body = json.loads(exc.read().decode())
    except Exception:
        return str(exc.reason)
    error = body.get("error") if isinstance(body, dict) else None
    if isinstance(error, dict) and error.get("message"):
        return str(error["message"])
    if isinstance(body, dict):
        return str(error or body.get("message") or body.get("detail") or json.dumps(body))
    return json.dumps(body)
