"""Weight-sync senders for SGLang servers: objects with ``update_weights()`` (the spec's contract).

Distributed path, per update (every training rank calls ``update_weights``; rank 0 talks to the servers)::

    trainer rank 0                                   SGLang server (ranks 1..)
    ──────────────                                   ─────────────────────────
    POST /pause_generation {mode: abort}  ─────────►  stop scheduling
    for each bucket (all ranks gather it; ZeRO-3):
        POST /update_weights_from_distributed ─────►  (request not awaited yet)
             {names, dtypes, shapes, flush_cache, weight_version, load_format}
        broadcast tensor 1..k (or one uint8 buffer) ──►  receive in names order, load
        await the reply  ◄──────────────────────────  {success, message}
    POST /continue_generation  ─────────────────────►  resume

The group is made once per trainer process: an earlier trainer's group of the same name is destroyed first
(``/destroy_weights_update_group``, so a resumed run can reconnect), then rank 0 hosts the store and joins
CONCURRENTLY with ``POST /init_weights_update_group`` (which blocks until every rank joined); engine i gets
rank_offset = 1 + GPUs of engines before it.
A failed update leaves the engine's weights unknown: everything is pushed again (``max_attempts``), then the
sender raises :class:`WeightSyncError` (the trainer saves a checkpoint before stopping).
"""
from __future__ import annotations

import concurrent.futures
import json
import logging
import shutil
import time
from pathlib import Path

import torch

from grpo_accel.rollout.http import HTTPClient, ServerError
from grpo_accel.weight_sync.gather import BucketedGather
from grpo_accel.weight_sync.group import broadcast, init_weight_update_group

logger = logging.getLogger(__name__)


class WeightSyncError(RuntimeError):
    """Weights could not be pushed; the engines hold unknown weights."""


def dtype_name(dtype: torch.dtype) -> str:
    """torch attribute name, as SGLang expects: torch.bfloat16 -> "bfloat16"."""
    return str(dtype).removeprefix("torch.")


class _Sender:
    """What every sender shares: rank-0 HTTP clients, the bucketed gather, versions, retries and the
    agreement of all ranks on success (only rank 0 sees the servers' answers)."""

    def __init__(self, accelerator, model, urls: list[str], *, api_key: str | None, bucket_mb: float,
                 dtype: torch.dtype, max_attempts: int, verify_names: int, timeout_s: float) -> None:
        self.accelerator, self.model, self.dtype = accelerator, model, dtype
        self.is_sender = accelerator.is_main_process
        self.clients = [HTTPClient(u, api_key, timeout_s, retries=0) for u in urls] if self.is_sender else []
        self.bucket_bytes = int(bucket_mb * 2**20)
        self._gather: BucketedGather | None = None
        self.max_attempts, self.verify_names = max_attempts, verify_names
        self.version = 0
        self.last_sync_s = 0.0

    @property
    def gather(self) -> BucketedGather:
        """Planned at the first push, once the trainer has prepared (and under ZeRO-3 partitioned) the model."""
        if self._gather is None:
            self._gather = BucketedGather(self.model, self.bucket_bytes, self.dtype, materialize=self.is_sender)
        return self._gather

    def update_weights(self) -> None:
        """Push every parameter as version ``version + 1`` (collective over training ranks)."""
        start = time.perf_counter()
        for attempt in range(1, self.max_attempts + 1):
            error = self._push_everywhere(str(self.version + 1))
            if self._all_agree(error is None):
                self.version += 1
                self.last_sync_s = time.perf_counter() - start
                if self.is_sender and self.verify_names:
                    self._verify()
                return
            logger.warning("weight push %d failed (%s); engine weights are unknown, pushing everything again",
                           attempt, error or "on another rank")
        raise WeightSyncError(f"weights could not be pushed after {self.max_attempts} attempts: {error}; the "
                              "engines hold unknown weights. Restart them, then resume from the last checkpoint.")

    def _push_everywhere(self, version: str) -> str | None:
        try:
            self._push(version)
            return None
        except RuntimeError as exc:  # ServerError, WeightSyncError, a broken broadcast
            if self.is_sender:
                self._continue_all()
            return str(exc)

    def _all_agree(self, ok: bool) -> bool:
        flag = torch.tensor([0.0 if ok else 1.0], device=self.accelerator.device)
        if self.accelerator.num_processes > 1:
            flag = self.accelerator.reduce(flag, reduction="sum")
        return bool(flag[0] == 0)

    def _each(self, path: str, body: dict) -> list:
        with concurrent.futures.ThreadPoolExecutor(max(1, len(self.clients))) as pool:
            return list(pool.map(lambda c: c.post(path, body), self.clients))

    def _continue_all(self) -> None:
        for client in self.clients:
            try:
                client.post("/continue_generation", {})
            except ServerError as exc:
                logger.warning("%s: continue_generation failed: %s", client.url, exc)

    def _verify(self) -> None:
        """Spot-check the first ``verify_names`` parameters' leading rows with ``/get_weights_by_name``."""
        params = dict(self.model.named_parameters())
        for name in list(params)[: self.verify_names]:
            p = params[name]
            if hasattr(p, "ds_id"):  # a ZeRO-3 shard: rank 0 alone cannot see the full tensor; skip
                continue
            expected = p.detach().to(self.dtype).float()
            for client in self.clients:
                got = torch.tensor(client.post("/get_weights_by_name", {"name": name, "truncate_size": 4}))
                rows = expected.reshape(-1)[: got.numel()] if expected.dim() < 2 else expected[: got.shape[0]]
                if got.shape != rows.shape or not torch.allclose(got.float(), rows.reshape(got.shape), atol=1e-2):
                    raise WeightSyncError(f"{client.url}: {name} differs from the trainer's after the update.")


