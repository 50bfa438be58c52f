"""Weight-sync senders for SGLang servers: objects with ``update_weights()`` (the spec's contract).

Distributed path (every training rank calls ``update_weights``; rank 0 talks to the servers)::

    trainer rank 0                                        SGLang server (ranks 1..)
    ──────────────                                        ─────────────────────────
    at start: GET /server_info  ◄───────────────────────  release, tp/dp/pp sizes (checked once)
              host the TCP store; join group "<name>" as rank 0, CONCURRENTLY with
              POST /init_weights_update_group  ──────────►  init_custom_process_group: joins the store's
                                                            PrefixStore(<name>) as ranks offset..offset+tp-1
    per update:
    POST /pause_generation {mode: retract}  ─────────────►  in-flight requests wait, keeping their tokens
    POST /begin_weight_update  ──────────────────────────►  (0.5.21+ only: updates are refused outside a session)
    for each bucket (all ranks gather it; ZeRO-3):
        POST /update_weights_from_distributed ───────────►  (request not awaited yet)
             {names, dtypes, shapes, group_name, flush_cache, weight_version, load_format}
        broadcast tensor 1..k (or one uint8 buffer) ─────►  receive in names order, load
        await the reply  ◄───────────────────────────────  {success, message}
    POST /end_weight_update, POST /continue_generation ──►  they go on with the new weights (KV recomputed)
    at the end: POST /destroy_weights_update_group

A refused or failed bucket can leave a broadcast that a server never joined: the group is then torn down on both
sides and made again under a new name before anything else is sent. After any failure the engines' weights are
unknown, so everything is pushed again (``max_attempts``), then the sender raises :class:`WeightSyncError` (the
trainer saves a checkpoint before stopping). After a push, rank 0 checks the servers against the trainer:
``/get_weights_by_name`` where the served model implements it, else the logprobs of a fixed probe sequence and the
weight version the server reports (both gathered / computed on every rank, so ZeRO-3 is checked too).

Pausing: ``retract`` (the default) keeps every in-flight request on the server with its tokens and logprobs and
lets it finish under the new weights, and the cache flush that ends an update succeeds (SGLang's running batch
is empty then: ``Scheduler.pause_generation`` / ``flush_cache``, srt/managers/scheduler.py); ``abort`` returns
them cut short and the engine continues them from what they had (:mod:`grpo_accel.sglang.engine`), which costs
a request per push; ``in_place`` is not offered, its requests stay in the running batch and the flush fails.
"""
from __future__ import annotations

import base64
import concurrent.futures
import json
import logging
import shutil
import threading
import time
from pathlib import Path

import torch

from grpo_accel.sglang import api
from grpo_accel.distributed import any_process, gathered_parameters
from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.weight_sync.gather import BucketedGather
from grpo_accel.sglang.group import WeightUpdateGroup, address_towards

logger = logging.getLogger(__name__)

KEY_SETTING = "weight_sync.admin_api_key (or rollout.api_key when the server has no --admin-api-key)"
PROBE_TOKENS = 32
PROBE_TOLERANCE = {torch.float32: 1e-3, torch.bfloat16: 0.2, torch.float16: 0.2}
"""Mean absolute difference allowed between the server's and the trainer's probe logprobs, by sync dtype."""


class WeightSyncError(RuntimeError):
    """Weights could not be pushed; the engines hold unknown weights."""


