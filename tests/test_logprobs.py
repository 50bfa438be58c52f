import torch

from grpo_accel import batch as K
from grpo_accel.logprobs import selected_logprobs, sequence_logprobs
from grpo_accel.rollout.local import EmbeddedEngine


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
    assert (td[K.PROMPT_MASK][:, 0] == 0).any(), "shorter prompts must be left-padded"
    with torch.no_grad():
        teacher = sequence_logprobs(tiny_model, td[K.PROMPT_IDS], td[K.PROMPT_MASK], td[K.COMPLETION_IDS],
                                    td[K.COMPLETION_MASK], temperature=0.8)
    torch.testing.assert_close(td[K.ENGINE_LOGPROBS], teacher, atol=1e-5, rtol=1e-5)
    assert (td[K.ENGINE_LOGPROBS] <= 0).all() and td[K.COMPLETION_MASK].sum() > 12


def test_engine_masks_after_eos_and_reports_finish(tokenizer, tiny_model):
    torch.manual_seed(1)
    engine = EmbeddedEngine(tiny_model, tokenizer, max_new_tokens=5)
    td = engine.generate([tokenizer("3+4=")["input_ids"]], group_size=32)
    eos = tokenizer.eos_token_id
    for ids, mask, reason in zip(td[K.COMPLETION_IDS], td[K.COMPLETION_MASK], td[K.FINISH_REASON]):
        n = int(mask.sum())
        real = ids[:n].tolist()
        assert (mask[:n] == 1).all() and (mask[n:] == 0).all(), "mask is a prefix"
        if reason == K.FINISH_STOP:
            assert real[-1] == eos and eos not in real[:-1], "EOS ends a stopped completion and is kept"
        else:
            assert n == 5 and eos not in real
        assert (ids[n:] == tokenizer.pad_token_id).all()
    assert {int(r) for r in td[K.FINISH_REASON]} == {K.FINISH_STOP, K.FINISH_LENGTH}
