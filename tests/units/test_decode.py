"""The embedded engine's decode loop against transformers' generate: same keys, same tokens, same logprobs."""
import copy

import pytest
import torch

from grpo_accel import batch
from grpo_accel.logprobs import sequence_logprobs
from grpo_accel.embedded.decode import Decoder, DecodeSettings, unsupported_reason
from grpo_accel.embedded.engine import EmbeddedEngine
from grpo_accel.embedded.sender import EmbeddedWeightSync

PROMPTS = ["12+34=", "1+2=", "7+7=", "49+49="]  # 4 to 6 tokens: left padding


def _qwen2(tokenizer):
    """The speed issue's model: Qwen2 with grouped-query attention and tied embeddings."""
    from grpo_accel.tasks.tiny import build_tiny_qwen2

    return build_tiny_qwen2(tokenizer, seed=0)


def _llama(tokenizer, attention="sdpa"):
    from grpo_accel.tasks.tiny import build_tiny_model

    model = build_tiny_model(tokenizer, seed=0)
    model.config._attn_implementation = attention
    return model


def _qwen3(tokenizer):
    """Qwen3: per-head q/k norms before the rotary embedding, grouped-query attention."""
    from transformers import Qwen3Config, Qwen3ForCausalLM

    torch.manual_seed(0)
    config = Qwen3Config(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=64,
                         tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    return Qwen3ForCausalLM(config)


def _lora(tokenizer):
    from grpo_accel.lora import apply_lora

    model = apply_lora(_llama(tokenizer), r=4, seed=0)
    with torch.no_grad():  # a trained-looking adapter: B is zero at start
        for name, p in model.named_parameters():
            if "lora_B" in name:
                p.normal_(0, 0.1)
    return model


def _ending(model, tokenizer, dtype=torch.float64):
    """EOS made likely, so that completions end at different steps (rows leave the batch)."""
    model = model.to(dtype)
    head = model.get_output_embeddings()
    with torch.no_grad():
        head.weight[tokenizer.eos_token_id] += 0.3 * head.weight.norm(dim=1).mean()
    return model


@pytest.mark.parametrize("build, sampling, dtype", [
    (_llama, {"temperature": 0.9}, torch.float64),
    (_qwen2, {"temperature": 1.0}, torch.float64),
    # float32: transformers' generate under eager attention turns left-padded float64 rows into NaN
    (lambda tok: _llama(tok, "eager"), {"temperature": 1.0}, torch.float32),
    (_lora, {"temperature": 0.7, "top_k": 5, "top_p": 0.9}, torch.float64),
    (_qwen3, {"temperature": 1.0}, torch.float64),
], ids=["llama", "qwen2-gqa-tied", "eager-attention", "lora-topk-topp", "qwen3-qk-norm"])
def test_fast_decoder_draws_what_generate_draws(tokenizer, build, sampling, dtype):
    """In float64 no rounding can flip a draw, so the tokens must be equal; logprobs to float32 rounding. Under
    sdpa the loop runs the lean forward (the model's modules without its wrappers), under eager the model's."""
    model = _ending(build(tokenizer), tokenizer, dtype)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    fast = EmbeddedEngine(model, tokenizer, max_new_tokens=24, decoder="fast", **sampling)
    slow = EmbeddedEngine(model, tokenizer, max_new_tokens=24, decoder="generate", **sampling)
    assert fast.fast and not slow.fast
    a, b = fast.generate(prompts, 4, seeds=[5, 6, 7, 8]), slow.generate(prompts, 4, seeds=[5, 6, 7, 8])
    assert fast.decoder.lean == (model.config._attn_implementation == "sdpa")
    wrapped = Decoder(model, lean=False)(a[batch.PROMPT_IDS][::4], a[batch.PROMPT_MASK][::4], 4,
                                         torch.tensor([s * 4 + j for s in [5, 6, 7, 8] for j in range(4)]), fast.settings)
    assert torch.equal(wrapped[0][:, : a[batch.COMPLETION_IDS].shape[1]], a[batch.COMPLETION_IDS])  # lean = wrapped
    lengths = a[batch.COMPLETION_MASK].sum(1)
    assert lengths.min() < 12 and lengths.max() == 24, "rows must finish at different steps"
    for key in (batch.PROMPT_IDS, batch.PROMPT_MASK, batch.COMPLETION_IDS, batch.COMPLETION_MASK, batch.FINISH_REASON):
        assert torch.equal(a[key], b[key]), key
    torch.testing.assert_close(a[batch.ENGINE_LOGPROBS], b[batch.ENGINE_LOGPROBS], atol=1e-6, rtol=0)
    # generate hands out float32 logits; the loop keeps the model's float64, which a teacher-forced pass matches
    ids, mask = a[batch.PROMPT_IDS][::4], a[batch.PROMPT_MASK][::4]
    keys = torch.tensor([s * 4 + j for s in [5, 6, 7, 8] for j in range(4)])
    tokens, logprobs = fast.decoder(ids, mask, 4, keys, fast.settings)
    assert logprobs.dtype == torch.promote_types(dtype, torch.float32) and torch.equal(tokens[:, : a[batch.COMPLETION_IDS].shape[1]], a[batch.COMPLETION_IDS])
    assert fast.decoder.no_grad is torch.inference_mode  # decoded without autograd's bookkeeping, yet the results
    assert not (tokens.is_inference() or logprobs.is_inference())  # are ordinary tensors the loss can use
    with torch.no_grad():
        teacher = sequence_logprobs(model, a[batch.PROMPT_IDS], a[batch.PROMPT_MASK], a[batch.COMPLETION_IDS], a[batch.COMPLETION_MASK],
                                    sampling["temperature"])
    torch.testing.assert_close(logprobs * a[batch.COMPLETION_MASK], teacher * a[batch.COMPLETION_MASK],
                               atol=1e-10 if dtype == torch.float64 else 1e-5, rtol=0)
    greedy = [e.generate(prompts, 2, greedy=True)[batch.COMPLETION_IDS] for e in (fast, slow)]
    assert torch.equal(*greedy)


@pytest.mark.parametrize("build", [_llama, _qwen2], ids=["llama", "qwen2-gqa"])
def test_the_lean_decode_attention_on_one_thread_and_several(tokenizer, build):
    """A decode step's attention is written out on CPU with several threads and SDPA's kernel on one: in float64
    both draw the model's forward's tokens, with its logprobs."""
    model = _ending(build(tokenizer), tokenizer)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    engine = EmbeddedEngine(model, tokenizer, max_new_tokens=24, decoder="fast", temperature=1.0)
    a = engine.generate(prompts, 4, seeds=[5, 6, 7, 8])
    ids, mask = a[batch.PROMPT_IDS][::4], a[batch.PROMPT_MASK][::4]
    keys = torch.tensor([s * 4 + j for s in [5, 6, 7, 8] for j in range(4)])
    wrapped = Decoder(model, lean=False)(ids, mask, 4, keys, engine.settings)
    before = torch.get_num_threads()
    try:
        for threads in (1, 2):
            torch.set_num_threads(threads)
            tokens, logprobs = engine.decoder(ids, mask, 4, keys, engine.settings)
            assert engine.decoder.lean and torch.equal(tokens, wrapped[0]), threads
            torch.testing.assert_close(logprobs, wrapped[1], atol=1e-10, rtol=0)
    finally:
        torch.set_num_threads(before)


def _decode_inputs(tokenizer):
    ids = batch.pad_sequences([tokenizer(p)["input_ids"] for p in PROMPTS], tokenizer.pad_token_id, "left")
    keys = torch.tensor([s * 4 + j for s in [5, 6, 7, 8] for j in range(4)])
    return ids, (ids != tokenizer.pad_token_id).long(), keys, DecodeSettings(24, (tokenizer.eos_token_id,), tokenizer.pad_token_id)


def test_the_lean_forward_fuses_plain_projections_of_the_moment_and_leaves_hooked_and_lora_ones(tokenizer):
    """Each layer's q/k/v and gate/up are multiplied as one product from the weights of the call (float64:
    the model's own forward's tokens, before and after an in-place update); a hooked projection is called as it
    is (and its hook runs), and LoRA layers are never fused."""
    from grpo_accel.embedded.lean import LeanForward, plain_product

    model = _ending(_qwen2(tokenizer), tokenizer)  # q/k/v with biases
    ids, mask, keys, settings = _decode_inputs(tokenizer)
    lean, wrapped = Decoder(model), Decoder(model, lean=False)
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    with lean.lean_forward.fused(plain_product) as fused:
        assert len(fused) == 5 * len(model.model.layers) and {id(attn), id(mlp)} <= lean.lean_forward.products.keys()
    assert lean.lean_forward.products == {}  # products are for one call only
    runs = []
    for _ in range(2):
        tokens, logprobs = lean(ids, mask, 4, keys, settings)
        expected = wrapped(ids, mask, 4, keys, settings)
        assert lean.lean and torch.equal(tokens, expected[0])
        torch.testing.assert_close(logprobs, expected[1], atol=1e-10, rtol=0)
        runs.append(tokens)
        with torch.no_grad():  # an optimizer step between two calls
            attn.k_proj.weight.mul_(-3.0)
            mlp.up_proj.weight.mul_(-2.0)
    assert not torch.equal(*runs)
    calls = []
    attn.k_proj.register_forward_hook(lambda module, args, out: calls.append(out.shape))
    with lean.lean_forward.fused(plain_product) as fused:
        assert attn.k_proj not in fused and mlp.up_proj in fused and id(attn) not in lean.lean_forward.products
    tokens, _ = lean(ids, mask, 4, keys, settings)
    assert calls and torch.equal(tokens, wrapped(ids, mask, 4, keys, settings)[0])
    lora = LeanForward(_lora(tokenizer))
    with lora.fused(plain_product) as fused:
        assert fused == []


def test_the_lean_forward_reads_the_rotary_table_and_norms_as_the_model_computes_them(tokenizer):
    """The rotary table's entries and the norms' results are bitwise the model's; a RoPE that rescales with the
    sequence length is computed by the model's module at each step, and decodes the model's tokens."""
    from transformers.models.qwen3.modeling_qwen3 import Qwen3RMSNorm

    from grpo_accel.embedded.lean import LeanForward, _rms_norm

    model = _qwen2(tokenizer)
    lean = LeanForward(model)
    assert lean.rotary.static
    hidden, positions = torch.randn(3, 4, 64), torch.tensor([[0, 1, 2, 3], [0, 0, 1, 2], [5, 6, 7, 8]])
    cos, sin = lean.rotary(hidden, positions, 16)
    own_cos, own_sin = model.model.rotary_emb(hidden, position_ids=positions)
    assert torch.equal(cos[:, 0], own_cos) and torch.equal(sin[:, 0, ..., 8:], own_sin[..., 8:])
    assert torch.equal(sin[:, 0, ..., :8], -own_sin[..., :8])  # rotate_half's negation, moved into sin
    for norm in (model.model.norm, Qwen3RMSNorm(16, eps=1e-6)):
        with torch.no_grad():
            norm.weight.normal_()
        for dtype in (torch.float32, torch.float64, torch.bfloat16):
            x = torch.randn(3, 2, norm.weight.shape[0], dtype=dtype) * 3
            assert torch.equal(_rms_norm(norm.to(dtype))(x), norm(x)), (type(norm).__name__, dtype)
    dynamic = _llama(tokenizer)
    dynamic.config.rope_parameters = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}
    dynamic.model.rotary_emb = type(dynamic.model.rotary_emb)(dynamic.config)
    dynamic = _ending(dynamic, tokenizer)
    decoder = Decoder(dynamic)
    assert decoder.lean and not decoder.lean_forward.rotary.static
    ids, mask, keys, settings = _decode_inputs(tokenizer)
    assert torch.equal(decoder(ids, mask, 4, keys, settings)[0], Decoder(dynamic, lean=False)(ids, mask, 4, keys, settings)[0])


