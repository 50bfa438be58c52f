import torch
from tensordict import TensorDict
from torch import nn

from grpo_accel import batch
import pytest

from grpo_accel.logprobs import selected_logprobs, sequence_logprobs
from grpo_accel.embedded.engine import EmbeddedEngine


def test_selected_logprobs_equal_log_softmax_gather_and_entropy():
    torch.manual_seed(0)
    logits = torch.randn(3, 5, 11)
    targets = torch.randint(0, 11, (3, 5))
    logp, ent = selected_logprobs(logits, targets, temperature=0.7, with_entropy=True)
    ref = torch.log_softmax(logits / 0.7, -1)
    torch.testing.assert_close(logp, ref.gather(-1, targets[..., None]).squeeze(-1))
    torch.testing.assert_close(ent, -(ref.exp() * ref).sum(-1))


def test_selected_logprobs_chunked_backward_matches_autograd(monkeypatch):
    import grpo_accel.logprobs as lp

    monkeypatch.setattr(lp, "CHUNK_BYTES", 4 * 11 * 2)  # 2 rows per chunk: exercises the chunk loop
    torch.manual_seed(0)
    logits = torch.randn(2, 3, 11, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, 11, (2, 3))
    assert torch.autograd.gradcheck(lambda z: selected_logprobs(z, targets, 1.3), (logits,))
    weights = torch.randn(2, 3, dtype=torch.float64)
    (selected_logprobs(logits, targets, 1.3) * weights).sum().backward()
    expected = torch.autograd.grad(
        (torch.log_softmax(logits / 1.3, -1).gather(-1, targets[..., None]).squeeze(-1) * weights).sum(), logits
    )[0]
    torch.testing.assert_close(logits.grad, expected)


def test_bf16_logits_get_bf16_gradient_and_float32_logprobs():
    logits = torch.randn(2, 3, 7).to(torch.bfloat16).requires_grad_()
    logp = selected_logprobs(logits, torch.zeros(2, 3, dtype=torch.long))
    assert logp.dtype == torch.float32
    logp.sum().backward()
    assert logits.grad.dtype == torch.bfloat16


def test_engine_logprobs_equal_teacher_forced_forward(tokenizer, tiny_model):
    torch.manual_seed(0)
    engine = EmbeddedEngine(tiny_model, tokenizer, max_new_tokens=6, temperature=0.8)
    prompts = [tokenizer(p)["input_ids"] for p in ["1+2=", "13+4=", "2="]]  # different lengths: left padding
    td = engine.generate(prompts, group_size=4)
    assert td.shape == (12,)
    assert (td[batch.PROMPT_MASK][:, 0] == 0).any(), "shorter prompts must be left-padded"
    with torch.no_grad():
        teacher = sequence_logprobs(tiny_model, td[batch.PROMPT_IDS], td[batch.PROMPT_MASK], td[batch.COMPLETION_IDS],
                                    td[batch.COMPLETION_MASK], temperature=0.8)
    torch.testing.assert_close(td[batch.ENGINE_LOGPROBS], teacher, atol=1e-5, rtol=1e-5)
    assert (td[batch.ENGINE_LOGPROBS] <= 0).all() and td[batch.COMPLETION_MASK].sum() > 12


def test_engine_masks_after_eos_and_reports_finish(tokenizer, tiny_model):
    torch.manual_seed(1)
    engine = EmbeddedEngine(tiny_model, tokenizer, max_new_tokens=5)
    td = engine.generate([tokenizer("3+4=")["input_ids"]], group_size=32)
    eos = tokenizer.eos_token_id
    for ids, mask, reason in zip(td[batch.COMPLETION_IDS], td[batch.COMPLETION_MASK], td[batch.FINISH_REASON]):
        n = int(mask.sum())
        real = ids[:n].tolist()
        assert (mask[:n] == 1).all() and (mask[n:] == 0).all(), "mask is a prefix"
        if reason == batch.FINISH_STOP:
            assert real[-1] == eos and eos not in real[:-1], "EOS ends a stopped completion and is kept"
        else:
            assert n == 5 and eos not in real
        assert (ids[n:] == tokenizer.pad_token_id).all()
    assert {int(r) for r in td[batch.FINISH_REASON]} == {batch.FINISH_STOP, batch.FINISH_LENGTH}


