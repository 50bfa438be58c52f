"""One push of the trained weights to an engine's servers, whatever the engine (:class:`WeightPusher`).

Every training rank walks the gather's buckets (under ZeRO-3 each is a collective); the sending rank (rank 0) has
the servers take back what they released, opens the update, sends each bucket through the transport, finishes
the update and lets the servers generate again. After any failure the engines' weights are unknown, so everything
is pushed again (``max_attempts``), then the pusher raises :class:`WeightSyncError` (the trainer saves a checkpoint
before stopping). After a push the servers are checked against the trainer: the smallest trained weights
(:func:`checked_weights`) gathered on every rank, and, where a server cannot show its weights, the trainer's
logprobs of a fixed probe sequence (a forward on every rank, so ZeRO-3 is checked too); the sending rank compares.

An engine brings two small objects: its servers (:class:`EngineServers`: what they hold, pausing, releasing and
taking back memory, the comparison) and a transport (:class:`Transport`: how a bucket reaches them).
"""
from __future__ import annotations

import concurrent.futures
import logging
import math
import time

import torch

from grpo_accel.contracts import WeightSender
from grpo_accel.distributed import any_process, full_shape, gathered_parameters
from grpo_accel.errors import UserError
from grpo_accel.weight_sync.gather import Bucket, BucketedGather, EngineWeight

logger = logging.getLogger(__name__)

PROBE_TOKENS = 32
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.2, torch.float16: 0.2}
"""Mean absolute difference allowed between the server's and the trainer's probe logprobs, by sync dtype."""


class WeightSyncError(UserError, RuntimeError):
    """Weights could not be pushed; the engines hold unknown weights."""


def dtype_name(dtype: torch.dtype) -> str:
    """torch attribute name, as the engines expect: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


class EngineServers:
    """An engine's servers as a push sees them; the sending rank's calls (other ranks hold no servers)."""

    stale = False
    """What they hold is unknown at start (e.g. a server found with its weights released): push first."""
    clients: list
    """The sending rank's HTTP clients, one per server (other ranks hold none)."""

    def each(self, path: str, body: dict) -> list:
        """``body`` posted to every server at once; their answers in order."""
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.clients))) as pool:
            return list(pool.map(lambda c: c.post(path, body), self.clients))

    def before_update(self) -> None:
        """Take back what the weights are loaded into (released memory) before the first bucket."""

    def after_update(self) -> None:
        """Take back the rest and let them generate again, once the weights are loaded."""

    def recover(self) -> None:
        """After a failure, best effort: let the servers that can generate again do so."""

    def release(self) -> None:
        """Colocated servers free their memory for the trainer's optimisation."""

    def needs_probe(self, first_weight: str) -> bool:
        """Whether any server cannot show its weights by name (asked once), so the logprob probe is needed."""
        return False

    def compare(self, version: int, expected: dict[str, torch.Tensor], probe: list[int],
                trainer_logprobs: torch.Tensor | None, dtype: torch.dtype) -> None:
        """Raise :class:`WeightSyncError` naming a server that does not hold ``version``'s weights."""


class Transport:
    """How one engine's servers receive the buckets of a push (the sending rank's calls)."""

    def open(self) -> None:
        """Before the first bucket."""

    def send(self, index: int, bucket: Bucket, tensors: list[torch.Tensor], version: int, last: bool) -> None:
        """Bucket ``index``: its full tensors at the sync dtype."""
        raise NotImplementedError

    def finish(self, version: int) -> None:
        """After the last bucket."""

    def recover(self) -> None:
        """After a failure, best effort: close what is open (the next attempt pushes everything again)."""

    def close(self) -> None:
        """Release what the transport holds on the servers (once training is over)."""


