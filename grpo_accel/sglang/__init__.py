"""Everything grpo_accel says to SGLang servers, in one room: the API (releases, requests, ``api.py``), rollouts over
HTTP (``engine.py``), the servers as a weight push sees them and what their transports share (``servers.py``), one
transport and its sender per file (``from_distributed.py``, ``from_disk.py``, ``from_tensor.py``; put together
under the engine-independent push of :mod:`grpo_accel.weight_sync` in ``sender.py``), the weight-update process
group the servers join (``group.py``) and colocated servers' memory released and resumed around training
(``memory.py``).

Nothing here imports ``sglang`` except the same-node tensor transport, which needs its serializer.
"""
