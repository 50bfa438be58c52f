"""``/update_weights_from_distributed``: the trainer's rank 0 broadcasts every bucket to the servers over a process
group they join (NCCL between GPUs, gloo where there is none); every training rank calls ``push``.

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
sides and made again under a new name before anything else is sent.
"""
from __future__ import annotations

import concurrent.futures
import logging
import threading
import time
from pathlib import Path
from typing import Mapping

import torch
import torch.distributed as dist

from grpo_accel.http import ServerError
from grpo_accel.rules import check_choice, setting
from grpo_accel.sglang import api
from grpo_accel.sglang.group import WeightUpdateGroup, address_towards
from grpo_accel.sglang.sender import SGLangSender
from grpo_accel.sglang.servers import SGLangServers, SGLangTransport
from grpo_accel.weight_sync.gather import Bucket
from grpo_accel.weight_sync.push import WeightSyncError, dtype_name

logger = logging.getLogger(__name__)


class DistributedTransport(SGLangTransport):
    """Rank 0 hosts a process group the servers join (``sending``: this is rank 0) and broadcasts each bucket
    over it while the servers' ``/update_weights_from_distributed`` requests wait for it."""

    uses_session = True

    def __init__(self, servers: SGLangServers, sending: bool, *, master_address: str | None, master_port: int | None,
                 backend: str, load_format: str, dtype: torch.dtype, group_name: str, timeout_s: float) -> None:
        super().__init__(servers)
        self.load_format, self.timeout_s, self.dtype = load_format, timeout_s, dtype
        self.backend = ("nccl" if torch.cuda.is_available() else "gloo") if backend == "auto" else backend
        self.group: WeightUpdateGroup | None = None
        if sending:
            gpus = [info.tp_size for info in servers.infos]
            self.offsets = [1 + sum(gpus[:i]) for i in range(len(gpus))]  # engine i: 1 + GPUs of engines before it
            url, names = servers.clients[0].url, servers.names
            address = master_address or address_towards(url)
            try:
                self.group = WeightUpdateGroup(self.backend, address, master_port, 1 + sum(gpus), group_name,
                                               timeout_s)
            except dist.DistNetworkError as exc:  # the port is taken (another trainer's group?), or not this host's
                raise WeightSyncError(
                    f"{setting(names, 'master_port')}={master_port}: the weight-update group's store cannot listen "
                    f"on {address}:{master_port} ({str(exc).rsplit('message: ', 1)[-1]}); choose another port, or "
                    f"null for a free one.") from None
            logger.info("weight-update group at %s:%d (%s; %s)", address, self.group.port,
                        setting(names, "master_address") if master_address else
                        f"this trainer's address on the route to {url}: set {setting(names, 'master_address')} to "
                        "choose another", setting(names, "master_port") if master_port else
                        f"a free port: {setting(names, 'master_port')} is null")
            self._join()

    def close(self) -> None:
        if self.group is None or self.group.name is None:
            return
        for client in self.servers.clients:
            self.servers.quietly(client, *api.destroy_weights_update_group(self.group.name))
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
        pool = concurrent.futures.ThreadPoolExecutor(len(self.servers.clients))
        replies = [pool.submit(c.post, *api.init_weights_update_group(group.address, group.port, offset,
                                                                       group.world_size, name, self.backend))
                   for c, offset in zip(self.servers.clients, self.offsets)]
        problems = []
        for client, reply in zip(self.servers.clients, replies):
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
                              for c, o, i in zip(self.servers.clients, self.offsets, self.servers.infos))
            names = self.servers.names
            waited = time.monotonic() - deadline + self.timeout_s  # a refused connection fails at once
            when = (f"did not form within {self.timeout_s:.0f} s" if waited >= self.timeout_s else
                    f"could not form ({waited:.1f} s)")
            raise WeightSyncError(
                f"the weight-update group {name!r} {when}: {'; '.join(problems)}. "
                f"The trainer is rank 0 of {group.world_size} and hosts the {group.store_keys(name)}; the servers "
                f"join it ({ranks}) by connecting to {setting(names, 'master_address')}:"
                f"{setting(names, 'master_port')}. Check that every server reaches that address and port, or "
                f"raise {setting(names, 'timeout_s')}.")

    def send(self, index: int, bucket: Bucket, tensors: list[torch.Tensor], version: int, last: bool) -> None:
        if self.group.group is None:
            raise WeightSyncError("no weight-update group: it could not be made again after the last failure.")
        for t, shape in zip(tensors, bucket.shapes):  # never send what was not announced
            if tuple(t.shape) != tuple(shape) or t.dtype != self.dtype:
                raise WeightSyncError(f"tensor {tuple(t.shape)}/{t.dtype} does not match announced {shape}/{self.dtype}")
        request = api.update_weights_from_distributed(
            bucket.names, [dtype_name(self.dtype)] * len(bucket.names), [list(s) for s in bucket.shapes],
            self.group.name, self.load_format == "flattened_bucket", last, version)
        device = "cuda" if self.backend == "nccl" else "cpu"
        if self.load_format == "flattened_bucket":  # one uint8 buffer: the tensors' bytes concatenated in order
            payload = [torch.cat([t.reshape(-1).view(torch.uint8) for t in tensors]).to(device)]
        else:
            payload = [t.to(device) for t in tensors]
        with concurrent.futures.ThreadPoolExecutor(len(self.servers.clients)) as pool:
            replies = [pool.submit(c.post, *request) for c in self.servers.clients]  # answered once received (or refused)
            works = [self.group.broadcast(t) for t in payload]
            refused = []
            for client, reply in zip(self.servers.clients, replies):
                try:
                    answer = reply.result()
                    if not answer.get("success"):
                        refused.append(f"{client.url}: {answer.get('message')}")
                except ServerError as exc:
                    refused.append(str(exc))
        if refused:  # broadcasts a server never joined may still be pending: recover makes a new group
            raise WeightSyncError(f"update_weights_from_distributed failed: {'; '.join(refused)}")
        for work in works:
            work.wait()

    def recover(self) -> None:
        """A new group before anything else is sent: the old one may hold a broadcast a server never joined."""
        if self.group.name is not None:
            for client in self.servers.clients:  # first: a server closing its side ends a broadcast pending on ours
                self.servers.quietly(client, *api.destroy_weights_update_group(self.group.name))
            self.group.leave(abort=True)
        try:
            self._join()
        except WeightSyncError as exc:
            logger.error("%s", exc)
        super().recover()