class WeightPusher(WeightSender):
    """The push every engine shares, over its ``servers`` and ``transport``; every training rank calls ``push``.

    Args:
        accelerator: the training Accelerator (its main process sends).
        model: the unwrapped policy (Hugging Face parameter names).
        servers / transport: the engine's (see the module's docstring).
        bucket_mb: bytes per bucket; bounds the extra memory of the gather on every rank.
        dtype: the dtype the engine holds (sent as such).
        max_attempts: full pushes before :class:`WeightSyncError`.
        verify_tensors: how many of the smallest trained weights are compared after each push (0: none).
    """

    def __init__(self, accelerator, model, servers: EngineServers, transport: Transport, *, bucket_mb: float,
                 dtype: torch.dtype, max_attempts: int, verify_tensors: int) -> None:
        self.accelerator, self.model, self.dtype = accelerator, model, dtype
        self.is_sender = accelerator.is_main_process
        self.engine, self.transport = servers, transport
        self.stale = any_process(servers.stale)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._gather: BucketedGather | None = None
        self.max_attempts, self.verify_tensors = max_attempts, verify_tensors
        self._probe_needed: bool | None = None  # asked at the first check
        self.pushed = 0
        self.last_sync_s = 0.0

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
            error = error or "it failed on another rank, whose line says why"
            logger.warning("weight push %d failed (%s); engine weights are unknown, pushing everything again",
                           attempt, error)
        raise WeightSyncError(f"weights could not be pushed after {self.max_attempts} attempts: {error}; the "
                              "engines hold unknown weights. Restart them, then resume from the last checkpoint.")

    def close(self) -> None:
        """Release what the transport holds on the servers (called once training is over)."""
        if self.is_sender:
            self.transport.close()

    def stats(self) -> dict[str, float]:
        """Seconds of the last push, and the most extra memory its gather held on this rank."""
        peak = self._gather.peak_extra_bytes if self._gather is not None else 0
        return {"weight_sync_s": round(self.last_sync_s, 4), "weight_sync_peak_extra_bytes": peak}

    def release_memory(self) -> None:
        """Colocated servers free their memory for the trainer's optimisation; the next push takes it back.
        Collective: every process must have collected."""
        self.accelerator.wait_for_everyone()
        if self.is_sender:
            self.engine.release()

    def _push(self, version: int) -> str | None:
        """One full push; every rank walks every bucket (a collective under ZeRO-3). Rank 0's error, or None."""
        error = self._rank0(self.engine.before_update) or self._rank0(self.transport.open)
        last = len(self.gather.buckets) - 1
        for index, (bucket, tensors) in enumerate(self.gather):
            if error is None:
                error = self._rank0(self.transport.send, index, bucket, tensors, version, index == last)
        if error is None:
            error = self._rank0(self.transport.finish, version) or self._rank0(self.engine.after_update)
        if error is not None and self.is_sender:
            self.transport.recover()
            self.engine.recover()
        return error

    def _rank0(self, step, *args) -> str | None:
        """Run ``step`` on the sending rank; a server's refusal or a broken collective becomes the error text."""
        if not self.is_sender:
            return None
        try:
            step(*args)
            return None
        except RuntimeError as exc:  # a server's error, WeightSyncError, a broken broadcast
            return str(exc)

    def _all_agree(self, ok: bool) -> bool:
        """True on every process when ``ok`` is true on every process (collective)."""
        return not any_process(not ok)

    def _verify(self, version: int) -> str | None:
        """Compare every server with the trainer after a push. Every rank gathers the checked parameters and,
        where a server needs the probe, runs its forward (collectives under ZeRO-3); rank 0 compares. The error
        text, or None."""
        if not self.verify_tensors:
            return None
        if self._probe_needed is None:
            self._probe_needed = self._agree_on_probe()
        weights = checked_weights(self.gather.weights, self.verify_tensors)
        with gathered_parameters([p for w in weights for p in w.params]):
            expected = {w.name: w.value().to(self.dtype).float().cpu() for w in weights} if self.is_sender else {}
        probe = self._probe_ids()
        trainer_logprobs = self._probe_logprobs(probe) if self._probe_needed else None
        return self._rank0(self.engine.compare, version, expected, probe, trainer_logprobs, self.dtype)

    def _agree_on_probe(self) -> bool:
        """Rank 0 asks its servers; every rank learns the answer (the probe's forward is a collective under
        ZeRO-3)."""
        first = checked_weights(self.gather.weights, 1)[0].name
        flag = torch.tensor([float(self.is_sender and self.engine.needs_probe(first))], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            from accelerate.utils import broadcast

            flag = broadcast(flag, from_process=0)
        return bool(flag[0] > 0)

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


def checked_weights(weights: list[EngineWeight], count: int) -> list[EngineWeight]:
    """The ``count`` smallest weights that training changes (in model order among equals). A server may answer a
    request for a weight by turning the whole parameter into a Python list before it cuts the rows asked for
    (SGLang's ``get_weights_by_name``, srt/models/llama.py: ``.numpy().tolist()[:truncate_size]``): for
    SmolLM2-135M's embedding, 28M floats, that took 1.8-4.3 s here, every push."""
    trained = [w for w in weights if any(p.requires_grad for p in w.params)] or weights
    return sorted(trained, key=lambda w: math.prod(full_shape(w.params[0])))[:count]
