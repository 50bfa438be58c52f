"""A process group shared with inference engines, separate from the training group.

Made the way SGLang's ``init_custom_process_group`` makes it (a plain TCP store at ``address:port``, then
``_new_process_group_helper`` under ``group_name``), so both sides agree on store keys: the trainer is rank 0
and hosts the store; engines join with their rank offsets. The store is built directly rather than through
``rendezvous("tcp://...")``, which under torchrun (``TORCHELASTIC_USE_AGENT_STORE``) would try to join the
launcher's own store instead of hosting one.
"""
from __future__ import annotations

from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import distributed_c10d as c10d


def init_weight_update_group(backend: str, master_address: str, master_port: int, rank: int, world_size: int,
                             group_name: str, timeout_s: float = 600.0) -> dist.ProcessGroup:
    """Join the weight-update group (blocks until every rank joined). Does not touch the default group."""
    if backend not in ("nccl", "gloo"):
        raise ValueError(f"weight update group backend={backend!r}: use 'nccl' (GPUs) or 'gloo' (CPU).")
    timeout = timedelta(seconds=timeout_s)
    store = dist.TCPStore(master_address, master_port, world_size, is_master=rank == 0, timeout=timeout)
    group, _ = c10d._new_process_group_helper(world_size, rank, [], backend, store, group_name=group_name,
                                              timeout=timeout)
    return group


def destroy_weight_update_group(group: dist.ProcessGroup, group_name: str) -> None:
    """Forget a group made by :func:`init_weight_update_group` so that the name can be joined again."""
    for registry in (c10d._world.pg_map, c10d._world.pg_names, c10d._world.pg_group_ranks,
                     c10d._world.pg_backend_config):
        registry.pop(group, None)
    c10d._unregister_process_group(group_name)


def broadcast(group: dist.ProcessGroup, tensor: torch.Tensor, src: int = 0) -> None:
    """Broadcast ``tensor`` in place from group rank ``src`` and wait."""
    opts = dist.BroadcastOptions()
    opts.rootRank, opts.rootTensor = src, 0
    group.broadcast([tensor], opts).wait()
