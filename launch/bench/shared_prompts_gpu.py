"""Training forward+backward of the loss's logprobs on a GPU: padded rows against the shared-prompt layout (a 4-D
mask: SDPA takes no FlashAttention kernel with it), a Qwen2.5-0.5B-shaped model (random weights) in bf16, with
gradient checkpointing. One JSON line per case: seconds per batch (median of 3 after a warm-up) of each path.

    bash launch/bench/gpu_check.sh shared        # (python launch/bench/shared_prompts_gpu.py from the checkout's root)
"""
import functools
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from transformers import Qwen2Config, Qwen2ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout without installing
from grpo_accel.logprobs import sequence_logprobs  # noqa: E402
from grpo_accel.loss.paths import shared_forward  # noqa: E402

torch.manual_seed(0)
cfg = Qwen2Config(vocab_size=151936, hidden_size=896, intermediate_size=4864, num_hidden_layers=24,
                  num_attention_heads=14, num_key_value_heads=2, max_position_embeddings=8192, tie_word_embeddings=True)
m = Qwen2ForCausalLM(cfg).to("cuda", torch.bfloat16)
m.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
print("attention:", m.config._attn_implementation)


def case(prompts, group, P, C, mb):
    pid = torch.randint(10, 150000, (prompts, P), device="cuda").repeat_interleave(group, 0)
    pm = torch.ones_like(pid)
    cid = torch.randint(10, 150000, (prompts * group, C), device="cuda")
    lens = torch.randint(C // 4, C + 1, (prompts * group,), device="cuda")
    cm = (torch.arange(C, device="cuda")[None] < lens[:, None]).long()
    paths = {"padded": None, "shared_auto": shared_forward, "shared_k=group": functools.partial(shared_forward, per_row=group)}
    out = {}
    for name, fwd in paths.items():
        times = []
        for rep in range(4):
            torch.cuda.synchronize(); t = time.perf_counter()
            for s in range(0, prompts * group, mb):
                sl = slice(s, s + mb)
                lp = sequence_logprobs(m, pid[sl], pm[sl], cid[sl], cm[sl], forward=fwd)
                lp.sum().backward()
            torch.cuda.synchronize(); times.append(time.perf_counter() - t)
            m.zero_grad(set_to_none=True)
        out[name] = round(statistics.median(times[1:]), 4)
    with torch.no_grad():
        a = sequence_logprobs(m, pid[:mb], pm[:mb], cid[:mb], cm[:mb])
        b = sequence_logprobs(m, pid[:mb], pm[:mb], cid[:mb], cm[:mb], forward=shared_forward)
    out["max_logprob_gap"] = float((a - b)[cm[:mb].bool()].abs().max())
    out["peak_GB"] = round(torch.cuda.max_memory_allocated() / 1e9, 1)
    print(json.dumps({"prompts": prompts, "group": group, "P": P, "C": C, "micro_batch": mb, **out}), flush=True)


for P, C in ((512, 128), (256, 256), (128, 512), (1024, 256)):
    case(8, 8, P, C, 32)
case(4, 16, 512, 256, 64)
