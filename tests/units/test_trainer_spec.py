"""The spec's remaining parameters and methods: hooks, stepper, fp16, async collection, dynamic sampling,
evaluation, request_stop from another thread."""
import copy
import threading
import time

import pytest
import torch

from grpo_accel import batch
from grpo_accel.trainer.hooks import STAGES, HookError
from grpo_accel.layout import BatchLayout
from grpo_accel.reporting.evaluation import Evaluator
from grpo_accel.rewards import RewardSet, answer_match, format_match
from grpo_accel.rollout.collector import GRPOCollector
from grpo_accel.embedded.engine import EmbeddedEngine
from grpo_accel.trainer.stepper import MixedPrecisionOptimizationStepper
from grpo_accel.tasks.addition import addition_rows
from grpo_accel.tasks.tiny import build_tiny_model
from grpo_accel.embedded.sender import EmbeddedWeightSync
from trainer_utils import fresh_accelerate_state, make_trainer, reset_accelerate_state  # noqa: F401


def test_every_stage_runs_in_order_with_its_arguments(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, batch_size=8, total_frames=32)
    calls = []
    for stage in STAGES:
        trainer.register_op(stage, lambda t, *args, s=stage: calls.append(
            (s, t.iterations, len(args), len(t.replay_buffer), t.weight_version)), f"spy_{stage}")
    trainer.train()
    first = [c for c in calls if c[1] == 1]
    assert [c[0] for c in first] == ["post_collect", "pre_optim", "post_optim_step", "post_optim_step",  # 2 steps
                                     "post_optim", "log", "post_iteration"]
    assert {s: n for s, _, n, _, _ in first} == {"post_collect": 1, "pre_optim": 0, "post_optim_step": 1,
                                                 "post_optim": 0, "log": 2, "post_iteration": 0}
    # post_collect comes before the rollout is stored; post_optim after the weights were pushed and the buffer emptied
    assert {s: (rows, version) for s, _, _, rows, version in first} == {
        "post_collect": (0, 0), "pre_optim": (16, 0), "post_optim_step": (16, 0), "post_optim": (0, 1), "log": (0, 1),
        "post_iteration": (0, 1)}
    assert trainer.hooks.names("post_optim") == ["spy_post_optim"]  # the loop's own steps are no hooks


def test_hooks_change_rollouts_and_scalars(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, total_frames=32)
    trainer.register_op("post_collect", lambda t, r: r[:4], "first_group_only")  # before the rollout is stored
    trainer.register_op("log", lambda t, rollout, scalars: scalars.update({"custom/rows": float(rollout.shape[0])}))
    trainer.train()
    assert len(trainer.unwrapped_loss.calls) == 2 and trainer.history[0]["custom/rows"] == 16.0
    assert all(c["ratio_mean"] == pytest.approx(1.0) for c in trainer.unwrapped_loss.calls)


def test_a_failing_hook_names_itself_and_its_stage(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model)

    def broken(t):
        raise KeyError("boom")

    trainer.register_op("post_iteration", broken)
    with pytest.raises(HookError, match="hook 'broken' at stage 'post_iteration' raised KeyError"):
        trainer.train()
    with pytest.raises(ValueError, match="stage 'after_everything' is unknown"):
        trainer.register_op("after_everything", broken)
    with pytest.raises(ValueError, match="already registered"):
        trainer.register_op("post_iteration", broken)


def test_request_stop_from_a_hook_and_from_another_thread(tokenizer, tiny_model, tmp_path):
    from grpo_accel.checkpoint import Checkpoint

    trainer = make_trainer(tokenizer, tiny_model, total_frames=10**6)
    trainer.register_op("post_iteration", lambda t: t.iterations == 3 and t.request_stop("three is enough"))
    trainer.train()
    assert trainer.iterations == 3 and trainer.frames == 48

    reset_accelerate_state()
    trainer = make_trainer(tokenizer, build_tiny_model(tokenizer, seed=0), total_frames=10**6,
                           checkpoint=Checkpoint(tmp_path))
    trainer.register_op("post_iteration", lambda t: time.sleep(0.05))
    stopper = threading.Timer(0.5, trainer.request_stop, args=("stopped from a thread",))
    stopper.start()
    trainer.train()
    stopper.join()
    assert trainer.stop_reason == "stopped from a thread"
    assert trainer.frames == 16 * trainer.iterations and trainer.optim_steps == trainer.iterations
    last = Checkpoint(tmp_path).complete()[-1]
    assert last.name == f"step_{trainer.iterations:08d}"  # a consistent state was saved at the boundary


