"""LoRA through PEFT in one process: only the adapter trains, sits in the optimizer and is checkpointed; the KL
reference is the adapter switched off; engines and exports get the merged weights. ZeRO-2/3: test_distributed.py;
the merged push to an SGLang server: test_sglang.py."""
import copy
import json

import pytest
import torch

from grpo_accel.checkpoint import Checkpoint, CheckpointError
from grpo_accel.distributed import optimizer_state_bytes, trainable_elements
from grpo_accel.lora import BasePolicy, apply_lora, merge_lora
from grpo_accel.config.checks import ConfigError
from grpo_accel.run.export import export_checkpoint, load_policy
from grpo_accel.config.loading import load_config, to_dict
from grpo_accel.recipe.parts import build_policy, lora_policy
from grpo_accel.config.schema import LoraConfig
from grpo_accel.tasks.tiny import build_tiny_model
from grpo_accel.weight_sync.gather import BucketedGather, engine_weights
from trainer_utils import fresh_accelerate_state, make_trainer, reset_accelerate_state  # noqa: F401

LORA = ["model.lora.r=4", "model.lora.alpha=8"]
LINEAR = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")  # per block of the tiny Llama


def lora_model(tokenizer, **kw):
    return apply_lora(build_tiny_model(tokenizer, seed=0), r=4, alpha=8, seed=0, **kw)