def _ragged_batch(vocab: int, prompt_lens: list[int], completion_lens: list[int], seed: int = 0):
    """Random tokens with the rollout's padding: prompts left-padded, completions right-padded."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in prompt_lens]
    completions = [torch.randint(3, vocab, (n,), generator=g).tolist() for n in completion_lens]
    return (batch.pad_sequences(prompts, 0, "left"), batch.pad_sequences([[1] * n for n in prompt_lens], 0, "left"),
            batch.pad_sequences(completions, 0, "right"), batch.pad_sequences([[1] * n for n in completion_lens], 0, "right"))


def test_pack_rows_first_fit_decreasing():
    assert batch.pack_rows([4, 1, 3, 2], capacity=4) == [[0], [2, 1], [3]]
    assert batch.pack_rows([2, 2, 2], capacity=6) == [[0, 1, 2]]
    assert batch.pack_rows([], capacity=3) == []
    with pytest.raises(ValueError, match="capacity=2"):
        batch.pack_rows([3], capacity=2)


@pytest.mark.parametrize("prompt_lens, completion_lens", [
    ([3, 5, 2, 4, 4, 1], [8, 2, 5, 0, 1, 3]),  # 4x+ ragged, one empty completion, bins of several rows
    ([4], [6]),  # one row: one bin, no packing boundary
    ([2, 2, 2, 2], [4, 4, 4, 4]),  # equal lengths: two rows per bin
])
def test_packed_logprobs_entropy_and_gradients_equal_the_padded_path(tokenizer, tiny_model, prompt_lens, completion_lens):
    model = tiny_model.double()
    inputs = _ragged_batch(model.config.vocab_size, prompt_lens, completion_lens)
    results = []
    for packed in (False, True):
        model.zero_grad()
        logp, entropy = sequence_logprobs(model, *inputs, temperature=0.7, with_entropy=True, packed=packed)
        (logp * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)).sum().backward()
        results.append((logp, entropy, [p.grad.clone() for p in model.parameters()]))
    (a, ea, ga), (b, eb, gb) = results
    torch.testing.assert_close(b, a, rtol=0, atol=1e-12)
    torch.testing.assert_close(eb, ea, rtol=0, atol=1e-12)
    assert (b[inputs[3] == 0] == 0).all() and b[inputs[3] == 1].lt(0).all()
    for x, y in zip(ga, gb):
        torch.testing.assert_close(y, x, rtol=1e-9, atol=1e-12)


def test_packing_really_isolates_rows(tokenizer, tiny_model):
    """Rows of lengths 6, 2, 2 share one bin of 12: changing row 1 must leave row 2, after it, exactly as it was."""
    model = tiny_model.double()
    inputs = _ragged_batch(model.config.vocab_size, [2, 1, 1], [4, 1, 1], seed=3)
    assert batch.pack_rows([6, 2, 2], capacity=12) == [[0, 1, 2]]
    changed = [x.clone() for x in inputs]
    changed[0][1, -1] = 3 if int(inputs[0][1, -1]) != 3 else 4  # row 1's only prompt token
    with torch.no_grad():
        before, after = (sequence_logprobs(model, *x, packed=True) for x in (inputs, changed))
    assert after[1, 0] != before[1, 0]
    torch.testing.assert_close(after[[0, 2]], before[[0, 2]], rtol=0, atol=0)


class _CumulativeMeanLM(nn.Module):
    """A causal LM that mixes every earlier position of its row (ignoring position ids): packing would leak."""

    def __init__(self, vocab: int):
        super().__init__()
        self.embed, self.head = nn.Embedding(vocab, 8), nn.Linear(8, vocab)

    def forward(self, input_ids, attention_mask=None, position_ids=None, logits_to_keep=0, use_cache=False):
        h = self.embed(input_ids).cumsum(1) / torch.arange(1, input_ids.shape[1] + 1)[:, None]  # [B, L, 8]
        if isinstance(logits_to_keep, torch.Tensor):  # boolean [B, L]: flattened, as transformers does
            h = h[logits_to_keep]
        elif logits_to_keep:
            h = h[:, -logits_to_keep:]
        return type("Out", (), {"logits": self.head(h)})()


def test_packing_is_refused_for_a_model_that_leaks_across_rows(tokenizer, tiny_model):
    from grpo_accel.loss import GRPOLoss

    inputs = _ragged_batch(tokenizer.vocab_size, [2, 1, 1], [4, 1, 1])
    td = TensorDict({batch.PROMPT_IDS: inputs[0], batch.PROMPT_MASK: inputs[1], batch.COMPLETION_IDS: inputs[2],
                     batch.COMPLETION_MASK: inputs[3], batch.ADVANTAGES: torch.tensor([1.0, -1.0, 0.5])}, batch_size=[3])
    with pytest.raises(ValueError, match=r"packing=True is invalid for _CumulativeMeanLM.*set packing=False"):
        GRPOLoss(_CumulativeMeanLM(tokenizer.vocab_size), packing=True)(td)
    loss = GRPOLoss(tiny_model, packing=True)  # a transformers Llama keeps rows apart: accepted, checked once
    out = loss(td)
    assert torch.isfinite(out["loss_objective"])
    torch.testing.assert_close(out["loss_objective"], GRPOLoss(tiny_model)(td)["loss_objective"])
    calls = []  # checked once: later calls run one (packed) forward only
    handle = tiny_model.register_forward_hook(lambda *_: calls.append(1))
    loss(td)
    handle.remove()
    assert len(calls) == 1


def test_packing_check_accepts_half_precision(tokenizer, tiny_model):
    """bf16 rounding differs between the padded and packed layouts; the check must not mistake it for a leak."""
    from grpo_accel.loss import GRPOLoss

    inputs = _ragged_batch(tokenizer.vocab_size, [5, 3, 8, 2] * 4, [24, 6, 12, 30] * 4)
    td = TensorDict({batch.PROMPT_IDS: inputs[0], batch.PROMPT_MASK: inputs[1], batch.COMPLETION_IDS: inputs[2],
                     batch.COMPLETION_MASK: inputs[3], batch.ADVANTAGES: torch.linspace(-1, 1, 16)}, batch_size=[16])
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.isfinite(GRPOLoss(tiny_model, packing=True)(td)["loss_objective"])
    assert torch.isfinite(GRPOLoss(tiny_model.to(torch.bfloat16), packing=True)(td)["loss_objective"])


def _embedding_taken_over_during_forward(model) -> list[bool]:
    """Records, each time the input embedding runs, whether its forward is the tied-gradient one."""
    seen = []
    model.get_input_embeddings().register_forward_hook(lambda module, args, out: seen.append("forward" in module.__dict__))
    return seen


def _weight_sums(model, run) -> int:
    """How many out-of-place sums or copies of a [V, H] tensor ``run`` makes (aten ops, as dispatched)."""
    from torch.utils._python_dispatch import TorchDispatchMode

    shape = model.get_input_embeddings().weight.shape
    seen = []

    class Ops(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            out = func(*args, **(kwargs or {}))
            if func.__name__ in ("add.Tensor", "copy_.default", "clone.default") and getattr(out, "shape", None) == shape:
                seen.append(func.__name__)
            return out

    with Ops():
        run()
    return len(seen)


@pytest.mark.parametrize("shared", [False, True])
def test_a_tied_embedding_adds_its_rows_into_the_head_gradient_in_place(tokenizer, monkeypatch, shared):
    """The tied weight's gradient equals autograd's own sum (float64, to 1e-12; padding ids get no rows, two
    accumulated backwards), made without the [V, H] sum or copy that autograd's own way makes."""
    import grpo_accel.logprobs as lp
    from grpo_accel.loss.paths import shared_forward
    from grpo_accel.tasks.tiny import build_tiny_qwen2

    model = build_tiny_qwen2(tokenizer, seed=0).double()
    assert model.lm_head.weight is model.model.embed_tokens.weight and model.model.embed_tokens.padding_idx == 0
    seen = _embedding_taken_over_during_forward(model)
    inputs = _ragged_batch(model.config.vocab_size, [3, 3, 5, 5], [6, 2, 4, 0])
    assert (inputs[0] == 0).any() and (inputs[2] == 0).any()  # padding ids among the looked-up tokens
    grads, sums = [], []
    for linked in (True, False):
        if not linked:
            monkeypatch.setattr(lp, "_tied_pair", lambda model: None)  # autograd's own sum
        model.zero_grad(set_to_none=True)

        def backward():
            for scale in (1.0, -0.5):  # two micro-batches accumulated
                logp = sequence_logprobs(model, *inputs, forward=shared_forward if shared else None)
                (logp * scale * torch.linspace(-1, 1, logp.numel(), dtype=logp.dtype).view_as(logp)).sum().backward()

        sums.append(_weight_sums(model, backward))
        assert model.lm_head.weight.grad.layout == torch.strided
        grads.append([p.grad.clone() for p in model.parameters()])
    assert seen == [True, True, False, False] and "forward" not in model.model.embed_tokens.__dict__
    assert sums[0] == 0 and sums[1] > 0, sums
    for linked, plain in zip(*grads):
        torch.testing.assert_close(linked, plain, rtol=0, atol=1e-12)


