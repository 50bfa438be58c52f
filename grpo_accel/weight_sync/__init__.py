"""Keeping an inference engine's weights current, whatever the engine: the ZeRO-3 bucketed gather of the trained
weights (``gather.py``), the push that walks it (``push.py``: the update's order, retries, versions and the
check that the servers hold what was pushed), over an engine's servers and one of its transports, small objects of
the engine's room (SGLang's: :mod:`grpo_accel.sglang.servers`, ``from_distributed.py``, ``from_disk.py``,
``from_tensor.py``; vLLM's: :mod:`grpo_accel.vllm.servers`), and the Hugging Face folders that the transports from
disk write (``folders.py``)."""
