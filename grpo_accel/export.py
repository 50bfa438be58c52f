"""Export a checkpoint (any ZeRO stage) as a Hugging Face model folder: safetensors + config + tokenizer.

    python -m grpo_accel.export runs/default/checkpoints/step_00001000 exported/ [--dtype bfloat16]

The folder loads with ``AutoModelForCausalLM.from_pretrained`` and is what an SGLang server serves
(``--model-path``) or reloads (``/update_weights_from_disk``).
"""
from __future__ import annotations

import argparse
import logging
from pathlib import Path

from grpo_accel.checkpoint import MARKER, CheckpointError

logger = logging.getLogger(__name__)
POLICY_PREFIX = "policy."


def checkpoint_state_dict(checkpoint: Path) -> dict:
    """The full (consolidated) state dict of the prepared module in ``checkpoint``, on CPU, float32."""
    ds_dir = checkpoint / "pytorch_model"
    if ds_dir.is_dir():  # DeepSpeed: consolidate every rank's shards (stages 0-3)
        from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

        return get_fp32_state_dict_from_zero_checkpoint(str(checkpoint), tag="pytorch_model")
    weights = checkpoint / "model.safetensors"
    if weights.is_file():
        from safetensors.torch import load_file

        return load_file(str(weights))
    bin_weights = checkpoint / "pytorch_model.bin"
    if bin_weights.is_file():
        import torch

        return torch.load(bin_weights, map_location="cpu", weights_only=True)
    raise CheckpointError(f"checkpoint {checkpoint}: no model weights found (model.safetensors or pytorch_model/).")


def policy_weights(state: dict) -> dict:
    """The policy's entries of a GRPOLoss state dict, with their Hugging Face names."""
    policy = {k[len(POLICY_PREFIX):]: v for k, v in state.items() if k.startswith(POLICY_PREFIX)}
    return policy or state


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None) -> Path:
    """Write the policy of ``checkpoint`` to ``out_dir`` as a transformers model folder; returns ``out_dir``."""
    import torch
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    checkpoint, out_dir = Path(checkpoint), Path(out_dir)
    if not (checkpoint / MARKER).is_file():
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint (no {MARKER} marker).")
    hf_dir = checkpoint / "hf"
    config = AutoConfig.from_pretrained(hf_dir)
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(policy_weights(checkpoint_state_dict(checkpoint)), strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {checkpoint}: weights do not fit {config.model_type} "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]}).")
    if dtype is not None:
        model = model.to(getattr(torch, dtype))
    model.save_pretrained(out_dir, safe_serialization=True)
    if (hf_dir / "tokenizer_config.json").is_file():
        AutoTokenizer.from_pretrained(hf_dir).save_pretrained(out_dir)
    logger.info("exported %s -> %s", checkpoint, out_dir)
    return out_dir


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("checkpoint", help="a checkpoint folder (output_dir/checkpoints/step_*)")
    parser.add_argument("out_dir", help="where to write the Hugging Face model folder")
    parser.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], help="cast the weights")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO)
    export_checkpoint(args.checkpoint, args.out_dir, args.dtype)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