def test_exactly_one_of_optimizer_and_stepper(tokenizer, tiny_model):
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.1)
    with pytest.raises(ValueError, match="exactly one of optimizer= and optimization_stepper="):
        make_trainer(tokenizer, tiny_model, optimization_stepper=MixedPrecisionOptimizationStepper(opt))


def test_custom_stepper_does_the_optimisation(tokenizer, tiny_model):
    class CountingStepper(MixedPrecisionOptimizationStepper):
        steps = 0

        def step(self):
            out = super().step()
            if self.accelerator.sync_gradients:
                CountingStepper.steps += 1
            return out

    stepper = CountingStepper(torch.optim.SGD(tiny_model.parameters(), lr=0.5), clip_norm=None)
    before = torch.cat([p.detach().flatten().clone() for p in tiny_model.parameters()])
    trainer = make_trainer(tokenizer, tiny_model, optimizer=None, optimization_stepper=stepper, clip_norm=None)
    trainer.train()
    after = torch.cat([p.detach().flatten() for p in tiny_model.parameters()])
    assert CountingStepper.steps == trainer.optim_steps == 3 and not torch.equal(before, after)
    assert "train/grad_norm" not in trainer.history[0]  # clip_norm=None: no clipping


def test_fp16_on_cpu_autocasts_with_a_gradient_scaler(tokenizer, tiny_model):
    trainer = make_trainer(tokenizer, tiny_model, mixed_precision=True, autocast_dtype=torch.float16)
    dtypes = []
    tiny_model.model.layers[0].mlp.register_forward_hook(lambda m, i, o: dtypes.append(o.dtype))
    trainer.train()
    assert torch.float16 in dtypes, "the forward ran in float16"
    assert trainer.stepper.scaler is not None and trainer.history[0]["train/loss_scale"] > 0
    assert all(torch.isfinite(torch.tensor(h["train/loss"])) for h in trainer.history)
    assert trainer.state_dict()["stepper"]["scaler"]["scale"] > 0  # the scaler is checkpointed


def _async_trainer(tokenizer, loss=None, **kw):
    reset_accelerate_state()
    model = build_tiny_model(tokenizer, seed=0)
    engine = EmbeddedEngine(copy.deepcopy(model), tokenizer, max_new_tokens=4)
    rewards = RewardSet({"answer_match": answer_match, "format_match": format_match}, {"format_match": 0.2})
    collector = GRPOCollector(engine, tokenizer, addition_rows(4)[0], rewards, layout=BatchLayout(4, 4))
    from trainer_utils import RecordingLoss

    args = dict(collector=collector, total_frames=16 * 6, loss_module=RecordingLoss(model, **(loss or {})),
                optimizer=torch.optim.AdamW(model.parameters(), lr=3e-3), seed=0,
                weight_sync_sender=EmbeddedWeightSync(engine, source=model),
                empty_replay_buffer_on_weight_update=True, async_collection=True) | kw
    from grpo_accel.trainer import GRPOTrainer

    return GRPOTrainer(**args), model, engine


def test_async_with_staleness_zero_matches_sync_first_step(tokenizer):
    sync, _, _ = _async_trainer(tokenizer, async_collection=False, total_frames=16)
    sync.train()
    trainer, _, _ = _async_trainer(tokenizer, max_staleness=0)
    trainer.train()
    # pi_old is the engine's logprob in async mode, the detached forward in sync: equal to float rounding
    assert trainer.history[0]["train/loss"] == pytest.approx(sync.history[0]["train/loss"], rel=1e-5)
    assert trainer.history[0]["train/reward_mean"] == sync.history[0]["train/reward_mean"]
    assert trainer.dropped_batches > 0 and trainer.history[-1]["train/dropped_batches"] == trainer.dropped_batches


def test_async_corrects_one_version_old_batches_and_pushes_every_n_steps(tokenizer):
    trainer, model, engine = _async_trainer(tokenizer, batch_size=8, weight_update_frequency=2, max_staleness=None,
                                            total_frames=16 * 8)
    trainer.train()
    assert trainer.optim_steps == 16 and engine.weight_version == 8  # 2 optimizer steps per push
    assert [h["train/staleness"] for h in trainer.history][2:] == [1.0] * 6
    assert trainer.dropped_batches == 0
    calls = trainer.unwrapped_loss.calls
    assert any(abs(c["ratio_mean"] - 1) > 1e-4 for c in calls), "stale batches are corrected by the ratio"
    for p, q in zip(model.parameters(), engine.model.parameters()):
        assert torch.equal(p, q), "the last push copied the trained weights into the engine"