class DistributedWeightSender(SGLangSender):
    """SGLang's ``/update_weights_from_distributed`` path (NCCL between GPUs, gloo where there is none).

    Args:
        accelerator: the training Accelerator; every rank calls ``update_weights``.
        model: the unwrapped policy (Hugging Face parameter names).
        urls: one SGLang server per engine replica.
        master_address / master_port: where rank 0 hosts the weight-update group (reachable by the servers);
            None: rank 0's address on the route to the first server, a free port (both said at start).
        backend: "nccl", "gloo", or "auto" (nccl with CUDA).
        bucket_mb: bytes per bucket; bounds the extra memory of the gather on every rank.
        load_format: "per_tensor" (one broadcast per tensor) or "flattened_bucket" (one uint8 broadcast per bucket).
        dtype: dtype the engine holds (sent as such).
        api_key / admin_api_key: the servers' ``--api-key`` and ``--admin-api-key`` (weight endpoints take the
            admin key when a server has one).
        group_name: start of the weight-update group's name (a fresh suffix per group).
        pause_mode: how the servers pause around a push: "retract" (in-flight requests keep their tokens and go
            on under the new weights) or "abort" (they come back cut short; the engine continues them).
        memory_record: colocated servers only: the file that records what each server has released of its
            memory, for a trainer restarted on the same run (:mod:`grpo_accel.sglang.memory`; None: this
            process alone knows).

    Example:
        >>> sender = DistributedWeightSender(accelerator, model, ["http://10.0.0.2:30000"],
        ...                                  master_address="10.0.0.1", backend="nccl")
        >>> sender.update_weights()  # on every training rank
    """

    def __init__(self, accelerator, model, urls: list[str], *, master_address: str | None = None,
                 master_port: int | None = None, backend: str = "auto", bucket_mb: float = 512,
                 load_format: str = "per_tensor",
                 dtype: torch.dtype = torch.bfloat16, api_key: str | None = None, admin_api_key: str | None = None,
                 group_name: str = api.DEFAULT_GROUP, max_attempts: int = 2, verify_tensors: int = 2,
                 timeout_s: float = 600.0, pause_mode: str = "retract", memory_record: str | Path | None = None,
                 names: Mapping[str, str] | None = None) -> None:
        check_choice(setting(names, "load_format"), load_format, api.LOAD_FORMATS, owner="DistributedWeightSender: ")
        transport = lambda servers: DistributedTransport(  # noqa: E731
            servers, accelerator.is_main_process, master_address=master_address, master_port=master_port,
            backend=backend, load_format=load_format, dtype=dtype, group_name=group_name, timeout_s=timeout_s)
        super().__init__(accelerator, model, urls, DistributedTransport.method, transport, api_key=api_key,
                         admin_api_key=admin_api_key, bucket_mb=bucket_mb, dtype=dtype, max_attempts=max_attempts,
                         verify_tensors=verify_tensors, timeout_s=timeout_s, pause_mode=pause_mode,
                         memory_record=memory_record, names=names)
