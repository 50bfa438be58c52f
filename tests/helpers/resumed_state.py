"""Launched by tests/launched/test_resume_anywhere.py: each process builds the recipe's trainer as ``grpo-accel train``
does, loads the checkpoint its ``checkpoint.resume`` names (``load_from_file``: the resume's own path, conversion
included), and the main process writes what it then holds to ``$RESUMED_STATE``: every trainable parameter's fp32
master weight and Adam moments, whole (gathered from the ZeRO shards through DeepSpeed's ``safe_get_full_*``), the
optimizer's step, the learning rate, the counters and the data position. Nothing is trained.

    accelerate launch --config_file accelerate_configs/zero3.yaml tests/helpers/resumed_state.py output_dir=... \
        checkpoint.resume=auto
"""
import logging
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from grpo_accel.distributed import uses_deepspeed, zero_stage  # noqa: E402
from grpo_accel.recipe.build import build_trainer  # noqa: E402
from grpo_accel.config.loading import load_config  # noqa: E402
from grpo_accel.runtime import start_process  # noqa: E402


def whole_state(trainer) -> dict:
    """name -> {fp32, exp_avg, exp_avg_sq, step} of every trainable parameter, whole (a collective under ZeRO)."""
    acc, out = trainer.accelerator, {}
    sharded = uses_deepspeed(acc) and zero_stage(acc) > 0
    optimizer = trainer.optimizer
    while hasattr(optimizer, "optimizer"):  # accelerate's and DeepSpeed's wrappers, down to the torch optimizer
        optimizer = optimizer.optimizer
    if sharded and zero_stage(acc) < 3:  # read the moments from the optimizer's own flat state (a load leaves
        zero = trainer.loss_module.optimizer  # DeepSpeed's fragment links unset, or pointing at copies)
        for flat, params in zip(zero.single_partition_of_fp32_groups, zero.bit16_groups):
            for p in params:
                if p._hp_mapping is not None:
                    p._hp_mapping.set_optim_state_fragment(flat, zero.optimizer.state[flat])
    for name, p in trainer.unwrapped_loss.named_parameters():
        if not p.requires_grad:
            continue
        if sharded:
            from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

            entry = {"fp32": safe_get_full_fp32_param(p)}
            entry.update({k: safe_get_full_optimizer_state(p, k) for k in ("exp_avg", "exp_avg_sq")})
        else:
            state = optimizer.state[p]
            entry = {"fp32": p.detach(), "exp_avg": state["exp_avg"], "exp_avg_sq": state["exp_avg_sq"],
                     "step": state["step"]}
        out[name] = {k: v.detach().float().cpu().clone() for k, v in entry.items()}
    if sharded:  # the base optimizer's step, one per flat group
        steps = {float(s["step"]) for s in optimizer.state.values() if "step" in s}
        step = torch.tensor(steps.pop() if len(steps) == 1 else float("nan"))
        for entry in out.values():
            entry["step"] = step
    return out


def main() -> None:
    logging.basicConfig(level=logging.INFO, format="%(name)s: %(message)s")  # the start lines, as the CLI's
    start_process()
    cfg = load_config(None, sys.argv[1:])
    trainer = build_trainer(cfg)
    trainer.load_from_file(trainer.checkpoint.resume_path())
    params = whole_state(trainer)
    if trainer.accelerator.is_main_process:
        torch.save({"params": params, "lr": trainer.optimizer.param_groups[0]["lr"],
                    "counters": {k: v for k, v in trainer.state_dict().items() if isinstance(v, (int, float))},
                    "collector": trainer.collector.state_dict(), "accelerator_step": trainer.accelerator.step,
                    "processes": trainer.accelerator.num_processes}, os.environ["RESUMED_STATE"])
    trainer.accelerator.wait_for_everyone()
    trainer.accelerator.end_training()
    sys.stdout.flush()
    os._exit(0)  # gloo's teardown may abort at exit (deepspeed-on-cpu pitfall 9)


if __name__ == "__main__":
    main()
