"""Pushed weights as Hugging Face folders that servers load from disk, whatever the engine: one folder per version
(config + safetensors, one file per bucket, and the index that maps each tensor to its file), the newest ``keep``
kept."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import torch

from grpo_accel.weight_sync.gather import Bucket


class WeightFolders:
    """``path/version_NNNNNN`` per pushed version; ``config`` is the model's (saved with each folder)."""

    def __init__(self, config, path: str | Path, keep: int) -> None:
        self.config, self.path, self.keep = config, Path(path), keep
        self._index: dict[str, str] = {}  # tensor name -> file, for the folder being written

    def folder(self, version: int) -> Path:
        return self.path / f"version_{version:06d}"

    def write(self, index: int, bucket: Bucket, tensors: list[torch.Tensor], version: int) -> None:
        """Bucket ``index`` of ``version``'s folder (the first bucket starts the folder)."""
        from safetensors.torch import save_file

        folder = self.folder(version)
        if index == 0:
            self._index = {}
            folder.mkdir(parents=True, exist_ok=True)
            self.config.save_pretrained(folder)
        file = f"model-{index:05d}.safetensors"
        save_file({n: t.cpu() for n, t in zip(bucket.names, tensors)}, str(folder / file))
        self._index.update({n: file for n in bucket.names})

    def complete(self, version: int) -> Path:
        """Write the index once every bucket is written; the folder, ready to load."""
        folder = self.folder(version)
        (folder / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": self._index}))
        return folder

    def rotate(self) -> None:
        """Drop all but the newest ``keep`` folders."""
        for old in sorted(self.path.glob("version_*"))[: -self.keep]:
            shutil.rmtree(old, ignore_errors=True)
