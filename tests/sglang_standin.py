"""A loopback stand-in for an SGLang server of a given release, built from that release's own code and source.

    python tests/sglang_standin.py --port 30000 --model DIR --sglang-version 0.5.23 [--api-key KEY]
        [--admin-api-key KEY] [--deterministic] [--dp-size N] [--enable-dp-attention] [--pp-size N]
        [--enable-memory-saver]
        [--tp-size N] [--context-length N] [--decode-delay S] [--startup-delay S] [--host ADDR]

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
  weight_updater.py in 0.5.23, model_runner.py in 0.5.9): rank = rank_offset + tp_rank, no timeout. With
  ``--tp-size N`` the ranks 1..N-1 are processes of their own (``TPRank``) that join and receive every broadcast as
  SGLang's other tensor-parallel workers do; ``GET /_standin/tp_digests`` says what each received;
- the flattened-bucket layout: SGLang's ``FlattenedTensorBucket`` (srt/weight_sync/tensor_bucket.py);
- the weight-update session (0.5.21+): the guards and messages read from
  srt/managers/scheduler_components/weight_updater.py (``SchedulerWeightUpdaterManager``);
- ``/get_weights_by_name``: answered only for model classes that implement it in srt/models/ (else 400 "Get
  parameter by name failed", srt/entrypoints/http_server.py ``get_weights_by_name``), rows as
  ``LlamaForCausalLM.get_weights_by_name`` returns them (srt/models/llama.py): ``tolist()[:truncate_size]``;
- ``sampling_seed`` is honoured only with ``--deterministic`` (SGLang's ``--enable-deterministic-inference``,
  srt/sampling/sampling_batch_info.py ``from_schedule_batch``);
- the context rule: ``TokenizerManager._validate_one_request`` (srt/managers/tokenizer_manager.py): a prompt of
  ``>=`` context tokens is a 400, and so is prompt + max_new_tokens at the release's own comparison (read from
  that file: ``>=`` in 0.5.9, ``>`` in 0.5.23), with SGLang's messages; the context length is the model's
  ``max_position_embeddings`` unless ``--context-length`` (as ``ModelConfig.context_len``), reported at
  ``GET /v1/models`` as ``max_model_len`` (``available_models``, srt/entrypoints/http_server.py).

Re-implemented from the source (cited where they are):

- the scheduler (srt/managers/scheduler.py): requests join one running batch, which takes a decode step at a
  time, each step lasting ``--decode-delay`` seconds at least (a large model's pace on a GPU), so that weight
  pushes land while requests are in flight. Control requests (pause, weight loads) run between steps.
- ``/pause_generation`` by mode (``PauseGenerationReqInput`` in srt/managers/io_struct.py;
  ``TokenizerManager.pause_generation`` and ``Scheduler.pause_generation``): ``abort`` aborts every request and
  returns it with finish reason abort and what it had generated, and answers once none is in flight; ``retract``
  moves the running requests back to the waiting queue (``retract_all``; ``Req.reset_for_retract`` keeps their
  output ids and logprobs), so the running batch is empty and a flush succeeds; after ``/continue_generation``
  they go on, their KV recomputed with the weights loaded by then (here: every step re-reads the whole sequence);
  ``in_place`` keeps them in the running batch, where they make a flush fail. While paused, a new /generate
  waits (``is_pause_cond``).
- receiving the broadcasts (per tensor: ``torch.empty`` + async ``broadcast`` in ``names`` order, then wait;
  flattened: one broadcast), loading after the receive (a wrong name or shape fails with "partially updated"),
  the flush that fails while the running batch is not empty (``Scheduler.flush_cache``, ``_is_no_request``), the
  reader/writer lock that makes an update wait for in-flight /generate unless generation is paused, the weight
  updates SGLang asserts against with ``--dp-size`` > 1 unless ``--enable-dp-attention``
  (srt/managers/tokenizer_communicator_mixin.py in 0.5.9), the response bodies and status codes of
  srt/entrypoints/http_server.py;
- with ``--enable-memory-saver``, ``/release_memory_occupation`` and ``/resume_memory_occupation`` by tag
  (kv_cache, weights, cuda_graph; srt/managers/scheduler_update_weights_mixin.py): a release while requests run
  fails (SGLang asserts), resuming a tag not released fails, released weights lose their values; and where
  SGLang would touch freed memory (generating, or loading weights before they are resumed) the stand-in answers
  500, so that a wrong order fails a test.

Nothing here imports grpo_accel. Test control, outside the protocol: ``POST /_standin/fail {"path", "times",
"how"}`` makes the next calls of ``path`` fail, how = "success_false" (an update receives, then fails to load),
"refuse" (an update is refused before it receives, as a closed session refuses it), "ignore" (an update is
received and answered with success but not loaded: a broken server), "http_500", "abort" (a /generate's requests
come back aborted before prefill) or "hang" (an /init_weights_update_group that never joins, until a reset);
``GET /_standin/state`` returns the weight version, the number of loads, the requests seen, the token counts
and every parameter; ``GET /_standin/counts`` the token counts alone (sampled, returned, aborted completions,
retracted requests) and the queues' lengths; ``GET /_standin/digest`` a SHA-256 of every
parameter (as float32 bytes); ``POST /_standin/reset {"flags"}`` makes it the server it was at start (weights,
version, groups, session, failures, requests) as if started with ``flags``, so that tests can share one process;
it refuses (409) while a request is in flight.
"""
from __future__ import annotations

