"""The stand-in's generation side (tests/sglang_standin.py): the tokenizer manager's part of /generate, the
data-parallel controller, and one scheduler per dp rank with its KV pool, running batch and waiting queue, each
re-implemented from the SGLang source it cites (0.5.9's files; where 0.5.23 differs, its file is named).

- Admission (srt/managers/scheduler.py ``get_new_batch_prefill``, srt/managers/schedule_policy.py
  ``PrefillAdder.add_one_req``): first come, first served (``schedule_policy`` "fcfs"); a request joins a prefill
  batch while fewer than ``max_running_requests`` run and its prompt plus its remaining budget (clipped at
  ``CLIP_MAX_NEW_TOKENS``) is below what the pool has left after every running request's remaining budget times
  ``new_token_ratio``; the rest wait. A prefill batch takes a step of its own and gives each request its first
  token (or, for a retracted one, its next). No radix cache and no chunked prefill: nothing is shared between
  requests, and no prompt here comes near ``--chunked-prefill-size``.
- Decoding (``Scheduler.update_running_batch``, ``ScheduleBatch.check_decode_mem`` / ``retract_decode``): when the
  pool cannot hold one more token per running request, the requests with the fewest output tokens go back to the
  end of the waiting queue, keeping their output (``Req.reset_for_retract``), and ``new_token_ratio`` is raised;
  otherwise it decays towards its minimum.
- Finishing (``Req.check_finished``): a pending abort first (after the step's token is appended), then the
  length, then a stop token.
- Aborts (``Scheduler.abort_request``): a waiting request is taken out and answered at once with what it has
  ("Abort in waiting queue", ``TokenizerManager._handle_abort_req``); a running one is marked
  (``FINISH_ABORT()``) and answered after one more decode step. ``/pause_generation {mode: abort}``
  (``TokenizerManager.pause_generation``) aborts everything, then checks every second until no /generate holds the
  reader lock; ``retract`` moves the running batch to the waiting queue (``retract_all``); ``in_place`` only stops
  the scheduler. While paused, a new /generate waits (``is_pause_cond``).
- Length limits (srt/managers/tp_worker.py): ``max_req_len = min(context - 1, pool - 1)``, ``max_req_input_len =
  max_req_len - 5``; a longer prompt is refused with 400 for the whole request (``validate_input_length``,
  ``Req.set_finish_with_abort``, then the tokenizer manager raises), and ``max_new_tokens`` is clamped silently to
  ``max_req_len - prompt - 1`` (``Scheduler.init_req_max_new_tokens``).
- dp ranks (srt/managers/data_parallel_controller.py ``round_robin_scheduler``): each completion goes to the next
  rank in turn, or to ``data_parallel_rank`` / ``routed_dp_rank`` when the request names one; each rank has its own
  model, pool and queues (``--max-total-tokens`` is each rank's pool).
- 0.5.23's per-token weight versions (srt/utils/weight_versions.py, run from that file): a weight version change
  records, for every live request with output, how many tokens the old version drew; each answer carries the spans.
"""
from __future__ import annotations

import contextlib
import os
import threading
import time
import uuid

import torch

CLIP_MAX_NEW_TOKENS = 4096  # srt/managers/schedule_policy.py (SGLANG_CLIP_MAX_NEW_TOKENS_ESTIMATION)
INIT_NEW_TOKEN_RATIO, MIN_NEW_TOKEN_RATIO_FACTOR, NEW_TOKEN_RATIO_DECAY_STEPS = 0.7, 0.14, 600  # srt/environ.py
RETRACT_DECODE_STEPS = 20  # srt/environ.py SGLANG_RETRACT_DECODE_STEPS
MAX_PREFILL_TOKENS = 16384  # srt/server_args.py max_prefill_tokens
PAUSE_ABORT_POLL_S = 1.0  # TokenizerManager.pause_generation: the reader lock is checked again after a second
ABORTED = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}  # FINISH_ABORT().to_json()
ABORTED_WAITING = {"type": "abort", "message": "Abort in waiting queue"}  # TokenizerManager._handle_abort_req


class HTTPError(Exception):
    def __init__(self, status: int, payload) -> None:
        super().__init__(str(payload))
        self.status, self.payload = status, payload


