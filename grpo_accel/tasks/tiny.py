"""A character-level tokenizer made in code and tiny models (Llama, Qwen2) built from a config (random weights)."""
from __future__ import annotations

from dataclasses import dataclass

SPECIAL_TOKENS = {"pad": "<pad>", "bos": "<bos>", "eos": "<eos>", "unk": "<unk>"}
ARITHMETIC_CHARS = "0123456789+-*="


def build_char_tokenizer(chars: str = ARITHMETIC_CHARS):
    """A transformers fast tokenizer with one token per character of ``chars`` plus pad/bos/eos/unk.

    Prompts are left-padded (batched generation); ``save_pretrained`` / ``AutoTokenizer.from_pretrained``
    round-trip it like any Hugging Face tokenizer.
    """
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate(SPECIAL_TOKENS.values())}
    for ch in dict.fromkeys(chars):
        vocab.setdefault(ch, len(vocab))
    core = Tokenizer(models.WordLevel(vocab, unk_token=SPECIAL_TOKENS["unk"]))
    core.pre_tokenizer = pre_tokenizers.Split("", behavior="isolated")
    core.decoder = decoders.Fuse()
    return PreTrainedTokenizerFast(
        tokenizer_object=core,
        pad_token=SPECIAL_TOKENS["pad"], bos_token=SPECIAL_TOKENS["bos"],
        eos_token=SPECIAL_TOKENS["eos"], unk_token=SPECIAL_TOKENS["unk"],
        padding_side="left",
    )


@dataclass
class TinyModelSpec:
    """Dimensions of the built-in Llama; the defaults give ~0.1M parameters."""

    hidden_size: int = 64
    num_layers: int = 2
    num_heads: int = 4
    intermediate_size: int = 128
    max_positions: int = 128


def build_tiny_model(tokenizer, spec: TinyModelSpec | None = None, seed: int | None = None):
    """A randomly initialised ``LlamaForCausalLM`` sized by ``spec`` for ``tokenizer``'s vocabulary."""
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    spec = spec or TinyModelSpec()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=spec.hidden_size,
        intermediate_size=spec.intermediate_size,
        num_hidden_layers=spec.num_layers,
        num_attention_heads=spec.num_heads,
        num_key_value_heads=spec.num_heads,
        max_position_embeddings=spec.max_positions,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        tie_word_embeddings=False,
    )
    if seed is not None:
        torch.manual_seed(seed)
    return LlamaForCausalLM(config)


def build_tiny_qwen2(tokenizer, seed: int | None = None):
    """The speed comparison's model (82,496 parameters): a ``Qwen2ForCausalLM`` with hidden 64, intermediate 128,
    2 layers, 4 heads, 2 key/value heads, a vocabulary of 128 and tied embeddings (random weights)."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    config = Qwen2Config(
        vocab_size=128, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, tie_word_embeddings=True, max_position_embeddings=128,
        pad_token_id=tokenizer.pad_token_id, bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
    )
    if seed is not None:
        torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def save_smollm2_shaped(folder, seed: int = 0):
    """A ``LlamaForCausalLM`` of SmolLM2-135M's shape with random weights, saved with the character tokenizer in
    ``folder``: 134.5M parameters, 538 MB in float32 (hidden 576, 30 layers, 9 heads over 3 key/value heads, a
    vocabulary of 49,152 embedded once and tied to the head, the largest weight at 113 MB). For measuring memory
    at a real model's size without the package registry's model. Built on the meta device, so the weights are
    made once. Returns ``folder`` as a Path."""
    from pathlib import Path

    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    tokenizer = build_char_tokenizer()
    config = LlamaConfig(vocab_size=49152, hidden_size=576, intermediate_size=1536, num_hidden_layers=30,
                         num_attention_heads=9, num_key_value_heads=3, max_position_embeddings=2048,
                         rope_theta=100000.0, tie_word_embeddings=True, pad_token_id=tokenizer.pad_token_id,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id)
    with torch.device("meta"):
        model = LlamaForCausalLM(config)
    model = model.to_empty(device="cpu")
    model.tie_weights()
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            p.normal_(0, 0.02, generator=generator)
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return Path(folder)
