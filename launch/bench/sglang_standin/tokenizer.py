"""The stand-in's tokenizer manager and data-parallel controller (launch/bench/sglang_standin): the /generate path in
front of the dp ranks' schedulers (scheduler.py), pause and continue, aborts by rid, and what an answer
says, each re-implemented from the SGLang source it cites (0.5.9's srt/managers/tokenizer_manager.py and
data_parallel_controller.py; where 0.5.23 differs, its file is named)."""
from __future__ import annotations

import contextlib
import threading
import time
import uuid

import torch

from sglang_standin.scheduler import PAUSE_ABORT_POLL_S, HTTPError, Req

HEALTH_POLL_S = 1.0  # health_generate looks at last_receive_tstamp once a second (``await asyncio.sleep(1)``)
HEALTH_CHECK_RID = "HEALTH_CHECK"  # is_health_check_generate_req: a rid that starts with it


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

    @property
    def max_req_input_len(self) -> int:
        return self.max_req_len - 5

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
                limit = self.max_req_input_len
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
        self.take(req, model(torch.tensor([req.prompt + req.output_ids])).logits[0].float())

    def take(self, req: Req, logits: torch.Tensor) -> None:  # [len(ids), V], or [1, V] once it has output
        """``req``'s next token from its logits (its input logprobs too, at its first), then ``check_finished``."""
        p = req.params
        temperature, top_k, top_p = p.get("temperature", 1.0), p.get("top_k", -1), p.get("top_p", 1.0)
        ids = req.prompt + req.output_ids
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
            self.counts["sampled"] += not req.rid.startswith(HEALTH_CHECK_RID)  # the counts are the clients' tokens
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
        tokenizer manager then: srt/managers/scheduler_components/output_streamer.py), and the tokenizer manager
        has received something (``handle_loop`` sets ``last_receive_tstamp``, which /health looks at)."""
        self.last_receive = time.monotonic()
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

    # -- /health ---------------------------------------------------------------------------------------------

    def health(self) -> bool:
        """``health_generate`` (srt/entrypoints/http_server.py, both releases; /health and /health_generate alike,
        ``SGLANG_ENABLE_HEALTH_ENDPOINT_GENERATION`` being on by default): it sends a one-token greedy generation of
        ``[0]`` and passes once the tokenizer manager has received anything since (``last_receive_tstamp > tic``),
        looked at once a second for ``HEALTH_CHECK_TIMEOUT`` seconds; else 503. (SGLang counts a control request's
        answer received meanwhile too; the stand-in counts finished requests and the scheduler's health signals.)"""
        tic = time.monotonic()
        deadline = tic + self.source.health_check_timeout_s
        threading.Thread(target=self._health_request, args=(deadline,), daemon=True).start()
        while time.monotonic() < deadline:
            time.sleep(HEALTH_POLL_S)
            if self.last_receive > tic:
                return True
        return False

    def _health_request(self, deadline: float) -> None:
        """The check's generation. It waits while the tokenizer manager is paused (``generate_request`` on
        ``is_pause_cond``; cancelled at the deadline, ``task.cancel()``), goes to a dp rank in turn
        (``dispatch_health_check``; 0.5.23 keeps a counter of its own for it, not modelled), and there the scheduler
        holds it back while it is busy (or, in 0.5.9, has memory released: ``SourceFacts.health_check_held_while``),
        answering it at its next batch result, or runs it as any request (on freed memory, if released)."""
        with self.lock:
            while self.is_pause:
                if time.monotonic() >= deadline:
                    return
                self.lock.wait(deadline - time.monotonic())
            rank, self._next_rank = self.dp_ranks[self._next_rank], (self._next_rank + 1) % len(self.dp_ranks)
            busy = {"running"} if rank.running or rank.stepping else set()
            busy |= {"waiting"} if rank.waiting else set()
            busy |= {"released"} if self.released else set()
            if busy & self.source.health_check_held_while:
                rank.health_signals += 1  # return_health_check_ct: sent at its next batch result
            else:
                req = Req(f"{HEALTH_CHECK_RID}_{uuid.uuid4().hex}", [0], {"max_new_tokens": 1, "temperature": 0.0},
                          {}, None)
                rank.waiting.append(req)
            self.lock.notify_all()

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