def test_min_new_tokens_and_the_budget(tokenizer):
    model = _ending(_llama(tokenizer), tokenizer)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS[:2]]
    engines = [EmbeddedEngine(model, tokenizer, max_new_tokens=9, decoder=d) for d in ("fast", "generate")]
    for e in engines:
        e.settings.min_new_tokens = 9  # the benchmark's fixed length: EOS cannot be drawn before the budget
    a, b = (e.generate(prompts, 3, seeds=[1, 2]) for e in engines)
    assert torch.equal(a[batch.COMPLETION_IDS], b[batch.COMPLETION_IDS]) and (a[batch.COMPLETION_MASK].sum(1) == 9).all()
    assert (a[batch.FINISH_REASON] == batch.FINISH_LENGTH).all()


def test_compiled_decoder_matches_eager_and_sees_weight_updates(tokenizer):
    model = _ending(_qwen2(tokenizer), tokenizer).eval()
    ids = batch.pad_sequences([tokenizer(p)["input_ids"] for p in PROMPTS[:2]], tokenizer.pad_token_id, "left")
    mask = (ids != tokenizer.pad_token_id).long()
    keys, settings = torch.arange(6), DecodeSettings(12, (tokenizer.eos_token_id,), tokenizer.pad_token_id)
    eager, compiled = Decoder(model), Decoder(model, compiled=True)
    for _ in range(2):  # the second round after an in-place update, as EmbeddedWeightSync makes it
        (t1, l1), (t2, l2) = eager(ids, mask, 3, keys, settings), compiled(ids, mask, 3, keys, settings)
        assert torch.equal(t1, t2)
        torch.testing.assert_close(l1, l2, atol=1e-6, rtol=0)  # inductor may keep float64 where eager rounds to float32
        with torch.no_grad():
            model.get_output_embeddings().weight.mul_(1.5)


