"""One run per output folder: a lock that names its holder, and no fresh run on top of another run's outputs.

A fresh run into a folder that held another run's checkpoints used to rotate them (and its own) out, overwrite
same-named step folders, mix TensorBoard event files and be picked up by ``checkpoint.resume=auto``; workers
orphaned by a killed launcher could keep writing into a folder a new run had started in.

    lock = RunFolderLock(output_dir)   # raises RunFolderBusy while another live process holds it
    lock.acquire(); ...; lock.release()
"""
from __future__ import annotations

import json
import logging
import os
import shutil
import socket
import time
from pathlib import Path

from grpo_accel.errors import UserError
from grpo_accel.config.checks import ConfigError
from grpo_accel.config.resume import changed_settings, resume_conflicts
from grpo_accel.config.secrets import record, redact, redact_text
from grpo_accel.runtime.build_locks import command_line

logger = logging.getLogger(__name__)

LOCK_FILE = ".grpo_accel.lock"
# What a run writes into its folder; any of them from an earlier run makes a fresh run refuse the folder.
RUN_OUTPUTS = ("checkpoints", "tensorboard", "summary.json")


def start_point(cfg, checkpoint, fingerprints: dict[str, str], first_process: bool) -> Path | None:
    """Where a launched run starts, decided in one place before any model is built: the checkpoint to resume
    (``checkpoint.resume``), whose saved settings (``loading.RESUME_MUST_MATCH``) and data (``fingerprints``:
    :func:`data_fingerprints` of ``cfg.data``) must be this run's, or None for a fresh run, which refuses a folder
    holding an earlier run's outputs unless ``overwrite=true`` (then the first process deletes them). What only the
    built run knows (process count, ZeRO stage, parameter shapes, whole files)
    :meth:`~grpo_accel.checkpoint.Checkpoint.verify` checks as the checkpoint loads."""
    out, resume = Path(cfg.output_dir), checkpoint.resume_path()
    if resume is not None:
        metadata = checkpoint.read_metadata(resume)
        saved = metadata["user"]
        saved_settings, settings = redact(saved["config"]), record(cfg)  # secrets compared as recorded: never shown
        conflicts = resume_conflicts(saved_settings, settings)
        if conflicts:
            raise ConfigError(f"checkpoint {resume} was trained with other settings: {'; '.join(conflicts)}; resume "
                              "with the same settings, or start a new run in another output_dir.")
        changed = [k for k, v in fingerprints.items() if saved.get("data", {}).get(k, v) != v]
        if changed:
            raise ConfigError(f"checkpoint {resume} was trained on other data: {', '.join(changed)} changed since "
                              "(size or content); resume on the data it was trained on, or start a new run in "
                              "another output_dir.")
        frames = metadata.get("frames", 0)
        if frames >= cfg.trainer.total_frames:
            raise RunFinished(f"the run in output_dir={str(out)!r} is finished: its checkpoint {resume} holds {frames} "
                              f"frames of trainer.total_frames={cfg.trainer.total_frames}; nothing to train (raise "
                              "trainer.total_frames to train on).")
        if differences := changed_settings(saved_settings, settings):
            logger.info("resuming %s with %d setting(s) changed since it was saved:", resume, len(differences))
            for change in differences:
                logger.info("  %s", change)
        return resume
    if not (found := previous_run_outputs(out)):
        return None
    if not cfg.overwrite:
        raise ConfigError(
            f"output_dir={str(out)!r} holds an earlier run's {', '.join(found)} and this run starts fresh "
            f"(checkpoint.resume={cfg.checkpoint.resume!r}): checkpoint.resume=auto continues that run; a new run "
            "needs another output_dir, or overwrite=true to delete them first.")
    if first_process:
        logger.warning("overwrite=true: deleted an earlier run's %s in %s", ", ".join(remove_run_outputs(out)), out)
    return None


def keep_the_batch(cfg, saved: dict, layout, micro_batch: int) -> int:
    """The micro-batch of a run resuming a checkpoint of another process count (``saved``: its metadata) on
    ``layout``: it and the accumulation are recomputed to keep the saved completions per optimizer step and
    optimizer steps per batch (said in a line, and set in ``cfg``); a ConfigError names the settings and the counts
    that work when none keep them."""
    from grpo_accel.layout import BatchLayout, resized_split

    t, old = cfg.trainer, saved["user"]["config"]["trainer"]
    if saved["num_processes"] == layout.processes:
        return micro_batch
    before = BatchLayout(layout.prompts, layout.group_size, saved["num_processes"], layout.names)
    ga = old["gradient_accumulation_steps"]
    micro = before.auto_micro_batch(ga) if old["micro_batch_completions"] == "auto" else old["micro_batch_completions"]
    try:
        new_micro, new_ga = resized_split(before, micro, ga, layout, t.num_epochs, t.optim_steps_per_batch)
    except ValueError as exc:
        raise ConfigError(f"checkpoint saved by {before.processes} processes: {exc}") from None
    if (new_micro, new_ga) != (micro_batch, t.gradient_accumulation_steps):
        logger.info("the batch as saved: %d completions per optimizer step (%d processes x %d x %d accumulation) -> "
                 "%d processes x %d x %d: trainer.micro_batch_completions=%d, trainer.gradient_accumulation_steps=%d",
                 micro * ga * before.processes, before.processes, micro, ga, layout.processes, new_micro, new_ga,
                 new_micro, new_ga)
        t.micro_batch_completions, t.gradient_accumulation_steps = new_micro, new_ga
    return new_micro


