"""Shared prompts: one row per distinct prompt and k of its completions, each seeing the prompt and itself.

The logprobs must be the padded forward's, gradients included; the model must really run fewer tokens; k comes
from a cost count worked here by hand; a model that takes no 4-D mask, or ignores it, runs padded.
"""
import functools
import logging

import pytest
import torch
from tensordict import TensorDict
from transformers import LlamaForCausalLM

from grpo_accel import batch
from grpo_accel.loss.paths import completions_per_row, distinct_prompts, shared_forward
from grpo_accel.logprobs import sequence_logprobs
from grpo_accel.tasks.tiny import build_char_tokenizer, build_tiny_model, build_tiny_qwen2


def _grouped_batch(vocab: int, prompt_lens: list[int], completion_lens: list[int], group: int, seed: int = 0):
    """Each prompt ``group`` times (left-padded), rows shuffled; completions right-padded, one per row."""
    g = torch.Generator().manual_seed(seed)
    prompts = [prompt for n in prompt_lens for prompt in [torch.randint(3, vocab, (n,), generator=g).tolist()] * group]
    lens = [n for n in prompt_lens for _ in range(group)]
    order = torch.randperm(len(prompts), generator=g).tolist()
    prompts, lens = [prompts[i] for i in order], [lens[i] for i in order]
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in completion_lens]
    return (batch.pad_sequences(prompts, 0, "left"), batch.pad_sequences([[1] * n for n in lens], 0, "left"),
            batch.pad_sequences(completions, 0, "right"),
            batch.pad_sequences([[1] * n for n in completion_lens], 0, "right"))


def _tokens_run(model, call) -> tuple[object, list[int]]:
    """``call()``'s result and the tokens of each forward the model ran (input_ids numel)."""
    runs = []
    handle = model.get_input_embeddings().register_forward_hook(lambda _m, args, _out: runs.append(args[0].numel()))
    try:
        return call(), runs
    finally:
        handle.remove()


def test_distinct_prompts_ignore_padding_ids():
    ids = torch.tensor([[0, 5, 6], [9, 5, 6], [7, 5, 6], [0, 5, 6]])
    mask = torch.tensor([[0, 1, 1], [0, 1, 1], [1, 1, 1], [0, 1, 1]])
    first, of_row = distinct_prompts(ids, mask)
    assert of_row[0] == of_row[1] == of_row[3] != of_row[2]  # rows 0, 1, 3: "5 6" (row 1 pads with id 9)
    assert torch.equal(first[of_row], torch.tensor([0, 0, 2, 0]))


def test_completions_per_row_weighs_projections_against_attention():
    # hidden 576, prompt 6, width 31: k=1: 4 rows x (3*576*37 + 37^2) = 261,220; k=2: 2 x (3*576*68 + 68^2) = 244,256;
    # k=4: 1 x (3*576*130 + 130^2) = 241,540
    assert completions_per_row([4, 4], prompt=6, width=31, hidden=576) == 4
    # long completions, short prompt, narrow model: attention over the longer row outweighs the prompt saved
    # (k=1: 8 x (3*64*1027 + 1027^2) = 9,015,032; k=2: 4 x (3*64*2051 + 2051^2) = 18,400,612)
    assert completions_per_row([8], prompt=4, width=1023, hidden=64) == 1
    assert completions_per_row([1, 1, 1], prompt=40, width=31, hidden=576) == 1  # nothing repeats
    assert completions_per_row([3, 1], prompt=40, width=31, hidden=576) == 3


def _assert_same_gradients(expected: list, actual: list) -> None:
    for x, y in zip(expected, actual):
        assert float((y - x).abs().max()) <= 1e-5 * float(x.abs().max()), (x, y)


def _forward_at(k: int):
    return functools.partial(shared_forward, per_row=k)


