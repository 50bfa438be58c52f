"""The SGLang HTTP API as grpo_accel speaks it: the releases it supports, what a server says about itself, and
every request body it sends (one builder per endpoint, so that a test can check each against SGLang's own
request classes, release by release).

Supported and tested: SGLang 0.5.9 through 0.5.23 (``SUPPORTED``). What differs inside that range and matters
here, read from the releases' source:

- 0.5.21+: ``/update_weights_from_distributed`` and ``/update_weights_from_tensor`` are refused (400) outside a
  ``/begin_weight_update`` ... ``/end_weight_update`` session
  (srt/managers/scheduler_components/weight_updater.py).
- Every release: ``sampling_seed`` is honoured only by a server started with ``--enable-deterministic-inference``;
  distributed and tensor weight updates are refused by a server with ``--dp-size`` > 1 unless it runs
  ``--enable-dp-attention`` (an assertion, HTTP 500: 0.5.9 srt/managers/tokenizer_communicator_mixin.py
  ``dp_size == 1 or enable_dp_attention``; 0.5.23 srt/managers/tokenizer_control_mixin.py asserts one replica,
  and dp attention runs inside one, srt/runtime_context.py ``num_dp_ranks_of``), while disk updates are served
  at any dp size (``update_weights_from_disk`` in srt/managers/tokenizer_manager.py asserts nothing of it);
  pipeline stages would join the weight-update group with colliding ranks (``rank = rank_offset + tp_rank``),
  so ``--pp-size`` > 1 is refused here; ``/get_weights_by_name`` is implemented by a few model classes only
  (Llama and its subclasses, OPT, Granite, EXAONE 4, ...), the others answer 400 "Get parameter by name failed".
- Every release: ``/pause_generation`` takes ``mode`` abort, retract or in_place (``PauseGenerationReqInput``,
  srt/managers/io_struct.py). ``abort`` returns every in-flight request with finish reason abort and what it had
  generated; ``retract`` moves running requests back to the waiting queue, keeping their output ids and logprobs
  (``Req.reset_for_retract``, srt/managers/schedule_batch.py), so that a flush succeeds and they go on after
  ``/continue_generation``, their KV cache recomputed with the weights loaded by then; ``in_place`` keeps them
  running, so a flush fails until they finish. The flush's idle test: 0.5.9 ``Scheduler._is_no_request`` looks at
  the running batch only; 0.5.23 ``Scheduler.is_fully_idle(ignore_waiting=<paused>)`` counts the waiting queue too,
  unless the scheduler is paused (``retract`` and ``in_place`` pause it; ``abort`` does not).
- Every release: a server started with ``--enable-memory-saver`` frees the GPU memory of the tags given to
  ``/release_memory_occupation`` (kv_cache, weights, cuda_graph; all when none are named) and takes it back at
  ``/resume_memory_occupation``. The release asserts the server is idle (the same test as the flush's: 0.5.9
  srt/managers/scheduler_update_weights_mixin.py, 0.5.23 scheduler_components/weight_updater.py) and resuming a
  tag that is not released raises (``offload_tags.remove``): either kills the scheduler, and the server with it.
  No route tells which tags are released. Resumed weights hold garbage until a push lands, unless the server runs
  ``--enable-weights-cpu-backup``. SGLang's own order (test/srt/test_release_memory_occupation.py): resume
  cuda_graph and weights, update the weights, resume kv_cache, generate. Without the flag all are no-ops.
- Every release: a request whose prompt is ``>=`` the context length is a 400, and so is prompt +
  ``max_new_tokens`` ``>=`` it in 0.5.9 (``>`` in 0.5.23; ``TokenizerManager._validate_one_request``), unless the
  server runs ``--allow-auto-truncate``; the context length is ``max_model_len`` at ``GET /v1/models``
  (``available_models``, srt/entrypoints/http_server.py, both releases).
- Every release: the scheduler has limits of its own, which ``/server_info`` reports (its init info:
  ``max_total_num_tokens``, the KV pool, and ``max_req_input_len``): ``max_req_len = min(context - 1, pool - 1)``,
  ``max_req_input_len = max_req_len - 5`` (srt/managers/tp_worker.py); a prompt of ``max_req_input_len`` tokens or
  more fails the whole request with 400 (``validate_input_length``), and ``max_new_tokens`` is cut to
  ``max_req_len - prompt - 1`` without a word (``Scheduler.init_req_max_new_tokens``). So every sequence here stays
  within ``max_req_input_len`` tokens, prompt and completion together, and any of its prefixes can be sent again.
- Every release: the scheduler admits what its KV pool holds (``PrefillAdder``, srt/managers/schedule_policy.py)
  and queues the rest. An abort (``/abort_request``, or ``/pause_generation {mode: abort}``) answers a waiting
  request at once with what it has ("Abort in waiting queue", often nothing) and a running one after one more
  token ("Aborted"); ``mode: abort`` then checks every second until no /generate is in flight
  (``TokenizerManager.pause_generation``). A request that times out on the client keeps its place on the server
  until it is aborted by its ``rid`` (the server notices a closed connection only on its own 4 s polls of a
  waiting request, ``_wait_one_response``).
- 0.5.19+ (``WEIGHT_SPANS_SINCE``; not 0.5.9): every answer carries ``meta_info.weight_versions``, the spans of
  output tokens each weight version drew (srt/utils/weight_versions.py). 0.5.23: ``/server_info`` reports ``--dp-size N --enable-dp-attention`` as
  ``attn_dp_size=N, dp_size=1`` (srt/arg_groups/parallel_hook.py), and ``startup_time``.
- Every release: with more than one dp rank (``dp_size`` x ``attn_dp_size``), ``/get_weights_by_name`` answers a
  list with one entry per rank, ``null`` where the model class lacks the method (200 all the same; one rank
  answers 400 "Get parameter by name failed"), and a /generate goes to one rank (round robin, or the rank its
  ``data_parallel_rank`` names: srt/managers/data_parallel_controller.py).

Nothing here imports ``sglang``.
"""
from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from grpo_accel.http import ServerError