def randomize_adapter(model, seed=1):
    """B starts at zero (the adapter starts as the base model): give it values so the merge is seen."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B." in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.1)


def test_only_the_adapter_trains_and_the_optimizer_holds_only_it(tokenizer):
    base = build_tiny_model(tokenizer, seed=0)
    full = trainable_elements(base)
    model = apply_lora(base, r=4, alpha=8, seed=0)
    trainable = [n for n, p in model.named_parameters() if p.requires_grad]
    assert len(trainable) == 2 * len(LINEAR) * 2  # A and B on every linear layer of both blocks; not lm_head
    assert all(".lora_A.default." in n or ".lora_B.default." in n for n in trainable)
    c = base.config  # r x (in + out) per layer
    per_block = 4 * (4 * 2 * c.hidden_size + 3 * (c.hidden_size + c.intermediate_size))
    assert trainable_elements(model) == 2 * per_block < full / 5
    # the adapter is drawn from the seed: every process starts with the same one
    again = lora_model(tokenizer)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


def test_bad_lora_settings_are_named(tokenizer):
    """apply_lora names its own argument; the recipe (lora_policy) names the config key for the same mistake."""
    with pytest.raises(ValueError, match=r"^apply_lora: target_modules=\['qkv'\].*'down_proj'.*'q_proj'"):
        lora_model(tokenizer, target_modules=["qkv"])
    with pytest.raises(ValueError, match=r"^apply_lora: target_modules=\['embed_tokens'\].*Embedding.*linear"):
        lora_model(tokenizer, target_modules=["embed_tokens"])
    with pytest.raises(ConfigError, match=r"^model.lora.target_modules=\['qkv'\].*'down_proj'.*'q_proj'"):
        lora_policy(build_tiny_model(tokenizer, seed=0), LoraConfig(r=4, target_modules=["qkv"]), seed=0)
    for key, value in (("r", -1), ("alpha", 0), ("dropout", 1.0), ("target_modules", "[]")):
        with pytest.raises(ConfigError, match=f"model.lora.{key}="):
            load_config(None, [f"model.lora.{key}={value}"])


def test_engines_get_the_merged_weights_under_the_base_names(tokenizer):
    model = lora_model(tokenizer)
    randomize_adapter(model)
    got = {w.name: w.value() for w in engine_weights(model)}
    base_names = [n for n, _ in build_tiny_model(tokenizer, seed=0).named_parameters()]
    assert list(got) == base_names
    merged = copy.deepcopy(model).merge_and_unload().state_dict()  # PEFT's own merge
    for name in base_names:
        torch.testing.assert_close(got[name], merged[name], rtol=0, atol=1e-6, msg=name)
    q = "model.layers.0.self_attn.q_proj.weight"
    assert not torch.allclose(got[q], build_tiny_model(tokenizer, seed=0).state_dict()[q])  # the adapter is in
    w, a, b = torch.randn(3, 2), torch.randn(1, 2), torch.randn(3, 1)
    torch.testing.assert_close(merge_lora(w, a, b, 2.0), w + 2.0 * b @ a)
    # buckets carry the merged tensors, in order, at the send dtype
    sent = [(n, t) for bucket, tensors in BucketedGather(model, 4096, torch.bfloat16) for n, t in zip(bucket.names, tensors)]
    assert [n for n, _ in sent] == base_names
    assert all(t.dtype == torch.bfloat16 and torch.equal(t, got[n].to(torch.bfloat16)) for n, t in sent)


def test_the_reference_is_the_base_model(tokenizer):
    model = lora_model(tokenizer)
    randomize_adapter(model)
    ids = torch.tensor([tokenizer("12+30=42")["input_ids"]])
    base_logits = build_tiny_model(tokenizer, seed=0)(ids).logits
    torch.testing.assert_close(BasePolicy(model)(ids).logits, base_logits, rtol=0, atol=0)
    assert not torch.allclose(model(ids).logits, base_logits)  # the adapter is back on afterwards


def test_a_lora_run_saves_the_adapter_resumes_exactly_and_exports(tokenizer, tmp_path):
    cfg = load_config(None, LORA + ["loss.kl_coef=0.05"])
    frames = 16  # one batch of 4 prompts x 4

    def run(folder, batches, resume=None):
        reset_accelerate_state()
        model, reference = build_policy(cfg.model, tokenizer, with_reference=True, seed=0)
        trainer = make_trainer(tokenizer, model, total_frames=frames * batches, loss_kwargs={
            "reference": reference, "kl_coef": 0.05}, checkpoint=Checkpoint(folder, resume=resume),
            checkpoint_metadata=lambda: {"config": to_dict(cfg)})
        trainer.train()
        return trainer, model

    straight, model = run(tmp_path / "a", 4)
    assert all(h["train/kl_ref"] >= 0 for h in straight.history) and straight.history[-1]["train/kl_ref"] > 0
    adapter_elements = trainable_elements(model)
    assert optimizer_state_bytes(straight.optimizer) == 2 * 4 * adapter_elements + 4 * 28  # exp_avg, exp_avg_sq, steps
    first, _ = run(tmp_path / "b", 2)
    resumed, resumed_model = run(tmp_path / "b", 4, resume="auto")
    assert [h["train/loss"] for h in first.history + resumed.history] == [h["train/loss"] for h in straight.history]
    assert all(torch.equal(a, b) for a, b in zip(resumed_model.parameters(), model.parameters()))

    last = Checkpoint(tmp_path / "a").complete()[-1]
    from safetensors import safe_open

    with safe_open(str(last / "model.safetensors"), "pt") as f:
        saved = list(f.keys())
    assert sorted(saved) == sorted(f"policy.{n}" for n, p in model.named_parameters() if p.requires_grad)
    meta = json.loads((last / "metadata.json").read_text())
    assert meta["manifest"]["model.safetensors"] < 4 * adapter_elements + 8192  # the adapter, not the base

    ids = torch.tensor([tokenizer("12+30=42")["input_ids"]])
    expected = model(ids).logits
    merged_dir = export_checkpoint(last, tmp_path / "merged")
    from transformers import AutoModelForCausalLM

    merged = AutoModelForCausalLM.from_pretrained(merged_dir)
    torch.testing.assert_close(merged(ids).logits, expected, rtol=0, atol=1e-5)
    adapter_dir = export_checkpoint(last, tmp_path / "adapter", adapter=True)
    from peft import PeftModel

    assert (adapter_dir / "adapter_config.json").is_file()
    reloaded = PeftModel.from_pretrained(build_tiny_model(tokenizer, seed=0), adapter_dir)
    torch.testing.assert_close(reloaded(ids).logits, expected, rtol=0, atol=1e-6)
    assert type(load_policy(last)).__name__ == "PeftModelForCausalLM"


def test_export_refuses_what_it_cannot_do(tokenizer, tmp_path):
    reset_accelerate_state()
    full = make_trainer(tokenizer, build_tiny_model(tokenizer, seed=0), total_frames=16,
                        checkpoint=Checkpoint(tmp_path / "full"))
    full.train()
    with pytest.raises(CheckpointError, match="--adapter needs a LoRA run"):
        export_checkpoint(Checkpoint(tmp_path / "full").complete()[-1], tmp_path / "x", adapter=True)
    reset_accelerate_state()
    lora = make_trainer(tokenizer, lora_model(tokenizer), total_frames=16, checkpoint=Checkpoint(tmp_path / "lora"))
    lora.train()
    with pytest.raises(CheckpointError, match="not the run's config"):
        export_checkpoint(Checkpoint(tmp_path / "lora").complete()[-1], tmp_path / "y")
