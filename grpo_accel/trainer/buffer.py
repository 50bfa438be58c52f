"""A replay buffer over rollout TensorDicts."""
from __future__ import annotations

from typing import Iterator

import torch
from tensordict import TensorDict

from grpo_accel.batch import concat_rollouts, trim_padding
from grpo_accel.rules import check


class ReplayBuffer:
    """Holds rollouts; hands out micro-batches of ``batch_size`` completions.

    Iterating yields every stored completion exactly once, in a fresh random order each pass (one epoch);
    the last micro-batch is smaller when ``len(buffer)`` is not a multiple of ``batch_size``. ``sample()``
    draws one micro-batch without replacement. Micro-batches are trimmed to their longest row.

    Example:
        >>> rb = ReplayBuffer(batch_size=8, pad_id=0)
        >>> rb.extend(rollout)                    # TensorDict [N]
        >>> for micro_batch in rb: ...            # one epoch
    """

    def __init__(self, batch_size: int, pad_id: int = 0, seed: int | None = None) -> None:
        check("positive_count", "batch_size", batch_size, owner="ReplayBuffer: ")  # completions per micro-batch
        self.batch_size = batch_size
        self.pad_id = pad_id
        self._storage: TensorDict | None = None
        self._generator = torch.Generator()
        self._generator.manual_seed(0 if seed is None else seed)

    def __len__(self) -> int:
        return 0 if self._storage is None else self._storage.shape[0]

    def extend(self, td: TensorDict) -> None:
        """Append rows (a TensorDict of batch size [n])."""
        td = td.detach().to("cpu")
        parts = [td] if self._storage is None else [self._storage, td]
        self._storage = concat_rollouts(parts, self.pad_id)

    def empty(self) -> None:
        self._storage = None

    def _take(self, index: torch.Tensor) -> TensorDict:
        return trim_padding(self._storage[index])

    def sample(self, batch_size: int | None = None) -> TensorDict:
        """A random micro-batch of ``batch_size`` (default: the buffer's) distinct completions."""
        n = batch_size or self.batch_size
        if n > len(self):
            raise ValueError(f"ReplayBuffer.sample: asked for {n} completions but the buffer holds {len(self)}.")
        return self._take(torch.randperm(len(self), generator=self._generator)[:n])

    def __iter__(self) -> Iterator[TensorDict]:
        order = torch.randperm(len(self), generator=self._generator)
        for start in range(0, len(self), self.batch_size):
            yield self._take(order[start : start + self.batch_size])

    def state_dict(self) -> dict:
        return {
            "storage": None if self._storage is None else self._storage.to_dict(),
            "generator": self._generator.get_state(),
        }

    def load_state_dict(self, state: dict) -> None:
        storage = state["storage"]
        if storage is None:
            self._storage = None
        else:
            rows = len(storage["prompt_ids"])
            self._storage = TensorDict(storage, batch_size=[rows])
        self._generator.set_state(state["generator"])
