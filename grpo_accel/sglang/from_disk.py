"""``/update_weights_from_disk``: rank 0 writes the weights as a Hugging Face folder the servers can read, then
posts its location; served at any ``--dp-size``."""
from __future__ import annotations

from pathlib import Path
from typing import Mapping

import torch

from grpo_accel.sglang import api
from grpo_accel.sglang.sender import SGLangSender
from grpo_accel.sglang.servers import SGLangServers, SGLangTransport
from grpo_accel.weight_sync.folders import WeightFolders
from grpo_accel.weight_sync.gather import Bucket
from grpo_accel.weight_sync.push import WeightSyncError


class DiskTransport(SGLangTransport):
    """A Hugging Face folder per version under ``path`` (:class:`~grpo_accel.weight_sync.folders.WeightFolders`),
    the newest ``keep`` kept; its location posted once written."""

    method = "disk"

    def __init__(self, servers: SGLangServers, config, path: str | Path, keep: int) -> None:
        super().__init__(servers)
        self.folders = WeightFolders(config, path, keep)

    def open(self) -> None:
        """Nothing to pause while the files are written: the servers pause around the load alone (``finish``)."""

    def send(self, index: int, bucket: Bucket, tensors: list[torch.Tensor], version: int, last: bool) -> None:
        self.folders.write(index, bucket, tensors, version)

    def finish(self, version: int) -> None:
        folder = self.folders.complete(version)
        self.servers.pause()
        answers = self.servers.each(*api.update_weights_from_disk(str(folder), version))
        for client, answer in zip(self.servers.clients, answers):
            if not answer.get("success"):
                raise WeightSyncError(f"{client.url}: update_weights_from_disk failed: {answer.get('message')}")
        super().finish(version)
        self.folders.rotate()


class DiskWeightSender(SGLangSender):
    """``/update_weights_from_disk``: rank 0 writes a Hugging Face folder (config + safetensors, one file per
    bucket) under ``path`` (which the servers must be able to read), then posts its location. Served at any
    ``--dp-size``."""

    def __init__(self, accelerator, model, urls: list[str], path: str | Path, *, bucket_mb: float = 512,
                 dtype: torch.dtype = torch.bfloat16, api_key: str | None = None, admin_api_key: str | None = None,
                 keep: int = 2, max_attempts: int = 2, verify_tensors: int = 2, timeout_s: float = 600.0,
                 pause_mode: str = "retract", memory_record: str | Path | None = None,
                 names: Mapping[str, str] | None = None) -> None:
        super().__init__(accelerator, model, urls, DiskTransport.method,
                         lambda servers: DiskTransport(servers, model.config, path, keep), api_key=api_key,
                         admin_api_key=admin_api_key, bucket_mb=bucket_mb, dtype=dtype, max_attempts=max_attempts,
                         verify_tensors=verify_tensors, timeout_s=timeout_s, pause_mode=pause_mode,
                         memory_record=memory_record, names=names)