def test_the_embedding_stays_as_it_is_untied_frozen_without_grad_under_autocast_and_after_a_failure(
        tokenizer, tiny_model):
    from grpo_accel.logprobs import tied_embedding_rows
    from grpo_accel.tasks.tiny import build_tiny_qwen2

    inputs = _ragged_batch(tiny_model.config.vocab_size, [3, 2], [4, 5])
    seen = _embedding_taken_over_during_forward(tiny_model)  # the tiny Llama's embedding is not tied
    sequence_logprobs(tiny_model, *inputs).sum().backward()
    assert seen == [False] and tiny_model.model.embed_tokens.weight.grad.layout == torch.strided
    tied = build_tiny_qwen2(tokenizer, seed=0)
    seen = _embedding_taken_over_during_forward(tied)
    with torch.no_grad():  # the reference pass: no backward
        sequence_logprobs(tied, *inputs)
    with torch.autocast("cpu", dtype=torch.bfloat16):  # mixed precision: autograd's own way
        sequence_logprobs(tied, *inputs).sum().backward()
    tied.model.embed_tokens.weight.requires_grad_(False)  # frozen (LoRA): no gradient at all
    sequence_logprobs(tied, *inputs)
    assert seen == [False, False, False]
    tied.model.embed_tokens.weight.requires_grad_(True)
    with pytest.raises(RuntimeError, match="boom"), tied_embedding_rows(tied):
        assert "forward" in tied.model.embed_tokens.__dict__ and "forward" in tied.lm_head.__dict__
        raise RuntimeError("boom")
    assert "forward" not in tied.model.embed_tokens.__dict__ and "forward" not in tied.lm_head.__dict__
