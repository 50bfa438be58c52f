"""Checkpoints that never lose a run: atomic folders, rotation that keeps the newest, verified resume.

Layout of ``<directory>/step_00000042/`` (one folder per save, named by the trainer's iteration):

    accelerate state        trainable weights / optimizer / RNG per rank / every rank's ZeRO shards (save_state)
    trainer_state_rank{r}.pt  counters, replay buffer, collector position of rank r
    hf/                     the policy's transformers config and the tokenizer (for export)
    metadata.json           step, frames, processes, ZeRO stage, parameter signature, user metadata, file manifest
    COMPLETE                written last: a folder without it is never loaded

Every rank writes into ``.tmp-step_00000042/``; once all have finished, rank 0 writes the manifest and the
marker and renames the folder. A crash at any point leaves either the previous checkpoints untouched or a
``.tmp-`` folder that is never loaded.
"""
from __future__ import annotations

import contextlib
import hashlib
import json
import logging
import os
import re
import shutil
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

MARKER = "COMPLETE"
METADATA = "metadata.json"
_STEP_DIR = re.compile(r"^step_(\d+)$")


class CheckpointError(RuntimeError):
    """A checkpoint cannot be used; the message names the folder or file and what differs."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


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
        from grpo_accel.rules import check

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

    Example:
        >>> ckpt = Checkpoint("runs/exp/checkpoints", resume="auto")
        >>> trainer = GRPOTrainer(..., checkpoint=ckpt, save_trainer_interval=12_800)
    """

    def __init__(self, directory: str | Path, resume: str | Path | None = None) -> None:
        self.directory = Path(directory)
        self.resume = resume

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
                why = "is not a checkpoint (checkpoints are output_dir/checkpoints/step_* folders)"
            raise CheckpointError(f"checkpoint.resume={str(path)!r} {why}; complete checkpoints here: "
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
    def verify(cls, path: Path, *, num_processes: int, zero_stage: int, signature: str) -> dict:
        """Metadata of ``path`` after checking every file is present and whole, and the run matches."""
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
        if meta["num_processes"] != num_processes:
            raise CheckpointError(
                f"checkpoint {path} was written by {meta['num_processes']} processes, this run has {num_processes}. "
                f"Resume with {meta['num_processes']} processes, or export it (python -m grpo_accel.export {path} "
                "OUT) and start a new run from OUT with model.name_or_path=OUT."
            )
        if meta["zero_stage"] != zero_stage:
            raise CheckpointError(f"checkpoint {path} is from ZeRO stage {meta['zero_stage']}, this run uses stage "
                                  f"{zero_stage}; resume with the same accelerate config, or export and restart.")
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
        with open(staging / MARKER, "w") as f:
            f.write("ok\n")
            f.flush()
            os.fsync(f.fileno())
        if final.exists():  # a previous run's folder for the same step (e.g. after a resume from an older one)
            shutil.rmtree(final)
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
            deleted.append(path)
        return deleted


def _no_space(exc: BaseException) -> bool:
    """Whether ``exc`` (or what caused it) says the disk is full; torch's zip writer says "unexpected pos"."""
    import errno

    while exc is not None:
        if isinstance(exc, OSError) and exc.errno == errno.ENOSPC:
            return True
        if "No space left on device" in str(exc) or "unexpected pos" in str(exc):
            return True
        exc = exc.__cause__ or exc.__context__
    return False


class RunCheckpointer:
    """Saves and restores a run through an ``accelerate.Accelerator``; every method is collective.

    Args:
        accelerator: the run's Accelerator (its ``save_state`` / ``load_state`` carry model, optimizer, RNG
            and ZeRO shards).
        checkpoint: the run's :class:`Checkpoint` folder.
        rotation: what to keep after each save (None keeps everything).
        metadata: callable returning extra JSON-serialisable metadata (the spec's ``checkpoint_metadata``).
    """

    def __init__(self, accelerator, checkpoint: Checkpoint, rotation: CheckpointRotation | None = None,
                 metadata=None) -> None:
        self.accelerator, self.checkpoint, self.rotation, self.metadata = accelerator, checkpoint, rotation, metadata

    def save(self, step: int, rank_state: dict, info: dict, hf_assets: list) -> Path:
        """Write ``step``: accelerate state, this rank's ``rank_state``, and (rank 0) ``hf_assets`` (objects with
        ``save_pretrained``) plus metadata ``info``; returns the final folder."""
        import time

        import torch

        from grpo_accel.distributed import any_process

        start = time.perf_counter()
        acc, staging = self.accelerator, self.checkpoint.staging_dir(step)
        if acc.is_main_process and staging.exists():
            shutil.rmtree(staging)
        acc.wait_for_everyone()
        failed = None
        try:
            with frozen_weights_left_out(acc):
                acc.save_state(str(staging), **_save_kwargs(acc))
            torch.save(rank_state, rank_state_file(staging, acc.process_index))
            if acc.is_main_process:
                for asset in hf_assets:
                    asset.save_pretrained(staging / "hf")
        except Exception as exc:  # e.g. the disk filled up: every process learns it below, none waits forever
            failed = exc
        if any_process(acc, failed is not None):
            shutil.rmtree(staging, ignore_errors=True)
            raise self._save_failed(step, failed)
        final = self.checkpoint.directory / step_dir_name(step)
        if acc.is_main_process:
            extra = self.metadata() if self.metadata is not None else {}
            final = self.checkpoint.finalize(step, {**info, "step": step, "user": extra})
            deleted = self.checkpoint.rotate(self.rotation, current=step) if self.rotation is not None else []
            size = sum(file_manifest(final).values())
            logger.info("checkpoint %s saved (%s) in %.2f s, %.1f MB%s", final, info.get("reason"),
                        time.perf_counter() - start, size / 1e6,
                        f"; rotated out {[p.name for p in deleted]}" if deleted else "")
        acc.wait_for_everyone()
        return final

    def _save_failed(self, step: int, exc: Exception | None) -> CheckpointError:
        """The error for a save that failed on some process; its partial folder is already gone."""
        directory = self.checkpoint.directory
        kept = self.checkpoint.complete()
        needed = sum(file_manifest(kept[-1]).values()) if kept else None
        existing = next(p for p in (directory, *directory.parents) if p.exists())  # the save may have made none
        free = shutil.disk_usage(existing).free
        if exc is None:
            why = "another process failed to write its part"
        elif _no_space(exc) or (needed is not None and free < needed):
            need = f"the last checkpoint needed {needed / 1e6:.1f} MB" if needed else "this is the first checkpoint"
            why = f"no space left on {directory} ({free / 1e6:.1f} MB free; {need})"
        else:
            why = f"{type(exc).__name__}: {exc}"
        return CheckpointError(f"checkpoint {step_dir_name(step)} could not be saved: {why}. Its partial folder was "
                               f"removed and earlier checkpoints are kept ({[p.name for p in kept] or 'none'}); "
                               "make room (or a new output_dir), then rerun with checkpoint.resume=auto.")

    def load(self, path: Path, *, signature: str, strict: bool = True) -> dict | None:
        """Verify ``path`` against this run, load accelerate state, return this rank's trainer state."""
        import time

        import torch

        from grpo_accel.distributed import zero_stage

        start = time.perf_counter()
        acc = self.accelerator
        Checkpoint.verify(path, num_processes=acc.num_processes, zero_stage=zero_stage(acc), signature=signature)
        rank_file = rank_state_file(path, acc.process_index)
        try:
            acc.load_state(str(path), **_load_kwargs(acc))
            state = torch.load(rank_file, weights_only=True) if rank_file.is_file() or strict else None
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path} could not be loaded ({type(exc).__name__}: {exc}); resume "
                                  "from another checkpoint. Nothing in the run folder was changed.") from exc
        logger.info("checkpoint %s loaded in %.2f s", path, time.perf_counter() - start)
        return state


