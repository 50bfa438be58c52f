"""TensorBoard: the logger (a :class:`~grpo_accel.contracts.Logger`) and readers of what it wrote."""
from __future__ import annotations

from pathlib import Path

from grpo_accel.contracts import Logger


class TensorBoardLogger(Logger):
    """Writes scalars as TensorBoard event files under ``log_dir`` (``tensorboard --logdir`` shows them).

    Example:
        >>> logger = TensorBoardLogger("runs/exp1/tensorboard")
        >>> logger.log_scalar("train/reward_mean", 0.5, step=3)
        >>> logger.log_text("samples", "**reward 1.0** ...", step=3)
    """

    def __init__(self, log_dir: str | Path) -> None:
        self.log_dir = Path(log_dir)
        self._writer = None
        self._purge_step: int | None = None

    def resume_at(self, step: int) -> None:
        """Training resumed after ``step``: points logged after it by the interrupted run are dropped."""
        self._purge_step = step + 1

    def _open(self):
        if self._writer is None:
            from torch.utils.tensorboard import SummaryWriter  # lazy: pulls in tensorboard

            self._writer = SummaryWriter(str(self.log_dir), purge_step=self._purge_step)
        return self._writer

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self._open().add_scalar(name, float(value), global_step=step)

    def log_text(self, name: str, text: str, step: int | None = None) -> None:
        """Markdown text (TensorBoard's Text tab), e.g. completion samples."""
        self._open().add_text(name, text, global_step=step)

    def flush(self) -> None:
        if self._writer is not None:
            self._writer.flush()

    def close(self) -> None:
        if self._writer is not None:
            self._writer.close()


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
