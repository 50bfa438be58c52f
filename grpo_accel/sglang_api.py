"""The SGLang HTTP API as grpo_accel speaks it: the releases it supports, what a server says about itself, and
every request body it sends (one builder per endpoint, so that a test can check each against SGLang's own
request classes, release by release).

Supported and tested: SGLang 0.5.9 through 0.5.23 (``SUPPORTED``). What differs inside that range and matters
here, read from the releases' source:

- 0.5.21+: ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` are refused (400) outside a
  ``/begin_weight_update`` ... ``/end_weight_update`` session
  (srt/managers/scheduler_components/weight_updater.py).
- Every release: ``sampling_seed`` is honoured only by a server started with ``--enable-deterministic-inference``;
  weight updates are refused by a server with ``--dp-size`` > 1 (an assertion, HTTP 500); pipeline stages would
  join the weight-update group with colliding ranks (``rank = rank_offset + tp_rank``), so ``--pp-size`` > 1
  is refused here; ``/get_weights_by_name`` is implemented by a few model classes only (Llama and its
  subclasses, OPT, Granite, EXAONE 4, ...), the others answer 400 "Get parameter by name failed".

Nothing here imports ``sglang``.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

logger = logging.getLogger(__name__)

SUPPORTED = ((0, 5, 9), (0, 5, 23))
"""Oldest and newest SGLang release this client was checked against (tests read both releases' source)."""
SESSION_SINCE = (0, 5, 21)
"""First release that refuses weight updates outside a begin/end session."""
DEFAULT_GROUP = "weight_update_group"


def parse_version(text: str) -> tuple[int, int, int]:
    """"0.5.23" / "0.5.10.post1" / "0.5.24.dev3+g1a2b" -> (0, 5, 23) / (0, 5, 10) / (0, 5, 24)."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", str(text))
    if not match:
        raise ValueError(f"not an SGLang release: {text!r}")
    return tuple(int(x) for x in match.groups())


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


@dataclass(frozen=True)
class ServerInfo:
    """What one server reports at ``GET /server_info``, read once at start."""

    url: str
    version: tuple[int, int, int]
    tp_size: int = 1
    dp_size: int = 1
    pp_size: int = 1
    deterministic: bool = False  # --enable-deterministic-inference: sampling_seed is honoured

    @classmethod
    def from_json(cls, url: str, info: dict) -> ServerInfo:
        if "version" not in info:
            raise ValueError(f"{url}/server_info has no 'version': is this an SGLang server?")
        return cls(url, parse_version(info["version"]), int(info.get("tp_size") or 1), int(info.get("dp_size") or 1),
                   int(info.get("pp_size") or 1), bool(info.get("enable_deterministic_inference", False)))

    @property
    def needs_session(self) -> bool:
        return self.version >= SESSION_SINCE

    def check_supported(self) -> None:
        """Refuse a release older than the supported range; warn once about a newer one."""
        low, high = SUPPORTED
        if self.version < low:
            raise RuntimeError(f"{self.url} runs SGLang {_dotted(self.version)}; grpo_accel supports {_dotted(low)} "
                               f"to {_dotted(high)}: upgrade the server (pip install 'sglang>={_dotted(low)}').")
        if self.version > high:
            logger.warning("%s runs SGLang %s, newer than the newest release checked here (%s); it is driven as %s.",
                           self.url, _dotted(self.version), _dotted(high), _dotted(high))

    def check_weight_updates(self) -> None:
        """Refuse, before anything is pushed, a topology whose weight updates SGLang would refuse or misroute."""
        if self.dp_size > 1:
            raise RuntimeError(f"{self.url} runs with --dp-size {self.dp_size}; SGLang refuses weight updates to a "
                               "server with data-parallel replicas. Start one server per replica (--dp-size 1, e.g. "
                               "behind sglang-router) and list every server in rollout.urls.")
        if self.pp_size > 1:
            raise RuntimeError(f"{self.url} runs with --pp-size {self.pp_size}; its pipeline stages would join the "
                               "weight-update group with the same ranks. Use --pp-size 1 (tensor parallelism is fine).")


def read_server_info(client) -> ServerInfo:
    """``GET /server_info`` (both ends of the range serve it; ``/get_server_info`` is deprecated)."""
    return ServerInfo.from_json(client.url, client.get("/server_info"))


# -- request bodies, one builder per endpoint: (path, body) ------------------------------------------------

def generate(input_ids: list[list[int]], sampling_params: list[dict]) -> tuple[str, dict]:
    """Token-exact generation with the logprob of every generated token."""
    return "/generate", {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True,
                         "logprob_start_len": -1}


def sampling_params(max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None) -> dict:
    """SGLang's top_k is -1 when off; temperature 0 means greedy."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
              "top_k": top_k if top_k > 0 else -1}
    if seed is not None:
        params["sampling_seed"] = seed
    return params


def prompt_logprobs(input_ids: list[int]) -> tuple[str, dict]:
    """The logprob of every prompt token after the first (``meta_info.input_token_logprobs``), one new token."""
    return "/generate", {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
                         "return_logprob": True, "logprob_start_len": 0}


def pause_generation() -> tuple[str, dict]:
    """Abort what is in flight (the engine generates those requests again with the new weights)."""
    return "/pause_generation", {"mode": "abort"}


def continue_generation() -> tuple[str, dict]:
    return "/continue_generation", {}


def begin_weight_update() -> tuple[str, dict]:
    return "/begin_weight_update", {}


def end_weight_update() -> tuple[str, dict]:
    return "/end_weight_update", {}


def init_weights_update_group(address: str, port: int, rank_offset: int, world_size: int, group_name: str,
                              backend: str) -> tuple[str, dict]:
    return "/init_weights_update_group", {"master_address": address, "master_port": port, "rank_offset": rank_offset,
                                          "world_size": world_size, "group_name": group_name, "backend": backend}


def destroy_weights_update_group(group_name: str) -> tuple[str, dict]:
    return "/destroy_weights_update_group", {"group_name": group_name}


def update_weights_from_distributed(names: list[str], dtypes: list[str], shapes: list[list[int]], group_name: str,
                                    flattened: bool, last: bool, version: str) -> tuple[str, dict]:
    """One bucket; the cache is flushed and the version recorded with the last bucket only."""
    return "/update_weights_from_distributed", {
        "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": last,
        "abort_all_requests": False, "weight_version": version if last else None,
        "load_format": "flattened_bucket" if flattened else None}


def update_weights_from_tensor(payloads: list[str], last: bool, version: str) -> tuple[str, dict]:
    """``payloads``: one base64 string per tensor-parallel rank of the server (each rank reads its own)."""
    return "/update_weights_from_tensor", {"serialized_named_tensors": payloads, "flush_cache": last,
                                           "abort_all_requests": False, "weight_version": version if last else None}


def update_weights_from_disk(model_path: str, version: str) -> tuple[str, dict]:
    return "/update_weights_from_disk", {"model_path": model_path, "weight_version": version, "flush_cache": True,
                                         "abort_all_requests": False}


def get_weights_by_name(name: str, truncate_size: int) -> tuple[str, dict]:
    return "/get_weights_by_name", {"name": name, "truncate_size": truncate_size}


WEIGHTS_BY_NAME_MISSING = "Get parameter by name failed"
"""SGLang's answer when the served model class does not implement get_weights_by_name."""
