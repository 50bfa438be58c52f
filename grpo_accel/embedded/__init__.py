"""The embedded engine's room: transformers generation in the trainer's process. ``EmbeddedEngine``
(``engine.py``), its decode loop (``decode.py``) with the lean forward for Llama-family models (``lean.py``) and
packed CPU weights (``packed.py``) and its decode step in C, compiled on first use (``native.py``), the decode
worker process (``worker.py``) and its weight-sync sender (``sender.py``). Keyed sampling, which the SGLang engine
shares, is :mod:`grpo_accel.rollout.sampling`.
"""
