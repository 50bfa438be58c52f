"""SGLang's weight senders put together: its servers (:class:`~grpo_accel.sglang.servers.SGLangServers`) and one
of its transports under the engine-independent push (:class:`~grpo_accel.weight_sync.push.WeightPusher`). The
senders themselves are ``from_distributed.py``, ``from_disk.py`` and ``from_tensor.py``."""
from __future__ import annotations

from pathlib import Path
from typing import Callable, Mapping

import torch

from grpo_accel.sglang import api
from grpo_accel.sglang.servers import SGLangServers, SGLangTransport
from grpo_accel.weight_sync.push import WeightPusher, WeightSyncError

__all__ = ["SGLangSender", "WeightSyncError"]


class SGLangSender(WeightPusher):
    """The servers at ``urls``, checked for the transport's ``method``, then the transport made over them."""

    def __init__(self, accelerator, model, urls: list[str], method: str,
                 transport: Callable[[SGLangServers], SGLangTransport], *, api_key: str | None,
                 admin_api_key: str | None, bucket_mb: float, dtype: torch.dtype, max_attempts: int,
                 verify_tensors: int, timeout_s: float, pause_mode: str = "retract",
                 memory_record: str | Path | None = None, names: Mapping[str, str] | None = None) -> None:
        servers = SGLangServers(accelerator, urls, method, api_key=api_key, admin_api_key=admin_api_key,
                                timeout_s=timeout_s, pause_mode=pause_mode, memory_record=memory_record, names=names)
        super().__init__(accelerator, model, servers, transport(servers), bucket_mb=bucket_mb, dtype=dtype,
                         max_attempts=max_attempts, verify_tensors=verify_tensors)

    @property
    def servers(self) -> list[api.ServerInfo]:
        """What each server said of itself at start (rank 0's; empty elsewhere)."""
        return self.engine.infos
