"""Shared by cli/ and distributed/.

The configuration files the project ships, found by name from a checkout or an installed package: accelerate
configs (``accelerate_configs/``), DeepSpeed files (``ds_configs/``) and recipes (``launch/configs/``). The repository holds one copy of each; a wheel carries
them as ``grpo_accel/_shipped/<folder>/`` (pyproject.toml maps those package folders onto the repository's)."""
from __future__ import annotations

from pathlib import Path

from grpo_accel.errors import UserError

FOLDERS = {"accelerate": ("accelerate_configs", "accelerate_configs", ".yaml"),
           "deepspeed": ("ds_configs", "ds_configs", ".json"),
           "recipe": ("launch/configs", "recipes", ".yaml")}
"""kind -> (folder in the repository, folder in the wheel's ``grpo_accel/_shipped/``, suffix)."""
FLAGS = {"accelerate": "--accelerate-config", "deepspeed": "deepspeed_config_file", "recipe": "--config"}


class ShippedConfigError(UserError, ValueError):
    """A config named by a name that is neither a file nor a shipped config."""


def folder(kind: str) -> Path:
    """Where the shipped configs of ``kind`` are: the checkout's folder, else the installed package's."""
    in_repo, in_wheel, _ = FOLDERS[kind]
    package = Path(__file__).resolve().parent
    checkout = package.parent / in_repo
    return checkout if checkout.is_dir() else package / "_shipped" / in_wheel


def names(kind: str) -> list[str]:
    """The shipped configs of ``kind`` by name: ["ddp", "zero3", ...]."""
    return sorted(p.stem for p in folder(kind).glob("*" + FOLDERS[kind][2]))


def find(kind: str, name: str | Path) -> Path:
    """``name`` as a file: a path that exists, else a shipped config's name (``zero3``, ``dapo``). A path that
    does not exist and is not a bare name comes back unchanged, for the reader's own error."""
    path = Path(name)
    if path.exists() or path.suffix or len(path.parts) > 1:
        return path
    shipped = folder(kind) / (path.name + FOLDERS[kind][2])
    if shipped.is_file():
        return shipped
    raise ShippedConfigError(f"{FLAGS[kind]} {str(name)!r}: no such file, and no shipped config of that name; give a "
                             f"path, or one of {', '.join(names(kind))}.")


def shipped_deepspeed_file(path: str) -> Path | None:
    """``ds_configs/<name>.json`` (as the shipped accelerate configs write it) as the shipped file, or None."""
    parts = Path(path).parts
    if len(parts) == 2 and parts[0] == FOLDERS["deepspeed"][0] and (folder("deepspeed") / parts[1]).is_file():
        return folder("deepspeed") / parts[1]
    return None