logger = logging.getLogger(__name__)

SUPPORTED = ((0, 5, 9), (0, 5, 23))
"""Oldest and newest SGLang release this client was checked against (tests read both releases' source)."""
PAUSE_MODES = ("retract", "abort")
LOAD_FORMATS = ("per_tensor", "flattened_bucket")  # /update_weights_from_distributed: a broadcast per tensor or per bucket
"""How a weight push pauses the servers (``in_place`` is not offered: its running requests make the flush that
ends every update fail)."""
MEMORY_TAGS = ("kv_cache", "weights", "cuda_graph")
"""What a colocated server frees while the trainer trains (srt/constants.py ``GPU_MEMORY_ALL_TYPES``)."""
SESSION_SINCE = (0, 5, 21)
"""First release that refuses weight updates outside a begin/end session."""
WEIGHT_SPANS_SINCE = (0, 5, 19)
"""First release whose answers say which weight version drew each output token (``meta_info.weight_versions``;
srt/utils/weight_versions.py first ships in 0.5.19's wheel)."""
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
    dp_size: int = 1  # replicas (0.5.23 moves dp attention's width to attn_dp_size)
    pp_size: int = 1
    deterministic: bool = False  # --enable-deterministic-inference: sampling_seed is honoured
    dp_attention: bool = False  # --enable-dp-attention
    memory_saver: bool = False  # --enable-memory-saver: memory release and resume do something
    attn_dp_size: int = 1
    max_req_input_len: int | None = None  # the scheduler's limit on one request's input
    instance: str = ""  # this start of the server: 0.5.23's startup_time, else its random_seed

    @classmethod
    def from_json(cls, url: str, info: dict) -> ServerInfo:
        if "version" not in info:
            raise ValueError(f"{url}/server_info has no 'version': is this an SGLang server?")
        limit = info.get("max_req_input_len")
        return cls(url, parse_version(info["version"]), int(info.get("tp_size") or 1), int(info.get("dp_size") or 1),
                   int(info.get("pp_size") or 1), bool(info.get("enable_deterministic_inference", False)),
                   bool(info.get("enable_dp_attention", False)), bool(info.get("enable_memory_saver", False)),
                   int(info.get("attn_dp_size") or 1), int(limit) if limit else None,
                   str(info.get("startup_time", info.get("random_seed", ""))))

    @property
    def dp_ranks(self) -> int:
        """Schedulers behind the server (``num_dp_ranks``): each answers /get_weights_by_name on its own."""
        return self.dp_size * self.attn_dp_size

    @property
    def needs_session(self) -> bool:
        return self.version >= SESSION_SINCE

    @property
    def reports_token_versions(self) -> bool:
        return self.version >= WEIGHT_SPANS_SINCE

    def check_supported(self) -> None:
        """Refuse a release older than the supported range; warn once about a newer one."""
        low, high = SUPPORTED
        if self.version < low:
            raise RuntimeError(f"{self.url} runs SGLang {_dotted(self.version)}; grpo_accel supports {_dotted(low)} "
                               f"to {_dotted(high)}: upgrade the server (pip install 'sglang>={_dotted(low)}').")
        if self.version > high:
            logger.warning("%s runs SGLang %s, newer than the newest release checked here (%s); it is driven as %s.",
                           self.url, _dotted(self.version), _dotted(high), _dotted(high))

    def check_weight_updates(self, method: str = "distributed") -> None:
        """Refuse, before anything is pushed, a topology whose weight updates SGLang would refuse or misroute
        (``method``: distributed, tensor or disk)."""
        if self.dp_size > 1 and not self.dp_attention and method != "disk":
            raise RuntimeError(f"{self.url} runs with --dp-size {self.dp_size}; SGLang refuses {method} weight updates "
                               "to a server with data-parallel replicas unless it runs --enable-dp-attention. Add "
                               "that flag, push from disk (DiskWeightSender), or start one server per replica "
                               "(--dp-size 1, e.g. behind sglang-router) and list every server's URL.")
        if self.pp_size > 1:
            raise RuntimeError(f"{self.url} runs with --pp-size {self.pp_size}; its pipeline stages would join the "
                               "weight-update group with the same ranks. Use --pp-size 1 (tensor parallelism is fine).")