def test_decode_worker_draws_like_the_engine_and_follows_weight_pushes(tokenizer):
    trained = _llama(tokenizer)
    prompts = [tokenizer(p)["input_ids"] for p in PROMPTS]
    local = EmbeddedEngine(copy.deepcopy(trained), tokenizer, max_new_tokens=8)
    remote = EmbeddedEngine(copy.deepcopy(trained), tokenizer, max_new_tokens=8, worker=True)
    try:
        for version in (1, 2):
            a, b = local.generate(prompts, 3, seeds=[1, 2, 3, 4]), remote.generate(prompts, 3, seeds=[1, 2, 3, 4])
            for key in a.keys():
                torch.testing.assert_close(a[key], b[key], atol=1e-6, rtol=0)
            with torch.no_grad():  # a training step, then the push that copies the weights into each engine
                trained.lm_head.weight.add_(torch.randn_like(trained.lm_head.weight))
            for engine in (local, remote):
                EmbeddedWeightSync(engine, source=trained).push(version)
        assert not torch.equal(a[batch.COMPLETION_IDS], local.generate(prompts, 3, seeds=[1, 2, 3, 4])[batch.COMPLETION_IDS])
        process = remote.worker.process
        remote.model.lm_head.weight = torch.nn.Parameter(remote.model.lm_head.weight.clone())  # replaced, not copied
        with pytest.raises(RuntimeError, match=r"\['lm_head.weight'\] are no longer in shared memory"):
            remote.generate(prompts, 3)
    finally:
        remote.close()
    assert not process.is_alive() and remote.worker is None


