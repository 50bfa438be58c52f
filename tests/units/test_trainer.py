"""GRPOTrainer in one process (the multi-process runs are in test_launch.py)."""
import copy
import re

import pytest
import torch

from grpo_accel import batch
from grpo_accel.trainer.buffer import ReplayBuffer
from grpo_accel.layout import BatchLayout
from trainer_utils import (fresh_accelerate_state, make_trainer, reset_accelerate_state,  # noqa: F401 (autouse fixture)
                           without_wall_times)


def test_reward_rises_in_a_short_run(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, prompts=16, group=8, total_frames=128 * 40)
    trainer.train()
    rewards = [h["train/reward_mean"] for h in trainer.history]
    assert len(rewards) == 40 and trainer.frames == 128 * 40 and trainer.optim_steps == 40
    first, last = sum(rewards[:10]) / 10, sum(rewards[-10:]) / 10
    assert last > first + 0.15, (first, last)


def test_each_batch_is_one_push_and_versions_advance(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model)
    trainer.train()
    assert trainer.collector.engine.weight_version == 3
    assert [h["train/weight_version_mean"] for h in trainer.history] == [0.0, 1.0, 2.0]
    assert len(trainer.replay_buffer) == 0


def test_the_trainer_names_every_push_and_the_collector_keeps_no_version(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model)
    sender, engine = trainer.weight_sync_sender, trainer.collector.engine
    sender.update_weights()  # a push outside the trainer (the specification's method): version 1, then 2
    sender.update_weights()
    assert sender.pushed == engine.weight_version == 2
    trainer.train()  # 3 batches: the trainer's versions 1, 2, 3, whatever the sender pushed before
    assert trainer.weight_version == sender.pushed == engine.weight_version == 3
    assert [h["train/weight_version_mean"] for h in trainer.history] == [2.0, 1.0, 2.0]
    assert "weight_version" not in trainer.collector.state_dict()
    trainer.collector.load_state_dict({**trainer.collector.state_dict(), "weight_version": 7})  # an older checkpoint
    assert engine.weight_version == 3


def test_kept_buffer_grows_and_old_logprobs_are_stored(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, empty_replay_buffer_on_weight_update=False, optim_steps_per_batch=1)
    trainer.train()
    assert len(trainer.replay_buffer) == 48
    assert all(batch.OLD_LOGPROBS in mb.keys() for mb in trainer.replay_buffer)


