"""Trained weights for inference engines: the ZeRO-aware bucketed gather any sender uses (``gather.py``). The
senders live with their engines: :mod:`grpo_accel.sglang` and :mod:`grpo_accel.embedded`."""
