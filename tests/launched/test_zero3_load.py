"""ZeRO-3 loads a named model partitioned: 4 processes on CPU (gloo) load a saved 120M-parameter Llama as the policy
and its KL reference under the shipped accelerate_configs/zero3.yaml, and none holds more than its quarter of
the weights and room for the largest weight whole at any moment of the load. Loaded whole on every process (as
before zero.Init), each would hold both models: 957 MB here, and 8 x 140 GB of host memory for a 70B model in
bf16 on a node of 8 GPUs."""
import json

import pytest
import torch

from launching import ROOT, launch

PROCESSES = 4


@pytest.fixture(scope="module")
def model_120m(tmp_path_factory):
    """A Llama of 119.6M parameters (478 MB in float32), random weights; vocabulary 8192 so that the layers, not
    the embeddings, hold most of it (the largest weight, an embedding, is 33.5 MB)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from grpo_accel.tasks.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=8192, hidden_size=1024, intermediate_size=2816, num_hidden_layers=8,
                         num_attention_heads=16, max_position_embeddings=256, tie_word_embeddings=False,
                         pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id,
                         eos_token_id=tokenizer.eos_token_id)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=generator)
    folder = tmp_path_factory.mktemp("llama_120m")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    params = list(model.parameters())
    return folder, sum(p.numel() * p.element_size() for p in params), max(p.numel() * p.element_size() for p in params)


def test_four_processes_each_hold_a_quarter_of_the_weights_while_loading(model_120m):
    folder, model_bytes, largest = model_120m
    assert model_bytes > 400e6  # at least 100M float32 parameters
    proc = launch("zero3.yaml", [str(folder)], launcher_args=["--num_processes", str(PROCESSES)],
                  script=(str(ROOT / "tests" / "helpers" / "zero3_load_memory.py"),), timeout=600)
    ranks = [json.loads(line) for line in proc.stdout.splitlines() if line.startswith('{"rank"')]
    assert sorted(r["rank"] for r in ranks) == list(range(PROCESSES)) and ranks[0]["processes"] == PROCESSES
    weights = 2 * model_bytes  # the policy and its reference
    for r in ranks:
        assert r["policy_share"] == pytest.approx(1 / PROCESSES, abs=1e-3) == r["reference_share"]
        held, peak = r["after"] - r["base"], r["peak"] - r["base"]
        # measured: 257 MB held after (the quarter, 239 MB, and 18 MB), 320 MB at the peak
        assert weights / PROCESSES <= held + 8e6 and held <= weights / PROCESSES + 48e6, r
        assert peak <= weights / PROCESSES + 2 * largest + 48e6, r  # one weight made whole, one gathered to fill
        assert peak < 0.75 * model_bytes  # below even one whole model, where a whole load held two
