"""Shared by cli/, recipe/, run/ and trainer/.

Checkpoints that never lose a run: atomic folders, rotation that keeps the newest, verified resume.

Layout of ``<directory>/step_00000042/`` (one folder per save, named by the trainer's iteration):

    accelerate state        trainable weights / optimizer / RNG per rank / every rank's ZeRO shards (save_state)
    trainer_state_rank{r}.pt  counters, replay buffer, collector position of rank r
    hf/                     the policy's transformers config and the tokenizer (for export)
    metadata.json           step, frames, processes, ZeRO stage, parameter signature, user metadata, file manifest
    COMPLETE                written last: a folder without it is never loaded

and, once another process count or ZeRO stage resumes it, ``step_00000042.portable/`` beside it: every parameter's
weight and optimizer moments whole (:mod:`grpo_accel.trainer.portable`), deleted with the checkpoint.

Every rank writes into ``.tmp-step_00000042/``; once all have finished, rank 0 writes the manifest and the
marker and renames the folder. A crash at any point leaves either the previous checkpoints untouched or a
``.tmp-`` folder that is never loaded.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Mapping

from grpo_accel.distributed import full_shape
from grpo_accel.errors import UserError
from grpo_accel.rules import check, setting

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
METADATA = "metadata.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(UserError, RuntimeError):
    """A checkpoint cannot be used; the message names the folder or file and what differs."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def converted(folder: Path) -> Path:
    """Where a checkpoint folder's portable form goes when another layout resumes it (beside it, deleted with it)."""
    folder = Path(folder)
    return folder.with_name(folder.name + ".portable")


def rank_state_file(folder: Path, rank: int) -> Path:
    """Where rank ``rank`` keeps its trainer state in a checkpoint folder."""
    return Path(folder) / f"trainer_state_rank{rank}.pt"


def parameter_signature(named_shapes: list[tuple[str, tuple[int, ...]]]) -> str:
    """A digest of parameter names and full shapes: equal iff the model architecture is the same."""
    text = "\n".join(f"{name}:{list(shape)}" for name, shape in sorted(named_shapes))
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def file_manifest(folder: Path) -> dict[str, int]:
    """Relative path -> size in bytes of every file under ``folder``."""
    return {str(p.relative_to(folder)): p.stat().st_size for p in sorted(folder.rglob("*")) if p.is_file()}


def write_marker(folder: Path) -> None:
    """``folder``'s COMPLETE marker, on disk (fsync) before the rename that publishes the folder."""
    with open(Path(folder) / MARKER, "w") as f:
        f.write("ok\n")
        f.flush()
        os.fsync(f.fileno())


def save_trainer_payload(path: Path, weights: dict, trainer_state: dict) -> None:
    """The single-file format (the spec's ``save_trainer_file``), written atomically."""
    import torch

    tmp = path.with_name(path.name + ".tmp")
    tmp.parent.mkdir(parents=True, exist_ok=True)
    torch.save({"model": weights, "trainer": trainer_state}, tmp)
    os.replace(tmp, path)


def load_trainer_payload(path: Path, weights_only: bool = True, mmap: bool = True, map_location="cpu") -> dict:
    """Read a single-file payload: ``weights_only`` and ``mmap`` on by default, tensors mapped to CPU."""
    import torch

    return torch.load(path, weights_only=weights_only, mmap=mmap, map_location=map_location)


@dataclass
class CheckpointRotation:
    """Which checkpoints to keep: the ``keep_last`` newest plus the ``keep_best`` best by ``metric``.

    The newest complete checkpoint is never deleted, whatever the settings.

    Example:
        >>> CheckpointRotation(keep_last=2, keep_best=1, metric="train/reward_mean", mode="max")
    """

    keep_last: int = 3
    keep_best: int = 0
    metric: str = "train/reward_mean"
    mode: str = "max"

    def __post_init__(self) -> None:
        check("keep_last", "keep_last", self.keep_last, owner="CheckpointRotation: ")
        check("non_negative_count", "keep_best", self.keep_best, owner="CheckpointRotation: ")
        check("best_mode", "mode", self.mode, owner="CheckpointRotation: ")

    def to_delete(self, checkpoints: list[tuple[int, float | None]], current: int | None = None) -> list[int]:
        """Steps to delete from ``[(step, metric value or None), ...]``; ``current``, the step just saved, is
        kept even where newer steps exist (a run resumed from an older checkpoint)."""
        steps = sorted(step for step, _ in checkpoints)
        keep = set(steps[-self.keep_last :]) | {current}
        scored = [(value, step) for step, value in checkpoints if value is not None]
        scored.sort(reverse=self.mode == "max")
        keep.update(step for _, step in scored[: self.keep_best])
        return [step for step in steps if step not in keep]


