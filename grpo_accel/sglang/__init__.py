"""Everything grpo_accel says to SGLang servers, in one room: the API (releases, requests, ``api.py``), rollouts over
HTTP (``engine.py``), weight pushes (``sender.py``: what every transport shares; one file per transport; the
trained weights gathered from their ZeRO-3 shards one bucket at a time, ``gather.py``; one file per transport:
``from_distributed.py``, ``from_disk.py``, ``from_tensor.py``), the weight-update process group the servers join
(``group.py``) and colocated servers' memory released and resumed around training (``memory.py``).

Nothing here imports ``sglang`` except the same-node tensor transport, which needs its serializer.
"""
