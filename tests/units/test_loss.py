"""The GRPO objective. Expected numbers are worked out by hand in the comments."""
import copy
import math

import pytest
import torch

from grpo_accel import batch
from grpo_accel.advantages import group_advantages
from grpo_accel.loss import (
    AGGREGATIONS,
    GRPOLoss,
    clipped_surrogate,
    effective_sample_size,
    engine_mismatch,
    kl_k1,
    kl_k2,
    kl_k3,
    sequence_log_ratio,
    token_log_ratio,
    engine_is_weights,
)
from grpo_accel.embedded.engine import EmbeddedEngine
from grpo_accel.trainer.normalizer import distributed_normalizer


def test_group_advantages_by_hand():
    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0, 2.0, 2.0, 2.0, 2.0])  # two groups of 4
    # group 1: mean 0.5, unbiased std sqrt(4 * 0.25 / 3) = 0.57735 -> +-0.5 / (0.57735 + 1e-4) = +-0.86588
    # group 2: all rewards tie -> 0 whatever the scaling
    adv = group_advantages(rewards, 4)
    torch.testing.assert_close(adv, torch.tensor([0.86588, -0.86588, -0.86588, 0.86588, 0, 0, 0, 0]), atol=1e-4, rtol=0)
    # no std scaling: r - mean
    torch.testing.assert_close(group_advantages(rewards, 4, scale_by_std=False), torch.tensor([0.5, -0.5, -0.5, 0.5, 0, 0, 0, 0]))
    # leave-one-out: 1 - (0+0+1)/3 = 0.6667, 0 - (1+0+1)/3 = -0.6667
    loo = group_advantages(rewards, 4, scale_by_std=False, leave_one_out=True)
    torch.testing.assert_close(loo, torch.tensor([2 / 3, -2 / 3, -2 / 3, 2 / 3, 0, 0, 0, 0]))


def test_one_group_statistic_two_documented_choices():
    """advantages.standardised serves both callers: the advantage with the sample std (torchrl's, TRL's), a
    reward's normalize with the population std."""
    from grpo_accel.advantages import standardised
    from grpo_accel.rewards import standardise

    rewards = torch.tensor([1.0, 0.0, 0.0, 1.0])  # mean 0.5; sample std 0.57735, population std 0.5
    torch.testing.assert_close(standardise(rewards, "group", 4), torch.tensor([1.0, -1.0, -1.0, 1.0]), atol=1e-5, rtol=0)
    torch.testing.assert_close(group_advantages(rewards, 4), standardised(rewards.view(1, 4), torch.tensor([[0.5]]),
                                                                          sample_std=True, eps=1e-4).view(-1))
    assert float(group_advantages(rewards, 4)[0]) == pytest.approx(0.5 / (0.57735 + 1e-4), abs=1e-4)
    assert standardise(torch.tensor([3.0]), "batch").tolist() == [0.0]  # one row: the population std is defined


def test_clipped_surrogate_by_hand():
    log_ratio = torch.tensor([[0.5, 1.0, 1.5], [0.5, 1.0, 1.5]]).log()
    adv = torch.tensor([1.0, -1.0])
    loss, side = clipped_surrogate(log_ratio, adv, eps_low=0.2, eps_high=0.28)
    # A=+1: -min(r, clip(r, 0.8, 1.28)) = [-0.5, -1, -1.28]   (1.5 is clipped to 1.28)
    # A=-1: -min(-r, -clip(r)) = max(r, clip(r)) = [0.8, 1, 1.5]   (0.5 is clipped to 0.8)
    torch.testing.assert_close(loss, torch.tensor([[-0.5, -1.0, -1.28], [0.8, 1.0, 1.5]]))
    assert side.tolist() == [[0, 0, 1], [-1, 0, 0]]  # +1: clipped high (A > 0), -1: clipped low (A < 0)


def test_kl_estimators_by_hand():
    logp, ref = torch.tensor([math.log(0.5)]), torch.tensor([math.log(0.25)])
    # log(pi/ref) = log 2 = 0.693147
    torch.testing.assert_close(kl_k1(logp, ref), torch.tensor([0.693147]))
    torch.testing.assert_close(kl_k2(logp, ref), torch.tensor([0.5 * 0.693147**2]))  # 0.240227
    torch.testing.assert_close(kl_k3(logp, ref), torch.tensor([0.5 + 0.693147 - 1]))  # ref/pi - log(ref/pi) - 1
    for kl in (kl_k1, kl_k2, kl_k3):
        assert kl(logp, logp).abs().max() == 0


