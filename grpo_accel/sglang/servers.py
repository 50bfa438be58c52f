"""SGLang's servers as a weight push sees them (:class:`SGLangServers`), and what every SGLang transport shares
(:class:`SGLangTransport`: the update session). The push itself is :mod:`grpo_accel.weight_sync.push`'s; one
transport per file: ``from_distributed.py`` (``/update_weights_from_distributed``: NCCL, or gloo without a GPU),
``from_disk.py`` (safetensors and ``/update_weights_from_disk``) and ``from_tensor.py`` (CUDA IPC handles to
servers on the same node); ``sender.py`` puts the three senders together.

The servers are paused (``/pause_generation``) and, from SGLang 0.5.21, an update session is open while the
weights load. Pausing: ``retract`` (the default) keeps every in-flight request on the server with its tokens and
logprobs and lets it finish under the new weights, and the cache flush that ends an update succeeds (the
scheduler is paused and its running batch empty: ``Scheduler.pause_generation``, then the flush's idle test, 0.5.9
``_is_no_request`` and 0.5.23 ``is_fully_idle(ignore_waiting=<paused>)``, srt/managers/scheduler.py); ``abort``
returns them cut short, the waiting ones with nothing, and the engine continues or resends them
(:mod:`grpo_accel.sglang.engine`), which costs a request per push and the prefill of each again, and SGLang answers
the pause only once none is in flight (it looks every second); ``in_place`` is not offered, its requests stay in
the running batch and the flush fails.

Colocated servers (``release_memory``): paused with ``retract`` (the server idle, as the release asserts), then
their KV cache, weights and CUDA graphs are freed; the next push takes back the weights and CUDA graphs, loads the
weights, takes back the KV cache, and only then lets them generate (SGLang's own order). What each server has
released is recorded for a restarted trainer (:mod:`grpo_accel.sglang.memory`). Servers found at start abort what
they still run for a trainer before this one, so that nothing keeps them busy, and what that trainer left paused
or released is brought back (``stale``: the trainer pushes before its first collection).

After a push each server is checked with ``/get_weights_by_name`` of the smallest trained weights where the served
model implements it, else with the logprobs of a fixed probe sequence and the weight version it reports.
"""
from __future__ import annotations

import logging
from pathlib import Path
from typing import Mapping

import torch

from grpo_accel.http import HTTPClient, ServerError
from grpo_accel.rules import check_choice, setting
from grpo_accel.sglang import api
from grpo_accel.sglang.memory import ServerMemory
from grpo_accel.weight_sync.push import PROBE_TOKENS, PROBE_TOLERANCE, EngineServers, Transport, WeightSyncError, \
    dtype_name

logger = logging.getLogger(__name__)


