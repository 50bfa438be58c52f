"""``/update_weights_from_tensor``: CUDA IPC handles to servers on the same node (needs ``sglang`` importable on
the trainer side for its serializer, and a GPU)."""
from __future__ import annotations

import base64
from pathlib import Path
from typing import Mapping

import torch

from grpo_accel.sglang import api
from grpo_accel.sglang.sender import SGLangSender
from grpo_accel.sglang.servers import SGLangTransport
from grpo_accel.weight_sync.gather import Bucket
from grpo_accel.weight_sync.push import WeightSyncError


class TensorTransport(SGLangTransport):
    """Each tensor-parallel rank of a server reads its own entry of ``serialized_named_tensors`` (one serialization
    per rank: another rank's copy would break CUDA IPC reference counting), and the handles name the GPU by UUID
    (SGLang's ``monkey_patch_torch_reductions``), so servers that number the GPUs differently still find it."""

    uses_session = True
    method = "tensor"

    def send(self, index: int, bucket: Bucket, tensors: list[torch.Tensor], version: int, last: bool) -> None:
        from sglang.srt.utils import MultiprocessingSerializer
        from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

        monkey_patch_torch_reductions()
        named = list(zip(bucket.names, [t.cuda() for t in tensors]))
        for client, info in zip(self.servers.clients, self.servers.infos):
            payloads = [base64.b64encode(MultiprocessingSerializer.serialize(named)).decode()
                        for _ in range(info.tp_size)]
            answer = client.post(*api.update_weights_from_tensor(payloads, last, version))
            if not answer.get("success"):
                raise WeightSyncError(f"{client.url}: update_weights_from_tensor failed: {answer.get('message')}")


class TensorWeightSender(SGLangSender):
    """``/update_weights_from_tensor``: CUDA IPC handles to servers on the same node. Needs ``sglang`` importable
    on the trainer side (its allow-list unpickler accepts only SGLang's own classes) and a GPU."""

    def __init__(self, accelerator, model, urls: list[str], *, bucket_mb: float = 512,
                 dtype: torch.dtype = torch.bfloat16, api_key: str | None = None, admin_api_key: str | None = None,
                 max_attempts: int = 2, verify_tensors: int = 2, timeout_s: float = 600.0, pause_mode: str = "retract",
                 memory_record: str | Path | None = None, names: Mapping[str, str] | None = None) -> None:
        try:
            from sglang.srt.utils import MultiprocessingSerializer  # noqa: F401
        except ImportError as exc:
            raise ImportError("TensorWeightSender needs sglang on the trainer side: pip install "
                              "'grpo_accel[sglang]' (GPU machines), or use method=distributed or disk.") from exc
        if not torch.cuda.is_available():
            raise RuntimeError("TensorWeightSender passes CUDA IPC handles and needs a GPU on the same node.")
        super().__init__(accelerator, model, urls, TensorTransport.method, TensorTransport, api_key=api_key,
                         admin_api_key=admin_api_key, bucket_mb=bucket_mb, dtype=dtype, max_attempts=max_attempts,
                         verify_tensors=verify_tensors, timeout_s=timeout_s, pause_mode=pause_mode,
                         memory_record=memory_record, names=names)
