"""Asynchronous collection: a thread generates the next batch while the trainer optimises the current one."""
from __future__ import annotations

import queue
import threading
from typing import Iterator

from tensordict import TensorDict

_DONE = object()


class BackgroundCollector:
    """Runs ``collector.collect()`` in a daemon thread, at most ``prefetch`` batches ahead of the consumer.

    A batch is started only once a slot is free (the consumer took an earlier one), so with ``prefetch=1`` a
    batch is generated during the optimisation of the previous one: it is one weight version old when used.
    An exception in the thread is re-raised, as it was, in the consumer. The collector's engine must not share
    weights that the trainer is updating (give it a copy updated by a weight-sync sender, as with an inference
    server). ``position`` is the collector's state after the last batch handed out: what a checkpoint records (the
    collector itself is already drawing the next batch), so a resume collects the batch in flight again.
    """

    def __init__(self, collector, prefetch: int = 1) -> None:
        self.collector = collector
        self.position: dict | None = None  # collector.state_dict() after the batch last handed out
        self._queue: queue.Queue = queue.Queue()
        self._slots = threading.Semaphore(prefetch)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="grpo-collector", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            while True:
                self._slots.acquire()
                if self._stop.is_set():
                    return
                batch = self.collector.collect()
                self._queue.put((batch, self.collector.state_dict()))
        except BaseException as exc:  # handed to the consumer
            self._queue.put(exc)
        finally:
            self._queue.put(_DONE)

    def __iter__(self) -> Iterator[TensorDict]:
        while True:
            item = self._queue.get()
            if item is _DONE:
                return
            if isinstance(item, BaseException):  # as raised in the thread: a user error stays one line
                raise item
            batch, self.position = item
            self._slots.release()  # the next batch may start now
            yield batch

    def close(self) -> None:
        """Stop after the batch in progress (if any) and wait for the thread."""
        self._stop.set()
        self._slots.release()
        self._thread.join()


def drop_stale(accelerator, weight_version: int, rollout: TensorDict,
               max_staleness: int | None) -> tuple[TensorDict, float, int]:
    """(the rollout, or none of it when it was generated over ``max_staleness`` pushes ago on any process; its
    :func:`staleness`; 1 if it was dropped, else 0)."""
    behind = staleness(accelerator, weight_version, rollout)
    dropped = max_staleness is not None and behind > max_staleness
    return (rollout[:0] if dropped else rollout), behind, int(dropped)


def staleness(accelerator, weight_version: int, rollout: TensorDict) -> float:
    """How many weight pushes ago the oldest row of this batch was generated, the most over all processes."""
    import torch

    from grpo_accel import batch

    behind = torch.tensor([float(weight_version - int(rollout[batch.WEIGHT_VERSION].min()))], device=accelerator.device)
    if accelerator.num_processes > 1:
        behind = accelerator.reduce(behind, reduction="max")
    return float(behind[0])