class TrainerFiles:
    """Where a trainer's state goes: checkpoint folders (:class:`RunCheckpointer`) and the single-file payload
    (``save_trainer_file``). Saving and loading folders is collective."""

    def __init__(self, accelerator, checkpoint: Checkpoint | None = None, rotation: CheckpointRotation | None = None,
                 metadata=None, file: str | Path | None = None) -> None:
        self.accelerator = accelerator
        self.checkpointer = RunCheckpointer(accelerator, checkpoint, rotation, metadata) if checkpoint else None
        self.file = Path(file) if file is not None else None

    def save(self, step: int, rank_state: dict, info: dict, module, policy=None, tokenizer=None) -> Path | None:
        """The checkpoint folder (returned; with the policy's config and the tokenizer, what export needs besides
        weights, when they exist) and the payload file (``module``'s weights), each when configured."""
        hf_assets = [a for a in (getattr(policy, "config", None), tokenizer) if hasattr(a, "save_pretrained")]
        final = self.checkpointer.save(step, rank_state, info, hf_assets) if self.checkpointer else None
        if self.file is not None:
            weights = self.accelerator.get_state_dict(module)  # collective under ZeRO-3; full on rank 0
            if self.accelerator.is_main_process:
                save_trainer_payload(self.file, weights, rank_state)
        return final

    def load_folder(self, path: Path, signature: str, strict: bool = True) -> dict | None:
        """This rank's trainer state of checkpoint folder ``path`` (accelerate state loaded)."""
        checkpointer = self.checkpointer or RunCheckpointer(self.accelerator, Checkpoint(Path(path).parent))
        return checkpointer.load(path, signature=signature, strict=strict)

    def load_file(self, path: Path, module, strict: bool = True, **kwargs) -> dict:
        """The trainer state of a payload file; its weights are loaded into ``module`` (``kwargs``: torch.load's)."""
        from grpo_accel.distributed import zero_stage

        payload = load_trainer_payload(path, **kwargs)
        if zero_stage(self.accelerator) == 3:
            raise CheckpointError(f"{path}: a single-file trainer payload cannot be loaded under ZeRO-3; resume "
                                  "from a checkpoint folder instead (checkpoint.resume).")
        missing, unexpected = module.load_state_dict(payload["model"], strict=False)
        if strict and (missing or unexpected):
            raise CheckpointError(f"{path}: model weights do not fit (missing {missing[:5]}, unexpected "
                                  f"{unexpected[:5]}); pass strict=False to load what fits.")
        return payload["trainer"]