import argparse
import hashlib
import json
import multiprocessing
import os
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
               "/v1/models",
               "/generate", "/flush_cache", "/pause_generation", "/continue_generation", "/init_weights_update_group",
               "/destroy_weights_update_group", "/update_weights_from_distributed", "/update_weights_from_disk",
               "/begin_weight_update", "/end_weight_update", "/get_weights_by_name", "/release_memory_occupation",
               "/resume_memory_occupation"}
PARTIAL = "The full weights of the ModelRunner are partially updated. Please discard the whole weights."


class HTTPError(Exception):
    def __init__(self, status: int, payload) -> None:
        super().__init__(str(payload))
        self.status, self.payload = status, payload


def bad_request(message: str) -> HTTPError:
    """SGLang's ``validation_exception_handler`` body (an ``ErrorResponse``)."""
    return HTTPError(400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


def digest(t: torch.Tensor) -> str:
    return hashlib.sha256(t.detach().float().contiguous().numpy().tobytes()).hexdigest()


def receive_weights(source: SGLangSource, group, names, dtypes, shapes, load_format) -> list[tuple[str, torch.Tensor]]:
    """As ``receive_weights_from_distributed`` / ``_receive_bucketed_weights_from_distributed`` do."""
    if load_format == "flattened_bucket":
        cls = source.FlattenedTensorBucket
        if hasattr(cls, "empty"):  # 0.5.23
            bucket = cls.empty(names, dtypes, shapes, "cpu")
        else:  # 0.5.9: the bucket is built from empty named tensors
            bucket = cls(named_tensors=[(n, torch.empty(s, dtype=getattr(torch, d))) for n, d, s in zip(names, dtypes, shapes)])
        dist.broadcast(bucket.get_flattened_tensor(), src=0, group=group)
        return bucket.reconstruct_tensors()
    weights, handles = [], []
    for name, dtype, shape in zip(names, dtypes, shapes):
        weight = torch.empty(shape, dtype=getattr(torch, dtype))
        handles.append(dist.broadcast(weight, src=0, group=group, async_op=True))
        weights.append((name, weight))
    for handle in handles:
        handle.wait()
    return weights


def tp_rank_main(conn, version: str, tp_rank: int) -> None:
    """Tensor-parallel rank ``tp_rank`` of a ``--tp-size`` > 1 server, a process of its own: it joins every
    weight-update group as ``rank_offset + tp_rank`` and receives every broadcast, as SGLang's other TP workers do
    (each receives the full tensors and loads its shard); it keeps a digest of what it received."""
    server = os.getppid()
    torch.set_num_threads(1)
    source = SGLangSource(version)
    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)  # its own TP group stand-in
    groups, received = {}, {}
    while True:
        if not conn.poll(0.5):
            if os.getppid() != server:  # the server is gone (killed): so is this rank
                return
            continue
        op, a = conn.recv()
        try:
            result = None
            if op == "init":
                groups[a["group_name"]] = source.init_custom_process_group(
                    backend=a["backend"], init_method=f"tcp://{a['master_address']}:{a['master_port']}",
                    world_size=a["world_size"], rank=a["rank_offset"] + tp_rank, group_name=a["group_name"])
            elif op == "receive":
                tensors = receive_weights(source, groups[a["group_name"]], a["names"], a["dtypes"], a["shapes"],
                                          a["load_format"])
                received.update({name: digest(t) for name, t in tensors})
            elif op == "destroy":
                dist.destroy_process_group(groups.pop(a["group_name"]))
            elif op == "reset":
                for group in groups.values():
                    dist.destroy_process_group(group)
                groups, received = {}, {}
            elif op == "digests":
                result = received
            conn.send(("ok", result))
        except Exception as exc:  # noqa: BLE001 (reported to the server, which answers as SGLang would)
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


