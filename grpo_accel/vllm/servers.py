"""vLLM's servers as a weight push sees them (:class:`VLLMServers`) and its transport from disk
(:class:`DiskTransport`), under the engine-independent push of :mod:`grpo_accel.weight_sync.push`
(:class:`VLLMDiskSender` puts them together).

A push writes a Hugging Face folder (the servers need not pause while it is written), pauses the servers
(``/pause``, mode ``keep`` or ``abort``: :data:`grpo_accel.vllm.api.PAUSE_MODES`), has each load it in place
(``/collective_rpc reload_weights``), records the version (``/update_weight_version``) and resumes them. vLLM has no
route that shows a weight by name, so each push is checked with the logprobs of a fixed probe sequence
(``prompt_logprobs``) against the trainer's, and the version ``/weight_info`` reports.

Colocated servers (``release_memory``, a server started with ``--enable-sleep-mode``) sleep at level 1 while the
trainer optimises (``/sleep``: the KV cache freed, the weights moved to host memory) and wake before the weights
load. Servers found at start abort what they still run for a trainer before this one and are resumed (a trainer
killed mid-push leaves them paused); one found asleep is woken by the first push.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import torch

from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.rules import check_choice, setting
from grpo_accel.vllm import api
from grpo_accel.weight_sync.folders import WeightFolders
from grpo_accel.weight_sync.gather import Bucket
from grpo_accel.weight_sync.push import PROBE_TOLERANCE, EngineServers, Transport, WeightPusher, WeightSyncError, \
    dtype_name

logger = logging.getLogger(__name__)


class VLLMServers(EngineServers):
    """Rank 0's HTTP clients and facts of each server (other ranks hold none)."""

    def __init__(self, accelerator, urls: list[str], *, api_key: str | None, timeout_s: float,
                 pause_mode: str = "retract", names: Mapping[str, str] | None = None) -> None:
        check_choice(setting(names, "pause_mode"), pause_mode, tuple(api.PAUSE_MODES))
        self.pause_mode = api.PAUSE_MODES[pause_mode]
        urls = urls if accelerator.is_main_process else []
        self.clients = [HTTPClient(u, api_key, timeout_s, retries=0, key_setting=setting(names, "api_key"))
                        for u in urls]
        self.infos = [api.read_server_info(c) for c in self.clients]
        self.each(*api.abort_requests([]))  # a trainer before this one may have left requests running
        self.asleep = [bool(c.get("/is_sleeping").get("is_sleeping")) for c in self.clients]
        self.stale = any(self.asleep)  # woken by the first push, which then loads weights into them
        self.each(*api.resume())  # a trainer killed mid-push leaves them paused

    def pause(self) -> None:
        self.each(*api.pause(self.pause_mode))

    def before_update(self) -> None:
        for i, client in enumerate(self.clients):
            if self.asleep[i]:
                client.post(*api.wake_up())
                self.asleep[i] = False

    def after_update(self) -> None:
        self.each(*api.resume())

    def recover(self) -> None:
        for client in self.clients:
            try:
                client.post(*api.resume())
            except ServerError as exc:
                logger.warning("%s/resume failed: %s", client.url, exc)

    def release(self) -> None:
        """Level-1 sleep: in-flight requests kept (there are none between batches), the KV cache freed."""
        self.each(*api.sleep(1))
        self.asleep = [True] * len(self.clients)

    def needs_probe(self, first_weight: str) -> bool:
        return True

    def compare(self, version: int, expected: dict[str, torch.Tensor], probe: list[int],
                trainer_logprobs: torch.Tensor | None, dtype: torch.dtype) -> None:
        for client in self.clients:
            served_version = api.read_weight_version(client)
            if served_version != version:
                raise WeightSyncError(f"{client.url} reports weight version {served_version} after version "
                                      f"{version} was pushed.")
            choice = client.post(*api.prompt_logprobs(probe))["choices"][0]
            served = torch.tensor([next(iter(p.values()))["logprob"] for p in choice["prompt_logprobs"][1:]])
            gap = float((served - trainer_logprobs).abs().mean())
            if gap > PROBE_TOLERANCE[dtype]:
                raise WeightSyncError(f"{client.url}: probe logprobs differ from the trainer's by {gap:.4f} on "
                                      f"average (allowed {PROBE_TOLERANCE[dtype]} at {dtype_name(dtype)}): the "
                                      "server does not hold the pushed weights.")


class DiskTransport(Transport):
    """A Hugging Face folder per version under ``path``, the newest ``keep`` kept, loaded in place by every
    server (``reload_weights``) while they are paused."""

    def __init__(self, servers: VLLMServers, config, path: str | Path, keep: int) -> None:
        self.servers, self.folders = servers, WeightFolders(config, path, keep)

    def send(self, index: int, bucket: Bucket, tensors: list[torch.Tensor], version: int, last: bool) -> None:
        self.folders.write(index, bucket, tensors, version)

    def finish(self, version: int) -> None:
        folder = self.folders.complete(version)
        self.servers.pause()
        self.servers.each(*api.reload_weights(str(folder.resolve())))
        self.servers.each(*api.update_weight_version(version))
        self.folders.rotate()


class VLLMDiskSender(WeightPusher):
    """Pushes to vLLM servers from disk: rank 0 writes a Hugging Face folder under ``path`` (which the servers must
    be able to read), then every server loads it in place. Works on any device and any server topology.

    Args:
        accelerator, model: the trainer's (rank 0 sends).
        urls: the servers.
        path: where the folders are written.
        bucket_mb, dtype, max_attempts, verify_tensors: as :class:`~grpo_accel.weight_sync.push.WeightPusher`'s.
        api_key: the servers' ``--api-key``.
        keep: folders kept (the newest).
        timeout_s: seconds each request to a server may take.
        pause_mode: retract (in-flight requests freeze and go on with the new weights) or abort.
        names: what messages call the settings they name.
    """

    def __init__(self, accelerator, model, urls: list[str], path: str | Path, *, bucket_mb: float = 512,
                 dtype: torch.dtype = torch.bfloat16, api_key: str | None = None, keep: int = 2, max_attempts: int = 2,
                 verify_tensors: int = 2, timeout_s: float = 600.0, pause_mode: str = "retract",
                 names: Mapping[str, str] | None = None) -> None:
        servers = VLLMServers(accelerator, urls, api_key=api_key, timeout_s=timeout_s, pause_mode=pause_mode,
                              names=names)
        super().__init__(accelerator, model, servers, DiskTransport(servers, model.config, path, keep),
                         bucket_mb=bucket_mb, dtype=dtype, max_attempts=max_attempts, verify_tensors=verify_tensors)
