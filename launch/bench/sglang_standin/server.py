"""A loopback stand-in for an SGLang server of a given release, built from that release's own code and source.

    python launch/bench/sglang_standin --port 30000 --model DIR --sglang-version 0.5.23 [--api-key KEY]
        [--admin-api-key KEY] [--deterministic] [--dp-size N] [--enable-dp-attention] [--pp-size N]
        [--tp-size N] [--enable-memory-saver] [--enable-weights-cpu-backup] [--context-length N]
        [--max-total-tokens N] [--max-running-requests N] [--schedule-conservativeness F] [--random-seed N]
        [--decode-delay S] [--kv-cache] [--startup-delay S] [--host ADDR]

A real SGLang server needs a GPU; this one serves a transformers model on CPU and takes from SGLang's source
(``source.py``) everything that decides whether the trainer and a real server agree:

- routes, methods and auth levels: srt/entrypoints/http_server.py; the auth decision itself is SGLang's
  ``decide_request_auth`` (srt/utils/auth.py); a path the release does not have is a 404;
- request validation: SGLang's own request classes (srt/managers/io_struct.py) through pydantic, as FastAPI
  does (400 on a violation); /generate bodies through SGLang's contract (sglang/api/v1/api_types.py, 0.5.22+;
  ``SamplingParams.__init__``'s parameters before). Unlike SGLang it also refuses fields the request classes do
  not have (SGLang ignores them), so that a misspelt field fails a test instead of being dropped;
- the weight-update group join, SGLang's ``init_custom_process_group``, the flattened-bucket layout, the session
  guards, ``/get_weights_by_name``, memory release and resume: weights.py, each cited there;
- 0.5.23's per-token weight versions: srt/utils/weight_versions.py, run as SGLang's scheduler and tokenizer
  manager call it;
- ``sampling_seed`` is honoured only with ``--deterministic`` (SGLang's ``--enable-deterministic-inference``,
  srt/sampling/sampling_batch_info.py ``from_schedule_batch``);
- the context rule: ``TokenizerManager._validate_one_request`` (srt/managers/tokenizer_manager.py): a prompt of
  ``>=`` context tokens is a 400, and so is prompt + max_new_tokens at the release's own comparison (read from
  that file: ``>=`` in 0.5.9, ``>`` in 0.5.23), with SGLang's messages; the context length is the model's
  ``max_position_embeddings`` unless ``--context-length`` (as ``ModelConfig.context_len``), reported at
  ``GET /v1/models`` as ``max_model_len`` (``available_models``, srt/entrypoints/http_server.py);
- ``/health``: SGLang's ``health_generate`` (srt/entrypoints/http_server.py), a one-token generation run as its
  tokenizer manager and scheduler run it (tokenizer.py ``Scheduling.health``);
- ``/server_info``: the server args (0.5.23 reports ``--dp-size N --enable-dp-attention`` as ``attn_dp_size`` N,
  srt/arg_groups/parallel_hook.py) and the scheduler's init info (``max_total_num_tokens``, ``max_req_input_len``).

Re-implemented from the source, cited where they are: the scheduler of each dp rank with its KV pool, waiting
queue, retraction, aborts, pause modes and length limits (scheduler.py), the tokenizer manager and the
data-parallel controller in front of them (tokenizer.py), and the weight updates (weights.py).
Where SGLang's scheduler raises (a memory release while requests run, a resume of a tag not released, freed
memory touched) the stand-in dies, as the server does.

Nothing here imports grpo_accel. Test control, outside the protocol: ``POST /_standin/fail {"path", "times",
"how"}`` makes the next calls of ``path`` fail, how = "success_false" (an update receives, then fails to load),
"refuse" (an update is refused before it receives, as a closed session refuses it), "ignore" (an update is received
and answered with success but not loaded: a broken server), "ignore_dp1" (dp rank 1 keeps its weights), "http_500",
"abort" (a /generate's requests come back aborted before prefill), "hang" (an /init_weights_update_group that never
joins, until a reset) or "hold" (the call takes effect and its answer waits for ``POST /_standin/unhold``); any
other word passes. ``GET /_standin/state`` returns the weight version, the number of loads, the requests seen, the
token counts and every parameter; ``GET /_standin/counts`` the token counts alone (sampled, returned, aborted
completions, retracted requests), the queues' lengths now and at their peak, the KV pool's peak and the released
memory tags; ``GET /_standin/digest`` a SHA-256 of every parameter (as float32 bytes), ``/_standin/dp_digests`` each
dp rank's; ``POST /_standin/reset {"flags"}`` makes it the server it was at start (weights, version, groups,
session, failures, requests, a new start time and seed) as if started with ``flags``, so that tests can share one
process; it refuses (409) while a request is in flight.
"""
from __future__ import annotations

