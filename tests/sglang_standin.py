"""A loopback stand-in for an SGLang server of a given release, built from that release's own code and source.

    python tests/sglang_standin.py --port 30000 --model DIR --sglang-version 0.5.23 [--api-key KEY]
        [--admin-api-key KEY] [--deterministic] [--dp-size N] [--pp-size N] [--startup-delay S]

A real SGLang server needs a GPU; this one serves a transformers model on CPU and takes from SGLang's source
(tests/sglang_source.py) everything that decides whether the trainer and a real server agree:

- routes, methods and auth levels: srt/entrypoints/http_server.py; the auth decision itself is SGLang's
  ``decide_request_auth`` (srt/utils/auth.py); a path the release does not have is a 404;
- request validation: SGLang's own request classes (srt/managers/io_struct.py) through pydantic, as FastAPI
  does (400 on a violation); /generate bodies through SGLang's contract (sglang/api/v1/api_types.py, 0.5.22+;
  ``SamplingParams.__init__``'s parameters before). Unlike SGLang it also refuses fields the request classes do
  not have (SGLang ignores them), so that a misspelt field fails a test instead of being dropped;
- the weight-update group join: SGLang's ``init_custom_process_group`` (srt/utils/common.py), called as
  ``WeightUpdater.init_weights_update_group`` calls it (srt/model_executor/model_runner_components/
  weight_updater.py in 0.5.23, model_runner.py in 0.5.9): rank = rank_offset + tp_rank, no timeout;
- the flattened-bucket layout: SGLang's ``FlattenedTensorBucket`` (srt/weight_sync/tensor_bucket.py);
- the weight-update session (0.5.21+): the guards and messages read from
  srt/managers/scheduler_components/weight_updater.py (``SchedulerWeightUpdaterManager``);
- ``/get_weights_by_name``: answered only for model classes that implement it in srt/models/ (else 400 "Get
  parameter by name failed", srt/entrypoints/http_server.py ``get_weights_by_name``), rows as
  ``LlamaForCausalLM.get_weights_by_name`` returns them (srt/models/llama.py): ``tolist()[:truncate_size]``;
- ``sampling_seed`` is honoured only with ``--deterministic`` (SGLang's ``--enable-deterministic-inference``,
  srt/sampling/sampling_batch_info.py ``from_schedule_batch``).

Re-implemented from the source (cited where they are): receiving the broadcasts (per tensor: ``torch.empty`` +
async ``broadcast`` in ``names`` order, then wait; flattened: one broadcast), loading after the receive (a wrong
name or shape fails with "partially updated"), the flush that fails while requests run, the reader/writer lock
that makes an update wait for in-flight /generate unless generation is paused, ``/pause_generation`` with
mode=abort, the response bodies and status codes of srt/entrypoints/http_server.py.

Nothing here imports grpo_accel. Test control, outside the protocol: ``POST /_standin/fail {"path", "times",
"how"}`` makes the next calls of ``path`` fail, how = "success_false" (an update receives, then fails to load),
"refuse" (an update is refused before it receives, as a closed session refuses it), "ignore" (an update is
received and answered with success but not loaded: a broken server), "http_500", "abort" (a /generate's requests
come back aborted) or "hang" (an /init_weights_update_group that never joins, until a reset);
``GET /_standin/state`` returns the weight version, the number of loads, the requests seen and every parameter;
``GET /_standin/digest`` a SHA-256 of every parameter (as float32 bytes); ``POST /_standin/reset {"flags"}``
makes it the server it was at start (weights, version, groups, session, failures, requests) as if started with
``flags`` (--api-key, --admin-api-key, --deterministic, --dp-size, --pp-size, --startup-delay), so that tests
can share one process; it refuses (409) while a request is in flight.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import sys
import threading
import time
import uuid
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import torch
import torch.distributed as dist

sys.path.insert(0, str(Path(__file__).resolve().parent))
from sglang_source import SGLangSource  # noqa: E402

IMPLEMENTED = {"/health", "/health_generate", "/server_info", "/get_server_info", "/model_info", "/get_model_info",
               "/generate", "/flush_cache", "/pause_generation", "/continue_generation", "/init_weights_update_group",
               "/destroy_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_disk",
               "/begin_weight_update", "/end_weight_update", "/get_weights_by_name"}
PARTIAL = "The full weights of the ModelRunner are partially updated. Please discard the whole weights."


class HTTPError(Exception):
    def __init__(self, status: int, payload) -> None:
        super().__init__(str(payload))
        self.status, self.payload = status, payload


def bad_request(message: str) -> HTTPError:
    """SGLang's ``validation_exception_handler`` body (an ``ErrorResponse``)."""
    return HTTPError(400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


class Server:
    def __init__(self, source: SGLangSource, args) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.source = source
        self.model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        self.initial_weights = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.architecture = self.model.config.architectures[0]
        self.lock = threading.Condition()
        self.groups: dict[str, object] = {}
        self.in_flight = 0  # requests being answered, test control included
        self.unhang = threading.Event()
        self.reset(args)
        # The server's own default group (its tensor-parallel group; one rank here): SGLang's WeightUpdater
        # asserts it exists before joining a weight-update group.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)

    def reset(self, args: argparse.Namespace) -> None:
        """The state at a start with ``args`` (test control: POST /_standin/reset); every weight-update group is
        destroyed."""
        self.args, self.ready_at = args, time.monotonic() + args.startup_delay
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(self.initial_weights[name])
        for group in self.groups.values():
            dist.destroy_process_group(group)
        self.weight_version, self.loads = "default", 0
        self.paused, self.running = False, 0
        self.groups, self.session_open = {}, False
        self.failures: dict[str, list[str]] = {}
        self.requests: list[tuple[str, dict]] = []

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, body: dict):
        error = self.source.generate_contract_error(body)
        if error is not None:
            raise HTTPError(400, {"error": error})
        if ("text" in body) == ("input_ids" in body):
            raise HTTPError(400, {"error": {"message": "Either text or input_ids should be provided."}})
        if "text" in body:
            texts = body["text"] if isinstance(body["text"], list) else [body["text"]]
            prompts, single = [self.tokenizer(t)["input_ids"] for t in texts], not isinstance(body["text"], list)
        else:
            ids = body["input_ids"]
            single = bool(ids) and isinstance(ids[0], int)
            prompts = [ids] if single else ids
        params = body.get("sampling_params") or {}
        params = params if isinstance(params, list) else [params] * len(prompts)
        if len(params) != len(prompts):
            raise HTTPError(400, {"error": {"message": f"sampling_params has {len(params)} entries for a batch "
                                                       f"of {len(prompts)}"}})
        with self.lock:
            while self.paused:
                self.lock.wait()
            self.running += 1
        try:
            out = [self._sample(prompt, p, body) for prompt, p in zip(prompts, params) for _ in range(p.get("n", 1))]
        finally:
            with self.lock:
                self.running -= 1
                self.lock.notify_all()
        return out[0] if single and len(out) == 1 else out

    @torch.no_grad()
    def _sample(self, prompt: list[int], p: dict, body: dict) -> dict:
        start = time.monotonic()
        temperature, top_k, top_p = p.get("temperature", 1.0), p.get("top_k", -1), p.get("top_p", 1.0)
        max_new = p.get("max_new_tokens", 128)
        stop_ids = set(p.get("stop_token_ids") or []) | ({self.tokenizer.eos_token_id} if not p.get("ignore_eos") else set())
        seed = p.get("sampling_seed") if self.args.deterministic else None  # ignored without the flag
        gen = torch.Generator().manual_seed(seed) if seed is not None else None
        ids, out, logprobs, reason = list(prompt), [], [], {"type": "length", "length": max_new}
        start_len = body.get("logprob_start_len", -1)
        input_logprobs = None
        for step in range(max_new):
            logits = self.model(torch.tensor([ids])).logits[0].float()  # [len(ids), V]
            if step == 0 and start_len is not None and start_len >= 0:  # [None] + logprob of each next prompt token
                lp = torch.log_softmax(logits[:-1] / (temperature if temperature >= 1e-6 else 1.0), -1)
                values = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
                input_logprobs = [[v, t, None] for v, t in zip([None] + values, ids)][start_len:]
            logits = logits[-1]
            if temperature < 1e-6:
                token = int(logits.argmax())
                lp = torch.log_softmax(logits, -1)
            else:
                lp = torch.log_softmax(logits / temperature, -1)  # reported BEFORE top-k / top-p
                z = logits / temperature
                if top_k > 0:
                    z = z.masked_fill(z < z.topk(top_k).values[-1], float("-inf"))
                if top_p < 1.0:
                    sz, order = z.sort(descending=True)
                    probs = sz.softmax(-1)
                    drop = probs.cumsum(-1) - probs > top_p
                    z = z.masked_fill(drop.scatter(0, order, drop), float("-inf"))
                token = int(torch.multinomial(z.softmax(-1), 1, generator=gen))
            ids.append(token)
            out.append(token)
            logprobs.append([float(lp[token]), token, None])
            if token in stop_ids:
                reason = {"type": "stop", "matched": token}
                break
        meta = {"id": uuid.uuid4().hex, "finish_reason": reason, "prompt_tokens": len(prompt),
                "completion_tokens": len(out), "cached_tokens": 0, "weight_version": self.weight_version,
                "e2e_latency": time.monotonic() - start}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = logprobs
            if input_logprobs is not None:
                meta["input_token_logprobs"] = input_logprobs
        text = self.tokenizer.decode([t for t in out if t not in stop_ids], skip_special_tokens=True)
        return {"text": text, "output_ids": out, "meta_info": meta}

    # -- weights ---------------------------------------------------------------------------------------

    def guard(self, method: str) -> dict | None:
        """The session guard of ``method`` (0.5.21+), as ``SchedulerWeightUpdaterManager`` applies it."""
        guard = self.source.session_guards.get(method)
        if guard is None:
            return None
        if (guard.refuse_when == "closed") != self.session_open:
            return {"success": False, "message": guard.message}
        return None

    def init_group(self, req) -> dict:
        name = req.group_name
        rank = req.rank_offset + 0  # + tp_rank: one rank here
        if name in self.groups:  # torch refuses a second group of that name inside init_custom_process_group
            return {"success": False, "message": f"Failed to initialize custom process group: The specified group "
                                                 f"name {name} has already been created."}
        try:
            self.groups[name] = self.source.init_custom_process_group(
                backend=req.backend, init_method=f"tcp://{req.master_address}:{req.master_port}",
                world_size=req.world_size, rank=rank, group_name=name)
        except Exception as exc:  # noqa: BLE001 (SGLang reports any failure this way)
            return {"success": False, "message": f"Failed to initialize custom process group: {exc}."}
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, req) -> dict:
        if req.group_name not in self.groups:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        dist.destroy_process_group(self.groups.pop(req.group_name))
        return {"success": True, "message": "Succeeded to destroy custom process group."}

    def session(self, begin: bool) -> dict:
        refusal = self.guard("begin_weight_update" if begin else "end_weight_update")
        if refusal is not None:
            return refusal
        self.session_open = begin
        return {"success": True, "message": "Success"}

    def update_distributed(self, req, how: str | None) -> dict:
        refusal = self.guard("update_weights_from_distributed")
        if how == "refuse":
            refusal = {"success": False, "message": self.source.session_guards.get("update_weights_from_distributed",
                                                                                   _NO_SESSION).message}
        if refusal is not None:
            return refusal  # nothing was received: the trainer's broadcast has no partner
        group = self.groups.get(req.group_name)
        if group is None:
            return {"success": False, "message": f"Failed to receive weights: Group {req.group_name} not in "
                                                 f"{list(self.groups)}. Please call `init_weights_update_group` first."}
        with self._writer():
            tensors = self._receive(group, req)
            if how == "success_false":
                return {"success": False, "message": f"Failed to update parameter online: injected. {PARTIAL}"}
            if how == "ignore":  # a broken server: claims the update, keeps its weights
                self.weight_version = str(req.weight_version) if req.weight_version is not None else self.weight_version
                return {"success": True, "message": "Succeeded to update parameter online."}
            return self._load(dict(tensors), req.flush_cache, req.weight_version)

    def _receive(self, group, req) -> list[tuple[str, torch.Tensor]]:
        """As ``receive_weights_from_distributed`` / ``_receive_bucketed_weights_from_distributed`` do."""
        if req.load_format == "flattened_bucket":
            cls = self.source.FlattenedTensorBucket
            if hasattr(cls, "empty"):  # 0.5.23
                bucket = cls.empty(req.names, req.dtypes, req.shapes, "cpu")
            else:  # 0.5.9: the bucket is built from empty named tensors
                bucket = cls(named_tensors=[(n, torch.empty(s, dtype=getattr(torch, d)))
                                            for n, d, s in zip(req.names, req.dtypes, req.shapes)])
            dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
            return bucket.reconstruct_tensors()
        weights, handles = [], []
        for name, dtype, shape in zip(req.names, req.dtypes, req.shapes):
            weight = torch.empty(shape, dtype=getattr(torch, dtype))
            handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
            weights.append((name, weight))
        for handle in handles:
            handle.wait()
        return weights

    def update_disk(self, req) -> dict:
        from safetensors.torch import load_file

        files = sorted(Path(req.model_path).glob("*.safetensors"))
        if not files:
            return {"success": False, "message": f"Failed to get weights iterator: no safetensors in {req.model_path}.",
                    "num_paused_requests": 0}
        state = {}
        for f in files:
            state.update(load_file(str(f)))
        with self._writer():
            return {**self._load(state, req.flush_cache, req.weight_version), "num_paused_requests": 0}

    def _load(self, state: dict, flush_cache: bool, weight_version) -> dict:
        params = dict(self.model.named_parameters())
        for name, t in state.items():
            if name not in params or tuple(params[name].shape) != tuple(t.shape):
                return {"success": False, "message": f"Failed to update parameter online: {name} {tuple(t.shape)} "
                                                     f"does not fit the model. {PARTIAL}"}
            with torch.no_grad():
                params[name].copy_(t.to(params[name].dtype))
        self.loads += 1
        if weight_version is not None:
            self.weight_version = str(weight_version)
        if flush_cache and self.running:
            return {"success": False, "message": "Weights were updated, but the cache was not flushed because "
                                                 "requests are still running or queued."}
        return {"success": True, "message": "Succeeded to update parameter online."}

    def weights_by_name(self, req):
        if self.architecture not in self.source.weights_by_name_architectures:
            raise HTTPError(400, {"error": {"message": "Get parameter by name failed"}})
        params = dict(self.model.named_parameters())
        if req.name not in params:
            raise HTTPError(400, {"error": {"message": "Get parameter by name failed"}})
        return params[req.name].detach().float().tolist()[: req.truncate_size]

    def _writer(self):
        """An update waits for in-flight requests unless generation is paused (the tokenizer manager's
        ``model_update_lock.writer_lock``)."""
        server = self

        class Writer:
            def __enter__(self):
                with server.lock:
                    while server.running and not server.paused:
                        server.lock.wait()

            def __exit__(self, *exc):
                return False

        return Writer()

    def server_info(self) -> dict:
        return {"tp_size": 1, "dp_size": self.args.dp_size, "pp_size": self.args.pp_size,
                "enable_deterministic_inference": self.args.deterministic, "version": self.source.version_string,
                "model_path": self.args.model}


