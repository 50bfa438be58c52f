"""The SGLang weight sender tests/on_sglang build in this process, with the tests' defaults."""
import torch


def distributed_sender(accelerator, model, urls, **kw):
    """A DistributedWeightSender to ``urls`` (a URL or a list): a float32 gloo group in 0.05 MB buckets, 60 s
    timeout, and ``master_port`` null, so that the group's store binds a free port itself (a port picked before the
    bind can be taken in between); ``kw`` overrides any of these."""
    from grpo_accel.sglang.from_distributed import DistributedWeightSender

    kw = {"master_port": None, "dtype": torch.float32, "bucket_mb": 0.05, "timeout_s": 60, **kw}
    return DistributedWeightSender(accelerator, model, [urls] if isinstance(urls, str) else urls, **kw)
