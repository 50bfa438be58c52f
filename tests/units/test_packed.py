"""Packed decode weights (grpo_accel/embedded/packed.py): the same draws as nn.Linear's, from the current weights."""
import pytest
import torch

from grpo_accel import batch
from grpo_accel.embedded.decode import Decoder, DecodeSettings
from grpo_accel.embedded.packed import PACK_MIN_BYTES, PackedLinears, packing_reason

PROMPTS = ["12+34=", "1+2=", "7+7="]


@pytest.fixture(autouse=True)
def packing_from_32_mib(monkeypatch):
    """The tests' models stay small: packing is tried from 32 MiB of matrices here (by default from 64 MiB)."""
    monkeypatch.setattr("grpo_accel.embedded.packed.PACK_MIN_BYTES", 32 * 2**20)


def _llama_of_32_mib(tokenizer):
    from grpo_accel.tasks.tiny import TinyModelSpec, build_tiny_model

    return build_tiny_model(tokenizer, TinyModelSpec(256, 8, 8, 1024, max_positions=64), seed=0).eval()


def _model_over_the_threshold(tokenizer):
    """A Llama with 32 MiB of matrices: packed from the tests' threshold, not from the default one."""
    model = _llama_of_32_mib(tokenizer)
    assert packing_reason(model) is None
    return model


def _prompts(tokenizer):
    ids = batch.pad_sequences([tokenizer(p)["input_ids"] for p in PROMPTS], tokenizer.pad_token_id, "left")
    return ids, (ids != tokenizer.pad_token_id).long()


def test_packed_decode_draws_what_nn_linear_draws_from_the_weights_of_the_moment(tokenizer):
    model = _model_over_the_threshold(tokenizer)
    ids, mask = _prompts(tokenizer)
    keys, settings = torch.arange(12) + 3, DecodeSettings(16, (tokenizer.eos_token_id,), tokenizer.pad_token_id)
    packed, plain = Decoder(model), Decoder(model)
    plain.packed = None  # the same loop on nn.Linear's own products
    assert packed.packed is not None
    swapped = []
    model.lm_head.register_forward_hook(lambda m, args, out: swapped.append("forward" in m.__dict__))
    runs = []
    for _ in range(2):  # the second after an in-place update, as an optimizer step makes it
        (t1, l1), (t2, l2) = packed(ids, mask, 4, keys, settings), plain(ids, mask, 4, keys, settings)
        assert torch.equal(t1, t2)
        torch.testing.assert_close(l1, l2, atol=1e-4, rtol=0)  # another summation order: float32 rounding only
        runs.append(t1)
        with torch.no_grad():
            for layer in model.model.layers:
                layer.mlp.down_proj.weight.mul_(-1.0)
    assert not torch.equal(runs[0], runs[1])  # the update changed the draws: the second call read it
    assert True in swapped and False in swapped  # the hook ran under both, and saw the packed forward swapped in
    assert not any("forward" in m.__dict__ for m in model.modules())  # every module's own forward is back


def test_packing_restores_the_modules_when_the_block_fails(tokenizer):
    model = _model_over_the_threshold(tokenizer)
    with pytest.raises(RuntimeError, match="inside"):
        with PackedLinears(model)():
            assert "forward" in model.lm_head.__dict__
            raise RuntimeError("inside")
    assert not any("forward" in m.__dict__ for m in model.modules())


def test_what_is_not_packed_and_why(tokenizer, monkeypatch):
    from grpo_accel.tasks.tiny import build_tiny_qwen2

    tiny = build_tiny_qwen2(tokenizer, seed=0)
    assert "packing pays from 32 MiB" in packing_reason(tiny)
    monkeypatch.setattr("grpo_accel.embedded.packed.PACK_MIN_BYTES", PACK_MIN_BYTES)  # the default: 64 MiB
    assert "32.0 MiB of matrix weights (packing pays from 64 MiB)" in packing_reason(_llama_of_32_mib(tokenizer))
    monkeypatch.setattr("grpo_accel.embedded.packed.PACK_MIN_BYTES", 32 * 2**20)
    assert Decoder(tiny).packed is None
    wide = _model_over_the_threshold(tokenizer).double()
    assert "torch.float64 weights on cpu" in packing_reason(wide)
    assert Decoder(wide).packed is None and Decoder(_model_over_the_threshold(tokenizer), compiled=True).packed is None

