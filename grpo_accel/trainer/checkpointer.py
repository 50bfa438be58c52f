"""Saving and restoring a run through its ``accelerate.Accelerator`` (every method collective): the trainer's
checkpoint folders (:class:`RunCheckpointer`, atomic through :class:`~grpo_accel.checkpoint.Checkpoint`) and its
single-file payload (:class:`TrainerFiles`). Checkpoints hold what training changes: frozen parameters (a LoRA
run's base model, a KL reference) come from the model the resumed run builds, as DeepSpeed's
``exclude_frozen_parameters`` does, so a LoRA checkpoint is its adapter."""
from __future__ import annotations

import contextlib
import logging
import shutil
import time
from pathlib import Path

import torch

from grpo_accel.checkpoint import (Checkpoint, CheckpointError, CheckpointRotation, file_manifest, load_trainer_payload,
                                   rank_state_file, save_trainer_payload, step_dir_name)
from grpo_accel.distributed import any_process, full_shape, uses_deepspeed, zero_stage
from grpo_accel.trainer.portable import (Layout, convert, is_complete, load_into_deepspeed, load_whole, portable_dir,
                                         rank_state_for, same_files, saved_layout)

logger = logging.getLogger(__name__)


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
        start = time.perf_counter()
        acc, staging = self.accelerator, self.checkpoint.staging_dir(step)
        if acc.is_main_process and staging.exists():
            shutil.rmtree(staging)
        acc.wait_for_everyone()
        failed = None
        try:
            with frozen_weights_left_out(acc), tie_left_unsaid():
                acc.save_state(str(staging), **_save_kwargs(acc))
            torch.save(rank_state, rank_state_file(staging, acc.process_index))
            if acc.is_main_process:
                for asset in hf_assets:
                    asset.save_pretrained(staging / "hf")
        except Exception as exc:  # e.g. the disk filled up: every process learns it below, none waits forever
            failed = exc
        if any_process(failed is not None):
            shutil.rmtree(staging, ignore_errors=True)
            raise self._save_failed(step, failed)
        final = self.checkpoint.directory / step_dir_name(step)
        if acc.is_main_process:
            extra = self.metadata() if self.metadata is not None else {}
            layout = run_layout(acc)  # what a resume compares with its own (grpo_accel.trainer.portable)
            info = {**info, "num_processes": layout.processes, "zero_stage": layout.zero_stage,
                    "deepspeed": layout.deepspeed}
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
                               f"make room (or write elsewhere), then rerun with {self.checkpoint.resume_setting}=auto.")

    def load(self, path: Path, *, signature: str, strict: bool = True, module=None, optimizer=None,
             pad_id: int = 0) -> dict | None:
        """Verify ``path`` against this run, load its weights, optimizer, schedule and RNG, return this rank's
        trainer state. Saved in this run's layout: ``accelerator.load_state``, bitwise. Saved by another process
        count or ZeRO stage: through the checkpoint's portable form (``module``: the prepared model, ``optimizer``:
        the prepared optimizer, accelerate's wrapper; ``pad_id`` pads replay-buffer rows dealt out again)."""
        start = time.perf_counter()
        acc = self.accelerator
        metadata = Checkpoint.verify(path, signature=signature)
        saved, run = saved_layout(path, metadata), run_layout(acc)
        try:
            if same_files(saved, run):
                acc.load_state(str(path), **_load_kwargs(acc))
                if acc.process_index >= saved.processes:  # a process the saved run did not have
                    self._load_rng(path, saved)
                how = ""
            else:
                how = self._load_converted(path, saved, module, optimizer)
            ranks = [acc.process_index] if saved.processes == run.processes else range(saved.processes)
            states = [state for r in ranks if (state := _rank_state(path, r, strict)) is not None]
        except CheckpointError:
            raise
        except Exception as exc:
            raise CheckpointError(f"checkpoint {path} could not be loaded ({type(exc).__name__}: {exc}); resume "
                                  "from another checkpoint. Nothing in the run folder was changed.") from exc
        state, notes = (states[0] if states else None), []  # this rank's, when the process count is the saved one
        if states and saved.processes != run.processes:
            state, notes = rank_state_for(states, acc.process_index, run.processes, pad_id)
        if run.processes > saved.processes:
            notes.insert(0, f"processes {saved.processes}-{run.processes - 1} take rank 0's random streams (sampling "
                            "is keyed by prompt group: the completions do not change)")
        if saved != run and acc.is_main_process:
            logger.info("checkpoint %s: saved by %s, resumed by %s%s%s", path.name, saved.describe(), run.describe(),
                        how, "".join(f"; {note}" for note in notes))
        logger.info("checkpoint %s loaded in %.2f s", path, time.perf_counter() - start)
        return state

    def _load_converted(self, path: Path, saved, module, optimizer) -> str:
        """Load ``path`` (saved in layout ``saved``) through its portable form, made once by the main process;
        returns what happened, in words, for the start line."""
        from accelerate.checkpointing import load_custom_state

        acc = self.accelerator
        unwrapped = acc.unwrap_model(module)
        shapes = {name: full_shape(p) for name, p in unwrapped.named_parameters() if p.requires_grad}
        portable, failed, made = portable_dir(path), None, not is_complete(portable_dir(path))
        start = time.perf_counter()
        if acc.is_main_process:
            try:
                convert(path, saved, shapes)
            except Exception as exc:
                failed = exc
        if any_process(failed is not None):
            raise self._conversion_failed(path, saved, failed, shapes)
        seconds = time.perf_counter() - start
        if uses_deepspeed(acc) and (zero_stage(acc) > 0 or module.bfloat16_enabled()):
            load_into_deepspeed(module, portable)
        else:
            load_whole(unwrapped, optimizer.optimizer, portable)  # accelerate's wrapper: the torch optimizer
        for index, obj in enumerate(acc._custom_objects):  # registered for checkpointing: the rate's schedule
            load_custom_state(obj, str(path), index)
        self._load_rng(path, saved)
        size = sum(file_manifest(portable).values()) / 1e6
        what = (f"converted to its portable form {portable.name} ({size:.1f} MB) in {seconds:.2f} s" if made else
                f"through its portable form {portable.name} ({size:.1f} MB), made by an earlier resume")
        return f": {what}"

    def _conversion_failed(self, path: Path, saved, exc: Exception | None, shapes: dict) -> CheckpointError:
        """The one line for a conversion that failed (on the main process; ``exc`` there, None elsewhere)."""
        run = run_layout(self.accelerator).describe()
        needed = 3 * 4 * sum(torch.Size(shape).numel() for shape in shapes.values())  # fp32 weight and 2 moments
        if exc is None:
            why, fix = "the main process could not write it", f"resume with the saved layout ({saved.describe()})"
        elif _no_space(exc):
            free = shutil.disk_usage(path.parent).free
            why = (f"no space left on {path.parent}: {free / 1e6:.1f} MB free, the form needs about "
                   f"{needed / 1e6:.1f} MB")
            fix = f"make room, or resume with the saved layout ({saved.describe()})"
        else:
            why = str(exc) if isinstance(exc, RuntimeError) else f"{type(exc).__name__}: {exc}"
            fix = f"resume from another checkpoint, or with the saved layout ({saved.describe()})"
        return CheckpointError(f"checkpoint {path} (saved by {saved.describe()}) could not be converted for {run} "
                               f"({why}); nothing was written beside it and the checkpoint is as it was: {fix}.")

    def _load_rng(self, path: Path, saved) -> None:
        """The random streams and the accumulation step ``load_state`` restores: this rank's, or rank 0's for a
        process the saved run did not have."""
        from accelerate.checkpointing import load_accelerator_state

        acc = self.accelerator
        rank = acc.process_index if acc.process_index < saved.processes else 0
        acc.step = load_accelerator_state(str(path), [], [], [], [], rank).get("step", acc.step)


