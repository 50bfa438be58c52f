"""Export a checkpoint (any ZeRO stage) as a Hugging Face model folder: safetensors + config + tokenizer.

    grpo-accel export runs/default/checkpoints/step_00001000 exported/ [--dtype bfloat16]

The folder loads with ``AutoModelForCausalLM.from_pretrained`` and is what an SGLang server serves
(``--model-path``) or reloads (``/update_weights_from_disk``). A LoRA run's checkpoint holds only its adapter:
export rebuilds the base model the run trained from (``model.name_or_path``) and writes the merged model, or with
``--adapter`` the PEFT adapter folder (``PeftModel.from_pretrained(base, out_dir)``).
"""
from __future__ import annotations

import contextlib
import logging
import os
import shutil
import tempfile
import time
from pathlib import Path

from grpo_accel.checkpoint import MARKER, CheckpointError

logger = logging.getLogger(__name__)
POLICY_PREFIX = "policy."
LORA_KEY = ".lora_A."


def checkpoint_state_dict(checkpoint: Path) -> dict:
    """The full (consolidated) state dict of the prepared module in ``checkpoint``, on CPU, float32."""
    ds_dir = checkpoint / "pytorch_model"
    if ds_dir.is_dir():  # DeepSpeed: consolidate every rank's shards (stages 0-3)
        logger.info("consolidating %s's DeepSpeed shards into one state dict", checkpoint)
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


def export_checkpoint(checkpoint: str | Path, out_dir: str | Path, dtype: str | None = None,
                      adapter: bool = False, replace: bool = False) -> Path:
    """Write the policy of ``checkpoint`` to ``out_dir`` as a transformers model folder (a LoRA run's merged model,
    or with ``adapter`` its PEFT adapter folder); returns ``out_dir``.

    ``out_dir`` must be new or empty, or ``replace`` set: the folder is written beside it and then takes its place
    whole, so it never holds files of two exports (an old ``chat_template.jinja`` beside a new model)."""
    import torch
    from transformers import AutoTokenizer

    from grpo_accel.lora import is_lora, merged_model

    checkpoint, out_dir = newest_checkpoint(Path(checkpoint)), Path(out_dir)
    check_target(out_dir, replace)
    start = time.perf_counter()
    model = load_policy(checkpoint)
    logger.info("read the policy (%.1fM parameters) in %.1f s; writing %s", sum(p.numel() for p in
                model.parameters()) / 1e6, time.perf_counter() - start, out_dir)
    if adapter and not is_lora(model):
        raise CheckpointError(f"checkpoint {checkpoint}: --adapter needs a LoRA run (model.lora.r > 0); this one "
                              "trained every weight: export it without --adapter.")
    with staged_folder(out_dir) as staging:
        if adapter:
            model.save_pretrained(staging)  # adapter_config.json + adapter_model.safetensors
        else:
            model = merged_model(model)
            if dtype is not None:
                model = model.to(getattr(torch, dtype))
            model.save_pretrained(staging, safe_serialization=True)
            if (checkpoint / "hf" / "tokenizer_config.json").is_file():
                AutoTokenizer.from_pretrained(checkpoint / "hf").save_pretrained(staging)
    logger.info("exported %s%s -> %s (%.1f s)", "the LoRA adapter of " if adapter else "", checkpoint, out_dir,
                time.perf_counter() - start)
    return out_dir


def check_target(out_dir: Path, replace: bool) -> None:
    """A CheckpointError unless ``out_dir`` can take an export: a new or empty folder (any folder with ``replace``)
    in a folder that exists and can be written."""
    if out_dir.exists() and not out_dir.is_dir():
        raise CheckpointError(f"export target {out_dir} is a file; name a folder to write the model into.")
    if out_dir.is_dir() and any(out_dir.iterdir()) and not replace:
        held = sorted(p.name for p in out_dir.iterdir())
        raise CheckpointError(f"export target {out_dir} is not empty ({', '.join(held[:4])}{', ...' if len(held) > 4 else ''}); "
                              "name a new folder, or pass --replace to replace it whole.")
    if not out_dir.resolve().parent.is_dir():
        raise CheckpointError(f"export target {out_dir}: its parent folder {out_dir.resolve().parent} does not exist; "
                              "make it first or name another folder.")
    try:  # before the weights are read (a ZeRO checkpoint's consolidation takes minutes at scale)
        os.rmdir(tempfile.mkdtemp(prefix=f".{out_dir.name}.check-", dir=out_dir.resolve().parent))
    except OSError as exc:
        raise CheckpointError(f"export target {out_dir}: cannot write there ({exc.strerror or exc}); name a folder "
                              "you can write.") from None