def test_first_epoch_is_on_policy_then_ratio_moves(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, num_epochs=2, batch_size=8, total_frames=16)
    trainer.train()
    calls = trainer.unwrapped_loss.calls
    assert len(calls) == 4 and trainer.optim_steps == 4  # 2 epochs x 2 micro-batches
    assert calls[0]["ratio_mean"] == pytest.approx(1.0, abs=1e-6) and calls[0]["clip_fraction"] == 0
    assert calls[0]["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert max(abs(c["ratio_mean"] - 1) for c in calls[1:]) > 1e-4


def test_accumulation_two_by_four_equals_one_by_eight(tokenizer):
    from grpo_accel.tasks.tiny import build_tiny_model

    def final_weights(batch_size, ga):
        reset_accelerate_state()
        model = build_tiny_model(tokenizer, seed=0)
        trainer = make_trainer(tokenizer, model, prompts=2, group=4, total_frames=8, batch_size=batch_size,
                               gradient_accumulation_steps=ga, optimizer=torch.optim.SGD(model.parameters(), lr=1.0),
                               clip_norm=None, collector_seed=1)  # a batch whose groups' rewards differ: a step
        trainer.train()
        assert trainer.optim_steps == 1
        return torch.cat([p.detach().flatten() for p in model.parameters()]), trainer.history[0]["train/loss"]

    w8, loss8 = final_weights(8, 1)
    w4, loss4 = final_weights(4, 2)
    w0 = torch.cat([p.detach().flatten() for p in build_tiny_model(tokenizer, seed=0).parameters()])
    assert (w8 - w0).abs().max() > 1e-4, "the step changed the weights"
    torch.testing.assert_close(w4, w8, atol=1e-6, rtol=1e-5)
    assert loss4 == pytest.approx(loss8, abs=1e-6)


def test_same_seed_same_run(tokenizer):
    from grpo_accel.tasks.tiny import build_tiny_model

    runs = []
    for _ in range(2):
        trainer = make_trainer(tokenizer, build_tiny_model(tokenizer, seed=0))
        trainer.train()
        runs.append(trainer.history)
    assert without_wall_times(runs[0]) == without_wall_times(runs[1])


def test_request_stop_from_the_weight_push(tokenizer, tiny_model):
    class StopAfterTwo:
        def __init__(self):
            self.pushes = 0

        def update_weights(self):
            self.pushes += 1
            if self.pushes == 2:
                trainer.request_stop("enough")

    sender = StopAfterTwo()
    trainer = make_trainer(tokenizer, tiny_model, weight_sync_sender=sender, total_frames=10_000)
    trainer.train()
    assert trainer.iterations == 2 and sender.pushes == 2 and trainer.frames == 32


def test_logging_switches(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, loss_kwargs={"reference": copy.deepcopy(tiny_model), "kl_coef": 0.1},
                           log_kl=False, log_rewards=False, auto_log_optim_steps=False, log_timings=True)
    trainer.train()
    keys = set(trainer.history[0])
    assert not any("kl" in k for k in keys) and not any("reward" in k for k in keys)
    assert "train/optim_steps" not in keys and "train/loss_objective" in keys
    assert {"time/forward_backward", "time/ref_logprobs", "time/iteration"} <= keys


def test_log_kl_leaves_out_the_losss_declared_kl_keys_only(tokenizer, tiny_model):
    """log_kl=False dropped every scalar whose name held "kl" (a user's "custom/kl_bonus" too); it leaves out the
    keys the loss declares (GRPOLoss.kl_outputs), every one of which the loss does output."""
    from grpo_accel.loss import KL_OUTPUTS, LOSS_OUTPUTS

    trainer = make_trainer(tokenizer, tiny_model, loss_kwargs={"reference": copy.deepcopy(tiny_model), "kl_coef": 0.1},
                           log_kl=False)
    trainer.register_op("log", lambda t, rollout, scalars: scalars.update({"custom/kl_bonus": 1.0}))
    trainer.train()
    keys = set(trainer.history[0])
    assert "custom/kl_bonus" in keys and not keys & {f"train/{k}" for k in KL_OUTPUTS}
    assert {f"train/{k}" for k in LOSS_OUTPUTS} - {f"train/{k}" for k in KL_OUTPUTS} <= keys


def test_default_logging_has_the_documented_tags(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, loss_kwargs={"reference": copy.deepcopy(tiny_model), "kl_coef": 0.1})
    trainer.train()
    keys = set(trainer.history[0])
    assert {"train/reward_mean", "train/reward_std", "train/loss", "train/loss_objective", "train/loss_kl",
            "train/kl_ref", "train/clip_fraction", "train/kl_approx", "train/ESS", "train/entropy",
            "train/ratio_mean", "train/ratio_min", "train/ratio_max", "train/reward/answer_match_mean",
            "train/reward/format_match_mean", "train/optim_steps", "train/frames", "train/grad_norm"} <= keys
    from grpo_accel.loss import LOSS_OUTPUTS

    assert {f"train/{k}" for k in LOSS_OUTPUTS} <= keys  # the table is what the loss outputs
    assert {k for k in keys if k.startswith("time/")} == {"time/generate", "time/score"}  # the rest: log_timings
    from launching import ROOT

    page = (ROOT / "docs" / "pages" / "metrics.md").read_text()  # its table names every tag a run logs

    def named(tag: str) -> bool:  # `train/x_mean`, `_min` names train/x_min
        stem, _, suffix = tag.rpartition("_")
        return f"`{tag}`" in page or (f"`{stem}_" in page and f"`_{suffix}`" in page)

    assert [k for k in sorted(keys) if not named(re.sub(r"reward/\w+_(mean|std)$", r"reward/<fn>_\1", k))] == []


def test_log_interval_and_frame_skip(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, log_interval=32, frame_skip=2, total_frames=16 * 2 * 4)
    trainer.train()
    assert trainer.iterations == 4 and trainer.frames == 128
    assert [h["train/frames"] for h in trainer.history] == [32.0, 64.0, 96.0, 128.0]
    trainer = make_trainer(tokenizer, tiny_model, log_interval=48, total_frames=16 * 4)
    tokens = []  # issue 74 item 15: num_tokens counts every batch's prompt and completion tokens, logged or not
    trainer.register_op("post_collect", lambda t, rollout: tokens.append(float(
        rollout["prompt_mask"].sum() + rollout["completion_mask"].sum())) or rollout)
    trainer.train()
    assert [h["train/frames"] for h in trainer.history] == [16.0, 64.0]  # the last batch always logs
    assert [h["train/num_tokens"] for h in trainer.history] == [tokens[0], sum(tokens)] and len(tokens) == 4


def test_trls_metrics_are_logged_with_their_meaning(tokenizer, tiny_model):
    """Issue 74 item 15: TRL's split clip ratios (DAPO's asymmetric clip needs them) and completion lengths (min,
    max, of the terminated ones), checked against the batch they describe."""
    from grpo_accel import batch
    from grpo_accel.loss.grpo import clipped_surrogate

    rollouts = []
    trainer = make_trainer(tokenizer, tiny_model, num_epochs=4, lr=3e-2, loss_kwargs={"clip_epsilon": (0.2, 0.28)})
    trainer.register_op("post_collect", lambda t, rollout: rollouts.append(rollout.clone()) or rollout)
    trainer.train()
    for logged, rollout in zip(trainer.history, rollouts):
        length = rollout[batch.COMPLETION_MASK].sum(-1).float()
        ended = length[rollout[batch.FINISH_REASON] != batch.FINISH_LENGTH]
        assert (logged["train/completion_length_min"], logged["train/completion_length_max"]) == (
            length.min(), length.max())
        assert logged["train/terminated_length_max"] == (ended.max() if ended.numel() else 0.0)
        low, high = logged["train/clip_low_fraction"], logged["train/clip_high_fraction"]
        assert logged["train/clip_fraction"] == pytest.approx(low + high)
    assert any(h["train/clip_low_fraction"] > 0 for h in trainer.history)
    assert any(h["train/clip_high_fraction"] > 0 for h in trainer.history)
    side = clipped_surrogate(torch.tensor([[0.5, 1.5]]).log(), torch.tensor([-1.0]), 0.2, 0.28)[1]
    assert side.tolist() == [[-1, 0]]  # low: ratio under 0.8 with A < 0; 1.5 with A < 0 is not clipped


def test_bf16_mixed_precision_finishes_finite(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, mixed_precision=True, autocast_dtype=torch.bfloat16)
    trainer.train()
    assert trainer.accelerator.mixed_precision == "bf16"
    assert all(torch.isfinite(torch.tensor(h["train/loss"])) for h in trainer.history)


def test_compute_loss_methods_and_explicit_device(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, device="cpu", replay_buffer=ReplayBuffer(4), batch_size=8)
    assert trainer.replay_buffer.batch_size == 8 and trainer.device == torch.device("cpu")
    td = trainer.collector.collect()
    out = trainer.compute_loss(td)
    assert "loss_objective" in out.keys()
    assert float(trainer.compute_loss(td, method="units")) == float(td[batch.COMPLETION_MASK].sum())


def test_progress_bar_shows_frames_on_a_terminal(tokenizer, tiny_model, capsys, monkeypatch):
    import sys

    monkeypatch.setattr(sys.stderr, "isatty", lambda: True)  # as on a terminal (without one: log lines)
    trainer = make_trainer(tokenizer, tiny_model, progress_bar=True)
    trainer.train()
    err = capsys.readouterr().err
    assert "frames" in err and err.count("\r") <= len(trainer.history) + 2, "one redraw per batch"


@pytest.mark.parametrize(
    "kwargs, fragment",
    [({"optimizer": None}, "optimizer=None"), ({"loss_module": None}, "loss_module=None"),
     ({"total_frames": 0}, "total_frames=0"), ({"num_epochs": 0}, "num_epochs=0"),
     ({"weight_update_frequency": 0}, "weight_update_frequency=0"), ({"log_interval": 0}, "log_interval=0"),
     ({"mixed_precision": True, "autocast_dtype": torch.float64}, "autocast_dtype"),
     ({"save_trainer_interval": 16}, "pass checkpoint= or save_trainer_file="),
     ({"checkpoint_rotation": object()}, "rotation needs checkpoint=")],
)
def test_bad_trainer_arguments_name_the_parameter(tokenizer, tiny_model, kwargs, fragment):
    args = {"optimizer": torch.optim.AdamW(tiny_model.parameters())} | kwargs
    with pytest.raises(ValueError, match=fragment):
        make_trainer(tokenizer, tiny_model, **args)


def test_micro_batches_must_fill_accumulation(tokenizer, tiny_model):
    with pytest.raises(ValueError, match=r"batch_size=8: 2 micro-batches per epoch \(16 completions / 8\) is not a "
                                         r"multiple of gradient_accumulation_steps=4"):
        make_trainer(tokenizer, tiny_model, batch_size=8, gradient_accumulation_steps=4)
    auto = make_trainer(tokenizer, tiny_model, gradient_accumulation_steps=4)  # no batch_size: the share / 4
    assert auto.replay_buffer.batch_size == 4
    with pytest.raises(ValueError, match=r"gradient_accumulation_steps=3: each process collects 16 completions .* "
                                         r"use one of \[1, 2, 4, 8, 16\]"):
        make_trainer(tokenizer, tiny_model, gradient_accumulation_steps=3)


def test_a_collector_split_for_another_process_count_is_refused(tokenizer, tiny_model):
    """Sharding is explicit: the trainer reads the collector's layout and rank and refuses what does not match its
    accelerator, instead of splitting the collector itself."""
    from grpo_accel import GRPOLoss, GRPOTrainer
    from grpo_accel.rewards import RewardSet, answer_match
    from grpo_accel.rollout.collector import GRPOCollector
    from grpo_accel.embedded.engine import EmbeddedEngine
    from grpo_accel.tasks.addition import addition_rows
    from grpo_accel.embedded.sender import EmbeddedWeightSync

    engine = EmbeddedEngine(tiny_model, tokenizer, max_new_tokens=4)
    rewards = RewardSet({"answer_match": answer_match})

    def trainer(layout, rank):
        collector = GRPOCollector(engine, tokenizer, addition_rows(4)[0], rewards, layout=layout, rank=rank)
        return GRPOTrainer(collector=collector, total_frames=8, loss_module=GRPOLoss(tiny_model),
                           optimizer=torch.optim.AdamW(tiny_model.parameters()), weight_sync_sender=EmbeddedWeightSync(engine))

    with pytest.raises(ValueError, match=r"collector.layout.processes=2: the accelerator runs 1 processes; build the "
                                         r"BatchLayout with processes=accelerator.num_processes"):
        trainer(BatchLayout(4, 2, processes=2), rank=1)
    with pytest.raises(ValueError, match=r"GRPOCollector: rank=1 is not one of the layout's 1 processes"):
        trainer(BatchLayout(4, 2), rank=1)
    with pytest.raises(ValueError, match=r"GRPOTrainer: collector=.*pass a grpo_accel.contracts.Collector"):
        GRPOTrainer(collector=[], total_frames=8, loss_module=GRPOLoss(tiny_model),
                    optimizer=torch.optim.AdamW(tiny_model.parameters()))
