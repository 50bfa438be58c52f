"""A character-level tokenizer made in code and a tiny Llama built from a config (random weights)."""
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