def _rank_state(path: Path, rank: int, strict: bool) -> dict | None:
    """Rank ``rank``'s trainer state in checkpoint ``path`` (None when absent and not ``strict``)."""
    file = rank_state_file(path, rank)
    return torch.load(file, weights_only=True) if file.is_file() or strict else None


def run_layout(acc) -> Layout:
    """The layout this run saves in (and reads without conversion)."""
    return Layout(acc.num_processes, zero_stage(acc), uses_deepspeed(acc))


def hugging_face_assets(config, tokenizer) -> list:
    """Of a policy's ``config`` and the ``tokenizer``, those that are transformers' (a model config, a tokenizer):
    what a checkpoint folder saves beside the weights for export."""
    from transformers import PretrainedConfig, PreTrainedTokenizerBase

    return [a for a, kind in ((config, PretrainedConfig), (tokenizer, PreTrainedTokenizerBase)) if isinstance(a, kind)]


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
        hf_assets = hugging_face_assets(getattr(policy, "config", None), tokenizer)
        final = self.checkpointer.save(step, rank_state, info, hf_assets) if self.checkpointer else None
        if self.file is not None:
            weights = self.accelerator.get_state_dict(module)  # collective under ZeRO-3; full on rank 0
            if self.accelerator.is_main_process:
                save_trainer_payload(self.file, weights, rank_state)
        return final

    def load_folder(self, path: Path, signature: str, strict: bool = True, **parts) -> dict | None:
        """This rank's trainer state of checkpoint folder ``path`` (its weights, optimizer, schedule and RNG loaded;
        ``parts``: :meth:`RunCheckpointer.load`'s)."""
        checkpointer = self.checkpointer or RunCheckpointer(self.accelerator, Checkpoint(Path(path).parent))
        return checkpointer.load(Path(path), signature=signature, strict=strict, **parts)

    def load_file(self, path: Path, module, strict: bool = True, **kwargs) -> dict:
        """The trainer state of a payload file; its weights are loaded into ``module`` (``kwargs``: torch.load's)."""
        payload = load_trainer_payload(path, **kwargs)
        if zero_stage(self.accelerator) == 3:
            raise CheckpointError(f"{path}: a single-file trainer payload cannot be loaded under ZeRO-3; resume "
                                  "from a checkpoint folder instead (load_from_file(folder), or a Checkpoint's resume).")
        missing, unexpected = module.load_state_dict(payload["model"], strict=False)
        if strict and (missing or unexpected):
            raise CheckpointError(f"{path}: model weights do not fit (missing {missing[:5]}, unexpected "
                                  f"{unexpected[:5]}); pass strict=False to load what fits.")
        return payload["trainer"]