class TPRank:
    """The server's handle on one ``tp_rank_main`` process."""

    def __init__(self, version: str, tp_rank: int) -> None:
        ctx = multiprocessing.get_context("spawn")
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=tp_rank_main, args=(child, version, tp_rank), daemon=True)
        self.proc.start()

    def send(self, op: str, args: dict | None = None) -> None:
        self.conn.send((op, args or {}))

    def reply(self):
        status, result = self.conn.recv()
        if status != "ok":
            raise RuntimeError(result)
        return result

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join()


class Req:
    """One sequence being generated (SGLang's ``Req``, srt/managers/schedule_batch.py). A retract keeps its
    output ids and logprobs (``reset_for_retract`` resets only the KV bookkeeping)."""

    def __init__(self, prompt: list[int], params: dict, body: dict, generator) -> None:
        self.prompt, self.params, self.generator = prompt, params, generator
        self.out: list[int] = []
        self.logprobs: list[list] = []
        self.input_logprobs = None
        self.start_len = body.get("logprob_start_len", -1)
        self.finish: dict | None = None
        self.done = threading.Event()
        self.start = time.monotonic()


class Server:
    def __init__(self, source: SGLangSource, args) -> None:
        from transformers import AutoModelForCausalLM, AutoTokenizer

        self.source = source
        self.model = AutoModelForCausalLM.from_pretrained(args.model).eval()
        self.initial_weights = {name: p.detach().clone() for name, p in self.model.named_parameters()}
        self.tokenizer = AutoTokenizer.from_pretrained(args.model)
        self.architecture = self.model.config.architectures[0]
        self.lock = threading.Condition()
        self.step_lock = threading.Lock()  # held by a decode step; control requests run between steps
        self.groups: dict[str, object] = {}
        self.tp_ranks: list[TPRank] = []
        self.in_flight = 0  # requests being answered, test control included
        self.unhang = threading.Event()
        self.reset(args)
        # The server's own default group (its tensor-parallel group; one rank here): SGLang's WeightUpdater
        # asserts it exists before joining a weight-update group.
        dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
        threading.Thread(target=self._schedule, name="scheduler", daemon=True).start()

    def reset(self, args: argparse.Namespace) -> None:
        """The state at a start with ``args`` (test control: POST /_standin/reset); every weight-update group is
        destroyed."""
        self.args, self.ready_at = args, time.monotonic() + args.startup_delay
        with torch.no_grad():
            for name, p in self.model.named_parameters():
                p.copy_(self.initial_weights[name])
        for group in self.groups.values():
            dist.destroy_process_group(group)
        if len(self.tp_ranks) != args.tp_size - 1:
            for rank in self.tp_ranks:
                rank.stop()
            self.tp_ranks = [TPRank(args.sglang_version, r) for r in range(1, args.tp_size)]
        for rank in self.tp_ranks:
            rank.send("reset")
            rank.reply()
        self.context_len = args.context_length or self.model.config.max_position_embeddings
        self.weight_version, self.loads = "default", 0
        self.is_pause = self.engine_paused = False  # the tokenizer manager's and the scheduler's
        self.running: list[Req] = []  # the running batch
        self.waiting: list[Req] = []  # retracted requests
        self.generating = 0  # /generate calls holding the reader lock
        self.counts = {"sampled": 0, "returned": 0, "aborted": 0, "retracted": 0}
        self.released: set[str] = set()  # --enable-memory-saver: the memory tags given back
        self.groups, self.session_open = {}, False
        self.failures: dict[str, list[str]] = {}
        self.requests: list[tuple[str, dict]] = []

    # -- generation ------------------------------------------------------------------------------------

    def generate(self, body: dict, how: str | None):
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
        if "kv_cache" in self.released or "weights" in self.released:  # SGLang would fault on freed memory
            raise HTTPError(500, {"error": {"message": f"generating with {sorted(self.released)} released "
                                                       "(resume_memory_occupation first)"}})
        with self.lock:
            while self.is_pause:  # TokenizerManager.generate_request waits on is_pause_cond
                self.lock.wait()
            self.generating += 1
        try:
            for prompt, p in zip(prompts, params):
                self._validate_length(prompt, p)
            reqs = [Req(prompt, p, body, self._generator(p)) for prompt, p in zip(prompts, params)
                    for _ in range(p.get("n", 1))]
            if how == "abort":  # aborted before they were scheduled
                for req in reqs:
                    req.finish = {"type": "abort", "message": "Abort before prefill", "status_code": 503,
                                  "err_type": None}
            else:
                with self.lock:
                    self.running += reqs
                    self.lock.notify_all()
                for req in reqs:
                    req.done.wait()
            out = [self._output(req, body) for req in reqs]
        finally:
            with self.lock:
                self.generating -= 1
                self.lock.notify_all()
        return out[0] if single and len(out) == 1 else out

    def _validate_length(self, prompt: list[int], p: dict) -> None:
        """``TokenizerManager._validate_one_request`` without --allow-auto-truncate (its ValueError is a 400)."""
        n, context, max_new = len(prompt), self.context_len, p.get("max_new_tokens")
        if n >= context:
            raise HTTPError(400, {"error": {"message": f"The input ({n} tokens) is longer than the model's context "
                                                       f"length ({context} tokens)."}})
        over = n + max_new >= context if self.source.total_tokens_refused_at == ">=" else n + max_new > context
        if max_new is not None and over:
            raise HTTPError(400, {"error": {"message": (
                f"Requested token count exceeds the model's maximum context length of {context} tokens. You "
                f"requested a total of {n + max_new} tokens: {n} tokens from the input messages and {max_new} "
                "tokens for the completion. Please reduce the number of tokens in the input messages or the "
                "completion to fit within the limit.")}})

    def _generator(self, p: dict):
        seed = p.get("sampling_seed") if self.args.deterministic else None  # ignored without the flag
        return torch.Generator().manual_seed(seed) if seed is not None else None

    def _schedule(self) -> None:
        """The scheduler's event loop: one decode step of the whole running batch at a time."""
        while True:
            with self.lock:
                while not self.running or self.engine_paused:
                    self.lock.wait()
            with self.step_lock:
                with self.lock:
                    batch = [] if self.engine_paused else list(self.running)
                if not batch:
                    continue
                began = time.monotonic()
                for req in batch:
                    self._decode_step(req)
                time.sleep(max(0.0, self.args.decode_delay - (time.monotonic() - began)))
                with self.lock:
                    self.running = [r for r in self.running if r.finish is None]
                for req in batch:
                    if req.finish is not None:
                        req.done.set()

    @torch.no_grad()
    def _decode_step(self, req: Req) -> None:
        p = req.params
        temperature, top_k, top_p = p.get("temperature", 1.0), p.get("top_k", -1), p.get("top_p", 1.0)
        max_new = p.get("max_new_tokens", 128)
        ids = req.prompt + req.out
        logits = self.model(torch.tensor([ids])).logits[0].float()  # [len(ids), V]
        if not req.out and req.start_len is not None and req.start_len >= 0 and req.input_logprobs is None:
            lp = torch.log_softmax(logits[:-1] / (temperature if temperature >= 1e-6 else 1.0), -1)
            values = lp.gather(-1, torch.tensor(ids[1:])[:, None])[:, 0].tolist()
            req.input_logprobs = [[v, t, None] for v, t in zip([None] + values, ids)][req.start_len:]
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
            token = int(torch.multinomial(z.softmax(-1), 1, generator=req.generator))
        req.out.append(token)
        req.logprobs.append([float(lp[token]), token, None])
        self.counts["sampled"] += 1
        if token in self._stop_ids(p):
            req.finish = {"type": "stop", "matched": token}
        elif len(req.out) >= max_new:
            req.finish = {"type": "length", "length": max_new}

    def _stop_ids(self, p: dict) -> set:
        return set(p.get("stop_token_ids") or []) | ({self.tokenizer.eos_token_id} if not p.get("ignore_eos") else set())

    def _output(self, req: Req, body: dict) -> dict:
        self.counts["returned"] += len(req.out)
        self.counts["aborted"] += req.finish["type"] == "abort"
        meta = {"id": uuid.uuid4().hex, "finish_reason": req.finish, "prompt_tokens": len(req.prompt),
                "completion_tokens": len(req.out), "cached_tokens": 0, "weight_version": self.weight_version,
                "e2e_latency": time.monotonic() - req.start}
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = req.logprobs
            if req.input_logprobs is not None:
                meta["input_token_logprobs"] = req.input_logprobs
        stop_ids = self._stop_ids(req.params)
        text = self.tokenizer.decode([t for t in req.out if t not in stop_ids], skip_special_tokens=True)
        return {"text": text, "output_ids": req.out, "meta_info": meta}

    def pause(self, mode: str) -> None:
        """``TokenizerManager.pause_generation`` + ``Scheduler.pause_generation``, between decode steps."""
        with self.step_lock, self.lock:
            self.is_pause = True
            if mode == "abort":  # abort_request(abort_all=True): every request returns with what it has
                for req in self.running + self.waiting:
                    req.finish = {"type": "abort", "message": "Aborted by /pause_generation (mode=abort).",
                                  "status_code": 503, "err_type": None}
                    req.done.set()
                self.running, self.waiting = [], []
            else:
                self.engine_paused = True
                if mode == "retract":  # retract_all: back to the waiting queue; the running batch is empty
                    self.counts["retracted"] += len(self.running)
                    self.waiting, self.running = self.waiting + self.running, []
        if mode == "abort":  # answered once no request holds the reader lock
            with self.lock:
                while self.generating:
                    self.lock.wait()

    def continue_(self) -> None:
        with self.lock:
            self.is_pause = self.engine_paused = False
            self.running, self.waiting = self.waiting + self.running, []
            self.lock.notify_all()

    # -- weights ---------------------------------------------------------------------------------------

    def guard(self, method: str) -> dict | None:
        """The session guard of ``method`` (0.5.21+), as ``SchedulerWeightUpdaterManager`` applies it."""
        guard = self.source.session_guards.get(method)
        if guard is None:
            return None
        if (guard.refuse_when == "closed") != self.session_open:
            return {"success": False, "message": guard.message}
        return None

    def check_dp(self) -> None:
        """The assertion of the distributed-update methods (0.5.9 tokenizer_communicator_mixin.py; 0.5.23 asserts
        one replica, which --enable-dp-attention keeps): an AssertionError, HTTP 500 as FastAPI answers it."""
        if self.args.dp_size > 1 and not self.args.enable_dp_attention:
            raise HTTPError(500, {"error": {"message": "dp_size must be 1 or dp attention must be enabled for "
                                                       "update weights from distributed"}})

    def init_group(self, req) -> dict:
        name = req.group_name
        if name in self.groups:  # torch refuses a second group of that name inside init_custom_process_group
            return {"success": False, "message": f"Failed to initialize custom process group: The specified group "
                                                 f"name {name} has already been created."}
        fields = {k: getattr(req, k) for k in ("master_address", "master_port", "rank_offset", "world_size",
                                               "group_name", "backend")}
        for rank in self.tp_ranks:  # the other TP workers join at the same time (rank_offset + tp_rank)
            rank.send("init", fields)
        try:
            self.groups[name] = self.source.init_custom_process_group(
                backend=req.backend, init_method=f"tcp://{req.master_address}:{req.master_port}",
                world_size=req.world_size, rank=req.rank_offset + 0, group_name=name)
            for rank in self.tp_ranks:
                rank.reply()
        except Exception as exc:  # noqa: BLE001 (SGLang reports any failure this way)
            return {"success": False, "message": f"Failed to initialize custom process group: {exc}."}
        return {"success": True, "message": "Succeeded to initialize custom process group."}

    def destroy_group(self, req) -> dict:
        if req.group_name not in self.groups:
            return {"success": False, "message": "The group to be destroyed does not exist."}
        dist.destroy_process_group(self.groups.pop(req.group_name))
        for rank in self.tp_ranks:
            rank.send("destroy", {"group_name": req.group_name})
            rank.reply()
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
            fields = {"group_name": req.group_name, "names": req.names, "dtypes": req.dtypes, "shapes": req.shapes,
                      "load_format": req.load_format}
            for rank in self.tp_ranks:
                rank.send("receive", fields)
            tensors = receive_weights(self.source, group, req.names, req.dtypes, req.shapes, req.load_format)
            for rank in self.tp_ranks:
                rank.reply()
            if how == "success_false":
                return {"success": False, "message": f"Failed to update parameter online: injected. {PARTIAL}"}
            if how == "ignore":  # a broken server: claims the update, keeps its weights
                self.weight_version = str(req.weight_version) if req.weight_version is not None else self.weight_version
                return {"success": True, "message": "Succeeded to update parameter online."}
            return self._load(dict(tensors), req.flush_cache, req.weight_version)

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

    def memory(self, release: bool, tags: list[str] | None) -> None:
        """``release_memory_occupation`` / ``resume_memory_occupation`` (0.5.9
        srt/managers/scheduler_update_weights_mixin.py): no tags means all; released weights lose their values
        (here: NaN); no-ops without --enable-memory-saver."""
        if not self.args.enable_memory_saver:
            return
        tags = tags or ["kv_cache", "weights", "cuda_graph"]  # GPU_MEMORY_ALL_TYPES, srt/constants.py
        if release:
            if self.running or self.generating:
                raise HTTPError(500, {"error": {"message": "release_memory_occupation should be called only when "
                                                           "no ongoing request."}})
            self.released |= set(tags)
            if "weights" in tags:
                with torch.no_grad(), self.step_lock:
                    for p in self.model.parameters():
                        p.fill_(float("nan"))
            return
        missing = [t for t in tags if t not in self.released]
        if missing:  # self.offload_tags.remove(tag)
            raise HTTPError(500, {"error": {"message": f"KeyError: {missing[0]!r}"}})
        self.released -= set(tags)

    def _load(self, state: dict, flush_cache: bool, weight_version) -> dict:
        if "weights" in self.released:
            raise HTTPError(500, {"error": {"message": "loading weights into released memory (resume_memory_occupation "
                                                       "with tags [weights] first)"}})
        params = dict(self.model.named_parameters())
        with self.step_lock:  # between decode steps, as the scheduler handles it
            for name, t in state.items():
                if name not in params or tuple(params[name].shape) != tuple(t.shape):
                    return {"success": False, "message": f"Failed to update parameter online: {name} "
                                                         f"{tuple(t.shape)} does not fit the model. {PARTIAL}"}
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
                    while server.generating and not server.is_pause:
                        server.lock.wait()

            def __exit__(self, *exc):
                return False

        return Writer()

    def server_info(self) -> dict:
        return {"tp_size": self.args.tp_size, "dp_size": self.args.dp_size, "pp_size": self.args.pp_size,
                "enable_dp_attention": self.args.enable_dp_attention, "context_length": self.args.context_length,
                "enable_memory_saver": self.args.enable_memory_saver,
                "enable_deterministic_inference": self.args.deterministic, "version": self.source.version_string,
                "model_path": self.args.model}

    def models(self) -> dict:
        """``available_models``: the served model's card (srt/entrypoints/http_server.py)."""
        return {"object": "list", "data": [{"id": self.args.model, "object": "model", "created": int(time.time()),
                                            "owned_by": "sglang", "root": self.args.model,
                                            "max_model_len": self.context_len}]}


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
                return s.generate(body, how)
            if path == "/v1/models":
                return s.models()
            req = self._validated(route, body)
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
                return s.memory(path.startswith("/release"), req.tags)
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
                        "groups": sorted(s.groups), "requests": s.requests, "tokens": s.counts,
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
                                    "--host", a.host, *body.get("flags", [])]))
                return {"ok": True}
            if path == "/_standin/digest":  # for models too large to list
                return {n: digest(p) for n, p in s.model.named_parameters()}
            if path == "/_standin/counts":  # tokens sampled, returned, aborted, retracted; the queues now
                return {**s.counts, "running": len(s.running), "waiting": len(s.waiting)}
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
    parser.add_argument("--startup-delay", type=float, default=0.0)
    parser.add_argument("--host", default="127.0.0.1")
    return parser.parse_args(argv)


def main() -> None:
    args = parse_args()
    torch.set_num_threads(1)
    server = Server(SGLangSource(args.sglang_version), args)
    ThreadingHTTPServer((args.host, args.port), make_handler(server)).serve_forever()


if __name__ == "__main__":
    main()
