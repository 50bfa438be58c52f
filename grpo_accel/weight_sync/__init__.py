"""Pushing trained weights to inference engines: ZeRO-aware bucketed gather and SGLang senders.

Nothing here imports ``sglang``: the HTTP and torch.distributed paths need only the standard library and torch.
"""