def test_async_truncated_importance_sampling_weighs_the_trainer_against_the_engine(tokenizer):
    """loss.tis_cap (TRL's vllm_importance_sampling_correction) in async collection: pi_old is the trainer's forward
    when the batch is stored, so pi_old / pi_engine carries the engine's staleness; taking pi_old from the engine,
    as the ratio does without tis_cap, would make that weight exactly 1."""
    runs = {}
    for name, loss in (("plain", None), ("tis", {"tis_cap": 1.05, "tis_mode": "token_mask"})):
        trainer, _, _ = _async_trainer(tokenizer, loss=loss, batch_size=8, weight_update_frequency=2,
                                       max_staleness=None, total_frames=16 * 4)
        trainer.train()
        assert [h["train/staleness"] for h in trainer.history][2:] == [1.0] * 2
        runs[name] = trainer.unwrapped_loss.calls
    assert all(c["engine_logprob_abs_diff"] == 0 for c in runs["plain"]), "the ratio is taken against the engine"
    stale = runs["tis"][4:]  # batches 3 and 4 were sampled one push behind
    assert all(c["engine_logprob_abs_diff"] > 1e-3 for c in stale), "pi_old / pi_engine sees the older weights"
    assert any(c["engine_prob_ratio_max"] > 1.05 for c in stale), "a token outside [., tis_cap] is masked"
    assert runs["tis"][0]["engine_logprob_abs_diff"] < 1e-5, "a fresh batch: the same weights, rounding apart"


def test_async_needs_its_own_engine_weights(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="the engine generates from the weights being trained"):
        make_trainer(tokenizer, tiny_model, async_collection=True)


def test_dynamic_sampling_refills_tied_groups(tokenizer, tiny_model):
    torch.manual_seed(0)
    engine = EmbeddedEngine(tiny_model, tokenizer, max_new_tokens=3)
    rewards = RewardSet({"answer_match": answer_match})  # almost always 0 for a random model: tied groups
    asked = []
    collector = GRPOCollector(engine, tokenizer, addition_rows(4)[0], rewards, layout=BatchLayout(4, 8),
                              dynamic_sampling=True, max_extra_rounds=3, sync_any=lambda f: asked.append(f) or f)
    td = collector.collect()
    assert td.shape == (32,) and collector.batches == 1 + len([f for f in asked if f])
    groups = td[batch.REWARD].view(4, 8)
    informative = int((groups.std(-1) > 0).sum())
    assert 0 < informative and (groups.std(-1) > 0)[:informative].all(), "informative groups come first"
    dropped = float(td["stats", "dropped_group_fraction"][0])
    assert 0 < dropped < 1 and td["stats", "extra_rounds"][0] == len([f for f in asked if f])
    assert len(asked) <= 4


def test_evaluation_hook_logs_greedy_and_pass_at_k(tokenizer, tiny_model):
    train_rows, held_out = addition_rows(4, holdout=5)
    trainer = make_trainer(tokenizer, tiny_model, total_frames=16 * 4)
    rewards = RewardSet({"answer_match": answer_match, "format_match": format_match})
    evaluator = Evaluator(trainer.collector.engine, tokenizer, held_out, rewards, every=3, k=4)
    trainer.register_op("pre_train", evaluator.before_training, "evaluate_untrained")
    trainer.register_op("post_iteration", evaluator, "evaluate")
    evaluated_at = []
    trainer.register_op("post_iteration", lambda t: evaluated_at.append((t.iterations, len(evaluator.history))))
    trainer.train()
    assert trainer.iterations == 4
    # before training, every 3 iterations, and after the last
    assert evaluated_at == [(1, 1), (2, 1), (3, 2), (4, 3)]
    keys = set(evaluator.history[0])
    assert {"eval/answer_match/greedy_mean", "eval/answer_match/pass@4", "eval/format_match/pass@4"} <= keys
    again = evaluator.evaluate()
    assert again == evaluator.history[-1], "greedy and keyed sampling make evaluation deterministic"
    with pytest.raises(ValueError, match="Evaluator: rows is empty; pass the held-out rows"):
        Evaluator(trainer.collector.engine, tokenizer, [], rewards, every=1)


