"""Packaged pretrained models: converted from the registry's GGUF file to a plain Hugging Face folder."""
import json

import pytest
import torch


def test_smollm2_is_a_plain_llama_folder_that_answers_sensibly(smollm2):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    config = json.loads((smollm2 / "config.json").read_text())
    assert config["architectures"] == ["LlamaForCausalLM"] and "quantization_config" not in config
    assert not smollm2.with_name(smollm2.name + ".partial").exists()
    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    model = AutoModelForCausalLM.from_pretrained(smollm2)
    assert 134e6 < sum(p.numel() for p in model.parameters()) < 136e6
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "What is the capital of France?"}],
                                        add_generation_prompt=True, return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        out = model.generate(ids, max_new_tokens=10, do_sample=False)
    assert "Paris" in tokenizer.decode(out[0, ids.shape[1]:])


def test_unknown_model_names_the_choices(tmp_path):
    from grpo_accel.cli.models import convert

    with pytest.raises(ValueError, match=r"unknown model 'smollm3': choose one of \['smollm2-135m'\]"):
        convert("smollm3", tmp_path)