def dtype_name(dtype: torch.dtype) -> str:
    """torch attribute name, as SGLang expects: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


class _Sender:
    """What every sender shares: rank-0 HTTP clients and server facts, the bucketed gather, the update session,
    versions, retries, verification and the agreement of all ranks (only rank 0 sees the servers' answers).

    Subclasses send one bucket in ``_send`` and may finish an update in ``_finish`` and mend things in ``_recover``.
    """

    uses_session = False  # /update_weights_from_distributed and _from_tensor need one from 0.5.21 on
    method = "distributed"  # as SGLang's dp rule names it (sglang_api.ServerInfo.check_weight_updates)

    def __init__(self, accelerator, model, urls: list[str], *, api_key: str | None, admin_api_key: str | None,
                 bucket_mb: float, dtype: torch.dtype, max_attempts: int, verify_tensors: int, timeout_s: float,
                 pause_mode: str = "retract") -> None:
        if pause_mode not in api.PAUSE_MODES:
            raise ValueError(f"pause_mode={pause_mode!r}: use one of {api.PAUSE_MODES}.")
        self.accelerator, self.model, self.dtype, self.pause_mode = accelerator, model, dtype, pause_mode
        self.is_sender = accelerator.is_main_process
        urls = urls if self.is_sender else []
        # SGLang's auth levels (srt/utils/auth.py): weight and pause endpoints take the admin key when the server
        # has one, else its --api-key; /generate and /server_info take the --api-key.
        self.clients = [HTTPClient(u, admin_api_key or api_key, timeout_s, retries=0, key_setting=KEY_SETTING)
                        for u in urls]
        self.readers = [HTTPClient(u, api_key, timeout_s, retries=0) for u in urls]
        self.servers = [api.read_server_info(c) for c in self.readers]
        for info in self.servers:
            info.check_supported()
            info.check_weight_updates(self.method)
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._gather: BucketedGather | None = None
        self.max_attempts, self.verify_tensors = max_attempts, verify_tensors
        self._by_name: list[bool] | None = None  # per server: /get_weights_by_name works (asked at the first check)
        self._probe_needed = False
        self.version = 0
        self.last_sync_s = 0.0
        self._released: set[str] = set()  # colocated servers: what they freed while the trainer trains

    @property
    def gather(self) -> BucketedGather:
        """Planned at the first push, once the trainer has prepared (and under ZeRO-3 partitioned) the model."""
        if self._gather is None:
            self._gather = BucketedGather(self.model, self.bucket_bytes, self.dtype, materialize=self.is_sender)
        return self._gather

    def update_weights(self) -> None:
        """Push every parameter as version ``version + 1`` and check it arrived (collective over training ranks)."""
        self.push(self.version + 1)

    def push(self, version: int) -> None:
        """Push every parameter as ``version`` and check it arrived (collective). A resumed trainer calls this
        with its restored version: a new process cannot know what the servers hold."""
        start = time.perf_counter()
        error = None
        for attempt in range(1, self.max_attempts + 1):
            error = self._push(str(version))
            if self._all_agree(error is None):
                error = self._verify(str(version))
                if self._all_agree(error is None):
                    self.version = version
                    self.last_sync_s = time.perf_counter() - start
                    return
            logger.warning("weight push %d failed (%s); engine weights are unknown, pushing everything again",
                           attempt, error or "on another rank")
        raise WeightSyncError(f"weights could not be pushed after {self.max_attempts} attempts: {error}; the "
                              "engines hold unknown weights. Restart them, then resume from the last checkpoint.")

    def close(self) -> None:
        """Release what the sender holds on the servers (called once training is over)."""

    def release_memory(self) -> None:
        """Colocated servers (SGLang on the trainer's GPUs, ``--enable-memory-saver``) free their KV cache,
        weights and CUDA graphs for the trainer's optimisation; the next push takes them back (weights, the push,
        then the rest). Collective: SGLang asserts no request runs, so every process must have collected."""
        self.accelerator.wait_for_everyone()
        if self.is_sender and not self._released:
            self._each(*api.release_memory_occupation(list(api.MEMORY_TAGS)))
            self._released = set(api.MEMORY_TAGS)

    def _resume_memory(self, tags: tuple[str, ...]) -> None:
        """Take back what ``release_memory`` freed of ``tags`` (SGLang fails to resume a tag it holds)."""
        wanted = [t for t in api.MEMORY_TAGS if t in tags and t in self._released]
        if wanted:
            self._each(*api.resume_memory_occupation(wanted))
            self._released -= set(wanted)

    # -- one push ------------------------------------------------------------------------------------------

    def _push(self, version: str) -> str | None:
        """One full push; every rank walks every bucket (a collective under ZeRO-3). Rank 0's error, or None.
        Colocated servers get their weights' memory back first and their KV cache after."""
        error = self._rank0(self._resume_memory, ("weights",)) or self._rank0(self._open_update)
        for index, (bucket, tensors) in enumerate(self.gather):
            if error is None:
                error = self._rank0(self._send, index, bucket, tensors, version)
        if error is None:
            error = self._rank0(self._finish, version) or self._rank0(self._resume_memory, ("kv_cache", "cuda_graph"))
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

    def _send(self, index: int, bucket, tensors: list[torch.Tensor], version: str) -> None:
        """Send bucket ``index`` (its full tensors at the sync dtype; the sending rank only)."""
        raise NotImplementedError

    def _is_last(self, index: int) -> bool:
        return index == len(self.gather.buckets) - 1

    def _finish(self, version: str) -> None:
        """Close the session and let the servers generate again."""
        if self.uses_session:
            for client in self._session_clients():
                client.post(*api.end_weight_update())
        self._each(*api.continue_generation())

    def _recover(self) -> None:
        """After a failure: close what is open, best effort (the next attempt pushes everything again)."""
        if self.uses_session:
            for client in self._session_clients():
                self._quietly(client, *api.end_weight_update())
        for client in self.clients:
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
        return not any_process(self.accelerator, not ok)

    # -- verification ----------------------------------------------------------------------------------------

    def _verify(self, version: str) -> str | None:
        """Compare every server with the trainer after a push. Every rank gathers the checked parameters and,
        where a server needs the probe, runs its forward (collectives under ZeRO-3); rank 0 compares. The error
        text, or None."""
        if not self.verify_tensors:
            return None
        if self._by_name is None:
            self._by_name = self._decide_checks()
        weights = self.gather.weights[: self.verify_tensors]
        with gathered_parameters([p for w in weights for p in w.params]):
            expected = {w.name: w.value().to(self.dtype).float().cpu() for w in weights} if self.is_sender else {}
        probe = self._probe_ids()
        trainer_logprobs = self._probe_logprobs(probe) if self._probe_needed else None
        return self._rank0(self._compare, version, expected, probe, trainer_logprobs)

    def _decide_checks(self) -> list[bool]:
        """Per server, whether its model implements /get_weights_by_name (asked once; said once where not). All
        ranks learn whether any server needs the probe: its forward is a collective under ZeRO-3."""
        first = self.gather.weights[0].name
        by_name = []
        for client in self.clients:
            try:
                client.post(*api.get_weights_by_name(first, truncate_size=1))
                by_name.append(True)
            except ServerError as exc:
                if api.WEIGHTS_BY_NAME_MISSING not in str(exc):
                    raise
                logger.warning("%s: the served model does not implement /get_weights_by_name; weights are checked "
                               "with a %d-token logprob probe and the reported weight version instead",
                               client.url, PROBE_TOKENS)
                by_name.append(False)
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

    def _compare(self, version: str, expected: dict, probe: list[int], trainer_logprobs: torch.Tensor | None) -> None:
        for client, reader, by_name in zip(self.clients, self.readers, self._by_name):
            if by_name:
                self._compare_by_name(client, expected)
            else:
                self._compare_probe(reader, version, probe, trainer_logprobs)

    def _compare_by_name(self, client: HTTPClient, expected: dict) -> None:
        for name, value in expected.items():
            got = torch.tensor(client.post(*api.get_weights_by_name(name, truncate_size=4)))
            rows = value.reshape(-1)[: got.numel()] if value.dim() < 2 else value[: got.shape[0]]
            if got.shape != rows.shape or not torch.allclose(got.float(), rows.reshape(got.shape), atol=1e-2):
                raise WeightSyncError(f"{client.url}: {name} differs from the trainer's after the update.")

    def _compare_probe(self, client: HTTPClient, version: str, probe: list[int], trainer: torch.Tensor) -> None:
        answer = client.post(*api.prompt_logprobs(probe))
        meta = (answer[0] if isinstance(answer, list) else answer)["meta_info"]
        if str(meta.get("weight_version")) != version:
            raise WeightSyncError(f"{client.url} reports weight version {meta.get('weight_version')!r} after "
                                  f"version {version} was pushed.")
        served = torch.tensor([float(v[0]) for v in meta["input_token_logprobs"][1:]])  # the first has no logprob
        gap = float((served - trainer).abs().mean())
        if gap > PROBE_TOLERANCE[self.dtype]:
            raise WeightSyncError(f"{client.url}: probe logprobs differ from the trainer's by {gap:.4f} on average "
                                  f"(allowed {PROBE_TOLERANCE[self.dtype]} at {dtype_name(self.dtype)}): the "
                                  "server does not hold the pushed weights.")


class DistributedWeightSender(_Sender):
    """SGLang's ``/update_weights_from_distributed`` path (NCCL between GPUs, gloo where there is none).

    Args:
        accelerator: the training Accelerator; every rank calls ``update_weights``.
        model: the unwrapped policy (Hugging Face parameter names).
        urls: one SGLang server per engine replica.
        master_address / master_port: where rank 0 hosts the weight-update group (reachable by the servers);
            None: rank 0's address on the route to the first server (said at start).
        backend: "nccl", "gloo", or "auto" (nccl with CUDA).
        bucket_mb: bytes per bucket; bounds the extra memory of the gather on every rank.
        layout: "per_tensor" (one broadcast per tensor) or "flattened_bucket" (one uint8 broadcast per bucket).
        dtype: dtype the engine holds (sent as such).
        api_key / admin_api_key: the servers' ``--api-key`` and ``--admin-api-key`` (weight endpoints take the
            admin key when a server has one).
        group_name: start of the weight-update group's name (a fresh suffix per group).
        pause_mode: how the servers pause around a push: "retract" (in-flight requests keep their tokens and go
            on under the new weights) or "abort" (they come back cut short; the engine continues them).

    Example:
        >>> sender = DistributedWeightSender(accelerator, model, ["http://10.0.0.2:30000"],
        ...                                  master_address="10.0.0.1", backend="nccl")
        >>> sender.update_weights()  # on every training rank
    """

    uses_session = True

    def __init__(self, accelerator, model, urls: list[str], *, master_address: str | None = None,
                 master_port: int = 29600, backend: str = "auto", bucket_mb: float = 512, layout: str = "per_tensor",
                 dtype: torch.dtype = torch.bfloat16, api_key: str | None = None, admin_api_key: str | None = None,
                 group_name: str = api.DEFAULT_GROUP, max_attempts: int = 2, verify_tensors: int = 2,
                 timeout_s: float = 600.0, pause_mode: str = "retract") -> None:
        if layout not in ("per_tensor", "flattened_bucket"):
            raise ValueError(f"weight_sync.layout={layout!r}: use 'per_tensor' or 'flattened_bucket'.")
        super().__init__(accelerator, model, urls, api_key=api_key, admin_api_key=admin_api_key, bucket_mb=bucket_mb,
                         dtype=dtype, max_attempts=max_attempts, verify_tensors=verify_tensors, timeout_s=timeout_s,
                         pause_mode=pause_mode)
        self.layout, self.timeout_s = layout, timeout_s
        self.backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        self.group: WeightUpdateGroup | None = None
        if self.is_sender:
            gpus = [info.tp_size for info in self.servers]
            self.offsets = [1 + sum(gpus[:i]) for i in range(len(gpus))]  # engine i: 1 + GPUs of engines before it
            if master_address is None:
                master_address = address_towards(urls[0])
                logger.info("weight-update group at %s:%d, this trainer's address on the route to %s (set "
                            "weight_sync.master_address to choose another)", master_address, master_port, urls[0])
            self.group = WeightUpdateGroup(self.backend, master_address, master_port, 1 + sum(gpus), group_name,
                                           timeout_s)
            self._join()

    def close(self) -> None:
        if self.group is None or self.group.name is None:
            return
        for client in self.clients:
            self._quietly(client, *api.destroy_weights_update_group(self.group.name))
        self.group.leave(abort=False)

    def _join(self) -> None:
        """Make a new group: rank 0's side in a thread, each server's through ``/init_weights_update_group``
        (which returns once every rank joined). Raises naming the group, the store keys and the servers."""
        group, name = self.group, self.group.new_name()
        local: dict = {}

        def join_here() -> None:
            try:
                group.join(name)
            except Exception as exc:  # noqa: BLE001 (reported below)
                local["error"] = exc

        thread = threading.Thread(target=join_here, name="weight-update-group", daemon=True)
        thread.start()  # a daemon: if a server never joins, nothing waits for it at exit
        deadline = time.monotonic() + self.timeout_s
        pool = concurrent.futures.ThreadPoolExecutor(len(self.clients))
        replies = [pool.submit(c.post, *api.init_weights_update_group(group.address, group.port, offset,
                                                                       group.world_size, name, self.backend))
                   for c, offset in zip(self.clients, self.offsets)]
        problems = []
        for client, reply in zip(self.clients, replies):
            try:
                answer = reply.result(timeout=max(0.0, deadline - time.monotonic()))
                if not answer.get("success"):
                    problems.append(f"{client.url} answered: {answer.get('message')}")
            except concurrent.futures.TimeoutError:
                problems.append(f"{client.url} did not answer /init_weights_update_group")
            except ServerError as exc:
                if exc.status in (401, 403):  # a key problem, not a network one: the key setting says what to do
                    raise
                problems.append(str(exc))
        pool.shutdown(wait=False)
        if not problems:
            thread.join(max(0.0, deadline - time.monotonic()))
            if thread.is_alive() or "error" in local:
                problems.append(f"the trainer's side did not complete ({local.get('error', 'still waiting')})")
        if problems:
            ranks = ", ".join(f"{c.url} as ranks {o}..{o + i.tp_size - 1}"
                              for c, o, i in zip(self.clients, self.offsets, self.servers))
            raise WeightSyncError(
                f"the weight-update group {name!r} did not form within {self.timeout_s:.0f} s: {'; '.join(problems)}. "
                f"The trainer is rank 0 of {group.world_size} and hosts the {group.store_keys(name)}; the servers "
                f"join it ({ranks}) by connecting to weight_sync.master_address:master_port. Check that every "
                "server reaches that address and port, or raise weight_sync.timeout_s.")

    def _send(self, index: int, bucket, tensors: list[torch.Tensor], version: str) -> None:
        if self.group.group is None:
            raise WeightSyncError("no weight-update group: it could not be made again after the last failure.")
        for t, shape in zip(tensors, bucket.shapes):  # never send what was not announced
            if tuple(t.shape) != tuple(shape) or t.dtype != self.dtype:
                raise WeightSyncError(f"tensor {tuple(t.shape)}/{t.dtype} does not match announced {shape}/{self.dtype}")
        request = api.update_weights_from_distributed(
            bucket.names, [dtype_name(self.dtype)] * len(bucket.names), [list(s) for s in bucket.shapes],
            self.group.name, self.layout == "flattened_bucket", self._is_last(index), version)
        device = "cuda" if self.backend == "nccl" else "cpu"
        if self.layout == "flattened_bucket":  # one uint8 buffer: the tensors' bytes concatenated in order
            payload = [torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]).to(device)]
        else:
            payload = [t.to(device) for t in tensors]
        with concurrent.futures.ThreadPoolExecutor(len(self.clients)) as pool:
            replies = [pool.submit(c.post, *request) for c in self.clients]  # answered once received (or refused)
            works = [self.group.broadcast(t) for t in payload]
            refused = []
            for client, reply in zip(self.clients, replies):
                try:
                    answer = reply.result()
                    if not answer.get("success"):
                        refused.append(f"{client.url}: {answer.get('message')}")
                except ServerError as exc:
                    refused.append(str(exc))
        if refused:  # broadcasts a server never joined may still be pending: _recover makes a new group
            raise WeightSyncError(f"update_weights_from_distributed failed: {'; '.join(refused)}")
        for work in works:
            work.wait()

    def _recover(self) -> None:
        """A new group before anything else is sent: the old one may hold a broadcast a server never joined."""
        if self.group.name is not None:
            for client in self.clients:  # first: a server closing its side ends a broadcast pending on ours
                self._quietly(client, *api.destroy_weights_update_group(self.group.name))
            self.group.leave(abort=True)
        try:
            self._join()
        except WeightSyncError as exc:
            logger.error("%s", exc)
        super()._recover()


