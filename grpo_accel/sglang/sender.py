"""What every SGLang weight sender shares (:class:`SGLangSender`); one transport per file: ``from_distributed.py``
(``/update_weights_from_distributed``: NCCL, or gloo without a GPU), ``from_disk.py`` (safetensors and
``/update_weights_from_disk``) and ``from_tensor.py`` (CUDA IPC handles to servers on the same node).

One push, whatever the transport: every training rank walks the gather's buckets (under ZeRO-3 each is a
collective), rank 0 pauses the servers, opens the update session (SGLang 0.5.21+), sends each bucket, closes the
session and lets them generate again. After any failure the engines' weights are unknown, so everything is pushed
again (``max_attempts``), then the sender raises :class:`WeightSyncError` (the trainer saves a checkpoint before
stopping). After a push, rank 0 checks the servers against the trainer: ``/get_weights_by_name`` of the smallest
trained weights (:func:`checked_weights`) where the served model implements it, else the logprobs of a fixed probe sequence and the weight version the server reports (both
gathered / computed on every rank, so ZeRO-3 is checked too).

Pausing: ``retract`` (the default) keeps every in-flight request on the server with its tokens and logprobs and
lets it finish under the new weights, and the cache flush that ends an update succeeds (the scheduler is paused
and its running batch empty: ``Scheduler.pause_generation``, then the flush's idle test, 0.5.9
``_is_no_request`` and 0.5.23 ``is_fully_idle(ignore_waiting=<paused>)``, srt/managers/scheduler.py); ``abort``
returns them cut short, the waiting ones with nothing, and the engine continues or resends them
(:mod:`grpo_accel.sglang.engine`), which costs a request per push and the prefill of each again, and SGLang answers
the pause only once none is in flight (it looks every second); ``in_place`` is not offered, its requests stay in
the running batch and the flush fails.

Colocated servers (``release_memory``): paused with ``retract`` (the server idle, as the release asserts), then
their KV cache, weights and CUDA graphs are freed; the next push takes back the weights and CUDA graphs, loads the
weights, takes back the KV cache, and only then lets them generate (SGLang's own order). What each server has
released is recorded for a restarted trainer (:mod:`grpo_accel.sglang.memory`). A sender that starts aborts what
the servers still run for a trainer before it, so that nothing keeps them busy, and brings back what that trainer
left paused or released (``stale``: the trainer pushes before its first collection).
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from pathlib import Path
from typing import Mapping

import torch

from grpo_accel.contracts import WeightSender
from grpo_accel.distributed import any_process, full_shape, gathered_parameters
from grpo_accel.errors import UserError
from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.rules import check_choice, setting
from grpo_accel.sglang import api
from grpo_accel.sglang.memory import ServerMemory
from grpo_accel.sglang.gather import BucketedGather, EngineWeight

logger = logging.getLogger(__name__)

PROBE_TOKENS = 32
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.2, torch.float16: 0.2}
"""Mean absolute difference allowed between the server's and the trainer's probe logprobs, by sync dtype."""


class WeightSyncError(UserError, RuntimeError):
    """Weights could not be pushed; the engines hold unknown weights."""


def dtype_name(dtype: torch.dtype) -> str:
    """torch attribute name, as SGLang expects: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