def read_server_info(client) -> ServerInfo:
    """``GET /server_info`` (both ends of the range serve it; ``/get_server_info`` is deprecated)."""
    return ServerInfo.from_json(client.url, client.get("/server_info"))


def read_context_length(client) -> int:
    """The served model's context length: ``max_model_len`` of ``GET /v1/models``."""
    cards = client.get("/v1/models").get("data") or []
    if not cards or not cards[0].get("max_model_len"):
        raise ValueError(f"{client.url}/v1/models reports no max_model_len: is this an SGLang server?")
    return int(cards[0]["max_model_len"])


def read_weight_rows(client, info: ServerInfo, name: str, truncate_size: int) -> list | None:
    """The first rows of parameter ``name`` on each dp rank of the server (``POST /get_weights_by_name``), or None
    where its model class lacks the method: one rank answers 400 "Get parameter by name failed", several answer a
    list with null entries (200)."""
    try:
        answer = client.post(*get_weights_by_name(name, truncate_size))
    except ServerError as exc:
        if WEIGHTS_BY_NAME_MISSING not in str(exc):
            raise
        return None
    ranks = answer if info.dp_ranks > 1 else [answer]
    return None if any(rows is None for rows in ranks) else ranks


def weight_version(value) -> int:
    """Our weight version (an int: the trainer's count of pushes) of one SGLang reports: a string everywhere in its
    API (``"default"`` before any update, which is our 0). Requests send ``str(version)``; this reads it back."""
    try:
        return int(value)
    except (TypeError, ValueError):
        return 0


def read_weight_version(client) -> int:
    """The version of the weights a server holds now (``weight_version`` of ``GET /model_info``)."""
    return weight_version(client.get("/model_info").get("weight_version"))


# -- request bodies, one builder per endpoint: (path, body) ------------------------------------------------

