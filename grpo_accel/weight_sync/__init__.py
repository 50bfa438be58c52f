"""Trained weights for inference engines: the ZeRO-aware bucketed gather any sender uses (``gather.py``) and the
embedded engine's sender (``embedded.py``). SGLang's senders live in :mod:`grpo_accel.sglang`."""