class SGLangSender(WeightSender):
    """What every sender shares: rank-0 HTTP clients and server facts, the bucketed gather, the update session,
    versions, retries, verification and the agreement of all ranks (only rank 0 sees the servers' answers).

    Subclasses send one bucket in ``_send`` and may finish an update in ``_finish`` and mend things in ``_recover``.
    """

    uses_session = False  # /update_weights_from_distributed and _from_tensor need one from 0.5.21 on
    method = "distributed"  # as SGLang's dp rule names it (api.ServerInfo.check_weight_updates)

    def __init__(self, accelerator, model, urls: list[str], *, api_key: str | None, admin_api_key: str | None,
                 bucket_mb: float, dtype: torch.dtype, max_attempts: int, verify_tensors: int, timeout_s: float,
                 pause_mode: str = "retract", memory_record: str | Path | None = None,
                 names: Mapping[str, str] | None = None) -> None:
        check_choice(setting(names, "pause_mode"), pause_mode, api.PAUSE_MODES)
        self.accelerator, self.model, self.dtype, self.pause_mode = accelerator, model, dtype, pause_mode
        self.is_sender = accelerator.is_main_process
        urls = urls if self.is_sender else []
        # SGLang's auth levels (srt/utils/auth.py): weight and pause endpoints take the admin key when the server
        # has one, else its --api-key; /generate and /server_info take the --api-key.
        self.names = names
        key = (f"{setting(names, 'admin_api_key')} (or {setting(names, 'api_key')} when the server has no "
               "--admin-api-key)")
        self.clients = [HTTPClient(u, admin_api_key or api_key, timeout_s, retries=0, key_setting=key) for u in urls]
        self.readers = [HTTPClient(u, api_key, timeout_s, retries=0) for u in urls]
        self.servers = [api.read_server_info(c) for c in self.readers]
        for info in self.servers:
            info.check_supported()
            info.check_weight_updates(self.method)
        self._each(*api.abort_all_requests())  # a trainer before this one may have left requests running
        self.memory = ServerMemory(self.clients, self.servers, memory_record)
        self.stale = any_process(self._bring_back())
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._gather: BucketedGather | None = None
        self.max_attempts, self.verify_tensors = max_attempts, verify_tensors
        self._by_name: list[bool] | None = None  # per server: /get_weights_by_name works (asked at the first check)
        self._probe_needed = False
        self.pushed = 0
        self.last_sync_s = 0.0

    def _bring_back(self) -> bool:
        """Servers a trainer before this one left paused (killed between a pause and its continue) generate again:
        those known to hold all their memory (no ``--enable-memory-saver``, or the record of this start of the
        server says nothing is released) are continued now (harmless on one that runs). Those the record says have
        memory released stay paused until the first push takes it back in SGLang's order and then continues them:
        whether any does is returned (the trainer pushes before it collects). A memory saver the record does not
        name is left alone: continued with memory released, SGLang's health check would fail (0.5.9) or run on
        freed memory (0.5.23); the engine's health wait says so if it is paused."""
        for client, info in zip(self.clients, self.servers):
            if self.memory.holds_all(client.url) and (not info.memory_saver or client.url in self.memory.known):
                client.post(*api.continue_generation())
        return not all(self.memory.holds_all(client.url) for client in self.clients)

    @property
    def gather(self) -> BucketedGather:
        """Planned at the first push, once the trainer has prepared (and under ZeRO-3 partitioned) the model."""
        if self._gather is None:
            self._gather = BucketedGather(self.model, self.bucket_bytes, self.dtype, materialize=self.is_sender)
        return self._gather

    def push(self, version: int) -> None:
        """Push every parameter as ``version`` and check it arrived (collective). A resumed trainer calls this
        with its restored version: a new process cannot know what the servers hold."""
        start = time.perf_counter()
        error = None
        for attempt in range(1, self.max_attempts + 1):
            error = self._push(version)
            if self._all_agree(error is None):
                error = self._verify(version)
                if self._all_agree(error is None):
                    self.pushed = version
                    self.last_sync_s = time.perf_counter() - start
                    return
            logger.warning("weight push %d failed (%s); engine weights are unknown, pushing everything again",
                           attempt, error or "on another rank")
        raise WeightSyncError(f"weights could not be pushed after {self.max_attempts} attempts: {error}; the "
                              "engines hold unknown weights. Restart them, then resume from the last checkpoint.")

    def close(self) -> None:
        """Release what the sender holds on the servers (called once training is over)."""

    def stats(self) -> dict[str, float]:
        """Seconds of the last push, and the most extra memory its gather held on this rank."""
        peak = self._gather.peak_extra_bytes if self._gather is not None else 0
        return {"weight_sync_s": round(self.last_sync_s, 4), "weight_sync_peak_extra_bytes": peak}

    def release_memory(self) -> None:
        """Colocated servers (SGLang on the trainer's GPUs, ``--enable-memory-saver``) free their KV cache,
        weights and CUDA graphs for the trainer's optimisation; the next push takes them back. Collective: every
        process must have collected. The servers are paused first (``retract``), which leaves them idle, as the
        release asserts."""
        self.accelerator.wait_for_everyone()
        if self.is_sender:
            self._each(*api.pause_generation("retract"))
            self.memory.release(api.MEMORY_TAGS)

    # -- one push ------------------------------------------------------------------------------------------

    def _push(self, version: int) -> str | None:
        """One full push; every rank walks every bucket (a collective under ZeRO-3). Rank 0's error, or None.
        Colocated servers take back their weights and CUDA graphs first and their KV cache once the weights are
        loaded, before they generate again."""
        error = self._rank0(self.memory.resume, ("weights", "cuda_graph")) or self._rank0(self._open_update)
        for index, (bucket, tensors) in enumerate(self.gather):
            if error is None:
                error = self._rank0(self._send, index, bucket, tensors, version)
        if error is None:
            error = (self._rank0(self._finish, version) or self._rank0(self.memory.resume, ("kv_cache",))
                     or self._rank0(self._each, *api.continue_generation()))
        if error is not None and self.is_sender:
            self._recover()
        return error

    def _rank0(self, step, *args) -> str | None:
        """Run ``step`` on the sending rank; a server's refusal or a broken collective becomes the error text."""
        if not self.is_sender:
            return None
        try:
            step(*args)
            return None
        except RuntimeError as exc:  # ServerError, WeightSyncError, a broken broadcast
            return str(exc)

    def _open_update(self) -> None:
        self._each(*api.pause_generation(self.pause_mode))
        if self.uses_session:
            for client in self._session_clients():
                try:
                    client.post(*api.begin_weight_update())
                except ServerError as exc:  # e.g. a session left open by a trainer that stopped mid-update
                    logger.warning("%s: begin_weight_update refused (%s); closing the open session and retrying",
                                   client.url, exc)
                    client.post(*api.end_weight_update())
                    client.post(*api.begin_weight_update())

    def _send(self, index: int, bucket, tensors: list[torch.Tensor], version: int) -> None:
        """Send bucket ``index`` (its full tensors at the sync dtype; the sending rank only)."""
        raise NotImplementedError

    def _is_last(self, index: int) -> bool:
        return index == len(self.gather.buckets) - 1

    def _finish(self, version: int) -> None:
        """Close the update session (the servers generate again once their memory is back)."""
        if self.uses_session:
            for client in self._session_clients():
                client.post(*api.end_weight_update())

    def _recover(self) -> None:
        """After a failure: close what is open, best effort (the next attempt pushes everything again). A server
        with memory released stays paused: it would generate on freed memory or on weights not loaded."""
        if self.uses_session:
            for client in self._session_clients():
                self._quietly(client, *api.end_weight_update())
        for client in self.clients:
            if self.memory.holds_all(client.url):
                self._quietly(client, *api.continue_generation())

    def _session_clients(self) -> list[HTTPClient]:
        return [c for c, info in zip(self.clients, self.servers) if info.needs_session]

    @staticmethod
    def _quietly(client: HTTPClient, path: str, body: dict) -> None:
        try:
            client.post(path, body)
        except ServerError as exc:
            logger.warning("%s%s failed: %s", client.url, path, exc)

    def _each(self, path: str, body: dict) -> list:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.clients))) as pool:
            return list(pool.map(lambda c: c.post(path, body), self.clients))

    def _all_agree(self, ok: bool) -> bool:
        """True on every process when ``ok`` is true on every process (collective)."""
        return not any_process(not ok)

    # -- verification ----------------------------------------------------------------------------------------

    def _verify(self, version: int) -> str | None:
        """Compare every server with the trainer after a push. Every rank gathers the checked parameters and,
        where a server needs the probe, runs its forward (collectives under ZeRO-3); rank 0 compares. The error
        text, or None."""
        if not self.verify_tensors:
            return None
        if self._by_name is None:
            self._by_name = self._decide_checks()
        weights = checked_weights(self.gather.weights, self.verify_tensors)
        with gathered_parameters([p for w in weights for p in w.params]):
            expected = {w.name: w.value().to(self.dtype).float().cpu() for w in weights} if self.is_sender else {}
        probe = self._probe_ids()
        trainer_logprobs = self._probe_logprobs(probe) if self._probe_needed else None
        return self._rank0(self._compare, version, expected, probe, trainer_logprobs)

    def _decide_checks(self) -> list[bool]:
        """Per server, whether its model implements /get_weights_by_name (asked once; said once where not). All
        ranks learn whether any server needs the probe: its forward is a collective under ZeRO-3."""
        first = checked_weights(self.gather.weights, 1)[0].name
        by_name = []
        for client, info in zip(self.clients, self.servers):
            by_name.append(api.read_weight_rows(client, info, first, 1) is not None)
            if not by_name[-1]:
                logger.warning("%s: the served model does not implement /get_weights_by_name; weights are checked "
                               "with a %d-token logprob probe and the reported weight version instead",
                               client.url, PROBE_TOKENS)
        flag = torch.tensor([float(not all(by_name))], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            flag = broadcast(flag, from_process=0)
        self._probe_needed = bool(flag[0] > 0)
        return by_name

    def _probe_ids(self) -> list[int]:
        vocab = int(self.model.config.vocab_size)
        return [(7919 * i + 13) % vocab for i in range(PROBE_TOKENS)]

    def _probe_logprobs(self, probe: list[int]) -> torch.Tensor:
        """The trainer's logprob of each probe token after the first: [len(probe) - 1]."""
        training = self.model.training
        self.model.eval()
        with torch.no_grad():
            ids = torch.tensor([probe], device=next(self.model.parameters()).device)  # [1, T]
            logits = self.model(ids).logits[0, :-1].float()  # [T-1, V]
        self.model.train(training)
        return torch.log_softmax(logits, -1).gather(-1, ids[0, 1:, None])[:, 0].cpu()

    def _compare(self, version: int, expected: dict, probe: list[int], trainer_logprobs: torch.Tensor | None) -> None:
        for client, reader, info, by_name in zip(self.clients, self.readers, self.servers, self._by_name):
            if by_name:
                self._compare_by_name(client, info, expected)
            else:
                for rank in range(info.dp_ranks):
                    self._compare_probe(reader, info, rank, version, probe, trainer_logprobs)

    def _compare_by_name(self, client: HTTPClient, info: api.ServerInfo, expected: dict) -> None:
        for name, value in expected.items():
            rows_asked = 4 if value.dim() >= 2 else value.numel()  # a vector whole, a matrix's first rows
            for rank, rows in enumerate(api.read_weight_rows(client, info, name, rows_asked) or [[]] * info.dp_ranks):
                got = torch.tensor(rows)
                want = value.reshape(-1)[: got.numel()] if value.dim() < 2 else value[: got.shape[0]]
                if got.shape != want.shape or not torch.allclose(got.float(), want.reshape(got.shape), atol=1e-2):
                    raise WeightSyncError(f"{_where(info, rank)}: {name} differs from the trainer's after the update.")

    def _compare_probe(self, client: HTTPClient, info: api.ServerInfo, rank: int, version: int, probe: list[int],
                       trainer: torch.Tensor) -> None:
        where = _where(info, rank)
        answer = client.post(*api.prompt_logprobs(probe, rank if info.dp_ranks > 1 else None))
        meta = (answer[0] if isinstance(answer, list) else answer)["meta_info"]
        if api.weight_version(meta.get("weight_version")) != version:
            raise WeightSyncError(f"{where} reports weight version {meta.get('weight_version')!r} after "
                                  f"version {version} was pushed.")
        served = torch.tensor([float(v[0]) for v in meta["input_token_logprobs"][1:]])  # the first has no logprob
        gap = float((served - trainer).abs().mean())
        if gap > PROBE_TOLERANCE[self.dtype]:
            raise WeightSyncError(f"{where}: probe logprobs differ from the trainer's by {gap:.4f} on average "
                                  f"(allowed {PROBE_TOLERANCE[self.dtype]} at {dtype_name(self.dtype)}): the "
                                  "server does not hold the pushed weights.")


def _where(info: api.ServerInfo, rank: int) -> str:
    """A server, and which of its dp ranks where it has several."""
    return f"{info.url} (dp rank {rank})" if info.dp_ranks > 1 else info.url


def checked_weights(weights: list[EngineWeight], count: int) -> list[EngineWeight]:
    """The ``count`` smallest weights that training changes (in model order among equals). A server answers
    /get_weights_by_name by turning the whole parameter into a Python list before it cuts the rows asked for
    (SGLang's ``get_weights_by_name``, srt/models/llama.py: ``.numpy().tolist()[:truncate_size]``): for
    SmolLM2-135M's embedding, 28M floats, that took 1.8-4.3 s here, every push."""
    trained = [w for w in weights if any(p.requires_grad for p in w.params)] or weights
    return sorted(trained, key=lambda w: math.prod(full_shape(w.params[0])))[:count]