def test_aggregation_normalisers_by_hand():
    token_loss = torch.tensor([[1.0, 2.0, 3.0], [4.0, 9.0, 9.0]])
    mask = torch.tensor([[1.0, 1.0, 1.0], [1.0, 0.0, 0.0]])  # 9s are padding
    def agg(mode, max_tokens=None):
        return AGGREGATIONS[mode](token_loss, mask) / AGGREGATIONS[mode].units(mask, max_tokens)
    assert agg("token_mean") == pytest.approx((1 + 2 + 3 + 4) / 4)  # 2.5: every token weighs the same
    assert agg("seq_mean_token_mean") == pytest.approx((6 / 3 + 4 / 1) / 2)  # 3.0: every sequence the same
    assert agg("seq_mean_token_sum_norm", 4) == pytest.approx(10 / (2 * 4))  # 1.25: constant normaliser


def test_sequence_ratio_is_length_normalised_and_keeps_token_gradients():
    logp = torch.tensor([[-1.0, -2.0, 0.0]], requires_grad=True)
    old = torch.tensor([[-1.5, -1.0, 0.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    s = sequence_log_ratio(logp, old, mask)
    # mean over the 2 real tokens of (0.5, -1.0) = -0.25 on every token
    torch.testing.assert_close(s.detach(), torch.full((1, 3), -0.25))
    s.sum().backward()
    torch.testing.assert_close(logp.grad, torch.ones(1, 3))  # d/dlogp of sg[s] + logp - sg[logp]
    # the token ratio is each token's own pi / pi_old: e^-1 / e^-1.5, e^-2 / e^-1, 1
    ratio = token_log_ratio(logp, old, mask).detach().exp()
    torch.testing.assert_close(ratio, torch.tensor([[math.exp(0.5), math.exp(-1.0), 1.0]]))


def test_engine_is_weights_in_every_mode_and_ess():
    old, engine = torch.tensor([[0.0, 0.0, 0.0]]), torch.tensor([[math.log(4.0), -math.log(4.0), 5.0]])
    mask = torch.tensor([[1.0, 1.0, 0.0]])  # the third token is padding: its ratio counts nowhere
    # pi_old / pi_engine per token = [1/4, 4]; per completion = 1/4 x 4 = 1
    weights = lambda mode, **kw: engine_is_weights(old, engine, mask, mode, **kw)[:, :2]  # noqa: E731
    torch.testing.assert_close(weights("token_truncate", cap=2.0), torch.tensor([[0.25, 2.0]]))
    torch.testing.assert_close(weights("token_truncate", cap=2.0, floor=0.5), torch.tensor([[0.5, 2.0]]))
    torch.testing.assert_close(weights("token_mask", cap=2.0), torch.tensor([[0.25, 0.0]]))
    torch.testing.assert_close(weights("token_mask", cap=5.0, floor=0.5), torch.tensor([[0.0, 4.0]]))
    torch.testing.assert_close(weights("sequence_truncate", cap=0.5), torch.tensor([[0.5, 0.5]]))
    torch.testing.assert_close(weights("sequence_mask", cap=3.0), torch.tensor([[1.0, 1.0]]))
    torch.testing.assert_close(weights("sequence_mask", cap=0.5), torch.tensor([[0.0, 0.0]]))
    with pytest.raises(ValueError, match="tis_mode='sentence'"):
        engine_is_weights(old, engine, mask, "sentence", cap=2.0)
    mask = torch.ones(1, 2)
    assert effective_sample_size(torch.zeros(1, 2), mask) == pytest.approx(1.0)
    # w = [1, 3]: (1+3)^2 / (2 * (1+9)) = 0.8
    assert effective_sample_size(torch.tensor([[0.0, math.log(3.0)]]), mask) == pytest.approx(0.8)


@pytest.mark.parametrize("mode", sorted(AGGREGATIONS))
def test_two_ranks_with_accumulation_equal_the_global_batch(mode):
    """Two simulated ranks x two accumulated micro-batches give the full batch's gradient exactly."""
    torch.manual_seed(0)
    logp = torch.randn(8, 5, dtype=torch.float64, requires_grad=True)
    old = logp.detach() + 0.1 * torch.randn(8, 5, dtype=torch.float64)
    adv = torch.randn(8, dtype=torch.float64)
    mask = (torch.rand(8, 5) > 0.3).double()
    mask[:, 0] = 1
    mask[6:, 1:] = 0  # uneven lengths across ranks
    agg = AGGREGATIONS[mode]

    def numerator(rows):
        loss, _ = clipped_surrogate(token_log_ratio(logp[rows], old[rows], mask[rows]), adv[rows], 0.2, 0.28)
        return agg(loss, mask[rows])

    full = numerator(slice(0, 8)) / AGGREGATIONS[mode].units(mask, 5)
    expected = torch.autograd.grad(full, logp)[0]
    world, ga = 2, 2
    micro = [slice(0, 2), slice(2, 4), slice(4, 6), slice(6, 8)]  # rank 0: first two, rank 1: last two
    total_units = sum(AGGREGATIONS[mode].units(mask[m], 5) for m in micro)
    norm = distributed_normalizer(total_units, world, ga)
    grads = torch.zeros_like(logp)
    for m in micro:  # Accelerate divides each micro-batch by ga; DDP averages over ranks
        grads += torch.autograd.grad(numerator(m) / norm / ga, logp)[0] / world
    torch.testing.assert_close(grads, expected)


# ---------------------------------------------------------------------------------------- GRPOLoss


def _rollout(tokenizer, model, n_prompts=2, group=4, seed=0):
    torch.manual_seed(seed)
    engine = EmbeddedEngine(model, tokenizer, max_new_tokens=5)
    td = engine.generate([tokenizer(p)["input_ids"] for p in ["1+2=", "33+4="][:n_prompts]], group)
    td[batch.ADVANTAGES] = torch.randn(td.shape[0])
    return td


def test_first_epoch_ratio_is_one_and_nothing_clipped(tokenizer, tiny_model):
    td = _rollout(tokenizer, tiny_model)
    loss = GRPOLoss(tiny_model, clip_epsilon=(0.2, 0.28))
    loss.add_old_logprobs(td)
    out = loss(td)
    assert out["ratio_mean"] == pytest.approx(1.0, abs=1e-6)
    assert out["ratio_min"] == pytest.approx(1.0, abs=1e-6) and out["ratio_max"] == pytest.approx(1.0, abs=1e-6)
    assert out["clip_fraction"] == 0 and out["ESS"] == pytest.approx(1.0)
    assert out["kl_approx"] == pytest.approx(0.0, abs=1e-6)
    assert "loss_kl" not in out.keys() and loss.reference is None
    assert all(not out[k].requires_grad for k in out.keys() if not k.startswith("loss_"))
    assert out["loss_objective"].requires_grad


def test_engine_mismatch_by_hand_and_in_the_loss(tokenizer, tiny_model):
    trainer = torch.tensor([[-1.0, -2.0, -3.0], [-0.5, -0.1, -4.0]])
    engine = torch.tensor([[-1.0, -2.5, -9.0], [-0.6, -0.1, -4.0]])
    out = engine_mismatch(trainer, engine, torch.tensor([[1, 1, 0], [1, 1, 1]]))  # the -9.0 is padding
    assert out["engine_logprob_abs_diff"] == pytest.approx(0.6 / 5)
    assert out["engine_prob_ratio_max"] == pytest.approx(math.exp(0.5))
    td = _rollout(tokenizer, tiny_model)  # the embedded engine: the trainer's own weights, batched differently
    td[batch.ENGINE_LOGPROBS][0, 0] += 0.25  # as if the engine's kernel had rounded that token's logprob apart
    out = GRPOLoss(tiny_model)(td)
    assert 0.25 / td[batch.COMPLETION_MASK].sum() < out["engine_logprob_abs_diff"] < 0.25 / td[batch.COMPLETION_MASK].sum() + 1e-5
    assert out["engine_prob_ratio_max"] == pytest.approx(math.exp(0.25), abs=1e-4)


def test_kl_is_zero_when_reference_equals_policy(tokenizer, tiny_model):
    td = _rollout(tokenizer, tiny_model)
    for estimator in ("k1", "k2", "k3"):
        loss = GRPOLoss(tiny_model, copy.deepcopy(tiny_model), kl_coef=0.1, kl_estimator=estimator)
        loss.add_reference_logprobs(td)
        out = loss(td)
        assert out["loss_kl"].abs() < 1e-6 and out["kl_ref"].abs() < 1e-6
        del td[batch.REF_LOGPROBS]


def test_reference_is_never_run_with_zero_kl(tokenizer, tiny_model):
    class Exploding(torch.nn.Module):
        def forward(self, *a, **k):
            raise AssertionError("reference forward ran with kl_coef=0")

    loss = GRPOLoss(tiny_model, Exploding(), kl_coef=0.0)
    td = _rollout(tokenizer, tiny_model)
    loss.add_reference_logprobs(td)
    assert batch.REF_LOGPROBS not in td.keys() and "loss_kl" not in loss(td).keys()


def test_positive_advantage_raises_its_completion_logprob(tokenizer, tiny_model):
    td = _rollout(tokenizer, tiny_model, n_prompts=1, group=2)
    td[batch.ADVANTAGES] = torch.tensor([1.0, -1.0])
    loss = GRPOLoss(tiny_model)
    before = loss.logprobs(tiny_model, td).sum(-1).detach()
    opt = torch.optim.SGD(tiny_model.parameters(), lr=0.5)
    loss(td)["loss_objective"].backward()
    opt.step()
    after = loss.logprobs(tiny_model, td).sum(-1).detach()
    assert after[0] > before[0] and after[1] < before[1]


@pytest.mark.parametrize(
    "importance_level, aggregation, tis_cap",
    # GSPO's objective mean_i min(s_i A_i, clip(s_i) A_i) is the sequence ratio with sequence-mean aggregation;
    # a per-token TIS weight has no such closed form there, so that case runs without it.
    [("token", "token_mean", 2.0), ("token", "seq_mean_token_mean", 2.0), ("sequence", "seq_mean_token_mean", None)],
)
def test_loss_gradient_matches_finite_difference(tokenizer, tiny_model, importance_level, aggregation, tis_cap):
    model = tiny_model.double()
    td = _rollout(tokenizer, model, seed=3)
    loss = GRPOLoss(model, copy.deepcopy(model), kl_coef=0.05, importance_level=importance_level,
                    aggregation=aggregation, tis_cap=tis_cap)
    with torch.no_grad():  # off-policy old logprobs so clipping and the ratio matter
        td[batch.OLD_LOGPROBS] = loss.logprobs(model, td) + 0.3 * torch.randn(td[batch.COMPLETION_IDS].shape) * td[batch.COMPLETION_MASK]
        td[batch.REF_LOGPROBS] = td[batch.OLD_LOGPROBS] - 0.1
    weight = model.lm_head.weight

    def total():
        out = loss(td)
        return out["loss_objective"] + out["loss_kl"]

    grad = torch.autograd.grad(total(), weight)[0]
    h = 1e-6
    for idx in [(4, 0), (7, 3), (10, 5)]:
        with torch.no_grad():
            weight[idx] += h
            up = total()
            weight[idx] -= 2 * h
            down = total()
            weight[idx] += h
        assert grad[idx].item() == pytest.approx(((up - down) / (2 * h)).item(), rel=1e-4, abs=1e-8)


@pytest.mark.parametrize(
    "kwargs, fragment",
    [
        ({"clip_epsilon": -0.1}, "clip_epsilon"),
        ({"kl_coef": 0.1}, "reference model"),
        ({"kl_estimator": "k9"}, "kl_estimator"),
        ({"aggregation": "mean"}, "aggregation"),
        ({"aggregation": "seq_mean_token_sum_norm"}, "max_completion_tokens"),
        ({"importance_level": "word"}, "importance_level"),
        ({"tis_cap": 0.5}, "tis_cap"),
    ],
)
def test_bad_loss_settings_name_the_setting(tiny_model, kwargs, fragment):
    with pytest.raises(ValueError, match=fragment):
        GRPOLoss(tiny_model, **kwargs)