@contextlib.contextmanager
def staged_folder(out_dir: Path):
    """A fresh folder beside ``out_dir`` to write into; when the block ends without an error it becomes
    ``out_dir`` (an earlier ``out_dir`` moved aside first, then deleted), else it is deleted. A folder this user
    cannot write is one CheckpointError."""
    staging = None
    try:
        staging = Path(tempfile.mkdtemp(prefix=f".{out_dir.name}.export-", dir=out_dir.resolve().parent))
        yield staging
        if out_dir.exists():
            old = staging.with_name(staging.name + ".old")
            out_dir.rename(old)
            try:
                staging.rename(out_dir)
            except OSError:
                old.rename(out_dir)  # the earlier export stays where it was
                raise
            shutil.rmtree(old)
        else:
            staging.rename(out_dir)
    except OSError as exc:
        raise CheckpointError(f"export target {out_dir}: cannot write there ({exc.strerror or exc}); name a folder "
                              "you can write.") from None
    finally:
        if staging is not None:
            shutil.rmtree(staging, ignore_errors=True)


def newest_checkpoint(path: Path) -> Path:
    """``path`` when it is a checkpoint; for a run's folder (or its ``checkpoints/``) its newest complete checkpoint,
    said in a line; else a CheckpointError saying what to give."""
    if (path / MARKER).is_file():
        return path
    from grpo_accel.checkpoint import Checkpoint

    folder = path / "checkpoints" if (path / "checkpoints").is_dir() else path
    complete = Checkpoint(folder).complete() if folder.is_dir() else []
    if not complete:
        raise CheckpointError(f"{path} is neither a complete checkpoint (no {MARKER} marker) nor a run folder holding "
                              "one (output_dir/checkpoints/step_*); give a run's output_dir or one of its checkpoints.")
    logging.getLogger(__name__).info("exporting %s, the newest complete checkpoint of %s", complete[-1], path)
    return complete[-1]


def load_policy(checkpoint: Path):
    """The checkpoint's policy with its trained weights, on CPU in float32: a transformers model, or for a LoRA run
    (whose checkpoint holds only the adapter) the PEFT model over the base the run trained from."""
    from transformers import AutoConfig, AutoModelForCausalLM

    if not (checkpoint / MARKER).is_file():
        raise CheckpointError(f"{checkpoint} is not a complete checkpoint (no {MARKER} marker).")
    state = policy_weights(checkpoint_state_dict(checkpoint))
    if any(LORA_KEY in k for k in state):
        return _lora_policy(checkpoint, state)
    config = AutoConfig.from_pretrained(checkpoint / "hf")
    model = AutoModelForCausalLM.from_config(config)
    missing, unexpected = model.load_state_dict(state, strict=False)
    missing = [k for k in missing if not (config.tie_word_embeddings and k == "lm_head.weight")]
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {checkpoint}: weights do not fit {config.model_type} "
                              f"(missing {missing[:5]}, unexpected {unexpected[:5]}).")
    return model


def _lora_policy(checkpoint: Path, adapter_state: dict):
    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.config.checks import ConfigError
    from grpo_accel.config.loading import build_section
    from grpo_accel.recipe.parts import build_tokenizer_and_model, lora_policy
    from grpo_accel.config.schema import ModelConfig

    run = Checkpoint.read_metadata(checkpoint).get("user", {}).get("config")
    if run is None:
        raise CheckpointError(f"checkpoint {checkpoint} holds a LoRA adapter but not the run's config (metadata "
                              "user.config), so its base model is unknown; export from a launch/train.py run.")
    cfg = build_section(ModelConfig, run["model"], "model")
    seed = run.get("trainer", {}).get("seed", 0)
    try:
        _, base = build_tokenizer_and_model(cfg, seed=seed)
    except ConfigError as exc:
        raise CheckpointError(f"checkpoint {checkpoint} holds only a LoRA adapter; its base model must load as in "
                              f"training: {exc}") from exc
    model = lora_policy(base, cfg.lora, seed)
    wanted = {name for name, p in model.named_parameters() if p.requires_grad}
    missing, unexpected = wanted - set(adapter_state), set(adapter_state) - set(model.state_dict())
    if missing or unexpected:
        raise CheckpointError(f"checkpoint {checkpoint}: the adapter does not fit model.lora={run['model']['lora']} "
                              f"(missing {sorted(missing)[:3]}, unexpected {sorted(unexpected)[:3]}).")
    model.load_state_dict(adapter_state, strict=False)
    return model