import argparse
import json
import random
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch
import torch.distributed as dist

from sglang_standin.source import SGLangSource
from sglang_standin.scheduler import DPRank, HTTPError, bad_request
from sglang_standin.tokenizer import Scheduling
from sglang_standin.weights import TPRank, WeightUpdates, digest

IMPLEMENTED = {"/health", "/health_generate", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
               "/v1/models", "/generate", "/flush_cache", "/pause_generation", "/continue_generation",
               "/init_weights_update_group", "/destroy_weights_update_group", "/update_weights_from_distributed",
               "/update_weights_from_disk", "/begin_weight_update", "/end_weight_update", "/get_weights_by_name",
               "/release_memory_occupation", "/resume_memory_occupation", "/abort_request"}


class Server(Scheduling, WeightUpdates):
    """An SGLang server of one release: its scheduler (scheduler.py) and weight updates (weights.py)."""

    def __init__(self, source: SGLangSource, args) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.source = source
        model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        self.initial_weights = {name: p.detach().clone() for name, p in model.named_parameters()}
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.architecture = model.config.architectures[0]
        self.max_position_embeddings = model.config.max_position_embeddings
        self.lock = threading.Condition()
        self.control_pending = 0  # control requests waiting to run between steps
        self.groups: dict[str, object] = {}
        self.tp_ranks: list[TPRank] = []
        self.in_flight = 0  # requests being answered, test control included
        self.unhang = threading.Event()
        self.unhold = threading.Event()
        self.all_ranks: list = []
        self.weight_epoch = 0  # bumped whenever the weights may change: --kv-cache's cache is then computed again
        self.reset(args)
        self._all_ranks_from(model)
        # The server's own default group (its tensor-parallel group; one rank here): SGLang's WeightUpdater
        # asserts it exists before joining a weight-update group.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def _all_ranks_from(self, model) -> None:
        """dp ranks as the flags ask (a reset to fewer leaves the others idle; to more makes them)."""
        import copy

        while len(self.all_ranks) < self.args.dp_size:
            self.all_ranks.append(DPRank(self, len(self.all_ranks), model if not self.all_ranks else copy.deepcopy(model)))
        self.dp_ranks = self.all_ranks[: self.args.dp_size]
        for rank in self.all_ranks:
            with rank.step_lock, self.lock:  # between its steps: nothing of an earlier test is left in a batch
                rank.reset()
                with torch.no_grad():
                    for name, p in rank.model.named_parameters():
                        p.copy_(self.initial_weights[name])

    @property
    def model(self):
        return self.dp_ranks[0].model

    def reset(self, args: argparse.Namespace) -> None:
        """The state at a start with ``args`` (test control: POST /_standin/reset); every weight-update group is
        destroyed."""
        self.args, self.ready_at = args, time.monotonic() + args.startup_delay
        self.startup_time, self.random_seed = time.time(), args.random_seed or random.randint(0, 1 << 30)
        for group in self.groups.values():
            dist.destroy_process_group(group)
        if len(self.tp_ranks) != args.tp_size - 1:
            for rank in self.tp_ranks:
                rank.stop()
            self.tp_ranks = [TPRank(args.sglang_version, r) for r in range(1, args.tp_size)]
        for rank in self.tp_ranks:
            rank.send("reset")
            rank.reply()
        self.context_len = args.context_length or self.max_position_embeddings
        self.weight_version, self.loads, self.weight_epoch = "default", 0, self.weight_epoch + 1
        self.is_pause = self.engine_paused = False  # the tokenizer manager's and the scheduler's
        self.last_receive = 0.0  # when the tokenizer manager last received anything (last_receive_tstamp)
        self.generating = 0  # /generate calls holding the reader lock
        self._next_rank = 0  # the data-parallel controller's round robin
        self.counts = {"sampled": 0, "returned": 0, "aborted": 0, "retracted": 0}
        self.peak = {"kv_tokens": 0, "running": 0, "waiting": 0}
        self.released: set[str] = set()  # --enable-memory-saver: the memory tags given back
        self.backup: list[dict] | None = None  # --enable-weights-cpu-backup: the weights at their release
        self.groups, self.session_open = {}, False
        self.failures: dict[str, list[str]] = {}
        self.requests: list[tuple[str, dict]] = []
        if self.all_ranks:
            self._all_ranks_from(self.model)

    def server_info(self) -> dict:
        """Server args (as 0.5.23 resolves dp attention), the scheduler's init info (``max_total_num_tokens``,
        ``max_req_input_len``: srt/managers/scheduler.py ``run_scheduler_process`` / ``get_init_info``) and the
        internal state of each dp rank."""
        a = self.args
        dp, attn_dp = (1, a.dp_size) if self.source.dp_attention_is_attn_dp and a.enable_dp_attention else (a.dp_size, 1)
        info = {"tp_size": a.tp_size, "dp_size": dp, "pp_size": a.pp_size, "enable_dp_attention": a.enable_dp_attention,
                "context_length": a.context_length, "enable_memory_saver": a.enable_memory_saver,
                "enable_weights_cpu_backup": a.enable_weights_cpu_backup, "max_total_tokens": a.max_total_tokens,
                "max_running_requests": a.max_running_requests, "random_seed": self.random_seed,
                "enable_deterministic_inference": a.deterministic, "version": self.source.version_string,
                "model_path": a.model, "status": "ready", "max_total_num_tokens": a.max_total_tokens,
                "max_req_input_len": self.max_req_input_len,
                "internal_states": [{"effective_max_running_requests_per_dp": r.max_running} for r in self.dp_ranks]}
        if self.source.dp_attention_is_attn_dp:
            info["attn_dp_size"] = attn_dp
        if self.source.reports_startup_time:
            info["startup_time"] = self.startup_time
        return info

    def models(self) -> dict:
        """``available_models``: the served model's card (srt/entrypoints/http_server.py)."""
        return {"object": "list", "data": [{"id": self.args.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "sglang", "root": self.args.model,
                                            "max_model_len": self.context_len}]}