@pytest.mark.parametrize("build", [build_tiny_model, build_tiny_qwen2], ids=["llama", "qwen2"])
@pytest.mark.parametrize("k", [2, 4])
def test_shared_prompts_give_the_padded_logprobs_entropy_and_gradients(tokenizer, build, k):
    model = build(tokenizer, seed=0).double()
    inputs = _grouped_batch(model.config.vocab_size, [5, 2, 7], [6, 1, 4, 0, 6, 3, 2, 6, 5, 1, 4, 6], group=4)
    results = []
    for forward in (None, _forward_at(k)):
        model.zero_grad()
        (logp, entropy), runs = _tokens_run(model, lambda: sequence_logprobs(model, *inputs, temperature=0.7,
                                                                             with_entropy=True, forward=forward))
        (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)).sum().backward()
        results.append((logp, entropy, [p.grad.clone() for p in model.parameters()], runs))
    (a, ea, ga, padded_runs), (b, eb, gb, shared_runs) = results
    assert padded_runs == [12 * (7 + 6)]  # every row: its padded prompt and completion
    assert shared_runs == [3 * (4 // k) * (7 + k * 5)]  # a row per prompt and k completions but their last token
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    torch.testing.assert_close(eb, ea, rtol=0, atol=1e-12)
    assert (b[inputs[3] == 0] == 0).all() and b[inputs[3] == 1].lt(0).all()
    # RMSNorm computes in float32 even for float64 weights, so the gradients, summed in another order, agree to
    # float32's precision (a completion seeing another's tokens moves them by percents)
    _assert_same_gradients(ga, gb)


def _norm_in_weight_dtype(self, hidden):
    """RMSNorm computed in its weight's dtype (transformers' Llama and Qwen2 norms compute in float32 always)."""
    return self.weight * (hidden * torch.rsqrt(hidden.pow(2).mean(-1, keepdim=True) + self.variance_epsilon))


@pytest.mark.parametrize("build", [build_tiny_model, build_tiny_qwen2], ids=["llama", "qwen2"])
def test_the_shared_path_adds_no_float32_step_of_its_own(tokenizer, build, monkeypatch):
    """In float64 the shared-prompt gradient differs from the padded one by float32's precision (above) because
    transformers' RMSNorm casts its input to float32 whatever the model's dtype: rows laid out otherwise differ in
    the last bits of float64 before the norm, and the float32 rounding there turns that into ~1e-7. With the norm
    computed in the model's dtype, the two paths agree to a few float64 ulps of the largest gradient (measured:
    4.9e-16 of it for the Llama, the padded path itself being 6.6e-16 of it from a one-row-at-a-time oracle):
    nothing in the shared path (its 4-D mask, its gathers, the tied embedding's gradient) computes in float32."""
    from transformers.models.llama.modeling_llama import LlamaRMSNorm
    from transformers.models.qwen2.modeling_qwen2 import Qwen2RMSNorm

    for norm in (LlamaRMSNorm, Qwen2RMSNorm):
        monkeypatch.setattr(norm, "forward", _norm_in_weight_dtype)
    model = build(tokenizer, seed=0).double()
    inputs = _grouped_batch(model.config.vocab_size, [5, 2, 7], [6, 1, 4, 0, 6, 3, 2, 6, 5, 1, 4, 6], group=4)
    grads = []
    for forward in (None, _forward_at(4)):
        model.zero_grad()
        logp = sequence_logprobs(model, *inputs, temperature=0.7, forward=forward)
        (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)).sum().backward()
        grads.append(torch.cat([p.grad.flatten() for p in model.parameters()]))
    padded, shared = grads
    assert float((shared - padded).abs().max()) <= 8 * torch.finfo(torch.float64).eps * float(padded.abs().max())


def test_eager_attention_gradient_checkpointing_and_one_token_completions(tokenizer):
    model = build_tiny_model(tokenizer, seed=0).double()
    model.config._attn_implementation = "eager"  # an additive mask of the model's dtype
    inputs = _grouped_batch(model.config.vocab_size, [4, 4], [3, 5, 1, 5, 2, 5], group=3)  # no left padding:
    with torch.no_grad():  # eager attention on a fully masked padding row gives NaN on the padded path
        padded = sequence_logprobs(model, *inputs)  # eager's softmax runs in float32: agreement to its precision
        torch.testing.assert_close(sequence_logprobs(model, *inputs, forward=_forward_at(3)), padded, rtol=0, atol=1e-6)
    model.config._attn_implementation = "sdpa"
    model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    model.train()
    grads = []
    for forward in (None, _forward_at(3)):
        model.zero_grad()
        sequence_logprobs(model, *inputs, forward=forward).sum().backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    _assert_same_gradients(*grads)
    one = _grouped_batch(model.config.vocab_size, [3, 6], [1, 1, 1, 1], group=2)  # nothing after the first token
    with torch.no_grad():
        logp, runs = _tokens_run(model, lambda: sequence_logprobs(model, *one, forward=_forward_at(2)))
    assert runs == [2 * 6]  # the prompts alone: the completions' one token each is predicted by the prompt
    torch.testing.assert_close(logp, sequence_logprobs(model, *one), rtol=0, atol=1e-6)


def _rollout(inputs) -> TensorDict:
    n = len(inputs[0])
    return TensorDict({batch.PROMPT_IDS: inputs[0], batch.PROMPT_MASK: inputs[1], batch.COMPLETION_IDS: inputs[2],
                       batch.COMPLETION_MASK: inputs[3], batch.ADVANTAGES: torch.linspace(-1, 1, n)}, batch_size=[n])


class _IgnoresFourDMasks(LlamaForCausalLM):
    """A Llama whose forward drops a 4-D mask: its shared rows would see one another's completions."""

    def forward(self, *args, attention_mask=None, **kwargs):
        four_d = attention_mask is not None and attention_mask.dim() == 4
        return super().forward(*args, attention_mask=None if four_d else attention_mask, **kwargs)


def test_the_loss_shares_prompts_by_default_and_runs_padded_where_it_cannot(tokenizer, caplog):
    from test_logprobs import _CumulativeMeanLM

    from grpo_accel.loss import GRPOLoss

    model = build_tiny_model(tokenizer, seed=0)
    td = _rollout(_grouped_batch(model.config.vocab_size, [20, 24], [5, 3, 6, 2, 6, 1, 4, 6], group=4))
    loss = GRPOLoss(model)
    with caplog.at_level(logging.INFO, "grpo_accel.loss.paths"):
        _, runs = _tokens_run(model, lambda: loss(td)["loss_objective"])
    assert "shared prompts checked for LlamaForCausalLM" in caplog.text
    assert runs == [8 * 30, 4 * (24 + 2 * 5), 2 * (24 + 4 * 5)]  # the check (padded, 2 a row), then the loss's own
    again, runs = _tokens_run(model, lambda: loss(td)["loss_objective"])
    assert runs == [2 * 44]  # checked once
    padded, runs = _tokens_run(model, lambda: GRPOLoss(model, shared_prompts=False)(td)["loss_objective"])
    assert runs == [8 * 30]
    torch.testing.assert_close(again, padded, rtol=1e-5, atol=1e-6)

    caplog.clear()
    for odd, message in ((_CumulativeMeanLM(model.config.vocab_size), "_CumulativeMeanLM runs every row's prompt (no "
                          "shared prompts): not a decoder-only transformers model"),
                         (_IgnoresFourDMasks(model.config), "GRPOLoss: _IgnoresFourDMasks runs every row's prompt "
                          "(shared_prompts off for it): its shared logprobs differ from padded ones by up to")):
        with caplog.at_level(logging.INFO, "grpo_accel.loss.paths"):
            out = GRPOLoss(odd)(td)["loss_objective"]
        assert message in caplog.text
        torch.testing.assert_close(out, GRPOLoss(odd, shared_prompts=False)(td)["loss_objective"])


def test_the_config_key_reaches_the_loss():
    from grpo_accel.recipe.build import build_loss
    from grpo_accel.config.loading import load_config

    model = build_tiny_model(build_char_tokenizer(), seed=0)
    assert build_loss(load_config(None, []), model, None).shared_prompts is True
    assert build_loss(load_config(None, ["loss.shared_prompts=false"]), model, None).shared_prompts is False
    assert build_loss(load_config(None, ["loss.packing=true"]), model, None).shared_prompts is False
