"""The Python API end to end: the built-in tiny model learns the built-in addition task.

    python launch/api_example.py                                                  # one process
    accelerate launch --config_file accelerate_configs/ddp.yaml launch/api_example.py   # or any config

The batch layout (16 prompts x 8 completions, 128 frames per batch in all) is made once and split over the
processes explicitly: each process's collector generates its own share of every batch, and the trainer trains on
it (and refuses a collector whose layout or rank does not match its accelerator). Each batch trains once and
leaves the replay buffer (``empty_replay_buffer_on_weight_update=True``, synchronous GRPO as launch/train.py does):
with the spec's default (False) every batch would train on the ones before it too, in micro-batches each process
shuffles from its own share, which no other process count reproduces.
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

import torch

from grpo_accel import BatchLayout, GRPOLoss, GRPOTrainer
from grpo_accel.distributed import make_accelerator
from grpo_accel.rewards import RewardSet, answer_match, format_match
from grpo_accel.rollout.collector import GRPOCollector
from grpo_accel.embedded.engine import EmbeddedEngine
from grpo_accel.runtime import start_process
from grpo_accel.runtime.signals import exit_skipping_teardown
from grpo_accel.tasks.addition import addition_rows
from grpo_accel.tasks.tiny import build_char_tokenizer, build_tiny_model
from grpo_accel.embedded.sender import EmbeddedWeightSync


def main(total_frames: int = 1280) -> GRPOTrainer:
    start_process()  # threads per process, the allocator for the ZeRO stage
    accelerator = make_accelerator()  # gloo on CPU, so that several processes really form a group
    tokenizer = build_char_tokenizer()
    model = build_tiny_model(tokenizer, seed=0)
    engine = EmbeddedEngine(model, tokenizer, max_new_tokens=4)
    rewards = RewardSet({"answer": answer_match, "format": format_match}, {"format": 0.2})
    rows, _ = addition_rows(max_operand=4)
    layout = BatchLayout(prompts=16, group_size=8, processes=accelerator.num_processes)
    collector = GRPOCollector(engine, tokenizer, rows, rewards, layout=layout, rank=accelerator.process_index)
    trainer = GRPOTrainer(collector=collector, total_frames=total_frames, loss_module=GRPOLoss(model),
                          optimizer=torch.optim.AdamW(model.parameters(), lr=3e-4),
                          weight_sync_sender=EmbeddedWeightSync(engine), seed=0, accelerator=accelerator,
                          empty_replay_buffer_on_weight_update=True)  # sync GRPO, as the launcher trains
    trainer.train()
    return trainer


if __name__ == "__main__":
    frames = int(sys.argv[1]) if len(sys.argv) > 1 else 1280
    trainer = main(frames)
    acc, collector = trainer.accelerator, trainer.collector
    print(f"process {acc.process_index} of {acc.num_processes}: share {collector.rank} of "
          f"{collector.layout.processes} of each batch, {trainer.frames} frames in all, mean reward {trainer.history[-1]['train/reward_mean']:.3f}",
          flush=True)
    acc.wait_for_everyone()
    acc.end_training()
    exit_skipping_teardown(0)  # gloo's teardown aborts now and then after the work is done