class SGLangServers(EngineServers):
    """Rank 0's HTTP clients and facts of each server (other ranks hold none), checked at start for the update
    ``method`` (as SGLang's dp rule names it: :meth:`grpo_accel.sglang.api.ServerInfo.check_weight_updates`)."""

    def __init__(self, accelerator, urls: list[str], method: str, *, api_key: str | None, admin_api_key: str | None,
                 timeout_s: float, pause_mode: str = "retract", memory_record: str | Path | None = None,
                 names: Mapping[str, str] | None = None) -> None:
        check_choice(setting(names, "pause_mode"), pause_mode, api.PAUSE_MODES)
        self.pause_mode, self.names = pause_mode, names
        urls = urls if accelerator.is_main_process else []
        # SGLang's auth levels (srt/utils/auth.py): weight and pause endpoints take the admin key when the server
        # has one, else its --api-key; /generate and /server_info take the --api-key.
        key = (f"{setting(names, 'admin_api_key')} (or {setting(names, 'api_key')} when the server has no "
               "--admin-api-key)")
        self.clients = [HTTPClient(u, admin_api_key or api_key, timeout_s, retries=0, key_setting=key) for u in urls]
        self.readers = [HTTPClient(u, api_key, timeout_s, retries=0) for u in urls]
        self.infos = [api.read_server_info(c) for c in self.readers]
        for info in self.infos:
            info.check_supported()
            info.check_weight_updates(method)
        self.each(*api.abort_all_requests())  # a trainer before this one may have left requests running
        self.memory = ServerMemory(self.clients, self.infos, memory_record)
        self.stale = self._bring_back()
        self._by_name: list[bool] = []  # per server: /get_weights_by_name works (asked at the first check)

    def _bring_back(self) -> bool:
        """Servers a trainer before this one left paused (killed between a pause and its continue) generate again:
        those known to hold all their memory (no ``--enable-memory-saver``, or the record of this start of the
        server says nothing is released) are continued now (harmless on one that runs). Those the record says have
        memory released stay paused until the first push takes it back in SGLang's order and then continues them:
        whether any does is returned (the trainer pushes before it collects). A memory saver the record does not
        name is left alone: continued with memory released, SGLang's health check would fail (0.5.9) or run on
        freed memory (0.5.23); the engine's health wait says so if it is paused."""
        for client, info in zip(self.clients, self.infos):
            if self.memory.holds_all(client.url) and (not info.memory_saver or client.url in self.memory.known):
                client.post(*api.continue_generation())
        return not all(self.memory.holds_all(client.url) for client in self.clients)

    @staticmethod
    def quietly(client: HTTPClient, path: str, body: dict) -> None:
        try:
            client.post(path, body)
        except ServerError as exc:
            logger.warning("%s%s failed: %s", client.url, path, exc)

    def pause(self) -> None:
        self.each(*api.pause_generation(self.pause_mode))

    def before_update(self) -> None:
        self.memory.resume(("weights", "cuda_graph"))

    def after_update(self) -> None:
        self.memory.resume(("kv_cache",))
        self.each(*api.continue_generation())

    def recover(self) -> None:
        """A server with memory released stays paused: it would generate on freed memory or on weights not
        loaded."""
        for client in self.clients:
            if self.memory.holds_all(client.url):
                self.quietly(client, *api.continue_generation())

    def release(self) -> None:
        """Paused first (``retract``), which leaves them idle, as the release asserts."""
        self.each(*api.pause_generation("retract"))
        self.memory.release(api.MEMORY_TAGS)

    def session_clients(self) -> list[HTTPClient]:
        return [c for c, info in zip(self.clients, self.infos) if info.needs_session]

    def needs_probe(self, first_weight: str) -> bool:
        """Asked once per server; said once where its model does not implement /get_weights_by_name."""
        self._by_name = []
        for client, info in zip(self.clients, self.infos):
            self._by_name.append(api.read_weight_rows(client, info, first_weight, 1) is not None)
            if not self._by_name[-1]:
                logger.warning("%s: the served model does not implement /get_weights_by_name; weights are checked "
                               "with a %d-token logprob probe and the reported weight version instead",
                               client.url, PROBE_TOKENS)
        return not all(self._by_name)

    def compare(self, version: int, expected: dict[str, torch.Tensor], probe: list[int],
                trainer_logprobs: torch.Tensor | None, dtype: torch.dtype) -> None:
        for client, reader, info, by_name in zip(self.clients, self.readers, self.infos, self._by_name):
            if by_name:
                self._compare_by_name(client, info, expected)
            else:
                for rank in range(info.dp_ranks):
                    self._compare_probe(reader, info, rank, version, probe, trainer_logprobs, dtype)

    def _compare_by_name(self, client: HTTPClient, info: api.ServerInfo, expected: dict) -> None:
        for name, value in expected.items():
            rows_asked = 4 if value.dim() >= 2 else value.numel()  # a vector whole, a matrix's first rows
            for rank, rows in enumerate(api.read_weight_rows(client, info, name, rows_asked) or [[]] * info.dp_ranks):
                got = torch.tensor(rows)
                want = value.reshape(-1)[: got.numel()] if value.dim() < 2 else value[: got.shape[0]]
                if got.shape != want.shape or not torch.allclose(got.float(), want.reshape(got.shape), atol=1e-2):
                    raise WeightSyncError(f"{_where(info, rank)}: {name} differs from the trainer's after the update.")

    def _compare_probe(self, client: HTTPClient, info: api.ServerInfo, rank: int, version: int, probe: list[int],
                       trainer: torch.Tensor, dtype: torch.dtype) -> None:
        where = _where(info, rank)
        answer = client.post(*api.prompt_logprobs(probe, rank if info.dp_ranks > 1 else None))
        meta = (answer[0] if isinstance(answer, list) else answer)["meta_info"]
        if api.weight_version(meta.get("weight_version")) != version:
            raise WeightSyncError(f"{where} reports weight version {meta.get('weight_version')!r} after "
                                  f"version {version} was pushed.")
        served = torch.tensor([float(v[0]) for v in meta["input_token_logprobs"][1:]])  # the first has no logprob
        gap = float((served - trainer).abs().mean())
        if gap > PROBE_TOLERANCE[dtype]:
            raise WeightSyncError(f"{where}: probe logprobs differ from the trainer's by {gap:.4f} on average "
                                  f"(allowed {PROBE_TOLERANCE[dtype]} at {dtype_name(dtype)}): the "
                                  "server does not hold the pushed weights.")


def _where(info: api.ServerInfo, rank: int) -> str:
    """A server, and which of its dp ranks where it has several."""
    return f"{info.url} (dp rank {rank})" if info.dp_ranks > 1 else info.url


class SGLangTransport(Transport):
    """What SGLang's transports share: the servers paused while the weights load, inside an update session where
    the route needs one (``/update_weights_from_distributed`` and ``_from_tensor`` from 0.5.21 on)."""

    uses_session = False
    method = "distributed"  # as SGLang's dp rule names it

    def __init__(self, servers: SGLangServers) -> None:
        self.servers = servers

    def open(self) -> None:
        self.servers.pause()
        if self.uses_session:
            for client in self.servers.session_clients():
                try:
                    client.post(*api.begin_weight_update())
                except ServerError as exc:  # e.g. a session left open by a trainer that stopped mid-update
                    logger.warning("%s: begin_weight_update refused (%s); closing the open session and retrying",
                                   client.url, exc)
                    client.post(*api.end_weight_update())
                    client.post(*api.begin_weight_update())

    def finish(self, version: int) -> None:
        """Close the update session (the servers generate again once their memory is back)."""
        if self.uses_session:
            for client in self.servers.session_clients():
                client.post(*api.end_weight_update())

    def recover(self) -> None:
        if self.uses_session:
            for client in self.servers.session_clients():
                self.servers.quietly(client, *api.end_weight_update())