class DistributedWeightSender(_Sender):
    """SGLang's ``/update_weights_from_distributed`` path (NCCL between GPUs, gloo where there is none).

    Args:
        accelerator: the training Accelerator; every rank calls ``update_weights``.
        model: the unwrapped policy (Hugging Face parameter names).
        urls: one SGLang server per engine replica.
        master_address / master_port: where rank 0 hosts the weight-update group (reachable by the servers).
        backend: "nccl", "gloo", or "auto" (nccl with CUDA).
        bucket_mb: bytes per bucket; bounds the extra memory of the gather on every rank.
        layout: "per_tensor" (one broadcast per tensor) or "flattened_bucket" (one uint8 broadcast per bucket).
        dtype: dtype the engine holds (sent as such).
        pause_mode: ``/pause_generation`` mode around the update.
    """

    def __init__(self, accelerator, model, urls: list[str], *, master_address: str = "127.0.0.1",
                 master_port: int = 29600, backend: str = "auto", bucket_mb: float = 512, layout: str = "per_tensor",
                 dtype: torch.dtype = torch.bfloat16, api_key: str | None = None, group_name: str = "weight_update_group",
                 pause_mode: str = "abort", max_attempts: int = 2, verify_names: int = 2,
                 timeout_s: float = 600.0) -> None:
        super().__init__(accelerator, model, urls, api_key=api_key, bucket_mb=bucket_mb, dtype=dtype,
                         max_attempts=max_attempts, verify_names=verify_names, timeout_s=timeout_s)
        if layout not in ("per_tensor", "flattened_bucket"):
            raise ValueError(f"weight_sync.layout={layout!r}: use 'per_tensor' or 'flattened_bucket'.")
        self.layout, self.group_name, self.pause_mode = layout, group_name, pause_mode
        self.backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        self.group = None
        if self.is_sender:
            self.group = self._init_group(master_address, master_port, timeout_s)

    def _init_group(self, address: str, port: int, timeout_s: float):
        for client in self.clients:  # a group left by an earlier trainer (e.g. before a resume) would block ours
            try:
                client.post("/destroy_weights_update_group", {"group_name": self.group_name})
            except ServerError:
                pass
        gpus = [int(c.get("/get_server_info").get("tp_size", 1)) for c in self.clients]
        world = 1 + sum(gpus)
        offsets = [1 + sum(gpus[:i]) for i in range(len(gpus))]
        with concurrent.futures.ThreadPoolExecutor(len(self.clients) + 1) as pool:
            mine = pool.submit(init_weight_update_group, self.backend, address, port, 0, world, self.group_name, timeout_s)
            replies = [pool.submit(c.post, "/init_weights_update_group", {
                "master_address": address, "master_port": port, "rank_offset": off, "world_size": world,
                "group_name": self.group_name, "backend": self.backend}) for c, off in zip(self.clients, offsets)]
            for client, reply in zip(self.clients, replies):
                answer = reply.result()
                if not answer.get("success"):
                    raise WeightSyncError(f"{client.url}: init_weights_update_group failed: {answer.get('message')}")
            return mine.result()

    def _push(self, version: str) -> None:
        if self.is_sender:
            self._each("/pause_generation", {"mode": self.pause_mode})
        error = None
        last = len(self.gather.buckets) - 1
        for index, (bucket, tensors) in enumerate(self.gather):  # every rank walks every bucket: it is collective
            if self.is_sender and error is None:
                try:
                    self._send_bucket(bucket, tensors, version if index == last else None, index == last)
                except (ServerError, WeightSyncError) as exc:
                    error = exc  # keep gathering with the other ranks, send nothing more
        if error is not None:
            raise error
        if self.is_sender:
            self._each("/continue_generation", {})

    def _send_bucket(self, bucket, tensors: list[torch.Tensor], version: str | None, last: bool) -> None:
        for t, shape in zip(tensors, bucket.shapes):  # never send what was not announced
            if tuple(t.shape) != tuple(shape) or t.dtype != self.dtype:
                raise WeightSyncError(f"tensor {tuple(t.shape)}/{t.dtype} does not match announced {shape}/{self.dtype}")
        body = {"names": bucket.names, "dtypes": [dtype_name(self.dtype)] * len(bucket.names),
                "shapes": [list(s) for s in bucket.shapes], "group_name": self.group_name,
                "flush_cache": last, "abort_all_requests": False, "weight_version": version,
                "load_format": "flattened_bucket" if self.layout == "flattened_bucket" else None}
        device = "cuda" if self.backend == "nccl" else "cpu"
        with concurrent.futures.ThreadPoolExecutor(len(self.clients)) as pool:
            replies = [pool.submit(c.post, "/update_weights_from_distributed", body) for c in self.clients]
            if self.layout == "flattened_bucket":  # one uint8 buffer: the tensors' bytes concatenated in order
                broadcast(self.group, torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]).to(device))
            else:
                for t in tensors:
                    broadcast(self.group, t.to(device))
            for client, reply in zip(self.clients, replies):
                answer = reply.result()
                if not answer.get("success"):
                    raise WeightSyncError(f"{client.url}: update_weights_from_distributed failed: {answer.get('message')}")


