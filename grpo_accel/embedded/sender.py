"""The embedded engine's weight-sync sender: a version bump, or an in-place copy into the engine's own model."""
from __future__ import annotations

import torch
from torch import nn

from grpo_accel.contracts import WeightSender
from grpo_accel.embedded.engine import EmbeddedEngine


class EmbeddedWeightSync(WeightSender):
    """Weight-sync sender for the embedded engine.

    When the engine generates from the trained model itself (synchronous GRPO), an update only bumps the
    version. When it has its own copy (``source`` is the trained model; asynchronous collection), the update
    copies the weights into it, waiting for the generation in progress to finish, like SGLang's writer lock.
    """

    def __init__(self, engine: EmbeddedEngine, source: nn.Module | None = None) -> None:
        self.engine, self.source = engine, source

    @property
    def pushed(self) -> int:
        """The version the engine holds: its weights and their version change together, under its lock."""
        return self.engine.weight_version

    @torch.no_grad()
    def push(self, version: int) -> None:
        """Give the engine the trained weights as ``version`` (a resumed trainer calls this with its own)."""
        with self.engine.lock:
            if self.source is not None and self.source is not self.engine.model:
                for dst, src in zip(self.engine.model.parameters(), self.source.parameters(), strict=True):
                    dst.copy_(src.detach())
            self.engine.weight_version = version