def test_parts_are_checked_against_their_contracts_once(tokenizer, tiny_model):
    """grpo_accel/contracts.py: a loss or stepper that is not one of its contracts is refused, naming the contract;
    torchrl's duck types are wrapped once: a logger with only log_scalar gets every scalar, and a sender with only
    update_weights is called for every push."""
    class Scalars:  # torchrl's Logger interface, nothing more
        def __init__(self):
            self.logged = []

        def log_scalar(self, name, value, step=None):
            self.logged.append((name, step))

    class Pushes:
        calls = 0

        def update_weights(self):
            Pushes.calls += 1

    scalars = Scalars()
    trainer = make_trainer(tokenizer, tiny_model, logger=scalars, weight_sync_sender=Pushes())
    trainer.train()
    assert ("train/reward_mean", 3) in scalars.logged and Pushes.calls == trainer.weight_version == 3
    with pytest.raises(ValueError, match=r"loss_module=.*subclasses grpo_accel.contracts.LossModule"):
        make_trainer(tokenizer, tiny_model, loss_module=torch.nn.Linear(2, 2))

    class Stepper:  # the right methods, but not the contract
        optimizer = torch.optim.SGD(tiny_model.parameters(), lr=0.1)

    with pytest.raises(ValueError, match=r"optimization_stepper=.*subclass grpo_accel.contracts.OptimizationStepper"):
        make_trainer(tokenizer, tiny_model, optimizer=None, optimization_stepper=Stepper())


def test_a_collector_of_another_process_is_refused():
    """Under several processes each collector must hold its own process's share (explicit rank, checked)."""
    from types import SimpleNamespace

    from grpo_accel.trainer.args import check_collector

    collector = SimpleNamespace(layout=BatchLayout(4, 2, processes=2), rank=0)
    check_collector(collector, SimpleNamespace(num_processes=2, process_index=0))
    with pytest.raises(ValueError, match=r"collector.rank=0: this is process 1; build the collector with "
                                         r"rank=accelerator.process_index"):
        check_collector(collector, SimpleNamespace(num_processes=2, process_index=1))


def test_an_engine_of_ones_own_plugs_in_through_the_contract(tokenizer, tiny_model):
    """An engine written from grpo_accel/contracts.py alone (generate, pad_id, max_new_tokens; its rollout made by
    batch.make_rollout) is collected from, scored and trained on like the built-in ones."""
    from grpo_accel.contracts import RolloutEngine
    from grpo_accel.loss import GRPOLoss
    from grpo_accel.trainer import GRPOTrainer

    digits = [tokenizer.convert_tokens_to_ids(d) for d in "0123456789"]

    class Guess(RolloutEngine):
        """Answers every prompt with a random digit and EOS; logprob log(1/10) for each."""
        pad_id, max_new_tokens = tokenizer.pad_token_id, 2

        def generate(self, prompt_ids, group_size, seeds=None, greedy=False):
            rows = [p for p in prompt_ids for _ in range(group_size)]
            picks = torch.randint(0, 10, (len(rows),)).tolist()
            completions = [[digits[i], tokenizer.eos_token_id] for i in picks]
            return batch.make_rollout(prompts=rows, completions=completions, engine_logprobs=[[-2.3, 0.0]] * len(rows),
                                      finish_reason=[batch.FINISH_STOP] * len(rows),
                                      weight_version=[self.weight_version] * len(rows), pad_id=self.pad_id)

    rewards = RewardSet({"answer_match": answer_match})
    collector = GRPOCollector(Guess(), tokenizer, addition_rows(4)[0], rewards, layout=BatchLayout(4, 4))
    trainer = GRPOTrainer(collector=collector, total_frames=32, loss_module=GRPOLoss(tiny_model),
                          optimizer=torch.optim.AdamW(tiny_model.parameters()), empty_replay_buffer_on_weight_update=True)
    trainer.train()
    assert trainer.iterations == 2 and trainer.optim_steps == 2 and "train/loss" in trainer.history[-1]
    collector.close()  # the contract's defaults: nothing to release


