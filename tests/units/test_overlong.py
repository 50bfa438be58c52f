"""Overlong handling (DAPO): truncated completions out of the loss, and the soft length penalty. Numbers by hand."""
import json

import pytest
import torch

from grpo_accel import batch
from grpo_accel.embedded.engine import EmbeddedEngine
from grpo_accel.loss import GRPOLoss, without_truncated
from grpo_accel.config.checks import ConfigError
from grpo_accel.rewards import overlong_penalty, soft_overlong_penalty
from trainer_utils import train_in_process


def test_soft_overlong_penalty_by_hand():
    # limit 20, cache 4: free up to 16 tokens, then (16 - L) / 4 down to -1 at 20, -1 past it
    got = [soft_overlong_penalty(n, 20, 4) for n in (0, 16, 17, 18, 19, 20, 21)]
    assert got == [0.0, 0.0, -0.25, -0.5, -0.75, -1.0, -1.0]
    assert overlong_penalty(["p"] * 3, ["a", "b", "c"], [[1] * 3, [1] * 4, [1] * 5], max_tokens=5, cache_tokens=2) == [
        0.0, -0.5, -1.0]  # free up to 3 tokens: 3 -> 0, 4 -> (3 - 4) / 2, 5 -> -1
    with pytest.raises(ValueError, match="cache_tokens=6 must be in 1..max_tokens=5"):
        overlong_penalty(["p"], ["a"], [[1]], max_tokens=5, cache_tokens=6)


def test_without_truncated_by_hand():
    mask = torch.tensor([[1, 1, 0], [1, 1, 1], [1, 0, 0]])
    finish = torch.tensor([batch.FINISH_STOP, batch.FINISH_LENGTH, batch.FINISH_ABORT])
    assert without_truncated(mask, finish).tolist() == [[1, 1, 0], [0, 0, 0], [1, 0, 0]]


def test_masked_truncated_rows_add_nothing_to_the_loss_or_its_gradient(tokenizer, tiny_model):
    """The loss over a batch with its truncated rows masked equals the loss over the other rows alone (token mean:
    the same numerator and the same token count), and those rows get no gradient."""
    torch.manual_seed(0)
    engine = EmbeddedEngine(tiny_model, tokenizer, max_new_tokens=3)
    td = engine.generate([tokenizer(p)["input_ids"] for p in ["1+2=", "3+4="]], 4)
    td[batch.ADVANTAGES] = torch.randn(td.shape[0])
    td[batch.FINISH_REASON] = torch.tensor([1, 0, 1, 0, 0, 1, 0, 0])  # rows 0, 2, 5 cut by the limit
    kept = td[td[batch.FINISH_REASON] != batch.FINISH_LENGTH]
    masked_loss = GRPOLoss(tiny_model, mask_truncated=True, shared_prompts=False)
    plain_loss = GRPOLoss(tiny_model, shared_prompts=False)
    assert masked_loss.units(td) == plain_loss.units(kept) == kept[batch.COMPLETION_MASK].sum()
    masked, alone = masked_loss(td)["loss_objective"], plain_loss(kept)["loss_objective"]
    torch.testing.assert_close(masked, alone, rtol=1e-6, atol=1e-7)
    grads = []
    for value in (masked, alone):
        tiny_model.zero_grad()
        value.backward()
        grads.append([p.grad.clone() for p in tiny_model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-7)
    full = GRPOLoss(tiny_model, shared_prompts=False)(td)["loss_objective"]
    assert not torch.allclose(full, masked)  # without the setting they count
    td[batch.FINISH_REASON] = torch.full_like(td[batch.FINISH_REASON], batch.FINISH_LENGTH)  # every row cut
    nothing = masked_loss(td)["loss_objective"]
    assert float(nothing.detach()) == 0.0 and masked_loss.units(td) == 0  # a zero loss, not 0 / 0
    from grpo_accel.trainer.normalizer import distributed_normalizer

    assert float(distributed_normalizer(masked_loss.units(td), 2, 1)) == 0.5  # the step's divisor: 1 / (2 x 1)


def test_a_run_with_overlong_handling_logs_its_parts(tmp_path):
    out = tmp_path / "run"
    assert train_in_process([
        f"output_dir={out}", "trainer.total_frames=384", "trainer.progress_bar=false", "loss.mask_truncated=true",
        "rewards=[{name: answer_match}, {name: overlong_penalty, weight: 0.5, kwargs: {cache_tokens: 2}}]",
        "data.holdout=4", "eval.every_iterations=3"]) == 0
    from grpo_accel.reporting.event_files import read_scalars

    scalars = read_scalars(out / "tensorboard")
    truncated = [v for _, v in scalars["train/truncated_fraction"]]
    penalty = [v for _, v in scalars["train/reward/overlong_penalty_mean"]]
    assert len(truncated) == len(penalty) == 3
    assert all(-1.0 <= p <= 0.0 for p in penalty) and any(p < 0 for p in penalty)  # 4 tokens, free up to 2
    assert all(p <= -t for p, t in zip(penalty, truncated))  # a truncated reply (4 tokens) costs the full -1
    assert [s for s, _ in scalars["eval/stopped_fraction"]] == [0, 3]
    saved = json.loads((out / "summary.json").read_text())
    assert saved["iterations"] == 3


def test_overlong_penalty_needs_its_cache_length():
    from grpo_accel.config.loading import load_config
    from grpo_accel.recipe.parts import build_rewards

    cfg = load_config(None, ["rewards=[{name: overlong_penalty}]"])
    with pytest.raises(ConfigError, match=r"rewards\[name=overlong_penalty\].kwargs={}: give cache_tokens"):
        build_rewards(cfg.rewards, 4)
    bound = build_rewards(load_config(None, ["rewards=[{name: overlong_penalty, kwargs: {cache_tokens: 2}}]"]).rewards,
                          16).fns["overlong_penalty"]
    assert bound.keywords == {"max_tokens": 16, "cache_tokens": 2}  # the limit is the completion budget