class DiskWeightSender(_Sender):
    """``/update_weights_from_disk``: rank 0 writes a Hugging Face folder (config + safetensors, one file per
    bucket) under ``path`` (which the servers must be able to read), then posts its location. Served at any
    ``--dp-size``."""

    method = "disk"

    def __init__(self, accelerator, model, urls: list[str], path: str | Path, *, bucket_mb: float = 512,
                 dtype: torch.dtype = torch.bfloat16, api_key: str | None = None, admin_api_key: str | None = None,
                 keep: int = 2, max_attempts: int = 2, verify_tensors: int = 2, timeout_s: float = 600.0,
                 pause_mode: str = "retract") -> None:
        super().__init__(accelerator, model, urls, api_key=api_key, admin_api_key=admin_api_key, bucket_mb=bucket_mb,
                         dtype=dtype, max_attempts=max_attempts, verify_tensors=verify_tensors, timeout_s=timeout_s,
                         pause_mode=pause_mode)
        self.path, self.keep = Path(path), keep
        self._index: dict[str, str] = {}  # parameter name -> file, for the update being written

    def _folder(self, version: str) -> Path:
        return self.path / f"version_{int(version):06d}"

    def _send(self, index: int, bucket, tensors: list[torch.Tensor], version: str) -> None:
        from safetensors.torch import save_file

        folder = self._folder(version)
        if index == 0:
            self._index = {}
            folder.mkdir(parents=True, exist_ok=True)
            self.model.config.save_pretrained(folder)
        file = f"model-{index:05d}.safetensors"
        save_file({n: t.cpu() for n, t in zip(bucket.names, tensors)}, str(folder / file))
        self._index.update({n: file for n in bucket.names})

    def _open_update(self) -> None:
        """Nothing to pause while the files are written: the servers pause around the load alone (``_finish``)."""

    def _finish(self, version: str) -> None:
        folder = self._folder(version)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": self._index}))
        self._each(*api.pause_generation(self.pause_mode))
        for client, answer in zip(self.clients, self._each(*api.update_weights_from_disk(str(folder), version))):
            if not answer.get("success"):
                raise WeightSyncError(f"{client.url}: update_weights_from_disk failed: {answer.get('message')}")
        super()._finish(version)
        for old in sorted(self.path.glob("version_*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)



class TensorWeightSender(_Sender):
    """``/update_weights_from_tensor``: CUDA IPC handles to servers on the same node. Needs ``sglang`` importable
    on the trainer side (its allow-list unpickler accepts only SGLang's own classes) and a GPU.

    Each tensor-parallel rank of a server reads its own entry of ``serialized_named_tensors`` (one serialization
    per rank: another rank's copy would break CUDA IPC reference counting), and the handles name the GPU by UUID
    (SGLang's ``monkey_patch_torch_reductions``), so servers that number the GPUs differently still find it.
    """

    uses_session = True
    method = "tensor"

    def __init__(self, accelerator, model, urls: list[str], **kwargs) -> None:
        try:
            from sglang.srt.utils import MultiprocessingSerializer  # noqa: F401
        except ImportError as exc:
            raise ImportError("weight_sync.method=tensor needs sglang on the trainer side: pip install "
                              "'grpo_accel[sglang]' (GPU machines), or use method=distributed or disk.") from exc
        if not torch.cuda.is_available():
            raise RuntimeError("weight_sync.method=tensor passes CUDA IPC handles and needs a GPU on the same node.")
        super().__init__(accelerator, model, urls, **kwargs)

    def _send(self, index: int, bucket, tensors: list[torch.Tensor], version: str) -> None:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        named = list(zip(bucket.names, [t.cuda() for t in tensors]))
        for client, info in zip(self.clients, self.servers):
            payloads = [base64.b64encode(MultiprocessingSerializer.serialize(named)).decode()
                        for _ in range(info.tp_size)]
            answer = client.post(*api.update_weights_from_tensor(payloads, self._is_last(index), version))
            if not answer.get("success"):
                raise WeightSyncError(f"{client.url}: update_weights_from_tensor failed: {answer.get('message')}")
