"""``/update_weights_from_disk``: rank 0 writes the weights as a Hugging Face folder the servers can read, then
posts its location; served at any ``--dp-size``."""
from __future__ import annotations

import json
import shutil
from pathlib import Path
from typing import Mapping

import torch

from grpo_accel.sglang import api
from grpo_accel.sglang.sender import SGLangSender
from grpo_accel.sglang.servers import SGLangServers, SGLangTransport
from grpo_accel.weight_sync.gather import Bucket
from grpo_accel.weight_sync.push import WeightSyncError


class DiskTransport(SGLangTransport):
    """A Hugging Face folder (config + safetensors, one file per bucket) per version under ``path``, the newest
    ``keep`` kept; its location posted once written."""

    method = "disk"

    def __init__(self, servers: SGLangServers, config, path: str | Path, keep: int) -> None:
        super().__init__(servers)
        self.config, self.path, self.keep = config, Path(path), keep
        self._index: dict[str, str] = {}  # parameter name -> file, for the update being written

    def _folder(self, version: int) -> Path:
        return self.path / f"version_{version:06d}"

    def open(self) -> None:
        """Nothing to pause while the files are written: the servers pause around the load alone (``finish``)."""

    def send(self, index: int, bucket: Bucket, tensors: list[torch.Tensor], version: int, last: bool) -> None:
        from safetensors.torch import save_file

        folder = self._folder(version)
        if index == 0:
            self._index = {}
            folder.mkdir(parents=True, exist_ok=True)
            self.config.save_pretrained(folder)
        file = f"model-{index:05d}.safetensors"
        save_file({n: t.cpu() for n, t in zip(bucket.names, tensors)}, str(folder / file))
        self._index.update({n: file for n in bucket.names})

    def finish(self, version: int) -> None:
        folder = self._folder(version)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": self._index}))
        self.servers.pause()
        answers = self.servers.each(*api.update_weights_from_disk(str(folder), version))
        for client, answer in zip(self.servers.clients, answers):
            if not answer.get("success"):
                raise WeightSyncError(f"{client.url}: update_weights_from_disk failed: {answer.get('message')}")
        super().finish(version)
        for old in sorted(self.path.glob("version_*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)


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