_NO_SESSION = type("Guard", (), {"message": "Failed to receive weights: refused"})()


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
            if path in ("/health", "/health_generate"):
                if time.monotonic() < s.ready_at:
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
                if s.running:
                    raise HTTPError(400, "Flush cache failed.\n")
                return "Cache flushed.\n"
            if path == "/generate":
                unknown = set(body) - source.field_names("GenerateReqInput")
                if unknown:
                    raise bad_request(f"unknown fields {sorted(unknown)} for GenerateReqInput")
                out = s.generate(body)
                if how == "abort":  # SGLang aborted the requests (e.g. a pause with mode=abort)
                    for item in out if isinstance(out, list) else [out]:
                        item["meta_info"]["finish_reason"] = {"type": "abort", "message": "Abort before prefill",
                                                              "status_code": 503, "err_type": None}
                return out
            req = self._validated(route, body)
            if path == "/pause_generation":
                with s.lock:
                    s.paused = True
                return {"message": "Generation paused successfully.", "status": "ok"}
            if path == "/continue_generation":
                with s.lock:
                    s.paused = False
                    s.lock.notify_all()
                return {"message": "Generation continued successfully.", "status": "ok"}
            if path == "/get_weights_by_name":
                return s.weights_by_name(req)
            if path == "/init_weights_update_group" and how == "hang":  # SGLang's join has no timeout
                s.unhang.wait()  # set by a reset (test control)
                raise HTTPError(503, {"error": "hung join ended by a reset"})
            answer = {
                "/init_weights_update_group": lambda: s.init_group(req),
                "/destroy_weights_update_group": lambda: s.destroy_group(req),
                "/begin_weight_update": lambda: s.session(begin=True),
                "/end_weight_update": lambda: s.session(begin=False),
                "/update_weights_from_distributed": lambda: s.update_distributed(req, how),
                "/update_weights_from_disk": lambda: s.update_disk(req),
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
                        "groups": sorted(s.groups), "requests": s.requests,
                        "params": {n: p.tolist() for n, p in s.model.named_parameters()}}
            if path == "/_standin/reset":
                s.unhang.set()  # a hung join answers and ends
                deadline = time.monotonic() + 5
                while s.in_flight > 1 and time.monotonic() < deadline:  # this request is one
                    time.sleep(0.05)
                s.unhang.clear()
                if s.in_flight > 1:
                    raise HTTPError(409, {"error": "a request is in flight: restart the stand-in instead"})
                a = s.args  # the same model and release, with the flags the next server would have been given
                s.reset(parse_args(["--port", str(a.port), "--model", a.model, "--sglang-version", a.sglang_version,
                                    *body.get("flags", [])]))
                return {"ok": True}
            if path == "/_standin/digest":  # for models too large to list
                return {n: hashlib.sha256(p.detach().float().contiguous().numpy().tobytes()).hexdigest()
                        for n, p in s.model.named_parameters()}
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
    parser.add_argument("--pp-size", type=int, default=1)
    parser.add_argument("--startup-delay", type=float, default=0.0)
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    server = Server(SGLangSource(args.sglang_version), args)
    ThreadingHTTPServer(("127.0.0.1", args.port), make_handler(server)).serve_forever()


if __name__ == "__main__":
    main()
