"""The keyed sampler: one uniform per row and step, drawn through the row's cumulative distribution."""
import torch

from grpo_accel.rollout.sampling import KeyedSampler, inverse_cdf, keyed_uniform

PROBS = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.06, 0.03, 0.01])  # a small vocabulary with a rare token
CHI2_999 = {6: 22.46, 48: 84.04}  # the chi-square distribution's 0.999 quantile for these degrees of freedom


def chi_square(counts: torch.Tensor, expected: torch.Tensor) -> float:
    return float(((counts - expected) ** 2 / expected).sum())


def test_draws_follow_the_distribution():
    """20,000 keys: the counts of each token pass a chi-square test at the 0.1 % level (fixed keys: the test
    gives the same answer every run); a sampler off by one token, or one that ignores the temperature, fails it."""
    n = 20_000
    logits = PROBS.log().repeat(n, 1) * 2.0  # temperature 2 undoes the doubling
    sampler = KeyedSampler(torch.arange(n), 0, temperature=2.0)
    tokens = sampler.draw(logits, keyed_uniform(torch.arange(n), torch.tensor([0]))[:, 0])
    counts = torch.bincount(tokens, minlength=len(PROBS)).double()
    assert chi_square(counts, n * PROBS.double()) < CHI2_999[6]
    shifted = torch.bincount((tokens + 1) % len(PROBS), minlength=len(PROBS)).double()
    assert chi_square(shifted, n * PROBS.double()) > 10 * CHI2_999[6]
    cold = KeyedSampler(torch.arange(n), 0, temperature=1.0).draw(logits, keyed_uniform(torch.arange(n), torch.tensor([0]))[:, 0])
    assert chi_square(torch.bincount(cold, minlength=len(PROBS)).double(), n * PROBS.double()) > 10 * CHI2_999[6]


def test_steps_are_independent_and_filters_hold():
    """The pair (token at step 0, token at step 1) of each key follows the product distribution; top-k and top-p
    never draw what they exclude."""
    n = 20_000
    u = keyed_uniform(torch.arange(n), torch.tensor([0, 1]))  # [N, 2]
    z = PROBS.log().repeat(n, 1)
    first, second = inverse_cdf(z, u[:, 0]), inverse_cdf(z, u[:, 1])
    pairs = torch.bincount(first * len(PROBS) + second, minlength=len(PROBS) ** 2).double()
    assert chi_square(pairs, n * torch.outer(PROBS, PROBS).flatten().double()) < CHI2_999[48]
    top_k = KeyedSampler(torch.arange(n), 0, 1.0, top_k=2).draw(z, u[:, 0])
    assert set(top_k.tolist()) == {0, 1}
    top_p = KeyedSampler(torch.arange(n), 0, 1.0, top_p=0.7).draw(z, u[:, 0])  # 0.40 + 0.25 < 0.7: three tokens
    assert set(top_p.tolist()) == {0, 1, 2}


def test_a_rows_draw_depends_only_on_its_key_and_logits():
    """The same key and logits give the same token alone or inside any batch, in any position: what makes
    2 processes x 64 completions draw what 1 x 128 draws."""
    torch.manual_seed(0)
    logits = torch.randn(64, 49_152) * 3
    keys = torch.arange(1000, 1064)
    u = keyed_uniform(keys, torch.tensor([7]))[:, 0]
    together = inverse_cdf(logits, u)
    order = torch.randperm(64)
    assert torch.equal(inverse_cdf(logits[order], u[order]), together[order])
    halves = torch.cat([inverse_cdf(logits[:32], u[:32]), inverse_cdf(logits[32:], u[32:])])
    assert torch.equal(halves, together)
    assert all(int(inverse_cdf(logits[i : i + 1], u[i : i + 1])) == int(together[i]) for i in range(0, 64, 9))


def test_extreme_uniforms_stay_on_tokens_with_mass():
    """u next to 0 or 1 lands on the first or last token the filters kept, never on an excluded one."""
    z = torch.tensor([[float("-inf"), 0.0, 1.0, float("-inf")]] * 2)
    tokens = inverse_cdf(z, torch.tensor([1e-16, 1 - 1e-16], dtype=torch.float64))
    assert tokens.tolist() == [1, 2]


def test_the_three_engines_key_completions_alike(tokenizer, model_dir, servers, monkeypatch):
    """Completion j of the prompt with seed s draws with key s * group_size + j in the embedded engine, in
    multi-turn episodes' first turns and in the SGLang engine's sampling_seed (an int32 there): one function,
    rollout/sampling.completion_keys, for all three (three copies had drifted: 2**40 against 2**56 for seeds)."""
    from grpo_accel.embedded.engine import EmbeddedEngine
    from grpo_accel.rollout.episodes import EpisodeRunner
    from grpo_accel.sglang import api
    from grpo_accel.sglang.engine import SGLangEngine
    from grpo_accel.tasks.tiny import build_tiny_model
    from episode_env import Countdown, chat_tokenizer

    seeds, group, prompts = [5, 2**40 + 3], 3, [tokenizer(p)["input_ids"] for p in ("1+2=", "30+4=")]
    expected = [s * group + j for s in seeds for j in range(group)]
    embedded = EmbeddedEngine(build_tiny_model(tokenizer, seed=0), tokenizer, max_new_tokens=3)
    drawn = []
    decode = embedded._decode
    monkeypatch.setattr(embedded, "_decode", lambda ids, mask, keys, *a: drawn.append(keys.tolist()) or decode(ids, mask, keys, *a))
    embedded.generate(prompts, group, seeds=seeds)
    sent = []
    sampling_params = api.sampling_params
    monkeypatch.setattr(api, "sampling_params",  # what goes out: the body's sampling_seed
                        lambda *a, **k: sent.append(sampling_params(*a, **k)["sampling_seed"]) or sampling_params(*a, **k))
    SGLangEngine([servers.get(model_dir)], tokenizer, max_new_tokens=3).generate(prompts, group, seeds=seeds)
    chat = chat_tokenizer()
    runner = EpisodeRunner(EmbeddedEngine(build_tiny_model(chat, seed=0), chat, max_new_tokens=3), chat, Countdown,
                           max_turns=1)
    rows = [{"prompt": "1+2="}, {"prompt": "30+4="}]
    _, episodes = runner.run(rows, runner.encode(rows), group, seeds=seeds)
    assert drawn == [expected] and [e.key for e in episodes] == expected
    assert sent == [k % 2**31 for k in expected]