def make_handler(server: Server):
    source = server.source

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args):
            pass

        def _send(self, code: int, payload) -> None:
            data = (json.dumps(payload) if not isinstance(payload, str) else payload).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def _handle(self, method: str) -> None:
            with server.lock:
                server.in_flight += 1
            try:
                self._answer(method)
            finally:
                with server.lock:
                    server.in_flight -= 1

        def _answer(self, method: str) -> None:
            path = self.path.split("?")[0]
            length = int(self.headers.get("Content-Length") or 0)
            raw = self.rfile.read(length) if length else b""
            try:
                if path.startswith("/_standin/"):
                    return self._send(200, self._control(path, json.loads(raw or b"{}")))
                route = source.routes.get(path)
                if route is None:
                    raise HTTPError(404, {"detail": "Not Found"})
                if method not in route.methods:
                    raise HTTPError(405, {"detail": "Method Not Allowed"})
                decision = source.auth.decide_request_auth(
                    method=method, path=path, authorization_header=self.headers.get("Authorization"),
                    api_key=server.args.api_key, admin_api_key=server.args.admin_api_key,
                    auth_level=source.auth.AuthLevel[route.auth_level])
                if not decision.allowed:
                    raise HTTPError(decision.error_status_code,
                                    {"error": "Unauthorized" if decision.error_status_code == 401 else "Forbidden"})
                if path not in IMPLEMENTED:
                    raise HTTPError(501, {"error": {"message": f"the stand-in does not implement {path}"}})
                try:
                    body = json.loads(raw) if raw else {}
                except json.JSONDecodeError as exc:
                    raise bad_request(f"invalid JSON: {exc}") from None
                server.requests.append((path, body))
                self._send(200, self._route(path, body, route))
            except HTTPError as exc:
                self._send(exc.status, exc.payload)

        def _validated(self, route, body):
            """FastAPI's validation with SGLang's class, plus the stand-in's refusal of unknown fields."""
            unknown = set(body) - source.field_names(route.request_class)
            if unknown:
                raise bad_request(f"unknown fields {sorted(unknown)} for {route.request_class} (SGLang ignores "
                                  "them; the stand-in refuses them so that a misspelt field fails a test)")
            try:
                return source.validate(route.request_class, body)
            except ValueError as exc:
                raise bad_request(str(exc)) from None

        def _route(self, path: str, body: dict, route):
            s = server
            failures = s.failures.get(path)
            how = failures.pop(0) if failures else None
            if how == "http_500":
                raise HTTPError(500, {"error": {"message": "injected failure"}})
            if path in ("/health", "/health_generate"):  # 503 while starting, then a one-token generation
                if time.monotonic() < s.ready_at or not s.health():
                    raise HTTPError(503, "")
                return ""
            if time.monotonic() < s.ready_at:
                raise HTTPError(503, {"error": {"message": "starting"}})
            if path in ("/server_info", "/get_server_info"):
                return s.server_info()
            if path in ("/model_info", "/get_model_info"):
                return {"model_path": s.args.model, "weight_version": s.weight_version, "is_generation": True,
                        "architectures": [s.architecture]}
            if path == "/flush_cache":
                if not s.idle():
                    raise HTTPError(400, "Flush cache failed.\n")
                return "Cache flushed.\n"
            if path == "/generate":
                unknown = set(body) - source.field_names("GenerateReqInput")
                if unknown:
                    raise bad_request(f"unknown fields {sorted(unknown)} for GenerateReqInput")
                return s.generate(body, how)
            if path == "/v1/models":
                return s.models()
            req = self._validated(route, body)
            if how == "hold":  # test control: the call takes effect, its answer waits for /_standin/unhold
                answer = self._route(path, body, route)
                s.unhold.wait()
                return answer
            if path == "/abort_request":
                s.abort_request(None if req.abort_all else req.rid)
                return ""
            if path == "/pause_generation":
                s.pause(req.mode)
                return {"message": "Generation paused successfully.", "status": "ok"}
            if path == "/continue_generation":
                s.continue_()
                return {"message": "Generation continued successfully.", "status": "ok"}
            if path in ("/init_weights_update_group", "/update_weights_from_distributed"):
                s.check_dp()
            if path == "/get_weights_by_name":
                return s.weights_by_name(req)
            if path in ("/release_memory_occupation", "/resume_memory_occupation"):
                s.memory(path.startswith("/release"), req.tags)
                return ""
            if path == "/init_weights_update_group" and how == "hang":  # SGLang's join has no timeout
                s.unhang.wait()  # set by a reset (test control)
                raise HTTPError(503, {"error": "hung join ended by a reset"})
            answer = {
                "/init_weights_update_group": lambda: s.init_group(req),
                "/destroy_weights_update_group": lambda: s.destroy_group(req),
                "/begin_weight_update": lambda: s.session(begin=True),
                "/end_weight_update": lambda: s.session(begin=False),
                "/update_weights_from_distributed": lambda: s.update_distributed(req, how),
                "/update_weights_from_disk": lambda: s.update_disk(req, how),
            }[path]()
            if not answer["success"]:  # every weight endpoint answers a failure with 400 and the same body
                raise HTTPError(400, answer)
            return answer

        def _control(self, path: str, body: dict):
            s = server
            if path == "/_standin/fail":
                s.failures.setdefault(body["path"], []).extend([body.get("how", "success_false")] * body.get("times", 1))
                return {"ok": True}
            if path == "/_standin/state":
                return {"weight_version": s.weight_version, "loads": s.loads, "session_open": s.session_open,
                        "groups": sorted(s.groups), "requests": s.requests, "tokens": s.counts,
                        "params": {n: p.tolist() for n, p in s.model.named_parameters()}}
            if path == "/_standin/reset":
                s.unhang.set()  # a hung join answers and ends
                s.unhold.set()
                deadline = time.monotonic() + 5
                while s.in_flight > 1 and time.monotonic() < deadline:  # this request is one
                    time.sleep(0.05)
                s.unhang.clear()
                s.unhold.clear()
                if s.in_flight > 1:
                    raise HTTPError(409, {"error": "a request is in flight: restart the stand-in instead"})
                a = s.args  # the same model and release, with the flags the next server would have been given
                s.reset(parse_args(["--port", str(a.port), "--model", a.model, "--sglang-version", a.sglang_version,
                                    "--host", a.host, *body.get("flags", [])]))
                return {"ok": True}
            if path == "/_standin/digest":  # for models too large to list
                return {n: digest(p) for n, p in s.model.named_parameters()}
            if path == "/_standin/counts":  # tokens sampled, returned, aborted, retracted; the queues now and at most
                with s.lock:
                    return {**s.counts, "running": sum(len(r.running) + len(r.stepping) for r in s.dp_ranks),
                            "waiting": sum(len(r.waiting) for r in s.dp_ranks), "peak": dict(s.peak),
                            "released": sorted(s.released)}
            if path == "/_standin/unhold":  # answers the calls held by how="hold"
                s.unhold.set()
                return {"ok": True}
            if path == "/_standin/dp_digests":  # each dp rank's weights
                return [{n: digest(p) for n, p in rank.model.named_parameters()} for rank in s.dp_ranks]
            if path == "/_standin/tp_digests":  # what each TP rank past the first received, by name
                for rank in s.tp_ranks:
                    rank.send("digests")
                return [rank.reply() for rank in s.tp_ranks]
            raise HTTPError(404, {"detail": "Not Found"})

        def do_GET(self):
            self._handle("GET")

        def do_POST(self):
            self._handle("POST")

    return Handler


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser()
    parser.add_argument("--port", type=int, required=True)
    parser.add_argument("--model", required=True)
    parser.add_argument("--sglang-version", required=True)
    parser.add_argument("--api-key")
    parser.add_argument("--admin-api-key")
    parser.add_argument("--deterministic", action="store_true", help="SGLang's --enable-deterministic-inference")
    parser.add_argument("--dp-size", type=int, default=1)
    parser.add_argument("--enable-dp-attention", action="store_true")
    parser.add_argument("--enable-memory-saver", action="store_true")
    parser.add_argument("--pp-size", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1, help="ranks 2..N are processes of their own")
    parser.add_argument("--context-length", type=int, help="default: the model's max_position_embeddings")
    parser.add_argument("--decode-delay", type=float, default=0.0, help="seconds per decode step at least")
    parser.add_argument("--kv-cache", action="store_true", help="decode on a KV cache (kv.py)")
    parser.add_argument("--max-total-tokens", type=int, default=16384, help="each dp rank's KV pool, in tokens")
    parser.add_argument("--max-running-requests", type=int, help="default: half the pool, at most 2048-4096")
    parser.add_argument("--schedule-conservativeness", type=float, default=1.0)
    parser.add_argument("--enable-weights-cpu-backup", action="store_true")
    parser.add_argument("--random-seed", type=int)
    parser.add_argument("--startup-delay", type=float, default=0.0)
    parser.add_argument("--host", default="127.0.0.1")
    args = parser.parse_args(argv)
    if args.kv_cache and args.deterministic:
        parser.error("--kv-cache batches requests, which float32 does not keep batch-invariant: drop --deterministic")
    return args


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    server = Server(SGLangSource(args.sglang_version), args)
    ThreadingHTTPServer((args.host, args.port), make_handler(server)).serve_forever()


if __name__ == "__main__":
    main()
