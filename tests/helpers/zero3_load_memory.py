"""Launched by tests/launched/test_zero3_load.py: each process loads a model folder's policy and KL reference as the recipe
does (the tokenizer before the process group, the Accelerator, then ``build_policy`` with the trainer's malloc
settings) and prints one JSON line: its anonymous memory (RssAnon, sampled every 2 ms) before and after the load
and at the load's peak, and the share of the parameters it holds.

Anonymous memory, not the resident set: the first process reads the checkpoint through a memory map, whose pages
are the page cache every process shares, not memory a process holds.
"""
import json
import sys
import threading
import time


def anonymous_bytes() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("RssAnon:"))


def main(folder: str) -> None:
    import deepspeed  # noqa: F401  imported before the baseline, as the trainer has by then
    import torch
    import transformers  # noqa: F401

    from grpo_accel.distributed import local_parameter_fraction, make_accelerator
    from grpo_accel.recipe.loading import load_config
    from grpo_accel.recipe.parts import build_policy, build_tokenizer
    from grpo_accel.runtime import keep_freed_memory

    torch.set_num_threads(1)
    keep_freed_memory()  # as grpo-accel train sets it
    cfg = load_config(None, [f"model.name_or_path={folder}", "loss.kl_coef=0.1"])
    tokenizer = build_tokenizer(cfg.model)
    accelerator = make_accelerator()
    peak, done = [0], threading.Event()

    def sample() -> None:
        while not done.is_set():
            peak[0] = max(peak[0], anonymous_bytes())
            time.sleep(0.002)

    base = anonymous_bytes()
    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    policy, reference = build_policy(cfg.model, tokenizer, with_reference=True)
    done.set()
    sampler.join()
    print(json.dumps({"rank": accelerator.process_index, "processes": accelerator.num_processes, "base": base,
                      "peak": max(peak[0], anonymous_bytes()), "after": anonymous_bytes(),
                      "policy_share": local_parameter_fraction(policy),
                      "reference_share": local_parameter_fraction(reference)}), flush=True)


if __name__ == "__main__":
    main(sys.argv[1])
