"""The user's experiment trackers through Accelerate: the names ``Accelerator(log_with=...)`` takes (TRL's
``report_to``), each an ``accelerate.tracking.GeneralTracker``; "tensorboard" is this package's own event-file
writer (:class:`~grpo_accel.reporting.event_files.TensorBoardLogger`, one event per step instead of one per scalar).

:class:`Trackers` is the trainer's :class:`~grpo_accel.contracts.Logger` over them: scalars to every tracker
at every log, the run's settings as hyperparameters once, completion samples as a table where the tracker has
tables (W&B, MLflow, Trackio; Markdown text in TensorBoard), and the run ids that let a resumed run continue the
same tracker run (W&B's run id, MLflow's run id, Trackio's run name: kept in the checkpoints' metadata).

Example:
    >>> trackers = open_trackers(["tensorboard", "wandb"], "runs/exp1", project="grpo", run_name="exp1",
    ...                          config={"optim.lr": 1e-6})
    >>> trackers.log_scalars({"train/reward_mean": 0.5}, step=1)
    >>> trackers.close()
"""
from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any, Callable, Mapping

from grpo_accel.contracts import Logger
from grpo_accel.errors import UserError
from grpo_accel.rules import check_choice, setting

TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio", "comet_ml", "aim", "clearml", "dvclive", "swanlab")
"""The names Accelerate's ``log_with`` takes (its ``LoggerType`` less "all")."""
EXTRAS = {"wandb": "wandb", "mlflow": "mlflow", "trackio": "trackio"}
"""Trackers with an extra of this package: ``pip install 'grpo_accel[NAME]'``; the others: ``pip install NAME``."""


def check_trackers(names: list[str], setting_names: Mapping[str, str] | None = None) -> None:
    """Each name is a tracker of ``TRACKERS`` whose package imports; else one line naming it and the install."""
    key = setting(setting_names, "report_to")
    for name in names:
        check_choice(f"{key}[{name!r}]", name, TRACKERS)
        if name == "tensorboard":
            continue
        try:
            importlib.import_module(name)
        except ImportError as exc:
            install = f"'grpo_accel[{EXTRAS[name]}]'" if name in EXTRAS else name
            raise ImportError(f"{key}={list(names)}: the {name} package is not installed ({exc}); pip install "
                              f"{install}, or leave {name} out of {key}.") from None


def one_line(exc: Exception, limit: int = 300) -> str:
    """``exc``'s message on one line, at most ``limit`` characters, keeping the first link it holds (MLflow's
    messages end in the page that explains them)."""
    import re

    text = " ".join(str(exc).split())
    if len(text) <= limit:
        return text
    link = re.search(r"https?://\S+", text)
    tail = f" ... {link.group(0).rstrip('.,;)')}" if link and link.start() >= limit else ""
    return text[:limit].rstrip() + (tail or " ...")


def open_trackers(names: list[str], output_dir: str | Path, *, project: str, run_name: str,
                  config: Mapping[str, Any] | None = None, resuming: bool = False,
                  run_ids: Mapping[str, str] | None = None, init_kwargs: Mapping[str, dict] | None = None) -> "Trackers":
    """The started trackers ``names`` of a run writing into ``output_dir`` (TensorBoard's event files go to its
    tensorboard/, W&B's files to its wandb/), holding ``config`` (flat settings) as hyperparameters. When ``resuming``,
    ``run_ids`` (:meth:`Trackers.run_ids` of the checkpoint resumed from) continue those runs, which hold their
    hyperparameters already (W&B and Trackio are given them again: they replace a resumed run's); ``init_kwargs``
    adds each tracker's own keyword arguments (e.g. ``{"wandb": {"entity": "team"}}``). Call it on the main
    process."""
    from accelerate.tracking import LOGGER_TYPE_TO_CLASS

    from grpo_accel.reporting.event_files import TensorBoardLogger

    out, ids, extra, config = Path(output_dir), dict(run_ids or {}), dict(init_kwargs or {}), dict(config or {})
    trackers = []
    for name in names:
        kwargs = dict(extra.get(name, {}))
        at_start = name in ("wandb", "trackio")  # given to their init; the others' after it, on a fresh run
        if name == "tensorboard":
            tracker = TensorBoardLogger(out / "tensorboard")
        elif name == "wandb":
            from wandb.sdk.lib.runid import generate_id

            out.mkdir(parents=True, exist_ok=True)
            tracker = LOGGER_TYPE_TO_CLASS[name](project, **{"name": run_name, "dir": str(out), **kwargs, "config": config,
                                                           "id": ids.get(name) or generate_id(), "resume": "allow"})
        elif name == "mlflow":
            tracker = LOGGER_TYPE_TO_CLASS[name](**{"experiment_name": project, "run_name": run_name, **kwargs,
                                                  "run_id": ids.get(name)})
        elif name == "trackio":
            tracker = LOGGER_TYPE_TO_CLASS[name](project, **{**kwargs, "name": ids.get(name, run_name), "config": config,
                                                           "resume": "allow" if name in ids else "never"})
        else:
            cls = LOGGER_TYPE_TO_CLASS[name]
            tracker = cls(project, str(out), **kwargs) if cls.requires_logging_directory else cls(project, **kwargs)
        try:
            tracker.start()
            if config and not at_start and not resuming:
                tracker.store_init_configuration(config)
        except Exception as exc:  # e.g. MLflow refusing its tracking URI: one line, the trackers started closed
            Trackers(trackers).close()
            raise TrackerError(f"the {name} tracker could not start ({type(exc).__name__}: {one_line(exc)}); fix "
                               "its settings (its environment variables, tracker_kwargs) or leave it out of "
                               "report_to.") from exc
        trackers.append(tracker)
    return Trackers(trackers)