def data_fingerprints(data) -> dict[str, str]:
    """For ``data.path`` / ``data.eval_path`` naming local files: ``"data.path=P"`` -> a fingerprint of what they
    hold (per file, sorted: its name, its size and a SHA-256 of its first and last MiB), which a resume compares."""
    import hashlib

    out = {}
    for key, value in (("data.path", data.path), ("data.eval_path", data.eval_path)):
        if value is None or not Path(value).exists():
            continue
        root = Path(value)
        digest = hashlib.sha256()
        for f in sorted(p for p in ([root] if root.is_file() else root.rglob("*")) if p.is_file())[:256]:
            size = f.stat().st_size
            digest.update(f"{f.relative_to(root) if f != root else f.name}:{size}".encode())
            with f.open("rb") as handle:
                digest.update(handle.read(2**20))
                if size > 2**21:
                    handle.seek(-(2**20), 2)
                    digest.update(handle.read())
        out[f"{key}={value}"] = digest.hexdigest()
    return out


class RunFinished(Exception):
    """The checkpoint to resume already holds ``trainer.total_frames``: the run is done (not an error)."""


class RunFolderBusy(UserError, RuntimeError):
    """Another live process holds the run folder's lock, or the folder cannot be written; the message says which."""


def previous_run_outputs(folder: Path) -> list[str]:
    """The outputs of an earlier run in ``folder`` (names from RUN_OUTPUTS that exist and are not empty)."""
    found = []
    for name in RUN_OUTPUTS:
        path = Path(folder) / name
        if path.is_file() or (path.is_dir() and any(path.iterdir())):
            found.append(name)
    return found


def remove_run_outputs(folder: Path) -> list[str]:
    """Delete an earlier run's outputs from ``folder`` (``overwrite=true``); returns what was removed."""
    removed = previous_run_outputs(folder)
    for name in removed:
        path = Path(folder) / name
        shutil.rmtree(path) if path.is_dir() else path.unlink()
    return removed


def _start_time(pid: int) -> str | None:
    """The kernel's start time of ``pid`` (tells a live holder from a new process that reused its pid);
    None when the process does not exist. "" where /proc is not available."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return None
    except PermissionError:  # exists, someone else's
        pass
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[19]
    except (OSError, IndexError):
        return ""


class RunFolderLock:
    """``<folder>/.grpo_accel.lock``: host, pid, start time and command of the run writing the folder.

    A lock whose process is gone (same host) is taken over with a warning; one held by a live process, or by
    a process on another host (which cannot be checked from here), raises :class:`RunFolderBusy`.
    """

    def __init__(self, folder: str | Path) -> None:
        self.path = Path(folder) / LOCK_FILE
        self.held = False

    def _me(self) -> dict:
        pid = os.getpid()
        return {"host": socket.gethostname(), "pid": pid, "start": _start_time(pid),
                "since": time.strftime("%Y-%m-%d %H:%M:%S"), "command": redact_text(command_line(pid))}

    def holder(self) -> dict | None:
        try:
            return json.loads(self.path.read_text())
        except FileNotFoundError:
            return None
        except (OSError, json.JSONDecodeError):
            return {}  # unreadable: treated as held by an unknown process

    def acquire(self) -> None:
        folder = self.path.parent
        try:
            folder.mkdir(parents=True, exist_ok=True)
        except OSError as exc:  # a file of that name, or a parent folder this user cannot write
            raise RunFolderBusy(f"output_dir={str(folder)!r}: cannot make that folder ({exc.strerror}: "
                                f"{exc.filename}); choose a folder you can write (output_dir=...).") from None
        for _ in range(3):  # a stale lock is removed, then taken like a free one (another run may win the race)
            try:
                fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY)
            except FileExistsError:
                self._clear_if_stale(self.holder())
                continue
            except OSError as exc:  # read-only file system or folder
                raise RunFolderBusy(f"output_dir={str(folder)!r}: cannot write there ({exc.strerror}); choose a "
                                    "folder you can write (output_dir=...).") from None
            with os.fdopen(fd, "w") as f:
                json.dump(self._me(), f)
            self.held = True
            return
        raise RunFolderBusy(f"output_dir {str(self.path.parent)!r}: could not take its lock {self.path}.")

    def _clear_if_stale(self, holder: dict | None) -> None:
        if holder is None:
            return  # released meanwhile
        here = socket.gethostname()
        if holder and holder.get("host") == here:
            alive = _start_time(int(holder["pid"]))
            if alive is None or (alive and holder.get("start") and alive != holder["start"]):
                logger.warning("output_dir %s: taking over the lock of pid %s (%s), which is gone", self.path.parent,
                               holder["pid"], holder.get("command", "?"))
                self.path.unlink(missing_ok=True)
                return
        who = (f"pid {holder.get('pid')} on {holder.get('host')} since {holder.get('since')} "
               f"({holder.get('command', '?')})" if holder else "an unknown process (unreadable lock)")
        elsewhere = "" if holder.get("host", here) == here else " (another host: if that run has ended, delete the lock file)"
        raise RunFolderBusy(f"output_dir {str(self.path.parent)!r} is in use by {who}{elsewhere}. Two runs writing one "
                            f"folder would overwrite each other's checkpoints: wait for it or stop it, or use another "
                            f"output_dir. Lock: {self.path}.")

    def release(self) -> None:
        """Remove the lock; one the folder no longer lets go of (made read-only, unmounted) is said in a line, not
        raised: release runs while the run's own error is reported, and the next run takes over a dead run's lock."""
        if not self.held:
            return
        self.held = False
        try:
            self.path.unlink(missing_ok=True)
        except OSError as exc:
            logger.warning("output_dir %s: its lock %s could not be removed (%s); the next run here takes it over "
                           "once this process has ended", self.path.parent, self.path, exc.strerror)