def generate(input_ids: list[list[int]], sampling_params: list[dict], rids: list[str]) -> tuple[str, dict]:
    """Token-exact generation with the logprob of every generated token; ``rids`` name the completions, so that
    they can be aborted (:func:`abort_request`)."""
    return "/generate", {"input_ids": input_ids, "sampling_params": sampling_params, "return_logprob": True,
                         "logprob_start_len": -1, "rid": rids}


def abort_request(rid: str) -> tuple[str, dict]:
    """Abort one completion by its rid (the tokenizer manager drops a rid it does not know)."""
    return "/abort_request", {"rid": rid}


def abort_all_requests() -> tuple[str, dict]:
    return "/abort_request", {"abort_all": True}


def sampling_params(max_new_tokens: int, temperature: float, top_p: float, top_k: int, seed: int | None,
                    stop_token_ids: list[int] = ()) -> dict:
    """SGLang's top_k is -1 when off; temperature 0 means greedy; ``stop_token_ids`` end a completion besides
    the model's EOS (the matched id is the last of ``output_ids``); ``sampling_seed`` is an int32 there, so a
    completion's key (:func:`grpo_accel.rollout.sampling.completion_keys`) goes modulo 2**31."""
    params = {"max_new_tokens": max_new_tokens, "temperature": temperature, "top_p": top_p,
              "top_k": top_k if top_k > 0 else -1}
    if stop_token_ids:
        params["stop_token_ids"] = list(stop_token_ids)
    if seed is not None:
        params["sampling_seed"] = seed % 2**31
    return params


def prompt_logprobs(input_ids: list[int], dp_rank: int | None = None) -> tuple[str, dict]:
    """The logprob of every prompt token after the first (``meta_info.input_token_logprobs``), one new token, from
    the dp rank ``dp_rank`` (``data_parallel_rank``, a deprecated alias of ``routed_dp_rank`` in 0.5.23)."""
    body = {"input_ids": input_ids, "sampling_params": {"max_new_tokens": 1, "temperature": 1.0},
            "return_logprob": True, "logprob_start_len": 0}
    if dp_rank is not None:
        body["data_parallel_rank"] = dp_rank
    return "/generate", body


def pause_generation(mode: str) -> tuple[str, dict]:
    """``retract``: in-flight requests wait and go on with the new weights; ``abort``: they come back cut short."""
    return "/pause_generation", {"mode": mode}


def continue_generation() -> tuple[str, dict]:
    return "/continue_generation", {}


def release_memory_occupation(tags: list[str]) -> tuple[str, dict]:
    return "/release_memory_occupation", {"tags": tags}


def resume_memory_occupation(tags: list[str]) -> tuple[str, dict]:
    return "/resume_memory_occupation", {"tags": tags}


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
                                    flattened: bool, last: bool, version: int) -> tuple[str, dict]:
    """One bucket; the cache is flushed and the version recorded with the last bucket only."""
    return "/update_weights_from_distributed", {
        "names": names, "dtypes": dtypes, "shapes": shapes, "group_name": group_name, "flush_cache": last,
        "abort_all_requests": False, "weight_version": str(version) if last else None,
        "load_format": "flattened_bucket" if flattened else None}


def update_weights_from_tensor(payloads: list[str], last: bool, version: int) -> tuple[str, dict]:
    """``payloads``: one base64 string per tensor-parallel rank of the server (each rank reads its own)."""
    return "/update_weights_from_tensor", {"serialized_named_tensors": payloads, "flush_cache": last,
                                           "abort_all_requests": False, "weight_version": str(version) if last else None}


def update_weights_from_disk(model_path: str, version: int) -> tuple[str, dict]:
    return "/update_weights_from_disk", {"model_path": model_path, "weight_version": str(version), "flush_cache": True,
                                         "abort_all_requests": False}


def get_weights_by_name(name: str, truncate_size: int) -> tuple[str, dict]:
    return "/get_weights_by_name", {"name": name, "truncate_size": truncate_size}


WEIGHTS_BY_NAME_MISSING = "Get parameter by name failed"
"""SGLang's answer when the served model class does not implement get_weights_by_name."""
