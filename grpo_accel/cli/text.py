"""What the commands print besides a run's lines: help text from a module's docstring, without its reST markup,
and ``grpo-accel env``'s report of the versions and devices a bug report needs."""
from __future__ import annotations

import argparse
import importlib.metadata
import platform
import re

PACKAGES = ("torch", "accelerate", "deepspeed", "transformers", "tensordict", "datasets", "peft", "trl", "sglang",
            "vllm")
"""What ``grpo-accel env`` reports the version of (or that it is not installed)."""


def plain(doc: str) -> str:
    """``doc`` as a terminal shows it: a role (:func: and the like) and double backquotes left out, their text
    kept."""
    return re.sub(r":\w+:`~?([^`]+)`", r"\1", doc or "").replace("``", "")


def command_parser(doc: str, **kwargs) -> argparse.ArgumentParser:
    """A subcommand's parser: ``doc`` (its module's docstring) as plain text, its line breaks kept."""
    return argparse.ArgumentParser(description=plain(doc), formatter_class=argparse.RawDescriptionHelpFormatter,
                                   **kwargs)


def environment() -> list[str]:
    """``name: value`` lines: grpo_accel, Python and the platform, each of :data:`PACKAGES`, CUDA and the GPUs."""
    import torch

    lines = [f"grpo_accel: {_version('grpo_accel')}", f"python: {platform.python_version()}",
             f"platform: {platform.platform()}"]
    lines += [f"{package}: {_version(package)}" for package in PACKAGES]
    if torch.version.cuda is None:
        lines.append("cuda: none (a CPU build of torch)")
    else:
        nccl = ".".join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else "-"
        lines.append(f"cuda: {torch.version.cuda} (torch's build), NCCL {nccl}")
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    lines.append(f"gpus: {count}")
    for i in range(count):
        p = torch.cuda.get_device_properties(i)
        lines.append(f"gpu {i}: {p.name}, {p.total_memory / 2**30:.0f} GiB, compute capability {p.major}.{p.minor}")
    return lines


def _version(package: str) -> str:
    try:
        return importlib.metadata.version(package)
    except importlib.metadata.PackageNotFoundError:
        return "not installed"