class Checkpoint:
    """The checkpoint folder of a run: listing, verification, and the two halves of an atomic save.

    Args:
        directory: where ``step_*`` folders live (e.g. ``<output_dir>/checkpoints``).
        resume: ``None`` (start fresh), ``"auto"`` (newest complete checkpoint, fresh if none) or a path.
        names: what messages call ``resume`` (:func:`grpo_accel.rules.setting`; the recipe: checkpoint.resume).

    Example:
        >>> ckpt = Checkpoint("runs/exp/checkpoints", resume="auto")
        >>> trainer = GRPOTrainer(..., checkpoint=ckpt, save_trainer_interval=12_800)
    """

    def __init__(self, directory: str | Path, resume: str | Path | None = None,
                 names: Mapping[str, str] | None = None) -> None:
        self.directory = Path(directory)
        self.resume, self.names = resume, names

    @property
    def resume_setting(self) -> str:
        """What this run calls its resume setting (``resume``, or the config's key)."""
        return setting(self.names, "resume")

    def complete(self) -> list[Path]:
        """Complete checkpoint folders, oldest first; folders without the marker are skipped with a warning."""
        if not self.directory.is_dir():
            return []
        found = []
        for path in self.directory.iterdir():
            match = _STEP_DIR.match(path.name)
            if not (match and path.is_dir()):
                continue
            if (path / MARKER).is_file():
                found.append((int(match.group(1)), path))
            else:
                logger.warning("skipping checkpoint %s: no %s marker (an interrupted save); it is never loaded", path, MARKER)
        return [path for _, path in sorted(found)]

    def resume_path(self) -> Path | None:
        """The folder to resume from, per ``resume``; None to start fresh."""
        if self.resume in (None, "", "none"):
            return None
        if self.resume == "auto":
            found = self.complete()
            return found[-1] if found else None
        path = Path(self.resume)
        if not (path / MARKER).is_file():
            if not path.exists():
                why = "does not exist"
            elif _STEP_DIR.match(path.name.removeprefix(".tmp-")):
                why = f"has no {MARKER} marker (an interrupted save)"
            else:
                why = "is not a checkpoint (checkpoints are the step_* folders of a run's checkpoints folder)"
            raise CheckpointError(f"{self.resume_setting}={str(path)!r} {why}; complete checkpoints here: "
                                  f"{[p.name for p in self.complete()] or 'none'}.")
        return path

    # -- verification -----------------------------------------------------------------------------------

    @staticmethod
    def read_metadata(path: Path) -> dict:
        try:
            return json.loads((Path(path) / METADATA).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise CheckpointError(f"checkpoint {path}: {METADATA} is missing or unreadable ({exc}).") from exc

    @classmethod
    def verify(cls, path: Path, *, signature: str) -> dict:
        """Metadata of ``path`` after checking every file is present and whole and the model is this run's. Any
        process count and ZeRO stage may resume it (:mod:`grpo_accel.trainer.portable`)."""
        path = Path(path)
        meta = cls.read_metadata(path)
        for name, size in meta.get("manifest", {}).items():
            file = path / name
            if not file.is_file():
                raise CheckpointError(f"checkpoint {path}: file {name} is missing (a lost shard?); resume from another "
                                      "checkpoint. Nothing was changed.")
            if file.stat().st_size != size:
                raise CheckpointError(f"checkpoint {path}: file {name} has {file.stat().st_size} bytes, {size} were "
                                      "written (truncated or corrupted); resume from another checkpoint.")
        if meta["signature"] != signature:
            raise CheckpointError(f"checkpoint {path} holds another model (parameter names/shapes differ: signature "
                                  f"{meta['signature']} vs {signature} here); check model.* settings and output_dir.")
        return meta

    # -- saving (the trainer calls these on the right ranks) ----------------------------------------------

    def staging_dir(self, step: int) -> Path:
        return self.directory / f".tmp-{step_dir_name(step)}"

    def finalize(self, step: int, metadata: dict) -> Path:
        """Rank 0, after every rank wrote into the staging folder: manifest, marker, rename."""
        staging, final = self.staging_dir(step), self.directory / step_dir_name(step)
        metadata = {**metadata, "manifest": file_manifest(staging)}
        (staging / METADATA).write_text(json.dumps(metadata, indent=2))
        write_marker(staging)
        for old in (final, converted(final)):  # a previous run's folder for the same step (a resume from an older one)
            if old.exists():
                shutil.rmtree(old)
        os.replace(staging, final)
        return final

    def rotate(self, rotation: CheckpointRotation, current: int | None = None) -> list[Path]:
        """Delete what ``rotation`` does not keep (never ``current``, the step just saved); returns the deleted
        folders."""
        entries = []
        for path in self.complete():
            meta = self.read_metadata(path)
            entries.append((meta["step"], meta.get("metrics", {}).get(rotation.metric)))
        deleted = []
        for step in rotation.to_delete(entries, current):
            path = self.directory / step_dir_name(step)
            shutil.rmtree(path, ignore_errors=True)
            shutil.rmtree(converted(path), ignore_errors=True)
            deleted.append(path)
        return deleted


def module_signature(module) -> str:
    """:func:`parameter_signature` of a module's parameters at their full (unpartitioned) shapes."""
    return parameter_signature([(name, full_shape(p)) for name, p in module.named_parameters()])
