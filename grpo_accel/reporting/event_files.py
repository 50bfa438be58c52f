"""TensorBoard: the logger (a :class:`~grpo_accel.contracts.Logger`, and Accelerate's ``GeneralTracker`` named
"tensorboard" for :class:`~grpo_accel.reporting.trackers.Trackers`) and readers of what it wrote."""
from __future__ import annotations

import itertools
import os
import socket
import struct
import time
from pathlib import Path

from accelerate.tracking import GeneralTracker

from grpo_accel.contracts import Logger


class TensorBoardLogger(Logger, GeneralTracker):
    """Writes scalars as TensorBoard event files under ``log_dir`` (``tensorboard --logdir`` shows them).

    The scalars of one step go out as one event (a summary with a value per tag), written in the calling thread
    by :class:`EventFile`. ``SummaryWriter.add_scalar`` made an event per scalar (~50 us each) and handed it to
    a writer thread whose pure-Python CRC took the interpreter lock from training: ~4 ms of every tiny-model
    step at the trainer's ~40 scalars and 3 samples per log.

    Example:
        >>> logger = TensorBoardLogger("runs/exp1/tensorboard")
        >>> logger.log_scalars({"train/reward_mean": 0.5, "train/kl": 0.01}, step=3)
        >>> logger.log_text("samples", "**reward 1.0** ...", step=3)
    """

    name = "tensorboard"  # Accelerate's tracker interface: what trainer.report_to calls it
    requires_logging_directory = True

    def __init__(self, log_dir: str | Path) -> None:
        GeneralTracker.__init__(self)
        self.log_dir = Path(log_dir)
        self._file: EventFile | None = None
        self._pending: list = []  # events written when the file opens, at the first point (the folder appears then)

    def resume_at(self, step: int) -> None:
        """Training resumed after ``step``: points logged after it by the interrupted run are dropped (a restart
        marker: TensorBoard drops the points at and after ``step + 1`` written before it)."""
        from tensorboard.compat.proto.event_pb2 import Event, SessionLog

        self._write(Event(step=step + 1, session_log=SessionLog(status=SessionLog.START)))

    def _write(self, event) -> None:
        if self._file is None:
            self._pending.append(event)
        else:
            self._file.write(event)

    def _open(self) -> "EventFile":
        if self._file is None:
            self._file = EventFile(self.log_dir)
            for event in self._pending:
                self._file.write(event)
            self._pending = []
        return self._file

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self.log_scalars({name: value}, step)

    def log_scalars(self, scalars: dict[str, float], step: int | None = None) -> None:
        from tensorboard.compat.proto.summary_pb2 import Summary

        values = [Summary.Value(tag=name, simple_value=float(value)) for name, value in scalars.items()]
        self._open().write_summary(Summary(value=values), step)

    def log_samples(self, rows: list[dict], step: int | None = None) -> None:
        """The samples as Markdown text under ``samples`` (the Text tab)."""
        from grpo_accel.reporting.metrics import samples_markdown

        self.log_text("samples", samples_markdown(rows), step)

    def log_text(self, name: str, text: str, step: int | None = None) -> None:
        """Markdown text (TensorBoard's Text tab), e.g. completion samples."""
        from torch.utils.tensorboard.summary import text as text_summary

        self._open().write_summary(text_summary(name, text), step)

    # Accelerate's GeneralTracker interface, as Trackers calls it
    @property
    def tracker(self) -> "TensorBoardLogger":
        return self

    def log(self, values: dict, step: int | None = None, **kwargs) -> None:
        self.log_scalars(values, step)

    def store_init_configuration(self, values: dict) -> None:
        """The run's settings (flat ``key -> value``) in TensorBoard's HPARAMS tab."""
        from torch.utils.tensorboard.summary import hparams

        from tensorboard.compat.proto.event_pb2 import Event

        for summary in hparams({k: v if isinstance(v, (bool, int, float, str)) else str(v) for k, v in values.items()},
                               {}):
            self._write(Event(wall_time=time.time(), step=0, summary=summary))

    def finish(self) -> None:
        self.close()

    def flush(self) -> None:
        if self._file is not None:
            self._file.flush()

    def close(self, outcome: str = "finished") -> None:
        if self._file is not None:
            self._file.close()
            self._file = None


class EventFile:
    """One TensorBoard event file: TFRecord records (length, its masked CRC32C, the serialized ``Event``, its
    masked CRC32C) appended in the calling thread, flushed to the OS at most ``flush_s`` after a write (and on
    :meth:`flush`), named as TensorBoard's writers name theirs."""

    _count = itertools.count()

    def __init__(self, log_dir: Path, flush_s: float = 5.0) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        log_dir.mkdir(parents=True, exist_ok=True)
        name = f"events.out.tfevents.{int(time.time()):010d}.{socket.gethostname()}.{os.getpid()}.{next(self._count)}"
        self.path, self.flush_s = log_dir / name, flush_s
        self._file = open(self.path, "ab")
        self._flushed = time.monotonic()
        self.write(Event(wall_time=time.time(), file_version="brain.Event:2"))

    def write_summary(self, summary, step: int | None) -> None:
        from tensorboard.compat.proto.event_pb2 import Event

        self.write(Event(wall_time=time.time(), step=step or 0, summary=summary))

    def write(self, event) -> None:
        data = event.SerializeToString()
        header = struct.pack("<Q", len(data))
        self._file.write(header + struct.pack("<I", _masked_crc(header)) + data + struct.pack("<I", _masked_crc(data)))
        if time.monotonic() - self._flushed > self.flush_s:
            self.flush()

    def flush(self) -> None:
        self._file.flush()
        self._flushed = time.monotonic()

    def close(self) -> None:
        self._file.close()


def _masked_crc(data: bytes) -> int:
    """TFRecord's masked CRC32C of ``data``."""
    import google_crc32c

    crc = google_crc32c.value(data)
    return (((crc >> 15) | (crc << 17)) + 0xA282EAD8) & 0xFFFFFFFF


def read_scalars(log_dir: str | Path) -> dict[str, list[tuple[int, float]]]:
    """Every scalar tag in the event files under ``log_dir``: tag -> [(step, value), ...] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"scalars": 0})
    acc.Reload()
    return {tag: [(e.step, e.value) for e in acc.Scalars(tag)] for tag in acc.Tags()["scalars"]}


def read_texts(log_dir: str | Path) -> dict[str, list[tuple[int, str]]]:
    """Every text tag in the event files under ``log_dir``: tag -> [(step, text), ...] in step order."""
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(log_dir), size_guidance={"tensors": 0})
    acc.Reload()
    return {tag.removesuffix("/text_summary"): [(e.step, e.tensor_proto.string_val[0].decode()) for e in acc.Tensors(tag)]
            for tag in acc.Tags()["tensors"] if tag.endswith("/text_summary")}
