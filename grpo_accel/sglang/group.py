"""Rank 0's side of the process group shared with inference engines, separate from the training group.

SGLang's servers join with ``init_custom_process_group`` (srt/utils/common.py, 0.5.9 through 0.5.23):
``rendezvous("tcp://address:port")`` as a client of the trainer's TCP store, then the store wrapped in
``PrefixStore(group_name, store)``, then ``_new_process_group_helper(..., group_name=group_name)``. The trainer
hosts the store and makes its side the same way, so both sides read and write the same keys
(``<group_name>/...``); without the prefix they wait on different keys until they time out (gloo) or the first
broadcast hangs (NCCL, whose communicator is made lazily).

The store is hosted once per trainer process; each group made on it gets a fresh name (:meth:`new_name`), so a
group torn down after a failure never shares keys with the one that replaces it, and a restarted trainer never
meets the name of a group its predecessor left on a server.

Where it listens: by default the trainer's own address on the route to the first server
(:func:`address_towards`), the one address of this machine that server is sure to reach; a gloo group binds the
interface that holds it (gloo would otherwise bind what the hostname resolves to, or the loopback device, which
a server on another machine cannot reach), unless ``GLOO_SOCKET_IFNAME`` says otherwise.
"""
from __future__ import annotations

import contextlib
import fcntl
import os
import socket
import struct
import uuid
from datetime import timedelta
from urllib.parse import urlsplit

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


class WeightUpdateGroup:
    """The trainer's TCP store and its side (rank 0) of the current weight-update group.

    Args:
        backend: "nccl" (GPUs) or "gloo".
        address / port: where the store listens; the servers connect to ``address:port`` (port None: a free
            one, read back as ``self.port``).
        world_size: 1 + the GPUs of every server.
        prefix: the start of every group name (SGLang's default is "weight_update_group").
        timeout_s: how long a join or a collective may take.
    """

    def __init__(self, backend: str, address: str, port: int | None, world_size: int, prefix: str,
                 timeout_s: float) -> None:
        if backend not in ("nccl", "gloo"):
            raise ValueError(f"WeightUpdateGroup: backend={backend!r}: use 'nccl' (GPUs) or 'gloo' (CPU).")
        self.backend, self.address, self.world_size = backend, address, world_size
        self.timeout = timedelta(seconds=timeout_s)
        # The store is not built through rendezvous("tcp://..."): under torchrun (TORCHELASTIC_USE_AGENT_STORE)
        # that would join the launcher's store instead of hosting one.
        self.store = dist.TCPStore(address, port or 0, is_master=True, timeout=self.timeout, wait_for_workers=False)
        self.port = self.store.port
        self._prefix, self._token, self._made = prefix, uuid.uuid4().hex[:8], 0
        self.group: dist.ProcessGroup | None = None
        self.name: str | None = None

    def new_name(self) -> str:
        """A name no earlier group of any trainer used: ``<prefix>-<process token>-<n>``."""
        self._made += 1
        return f"{self._prefix}-{self._token}-{self._made}"

    def join(self, name: str) -> None:
        """Make the group ``name`` as rank 0; blocks until every rank joined (gloo) or returns at once (NCCL)."""
        with self._bound():
            group, _ = c10d._new_process_group_helper(self.world_size, 0, [], self.backend,
                                                      c10d.PrefixStore(name, self.store), group_name=name,
                                                      timeout=self.timeout)
        c10d._world.pg_group_ranks[group] = {i: i for i in range(self.world_size)}  # as SGLang registers its side
        self.group, self.name = group, name

    @contextlib.contextmanager
    def _bound(self):
        """gloo: the group's device on the interface that holds ``address`` (``GLOO_SOCKET_IFNAME`` is read when
        the group is made; the training group, made earlier, keeps its own)."""
        interface = interface_of(self.address) if self.backend == "gloo" else None
        if interface is None or "GLOO_SOCKET_IFNAME" in os.environ:
            yield
            return
        os.environ["GLOO_SOCKET_IFNAME"] = interface
        try:
            yield
        finally:
            del os.environ["GLOO_SOCKET_IFNAME"]

    def store_keys(self, name: str) -> str:
        """Where the ranks of group ``name`` meet, for error messages."""
        return f"TCP store {self.address}:{self.port}, keys under '{name}/'"

    def broadcast(self, tensor: torch.Tensor) -> dist.Work:
        """Start broadcasting ``tensor`` from rank 0; the caller waits on the returned work."""
        opts = dist.BroadcastOptions()
        opts.rootRank, opts.rootTensor, opts.timeout = 0, 0, self.timeout
        return self.group.broadcast([tensor], opts)

    def leave(self, abort: bool) -> None:
        """Forget the current group; ``abort`` first when a collective may be pending (a refused update), so
        nothing waits on a peer that will never answer."""
        if self.group is None:
            return
        if abort:
            self.group.abort()
        dist.destroy_process_group(self.group)
        self.group = self.name = None


def address_towards(url: str) -> str:
    """This machine's address on the route to ``url``'s host (no packet is sent: a UDP socket is connected)."""
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    family, _, _, _, target = socket.getaddrinfo(host, port, proto=socket.IPPROTO_UDP)[0]
    with socket.socket(family, socket.SOCK_DGRAM) as sock:
        sock.connect(target)
        return sock.getsockname()[0]


def interface_of(address: str) -> str | None:
    """The name of the local network interface that holds the IPv4 ``address`` (None: none does, or not IPv4)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        for _, name in socket.if_nameindex():
            try:  # SIOCGIFADDR: the interface's IPv4 address
                raw = fcntl.ioctl(sock.fileno(), 0x8915, struct.pack("256s", name.encode()[:15]))
            except OSError:
                continue
            if socket.inet_ntoa(raw[20:24]) == address:
                return name
    return None