def test_decoder_choices_and_their_errors(tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    from grpo_accel.config.checks import ConfigError
    from grpo_accel.config.rollout_schema import RolloutConfig
    from grpo_accel.config.schema import GRPOConfig

    windowed = MistralForCausalLM(MistralConfig(vocab_size=32, hidden_size=16, intermediate_size=32, num_hidden_layers=1,
                                                num_attention_heads=2, num_key_value_heads=1, sliding_window=8))
    assert "sliding window (8)" in unsupported_reason(windowed)
    assert not EmbeddedEngine(windowed, tokenizer, max_new_tokens=2).fast  # auto: transformers' generate
    with pytest.raises(ValueError, match=r"decoder='fast' cannot decode this model: it has a sliding window"):
        EmbeddedEngine(windowed, tokenizer, max_new_tokens=2, decoder="fast")
    with pytest.raises(ValueError, match="worker=True decodes a CPU model with the fast decoder"):
        EmbeddedEngine(_llama(tokenizer), tokenizer, max_new_tokens=2, decoder="generate", worker=True)
    with pytest.raises(ConfigError, match=r"rollout.decoder='greedy'.*must be one of \['auto', 'fast', 'compiled', 'generate'\]"):
        RolloutConfig(decoder="greedy")
    with pytest.raises(ConfigError, match="rollout.embedded_worker=True.*only with trainer.async_collection=true"):
        GRPOConfig(rollout=RolloutConfig(embedded_worker=True))