def bad_request(message: str) -> HTTPError:
    """SGLang's ``validation_exception_handler`` body (an ``ErrorResponse``)."""
    return HTTPError(400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


def die(reason: str) -> None:
    """Where SGLang's scheduler raises (an assertion, a KeyError, memory freed under it), its process dies and takes
    the server with it (``run_scheduler_process`` signals the parent, which kills the process tree)."""
    print(f"stand-in: the server dies: {reason}", flush=True)
    os._exit(1)


def max_running_requests(args, context: int) -> int:
    """Per dp rank (srt/model_executor/model_runner.py, model_runner_kv_cache_mixin.py ``init_memory_pool``): the
    flag split over the dp ranks, else half the pool, at most the request pool (2048-4096 slots)."""
    if args.max_running_requests is not None:
        return max(1, args.max_running_requests // args.dp_size)
    return min(args.max_total_tokens // 2, min(max(int(args.max_total_tokens / context * 512), 2048), 4096))


class Req:
    """One sequence (SGLang's ``Req``, srt/managers/schedule_batch.py); the names SGLang's own weight-version code
    reads (``output_ids``, ``weight_version_events``) are its own."""

    def __init__(self, rid: str, prompt: list[int], params: dict, body: dict, generator) -> None:
        self.rid, self.prompt, self.params, self.generator = rid, prompt, params, generator
        self.max_new = params.get("max_new_tokens", 128)
        self.output_ids: list[int] = []
        self.logprobs: list[list] = []
        self.input_logprobs = None
        self.start_len = body.get("logprob_start_len", -1)
        self.finish: dict | None = None
        self.to_finish: dict | None = None
        self.from_waiting_queue = False  # answered by _handle_abort_req, not the output path
        self.weight_version_events: list = []
        self.finish_version: str | None = None  # the server's weight version when it finished
        self.spans = None  # 0.5.23: its tokens' weight versions, computed as it finished
        self.done = threading.Event()
        self.start = time.monotonic()

    @property
    def kv_tokens(self) -> int:
        return len(self.prompt) + len(self.output_ids)


class DPRank:
    """One scheduler of the server (srt/managers/scheduler.py ``Scheduler``): its model, a KV pool of
    ``--max-total-tokens`` tokens, its running batch and waiting queue; its event loop takes one step at a time (a
    prefill of what it admits, else a decode of the running batch), each lasting ``--decode-delay`` at least.
    ``step_lock`` is held for a whole step: control requests run between steps."""

    def __init__(self, server, index: int, model) -> None:
        self.server, self.index, self.model = server, index, model
        self.step_lock = threading.Lock()
        self.reset()
        threading.Thread(target=self._loop, name=f"scheduler-dp{index}", daemon=True).start()

    def reset(self) -> None:
        args = self.server.args
        self.pool, self.max_running = args.max_total_tokens, max_running_requests(args, self.server.context_len)
        self.running: list[Req] = []
        self.waiting: list[Req] = []
        self.stepping: list[Req] = []  # the batch of the step under way (cur_batch)
        self.init_ratio = min(INIT_NEW_TOKEN_RATIO * args.schedule_conservativeness, 1.0)
        self.min_ratio = min(self.init_ratio * MIN_NEW_TOKEN_RATIO_FACTOR, 1.0)
        self.new_token_ratio = self.init_ratio

    def kv_used(self, reqs=None) -> int:
        return sum(r.kv_tokens for r in (self.running + self.stepping if reqs is None else reqs))

    def idle(self, ignore_waiting: bool) -> bool:
        """``_is_no_request`` (0.5.9: the running batch) / ``is_fully_idle(ignore_waiting=...)`` (0.5.23: and the
        waiting queue unless paused)."""
        if self.running or self.stepping:
            return False
        return ignore_waiting or not self.server.source.idle_counts_waiting or not self.waiting

    # -- the event loop ------------------------------------------------------------------------------------

    def _loop(self) -> None:
        s = self.server
        while True:
            with s.lock:  # a control request waiting for the step lock goes first (the lock is not fair)
                while s.engine_paused or s.control_pending or not (self.running or self.waiting):
                    s.lock.wait()
            began = time.monotonic()
            with self.step_lock:
                with s.lock:
                    batch, prefill = ([], False) if s.engine_paused else self._next_batch()
                    self.stepping = batch
                if not batch:  # nothing admissible now: look again shortly
                    time.sleep(0.005)
                    continue
                if s.released & {"kv_cache", "weights"}:
                    die(f"a batch was scheduled with {sorted(s.released)} released (illegal memory access)")
                for req in batch:
                    s.forward(self.model, req)
                time.sleep(max(0.0, s.args.decode_delay - (time.monotonic() - began)))
                with s.lock:
                    if prefill:
                        self.running += batch
                    self.stepping = []
                    finished = [r for r in self.running if r.finish is not None]
                    self.running = [r for r in self.running if r.finish is None]
                    for req in finished:
                        s.finished(req)
                    s.peak["kv_tokens"] = max(s.peak["kv_tokens"], self.kv_used(self.running + finished))
                    s.lock.notify_all()
            for req in finished:
                req.done.set()

    def _next_batch(self) -> tuple[list[Req], bool]:
        """``get_next_batch_to_run``: a prefill batch when one can be formed, else the running batch decodes."""
        peak = self.server.peak
        peak["waiting"] = max(peak["waiting"], sum(len(r.waiting) for r in self.server.dp_ranks))
        admitted = self._admit()
        peak["running"] = max(peak["running"], len(self.running) + len(admitted))
        if admitted:
            self.waiting = [r for r in self.waiting if r not in admitted]
            return admitted, True
        self._update_running_batch()
        return list(self.running), False

    def _admit(self) -> list[Req]:
        """``get_new_batch_prefill`` with ``PrefillAdder``: fcfs, bounded by running slots and the pool."""
        room = self.max_running - len(self.running)
        offset = sum(min(r.max_new - len(r.output_ids), CLIP_MAX_NEW_TOKENS) * self.new_token_ratio
                     for r in self.running)  # _get_running_request_total_token_offset
        available, rem_input, admitted = self.pool - self.kv_used(), MAX_PREFILL_TOKENS, []
        for req in self.waiting:
            if len(admitted) >= room:  # batch_is_full
                break
            extend = req.kv_tokens  # no prefix cache: prompt + output so far are computed again
            total = extend + min(max(req.max_new - len(req.output_ids), 0), CLIP_MAX_NEW_TOKENS)
            if total >= available - offset:  # AddReqResult.NO_TOKEN
                break
            if extend >= rem_input and admitted:
                break
            admitted.append(req)
            offset += extend + min(req.max_new, CLIP_MAX_NEW_TOKENS)  # _update_prefill_budget
            rem_input -= extend
        return admitted

    def _update_running_batch(self) -> None:
        """``update_running_batch``: retract when the pool cannot take the next decode step, else decay the ratio."""
        if not self.running:
            return
        if self.pool - self.kv_used() >= len(self.running):  # check_decode_mem, page size 1
            self.new_token_ratio = max(self.new_token_ratio - (self.init_ratio - self.min_ratio)
                                       / NEW_TOKEN_RATIO_DECAY_STEPS, self.min_ratio)
            return
        # retract_decode: keep the requests with the most output (then the shortest prompts), retract from the back
        kept = sorted(self.running, key=lambda r: (len(r.output_ids), -len(r.prompt)), reverse=True)
        retracted = []
        while not retracted or self.pool - self.kv_used(kept) < len(kept):
            if len(kept) == 1:
                break
            retracted.append(kept.pop())
        if len(kept) <= 1 and self.pool - self.kv_used(kept) < len(kept):
            die("Out of memory even after retracting all other requests in the decode batch.")
        decoded, budgets = sum(len(r.output_ids) for r in kept), sum(r.max_new for r in kept)
        self.new_token_ratio = min(1.0, (decoded + RETRACT_DECODE_STEPS * len(kept)) / (budgets + 1))
        self.running = kept
        self.waiting += retracted  # _add_request_to_queue(is_retracted=True): the end of the queue
        self.server.counts["retracted"] += len(retracted)

    # -- control, between steps ------------------------------------------------------------------------------

    def abort(self, rid: str | None) -> None:
        """``Scheduler.abort_request``: ``rid`` None aborts all (prefix match, as SGLang's ``startswith``)."""
        hit = (lambda r: True) if rid is None else (lambda r: r.rid.startswith(rid))
        for req in [r for r in self.waiting if hit(r)]:
            self.waiting.remove(req)
            req.finish, req.from_waiting_queue = dict(ABORTED_WAITING), True
            self.server.finished(req)
            req.done.set()
        for req in self.running:
            if req.finish is None and hit(req):
                req.to_finish = dict(ABORTED)

    def retract_all(self) -> None:
        """``Scheduler.pause_generation(mode="retract")``: the running batch goes back to the waiting queue."""
        self.server.counts["retracted"] += len(self.running)
        self.waiting, self.running = self.waiting + self.running, []


class Scheduling:
    """The generation side of the stand-in's ``Server``: the tokenizer manager and the data-parallel controller."""

    @contextlib.contextmanager
    def between_steps(self):
        """Every dp rank between two of its steps (control requests run there); no rank starts another step while
        a control request waits for them."""
        with self.lock:
            self.control_pending += 1
        try:
            with contextlib.ExitStack() as stack:
                for rank in self.dp_ranks:
                    stack.enter_context(rank.step_lock)
                yield
        finally:
            with self.lock:
                self.control_pending -= 1
                self.lock.notify_all()

    @property
    def max_req_len(self) -> int:
        return min(self.context_len - 1, self.args.max_total_tokens - 1)

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
        rids = body.get("rid")
        rids = ([rids] if isinstance(rids, str) else rids) or [uuid.uuid4().hex for _ in prompts]
        with self.lock:
            while self.is_pause:  # TokenizerManager.generate_request waits on is_pause_cond
                self.lock.wait()
            self.generating += 1  # the reader lock
        try:
            for prompt, p in zip(prompts, params):
                self._validate_length(prompt, p)
            rank = body.get("routed_dp_rank", body.get("data_parallel_rank"))
            reqs = [Req(rid if p.get("n", 1) == 1 else uuid.uuid4().hex, prompt, dict(p), body, self._generator(p))
                    for rid, prompt, p in zip(rids, prompts, params) for _ in range(p.get("n", 1))]
            if how == "abort":  # aborted before they were scheduled (test control)
                for req in reqs:
                    req.finish = {"type": "abort", "message": "Abort before prefill", "status_code": 503,
                                  "err_type": None}
                    self.finished(req)
            else:
                self._dispatch(reqs, rank)
                for req in reqs:
                    if req.finish is not None and req.finish.get("status_code") == 400:  # the tokenizer manager
                        raise HTTPError(400, {"error": {"message": req.finish["message"]}})  # raises for all
                for req in reqs:
                    req.done.wait()
            out = [self._output(req, body) for req in reqs]
        finally:
            with self.lock:
                self.generating -= 1
                self.lock.notify_all()
        return out[0] if single and len(out) == 1 else out

    def _dispatch(self, reqs: list[Req], rank: int | None) -> None:
        """The data-parallel controller's round robin (or the named rank), then each rank's
        ``handle_generate_request``: the input-length check and the silent clamp of max_new_tokens."""
        with self.lock:
            for req in reqs:
                if rank is None:
                    target, self._next_rank = self.dp_ranks[self._next_rank], (self._next_rank + 1) % len(self.dp_ranks)
                else:
                    target = self.dp_ranks[rank]
                limit = self.max_req_len - 5  # max_req_input_len
                if len(req.prompt) >= limit:  # validate_input_length, then set_finish_with_abort
                    req.finish = {"type": "abort", "status_code": 400, "err_type": "BadRequestError", "message": (
                        f"Input length ({len(req.prompt)} tokens) exceeds the maximum allowed length ({limit} "
                        "tokens). Use a shorter input or enable --allow-auto-truncate.")}
                    self.finished(req)
                    req.done.set()
                    continue
                req.max_new = max(0, min(req.max_new, self.max_req_len - len(req.prompt) - 1))  # init_req_max_new_tokens
                target.waiting.append(req)
            self.lock.notify_all()

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

    @torch.no_grad()
    def forward(self, model, req: Req) -> None:
        """One token of ``req`` (a full forward: the KV cache is not kept), then ``check_finished``."""
        p = req.params
        temperature, top_k, top_p = p.get("temperature", 1.0), p.get("top_k", -1), p.get("top_p", 1.0)
        ids = req.prompt + req.output_ids
        logits = model(torch.tensor([ids])).logits[0].float()  # [len(ids), V]
        if not req.output_ids and req.start_len is not None and req.start_len >= 0 and req.input_logprobs is None:
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
        req.output_ids.append(token)
        req.logprobs.append([float(lp[token]), token, None])
        with self.lock:
            self.counts["sampled"] += 1
        if req.to_finish is not None:
            req.finish = req.to_finish
        elif len(req.output_ids) >= req.max_new:
            req.finish = {"type": "length", "length": req.max_new}
        elif token in self._stop_ids(p):
            req.finish = {"type": "stop", "matched": token}

    def _stop_ids(self, p: dict) -> set:
        return set(p.get("stop_token_ids") or []) | ({self.tokenizer.eos_token_id} if not p.get("ignore_eos") else set())

    def _output(self, req: Req, body: dict) -> dict:
        """The answer of a finished request (``_handle_batch_output``), or of one taken out of the waiting queue
        (``_handle_abort_req``: no token counts but the completion's); 0.5.23 adds the weight-version spans."""
        self.counts["returned"] += len(req.output_ids)
        self.counts["aborted"] += req.finish["type"] == "abort"
        meta = {"id": req.rid, "finish_reason": req.finish, "weight_version": req.finish_version,
                "e2e_latency": time.monotonic() - req.start, "completion_tokens": len(req.output_ids)}
        if not req.from_waiting_queue:
            meta.update(prompt_tokens=len(req.prompt), cached_tokens=0)
        if req.spans is not None:
            self.source.weight_versions.add_weight_versions_to_meta_info(meta, req.spans, len(req.output_ids))
        if body.get("return_logprob"):
            meta["output_token_logprobs"] = req.logprobs
            if req.input_logprobs is not None:
                meta["input_token_logprobs"] = req.input_logprobs
        stop_ids = self._stop_ids(req.params)
        text = self.tokenizer.decode([t for t in req.output_ids if t not in stop_ids], skip_special_tokens=True)
        return {"text": text, "output_ids": req.output_ids, "meta_info": meta}

    def finished(self, req: Req) -> None:
        """What the answer says of the weights is taken as the request finishes (the scheduler streams it to the
        tokenizer manager then: srt/managers/scheduler_components/output_streamer.py)."""
        req.finish_version = self.weight_version
        versions = self.source.weight_versions
        if versions is not None:
            req.spans = versions.compute_weight_version_spans(req.weight_version_events, self.weight_version,
                                                              len(req.output_ids))

    def record_weight_version(self, new_version: str) -> None:
        """``Scheduler.record_weight_version_change`` (0.5.23): what the old version drew, for every live request."""
        versions = self.source.weight_versions
        if versions is not None and new_version != self.weight_version:
            for rank in self.dp_ranks:
                versions.record_weight_version_events(rank.running + rank.stepping + rank.waiting,
                                                      old_version=self.weight_version)
        self.weight_version = new_version

    # -- pause, continue, abort --------------------------------------------------------------------------------

    def abort_request(self, rid: str | None) -> None:
        """``TokenizerManager.abort_request`` (a rid it does not know is dropped) sent to every dp rank."""
        with self.between_steps(), self.lock:
            if rid is not None and not any(r.rid == rid for rank in self.dp_ranks
                                           for r in rank.running + rank.stepping + rank.waiting):
                return
            for rank in self.dp_ranks:
                rank.abort(rid)
            self.lock.notify_all()

    def pause(self, mode: str) -> None:
        """``TokenizerManager.pause_generation`` + ``Scheduler.pause_generation``."""
        with self.lock:
            self.is_pause = True
        if mode == "abort":  # abort everything, answered once no request holds the reader lock
            while True:
                self.abort_request(None)
                with self.lock:
                    if not self.generating:
                        return
                time.sleep(PAUSE_ABORT_POLL_S)
        with self.between_steps(), self.lock:
            self.engine_paused = True
            if mode == "retract":
                for rank in self.dp_ranks:
                    rank.retract_all()

    def continue_(self) -> None:
        with self.lock:
            self.is_pause = self.engine_paused = False
            self.lock.notify_all()

    def idle(self) -> bool:
        """What a flush or a memory release asks of every dp rank (see ``DPRank.idle``)."""
        return all(rank.idle(ignore_waiting=self.engine_paused) for rank in self.dp_ranks)