def _save_kwargs(acc) -> dict:
    return {"exclude_frozen_parameters": True} if uses_deepspeed(acc) else {}


def _load_kwargs(acc) -> dict:
    return {"load_module_strict": False} if uses_deepspeed(acc) else {"strict": False}


@contextlib.contextmanager
def tie_left_unsaid():
    """Around ``save_state``: Accelerate's "Removed shared tensor {'policy.lm_head.weight'} while saving", said at
    every checkpoint of a tied-embedding model, is left out (the tie is expected; the weight comes back tied)."""
    said = logging.getLogger("accelerate.utils.other")
    tie = lambda record: "Removed shared tensor" not in record.getMessage()  # noqa: E731
    said.addFilter(tie)
    try:
        yield
    finally:
        said.removeFilter(tie)


@contextlib.contextmanager
def frozen_weights_left_out(acc):
    """Around ``save_state``: the model files (outside DeepSpeed) keep only parameters that require grad."""
    def drop_frozen(models, weights, output_dir) -> None:
        for model, state in zip(models, weights):
            for name, p in model.named_parameters(remove_duplicate=False):  # tied names too
                if not p.requires_grad:
                    state.pop(name, None)

    handle = None if uses_deepspeed(acc) else acc.register_save_state_pre_hook(drop_frozen)
    try:
        yield
    finally:
        if handle is not None:
            handle.remove()
