"""The stand-in's scheduler (tests/sglang_standin.py): requests, one running batch decoded a step at a time, the
pause modes and the context rule, each re-implemented from the SGLang source it cites."""
from __future__ import annotations

import threading
import time
import uuid

import torch


class HTTPError(Exception):
    def __init__(self, status: int, payload) -> None:
        super().__init__(str(payload))
        self.status, self.payload = status, payload


def bad_request(message: str) -> HTTPError:
    """SGLang's ``validation_exception_handler`` body (an ``ErrorResponse``)."""
    return HTTPError(400, {"object": "error", "message": message, "type": "Bad Request", "param": None, "code": 400})


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


class Scheduling:
    """The generation side of the stand-in's ``Server`` (SGLang's tokenizer manager and scheduler)."""

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
