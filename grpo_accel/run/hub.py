"""Pushing the trained model to a Hugging Face Hub repository (TRL's ``push_to_hub`` and ``hub_*`` keys).

After a checkpoint is written, the main process takes a hard-linked snapshot of it (instant: the checkpoint may be
rotated away meanwhile), and a background thread exports it as a model folder (the recipe passes
:func:`grpo_accel.run.export.export_checkpoint`) and uploads it with ``huggingface_hub``; training goes on. A push still running when the next
checkpoint comes is let be and that checkpoint skipped (``always_push`` waits for it instead, as TRL's
``hub_always_push``). A push that fails is one warning line: the run goes on and the checkpoint stays where it is.
The end of training waits for the last push.

    hub: {push: true, model_id: me/my-grpo, strategy: every_save, token: ${HF_TOKEN}}
"""
from __future__ import annotations

import logging
import os
import shutil
import tempfile
import threading
from pathlib import Path
from typing import Callable

from grpo_accel.config.outputs import HubConfig

log = logging.getLogger(__name__)


class HubPusher:
    """Pushes a run's checkpoints as ``config`` says; one per run, on the main process. ``after_checkpoint`` at
    every saved checkpoint, ``close`` at the end of training."""

    def __init__(self, config: HubConfig, output_dir: str | Path, export: Callable[[Path, Path], Path]) -> None:
        self.config, self.output_dir, self.export = config, Path(output_dir), export  # export(checkpoint, folder)
        self.repo_id = config.model_id or self.output_dir.resolve().name
        self.pushes = self.failures = 0
        self._thread: threading.Thread | None = None
        self._newest: Path | None = None

    def after_checkpoint(self, checkpoint: Path) -> None:
        self._newest = checkpoint
        if self.config.strategy != "end":
            self._push(checkpoint)

    def close(self) -> None:
        """At the end of training: the push ``end`` waits for, then the last push done."""
        if self.config.strategy == "end" and self._newest is not None:
            self._push(self._newest, wait=True)
        if self._thread is not None:
            self._thread.join()

    def _push(self, checkpoint: Path, wait: bool = False) -> None:
        if self._thread is not None and self._thread.is_alive():
            if not (self.config.always_push or wait):
                log.info("hub: the push before %s is still running; this checkpoint is not pushed", checkpoint.name)
                return
            self._thread.join()
        snapshot = Path(tempfile.mkdtemp(prefix="hub-", dir=self.output_dir))
        linked = snapshot / checkpoint.name
        shutil.copytree(checkpoint, linked, copy_function=os.link)  # the files themselves, instantly
        self._thread = threading.Thread(target=self._upload, args=(linked, snapshot), name="hub-push")
        self._thread.start()

    def _upload(self, checkpoint: Path, snapshot: Path) -> None:
        """Export ``checkpoint`` and upload it (this thread); a failure is one line, the checkpoint kept."""
        c = self.config
        try:
            from huggingface_hub import HfApi

            api = HfApi(endpoint=c.endpoint, token=c.token)
            repo = api.create_repo(self.repo_id, private=c.private, exist_ok=True).repo_id  # the user's namespace
            if c.revision:
                api.create_branch(repo, branch=c.revision, exist_ok=True)
            model = self.export(checkpoint, snapshot / "model")
            message = f"grpo_accel: {checkpoint.name}"
            api.upload_folder(repo_id=repo, folder_path=model, revision=c.revision, commit_message=message)
            if c.strategy in ("checkpoint", "all_checkpoints"):
                folder = "last-checkpoint" if c.strategy == "checkpoint" else checkpoint.name
                api.upload_folder(repo_id=repo, folder_path=checkpoint, path_in_repo=folder, revision=c.revision,
                                  commit_message=message)
            self.pushes += 1
            log.info("hub: %s pushed to %s", checkpoint.name, repo)
        except Exception as exc:  # noqa: BLE001 - any failure: the run goes on, the checkpoint stays
            self.failures += 1
            first = str(exc).strip().splitlines()[0][:300] if str(exc).strip() else ""
            log.warning("hub: pushing %s to %s failed (%s: %s); training goes on, the checkpoint is kept in %s",
                        checkpoint.name, self.repo_id, type(exc).__name__, first, self.output_dir / "checkpoints")
        finally:
            shutil.rmtree(snapshot, ignore_errors=True)