def module_signature(module) -> str:
    """:func:`parameter_signature` of a module's parameters at their full (unpartitioned) shapes."""
    from grpo_accel.distributed import full_shape

    return parameter_signature([(name, full_shape(p)) for name, p in module.named_parameters()])


# Checkpoints hold what training changes. Frozen parameters (a LoRA run's base model, a KL reference) come from the
# model the resumed run builds, as DeepSpeed's exclude_frozen_parameters does: a LoRA checkpoint is the adapter.


def _uses_deepspeed(acc) -> bool:
    return acc.distributed_type.name == "DEEPSPEED"


def _save_kwargs(acc) -> dict:
    return {"exclude_frozen_parameters": True} if _uses_deepspeed(acc) else {}


def _load_kwargs(acc) -> dict:
    return {"load_module_strict": False} if _uses_deepspeed(acc) else {"strict": False}


@contextlib.contextmanager
def frozen_weights_left_out(acc):
    """Around ``save_state``: the model files (outside DeepSpeed) keep only parameters that require grad."""
    def drop_frozen(models, weights, output_dir) -> None:
        for model, state in zip(models, weights):
            for name, p in model.named_parameters(remove_duplicate=False):  # tied names too
                if not p.requires_grad:
                    state.pop(name, None)

    handle = None if _uses_deepspeed(acc) else acc.register_save_state_pre_hook(drop_frozen)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