def test_a_loss_at_another_temperature_than_the_engine_is_refused_where_the_trainer_is_assembled(tokenizer):
    """Issue 51: the sampling temperature reached the engine and the loss separately and nothing checked that they
    agree for a Python API user: a loss at 1.0 over an engine sampling at 0.7 trained on the wrong ratios."""
    from grpo_accel.loss import GRPOLoss
    from grpo_accel.trainer import GRPOTrainer

    model = build_tiny_model(tokenizer, seed=0)
    engine = EmbeddedEngine(model, tokenizer, max_new_tokens=2, temperature=0.7)
    collector = GRPOCollector(engine, tokenizer, addition_rows(4)[0], RewardSet({"a": answer_match}),
                              layout=BatchLayout(prompts=2, group_size=2))
    with pytest.raises(ValueError, match=r"GRPOTrainer: loss_module.temperature=1.0: the collector's engine samples "
                                         r"at temperature 0.7; build the loss with temperature=0.7"):
        GRPOTrainer(collector=collector, total_frames=4, loss_module=GRPOLoss(model),
                    optimizer=torch.optim.AdamW(model.parameters()))
    GRPOTrainer(collector=collector, total_frames=4, loss_module=GRPOLoss(model, temperature=0.7),
                optimizer=torch.optim.AdamW(model.parameters()))


def test_a_loss_dividing_by_another_completion_budget_is_refused_where_the_trainer_is_assembled(tokenizer):
    """Issue 59: the config path checked Dr. GRPO's divisor against the completion budget, the Python API did not:
    GRPOLoss(max_completion_tokens=256) over an engine capped at 2 tokens divided every loss by 128 x too much."""
    from grpo_accel.loss import GRPOLoss
    from grpo_accel.trainer import GRPOTrainer

    model = build_tiny_model(tokenizer, seed=0)
    collector = GRPOCollector(EmbeddedEngine(model, tokenizer, max_new_tokens=2), tokenizer, addition_rows(4)[0],
                              RewardSet({"a": answer_match}), layout=BatchLayout(prompts=2, group_size=2))
    assert collector.completion_budget == 2

    def loss(budget):
        return GRPOLoss(model, aggregation="seq_mean_token_sum_norm", max_completion_tokens=budget)

    with pytest.raises(ValueError, match=r"GRPOTrainer: loss_module.max_completion_tokens=256: the collector's "
                                         r"completions hold up to 2 tokens .*build the loss with max_completion_tokens=2"):
        GRPOTrainer(collector=collector, total_frames=4, loss_module=loss(256),
                    optimizer=torch.optim.AdamW(model.parameters()))
    GRPOTrainer(collector=collector, total_frames=4, loss_module=loss(2), optimizer=torch.optim.AdamW(model.parameters()))


def test_an_async_checkpoint_holds_the_data_position_of_the_batches_trained_on(tokenizer, tmp_path):
    """The batch the thread is collecting while a checkpoint is saved was not trained on: the saved data position
    is the one after the batches consumed, so a resume collects that batch again (the same prompts, the same
    group numbers), none skipped, none counted twice."""
    from grpo_accel.checkpoint import Checkpoint, rank_state_file

    trainer, _, _ = _async_trainer(tokenizer, max_staleness=None, save_trainer_interval=16,
                                   checkpoint=Checkpoint(tmp_path / "ckpt"))
    rows = len(trainer.collector.rows)
    trainer.train()
    for step in range(1, 7):
        saved = torch.load(rank_state_file(tmp_path / "ckpt" / f"step_{step:08d}", 0), weights_only=True)["collector"]
        assert saved["batches"] == step and saved["epoch"] * rows + saved["position"] == 4 * step, (step, saved)


def test_a_stop_from_a_hook_logs_its_batch_and_a_tied_models_checkpoint_says_nothing_of_the_tie(tokenizer,
                                                                                             tmp_path, caplog):
    """Issue 74 item 12, from the Python API: request_stop in post_iteration left the batch it stopped at unlogged
    (the last batch always logs), and every checkpoint of a tied-embedding model said Accelerate's "Removed shared
    tensor {'policy.lm_head.weight'} ... check by verifying that you don't receive any warning while reloading"."""
    import logging

    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.tasks.tiny import build_tiny_qwen2

    trainer = make_trainer(tokenizer, build_tiny_qwen2(tokenizer, seed=0), total_frames=16 * 4, log_interval=10**6,
                           log_first=False, checkpoint=Checkpoint(tmp_path / "ckpt"))
    trainer.register_op("post_iteration", lambda t: t.iterations == 2 and t.request_stop("enough"))
    with caplog.at_level(logging.WARNING):
        trainer.train()
    assert [h["train/frames"] for h in trainer.history] == [32], "the batch it stopped at logs"
    assert "training stopped early after 32 frames: enough" in caplog.text
    assert [p.name for p in (tmp_path / "ckpt").iterdir()] == ["step_00000002"]
    assert "Removed shared tensor" not in caplog.text
