"""Everything grpo_accel says to vLLM servers, in one room: the release it was checked against and every request
body (``api.py``), rollouts over HTTP (``engine.py``), and the servers as a weight push sees them with the transport
from disk and its sender (``servers.py``), under the engine-independent push of :mod:`grpo_accel.weight_sync`.

Nothing here imports ``vllm``.
"""