class DiskWeightSender(_Sender):
    """``/update_weights_from_disk``: rank 0 writes a Hugging Face folder (config + safetensors, one file per
    bucket) under ``path`` (which the servers must be able to read), then posts its location."""

    def __init__(self, accelerator, model, urls: list[str], path: str | Path, *, bucket_mb: float = 512,
                 dtype: torch.dtype = torch.bfloat16, api_key: str | None = None, keep: int = 2,
                 max_attempts: int = 2, verify_names: int = 2, timeout_s: float = 600.0) -> None:
        super().__init__(accelerator, model, urls, api_key=api_key, bucket_mb=bucket_mb, dtype=dtype,
                         max_attempts=max_attempts, verify_names=verify_names, timeout_s=timeout_s)
        self.path, self.keep = Path(path), keep

    def _push(self, version: str) -> None:
        from safetensors.torch import save_file

        folder = self.path / f"version_{int(version):06d}"
        if self.is_sender:
            folder.mkdir(parents=True, exist_ok=True)
            self.model.config.save_pretrained(folder)
        index = {}
        for i, (bucket, tensors) in enumerate(self.gather):
            if self.is_sender:
                file = f"model-{i:05d}.safetensors"
                save_file({n: t.cpu() for n, t in zip(bucket.names, tensors)}, str(folder / file))
                index.update({n: file for n in bucket.names})
        if not self.is_sender:
            return
        (folder / "model.safetensors.index.json").write_text(
            json.dumps({"metadata": {}, "weight_map": index}))
        self._each("/pause_generation", {"mode": "abort"})
        for client, answer in zip(self.clients, self._each("/update_weights_from_disk", {
                "model_path": str(folder), "weight_version": version, "flush_cache": True})):
            if not answer.get("success"):
                raise WeightSyncError(f"{client.url}: update_weights_from_disk failed: {answer.get('message')}")
        self._each("/continue_generation", {})
        for old in sorted(self.path.glob("version_*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


class TensorWeightSender(_Sender):
    """``/update_weights_from_tensor``: CUDA IPC handles to servers on the same node. Needs ``sglang``
    importable on the trainer side (its allow-list unpickler accepts only SGLang's own classes) and a GPU."""

    def __init__(self, accelerator, model, urls: list[str], **kwargs) -> None:
        try:
            from sglang.srt.utils import MultiprocessingSerializer  # noqa: F401
        except ImportError as exc:
            raise ImportError("weight_sync.method=tensor needs sglang on the trainer side: pip install "
                              "'grpo_accel[sglang]' (GPU machines), or use method=distributed or disk.") from exc
        if not torch.cuda.is_available():
            raise RuntimeError("weight_sync.method=tensor passes CUDA IPC handles and needs a GPU on the same node.")
        super().__init__(accelerator, model, urls, **kwargs)

    def _push(self, version: str) -> None:
        import base64

        from sglang.srt.utils import MultiprocessingSerializer

        last = len(self.gather.buckets) - 1
        for index, (bucket, tensors) in enumerate(self.gather):
            if not self.is_sender:
                continue
            payload = MultiprocessingSerializer.serialize(list(zip(bucket.names, [t.cuda() for t in tensors])))
            body = {"serialized_named_tensors": [base64.b64encode(payload).decode()],
                    "flush_cache": index == last, "weight_version": version if index == last else None}
            for client, answer in zip(self.clients, self._each("/update_weights_from_tensor", body)):
                if not answer.get("success"):
                    raise WeightSyncError(f"{client.url}: update_weights_from_tensor failed: {answer.get('message')}")