class TrackerError(UserError, RuntimeError):
    """A tracker failed to start; the message names it and what it said."""


class Trackers(Logger):
    """A run's trackers (Accelerate's ``GeneralTracker`` objects) as one logger.

    Args:
        trackers: started trackers, e.g. from :func:`open_trackers`.
    """

    def __init__(self, trackers: list) -> None:
        self.trackers = list(trackers)

    @property
    def names(self) -> list[str]:
        return [t.name for t in self.trackers]

    def log_scalar(self, name: str, value: float, step: int | None = None) -> None:
        self.log_scalars({name: value}, step)

    def log_scalars(self, scalars: dict[str, float], step: int | None = None) -> None:
        for tracker in self.trackers:
            tracker.log(scalars, step=step)

    def log_text(self, name: str, text: str, step: int | None = None) -> None:
        for tracker in self._tensorboard():
            tracker.log_text(name, text, step)

    def log_samples(self, rows: list[dict], step: int | None = None) -> None:
        if rows:
            for tracker in self.trackers:
                TABLES.get(tracker.name, _no_table)(tracker, rows, step)

    def resume_at(self, step: int) -> None:
        for tracker in self._tensorboard():
            tracker.resume_at(step)

    def run_ids(self) -> dict[str, str]:
        """What continues each resumable tracker's run: W&B's and MLflow's run id, Trackio's run name."""
        ids = {}
        for tracker in self.trackers:
            if tracker.name == "wandb":
                ids["wandb"] = tracker.run.id
            elif tracker.name == "mlflow":
                ids["mlflow"] = tracker.active_run.info.run_id
            elif tracker.name == "trackio":
                ids["trackio"] = tracker.run.name
        return ids

    def flush(self) -> None:
        for tracker in self._tensorboard():
            tracker.flush()

    def close(self, outcome: str = "finished") -> None:
        """Each tracker's run ended as ``outcome``: W&B's with exit code 0, 1 (failed) or 143 (killed: SIGTERM's),
        MLflow's FINISHED, FAILED or KILLED; the others have no status to set."""
        for tracker in self.trackers:
            if tracker.name == "wandb":
                tracker.run.finish(exit_code={"finished": 0, "failed": 1, "killed": 143}[outcome])
            elif tracker.name == "mlflow":
                import mlflow

                mlflow.end_run(status={"finished": "FINISHED", "failed": "FAILED", "killed": "KILLED"}[outcome])
            else:
                tracker.finish()
        self.trackers = []

    def _tensorboard(self) -> list:
        return [t for t in self.trackers if t.name == "tensorboard"]


def _columns(rows: list[dict]) -> tuple[list[str], list[list]]:
    columns = list(rows[0])
    return columns, [[row[c] for c in columns] for row in rows]


def _wandb_table(tracker, rows: list[dict], step: int | None) -> None:
    columns, data = _columns(rows)
    tracker.log_table("samples", columns=columns, data=data, step=step)


def _trackio_table(tracker, rows: list[dict], step: int | None) -> None:
    import trackio

    columns, data = _columns(rows)
    tracker.log({"samples": trackio.Table(columns=columns, data=data)}, step=step)


def _mlflow_table(tracker, rows: list[dict], step: int | None) -> None:
    """The samples as MLflow's table file ({"columns", "data"}), written with log_dict: log_table also lists every
    table in one run tag, which MLflow cuts at 8,000 characters, and the next log_table then fails to read it back
    (JSONDecodeError; here after ~120 logged batches, ending the run)."""
    import mlflow

    columns, data = _columns(rows)
    mlflow.log_dict({"columns": columns, "data": data}, f"samples/step_{step or 0:08d}.json")


def _tensorboard_text(tracker, rows: list[dict], step: int | None) -> None:
    tracker.log_samples(rows, step)  # our TensorBoardLogger: Markdown in the Text tab


def _no_table(tracker, rows: list[dict], step: int | None) -> None:
    """Trackers without a table here (Comet, Aim, ClearML, DVCLive, SwanLab) get the scalars only."""


TABLES: dict[str, Callable[[Any, list[dict], int | None], None]] = {
    "wandb": _wandb_table, "trackio": _trackio_table, "mlflow": _mlflow_table, "tensorboard": _tensorboard_text}
"""How each tracker takes completion samples."""
