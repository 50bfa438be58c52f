"""The vLLM HTTP API as grpo_accel speaks it: the release it was checked against, what a server says about itself,
and every request it sends (one builder per route, so that a test can check each against vLLM's own request
classes). Read from vLLM 0.32.0's source (``vllm/entrypoints``):

- The RL routes (``/pause``, ``/resume``, ``/is_paused``, ``/abort_requests``, ``/update_weight_version``,
  ``/weight_info``, the weight-transfer routes; rl/online/api_router.py), ``/collective_rpc``, ``/sleep``,
  ``/wake_up`` and ``/server_info`` exist only on a server started with ``VLLM_SERVER_DEV_MODE=1``
  (launchers/api_server/routers.py). TRL's ``trl vllm-serve`` (1.16) is vLLM's own server started that way.
- ``/pause`` and ``/sleep`` take their settings as query parameters, not a body: ``mode`` abort (in-flight
  requests end with what they have, finish reason "abort"), wait (until they finish) or keep (frozen; they go on
  after ``/resume``).
- ``/collective_rpc {"method": "reload_weights", "kwargs": {"weights_path": DIR}}`` loads a Hugging Face folder
  into the running model in place (v1/worker/gpu_model_runner.py ``reload_weights``); it records no version:
  ``/update_weight_version {"new_version": "N"}`` does, read back at ``GET /weight_info``.
- Logprobs (``logprobs: 0``) are the sampled token's only, as the server's ``--logprobs-mode`` computes them:
  ``raw_logprobs`` (the default) before the temperature, ``processed_logprobs`` after the temperature and after
  top-k / top-p (config/model.py). ``prompt_logprobs`` ignore the mode.
- A completions request names itself by ``request_id``; the engine names its one prompt ``cmpl-<request_id>-0``
  (openai/completion/serving.py), the id ``/abort_requests`` takes. With ``n`` > 1 and a ``seed`` s, sample j
  draws with seed s + j (v1/engine/parallel_sampling.py).
- ``GET /v1/models`` gives ``max_model_len``; a prompt + ``max_tokens`` beyond it is a 400.
- The CPU build only: a seeded request prefilled in parts (chunked prefill on, and more tokens to prefill in one
  step than ``--max-num-batched-tokens``) stops the engine: ``_bookkeeping_sync`` moves the seeded generator back
  (``set_offset``), which a CPU generator refuses ("CPU Generator does not use offset",
  v1/worker/gpu_model_runner.py). Prompts are prefilled, and so is every running request again after a ``/pause``:
  it clears the KV cache by default (``clear_cache``, rl/online/api_router.py; ``_reset_caches`` preempts the
  running requests, v1/engine/core.py), so a step after a push can prefill ``--max-num-seqs`` x
  ``--max-model-len`` tokens at most.

Nothing here imports ``vllm``.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from grpo_accel.http import ServerError

logger = logging.getLogger(__name__)

SUPPORTED = ((0, 32, 0), (0, 32, 0))
"""Oldest and newest vLLM release this client was checked against (the tests run 0.32.0's CPU build)."""
PAUSE_MODES = {"retract": "keep", "abort": "abort"}
"""weight_sync.pause_mode -> vLLM's ``/pause`` mode: ``keep`` freezes in-flight requests, which go on with the new
weights after ``/resume`` (SGLang's retract); ``abort`` returns them cut short, continued here."""
DEV_MODE = "VLLM_SERVER_DEV_MODE=1"


def parse_version(text: str) -> tuple[int, int, int]:
    """"0.32.0" / "0.32.1rc2" / "0.33.0.dev4+gabc" -> (0, 32, 0) / (0, 32, 1) / (0, 33, 0)."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", str(text))
    if not match:
        raise ValueError(f"not a vLLM release: {text!r}")
    return tuple(int(x) for x in match.groups())


@dataclass(frozen=True)
class ServerInfo:
    """What one server says of itself at start: ``GET /version`` and ``GET /server_info?config_format=json``."""

    url: str
    version: tuple[int, int, int]
    max_model_len: int
    logprobs_mode: str = "raw_logprobs"
    dtype: str = ""
    sleep_mode: bool = False  # --enable-sleep-mode: /sleep frees memory
    tp_size: int = 1
    dp_size: int = 1
    device: str = ""
    chunk_tokens: int | None = None  # tokens prefilled per step when chunked prefill is on
    max_num_seqs: int = 0  # requests running at once

    @classmethod
    def from_json(cls, url: str, version: dict, info: dict) -> ServerInfo:
        config = info.get("vllm_config") or {}
        model, parallel = config.get("model_config") or {}, config.get("parallel_config") or {}
        scheduler = config.get("scheduler_config") or {}
        chunked = scheduler.get("enable_chunked_prefill") and scheduler.get("max_num_batched_tokens")
        return cls(url, parse_version(version.get("version", "")), int(model.get("max_model_len") or 0),
                   str(model.get("logprobs_mode") or "raw_logprobs"), str(model.get("dtype") or ""),
                   bool(model.get("enable_sleep_mode", False)), int(parallel.get("tensor_parallel_size") or 1),
                   int(parallel.get("data_parallel_size") or 1), str((config.get("device_config") or {}).get("device")),
                   int(chunked) if chunked else None, int(scheduler.get("max_num_seqs") or 0))

    def check_supported(self) -> None:
        """Refuse a release older than the checked one; warn once about a newer one."""
        low, high = SUPPORTED
        dotted = ".".join(map(str, self.version))
        if self.version < low:
            oldest = ".".join(map(str, low))
            raise ServerError(f"{self.url} runs vLLM {dotted}; grpo_accel drives {oldest} and newer (its RL "
                              f"routes): upgrade the server (pip install 'vllm>={oldest}').")
        if self.version > high:
            logger.warning("%s runs vLLM %s, newer than the newest release checked here (%s).", self.url, dotted,
                           ".".join(map(str, high)))

    def check_logprobs(self, temperature: float, top_p: float, top_k: int) -> None:
        """The loss divides its logits by the temperature and applies no filter: the server's logprobs must be
        ``log_softmax(logits / temperature)``. ``raw_logprobs`` are that at temperature 1 only, ``processed_logprobs``
        without top-k / top-p only."""
        filtered = top_k > 0 or top_p < 1.0
        if self.logprobs_mode == "processed_logprobs" and filtered:
            raise ServerError(f"{self.url} runs --logprobs-mode processed_logprobs, whose logprobs are taken after "
                              f"top-k / top-p (rollout.top_k={top_k}, rollout.top_p={top_p}); the loss computes them "
                              "before. Restart it with --logprobs-mode raw_logprobs at rollout.temperature=1, or set "
                              "rollout.top_k=0 and rollout.top_p=1.")
        if self.logprobs_mode == "raw_logprobs" and temperature != 1.0:
            raise ServerError(f"{self.url} runs --logprobs-mode raw_logprobs (vLLM's default), whose logprobs ignore "
                              f"the temperature (rollout.temperature={temperature}); restart it with --logprobs-mode "
                              "processed_logprobs (as trl vllm-serve does).")
        if self.logprobs_mode not in ("raw_logprobs", "processed_logprobs"):
            raise ServerError(f"{self.url} runs --logprobs-mode {self.logprobs_mode}, which returns logits; restart "
                              "it with --logprobs-mode processed_logprobs.")

    def check_prefill(self) -> None:
        """Refuse a CPU build that can prefill a seeded request in parts: its engine stops the first time it does,
        mid-run (the module's notes say when)."""
        most = self.max_num_seqs * self.max_model_len
        if self.device == "cpu" and self.chunk_tokens and self.chunk_tokens < most:
            raise ServerError(f"{self.url} is vLLM's CPU build with chunked prefill at --max-num-batched-tokens "
                              f"{self.chunk_tokens}: a step with more tokens to prefill splits a seeded request, and "
                              "the CPU build's engine then stops (\"CPU Generator does not use offset\"). Prompts are "
                              "prefilled, and so is every running request again after a weight push (vLLM's /pause "
                              "clears the KV cache). Restart it with --no-enable-chunked-prefill, or with "
                              f"--max-num-batched-tokens {most} (--max-num-seqs {self.max_num_seqs} x --max-model-len "
                              f"{self.max_model_len}), which no step can exceed.")


def read_server_info(client, timeout_s: float | None = None) -> ServerInfo:
    """``/version`` and the dev-mode ``/server_info`` (its first answer collects the machine's facts: seconds),
    each within ``timeout_s`` (default: the client's); a server without them is named for what it lacks."""
    try:
        version = client.get("/version", timeout_s=timeout_s)
    except ServerError as exc:
        if exc.status == 404:
            raise ServerError(f"{client.url} has no /version: it is not vLLM's own server (trl vllm-serve before TRL "
                              f"1.16 spoke a protocol of its own); start {DEV_MODE} vllm serve MODEL --logprobs-mode "
                              "processed_logprobs there.", 404) from None
        raise
    try:
        info = client.get("/server_info?config_format=json", timeout_s=timeout_s)
    except ServerError as exc:
        if exc.status == 404:
            raise ServerError(f"{client.url} runs vLLM without its RL routes (/pause, /collective_rpc, "
                              f"/weight_info): restart it with {DEV_MODE} in its environment.", 404) from None
        raise
    return ServerInfo.from_json(client.url, version, info)


def read_weight_version(client) -> int:
    """The version of the weights a server holds (``/weight_info``; "default" or none before any update: 0)."""
    try:
        return int(client.get("/weight_info").get("weight_version"))
    except (TypeError, ValueError):
        return 0


def engine_request_id(request_id: str) -> str:
    """What ``/abort_requests`` calls the one prompt of completions request ``request_id``."""
    return f"cmpl-{request_id}-0"


# -- requests, one builder per route: (path, body) -------------------------------------------------------

def completions(prompt: list[int], n: int, max_tokens: int, temperature: float, top_p: float, top_k: int,
                seed: int | None, stop_token_ids: list[int], request_id: str) -> tuple[str, dict]:
    """``n`` samples of one token prompt with each sampled token's logprob, as token ids (sample j draws with
    ``seed + j``)."""
    body = {"prompt": prompt, "n": n, "max_tokens": max_tokens, "temperature": temperature, "top_p": top_p,
            "top_k": top_k if top_k > 0 else -1, "logprobs": 0, "return_token_ids": True,
            "stop_token_ids": list(stop_token_ids), "skip_special_tokens": False, "request_id": request_id}
    if seed is not None:
        body["seed"] = seed
    return "/v1/completions", body


def prompt_logprobs(prompt: list[int]) -> tuple[str, dict]:
    """The logprob of every prompt token after the first, one greedy token generated."""
    return "/v1/completions", {"prompt": prompt, "max_tokens": 1, "temperature": 0.0, "prompt_logprobs": 0}


def abort_requests(request_ids: list[str]) -> tuple[str, dict]:
    """Abort by the engine's ids (:func:`engine_request_id`); an empty list aborts everything."""
    return "/abort_requests", {"request_ids": request_ids}


def pause(mode: str) -> tuple[str, dict]:
    return f"/pause?mode={mode}", {}


def resume() -> tuple[str, dict]:
    return "/resume", {}


def reload_weights(folder: str) -> tuple[str, dict]:
    return "/collective_rpc", {"method": "reload_weights", "kwargs": {"weights_path": folder}}


def update_weight_version(version: int) -> tuple[str, dict]:
    return "/update_weight_version", {"new_version": str(version)}


def sleep(level: int = 1) -> tuple[str, dict]:
    """Level 1 frees the KV cache and moves the weights to host memory (``--enable-sleep-mode``)."""
    return f"/sleep?level={level}&mode=keep", {}


def wake_up() -> tuple[str, dict]:
    return "/wake_up", {}
