"""The stand-in's schedulers (launch/bench/sglang_standin): one per dp rank, with its KV pool, running batch and
waiting queue, behind the tokenizer manager and data-parallel controller of tokenizer.py; each part
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
- Health checks (srt/managers/scheduler.py ``process_input_requests``, ``maybe_send_health_check_signal``): held
  back while the rank is busy (0.5.9: or has memory released) and answered at its next batch result, else run as
  a request of their own (tokenizer.py ``Scheduling.health``).
- 0.5.23's per-token weight versions (srt/utils/weight_versions.py, run from that file): a weight version change
  records, for every live request with output, how many tokens the old version drew; each answer carries the spans.
"""
from __future__ import annotations

import os
import threading
import time

from sglang_standin.kv import RunningBatch

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
        self.kv = RunningBatch()  # --kv-cache
        self.reset()
        threading.Thread(target=self._loop, name=f"scheduler-dp{index}", daemon=True).start()

    def reset(self) -> None:
        args = self.server.args
        self.pool, self.max_running = args.max_total_tokens, max_running_requests(args, self.server.context_len)
        self.running: list[Req] = []
        self.waiting: list[Req] = []
        self.stepping: list[Req] = []  # the batch of the step under way (cur_batch)
        self.health_signals = 0  # health checks held back, answered at the next batch result
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
                if s.args.kv_cache:
                    for req, logits in zip(batch, self.kv.logits(self.model, batch, s.weight_epoch)):
                        s.take(req, logits)
                else:
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
                    if self.health_signals:  # maybe_send_health_check_signal, at every batch result
                        self.health_signals -= 1
                        s.last_receive = time.monotonic()
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
