"""``grpo-accel report RUN_DIR [RUN_DIR ...] [--out DIR]``: runs' curves as one PNG, and a Markdown summary.

Read from each run's event files (``RUN_DIR/tensorboard``); several runs share each panel, one line per run, named
by their folders. Panels, where the runs logged them: the reward and each reward function's mean, the completion
length, the KL estimate, the clip fraction, the entropy, the share of completions without signal (advantage 0),
the learning rate, and the seconds of each part of a step (``trainer.log_timings=true``); a quantity that is off
(0 at every batch: the KL estimate with ``kl_coef 0``) is not drawn, and the summary names it. Written: ``report.png`` and ``report.md`` in ``--out`` (default: the first run's
folder). Needs matplotlib (``pip install 'grpo_accel[report]'``).
"""
from __future__ import annotations

import logging
import math
from pathlib import Path

from grpo_accel.errors import UserError

logger = logging.getLogger(__name__)

Series = list[tuple[int, float]]
PANELS = (  # (title, tags: exact names, or a prefix and suffix around "*")
    ("reward (mean)", ("train/reward_mean", "train/reward/*_mean")),
    ("completion length (tokens, mean)", ("train/completion_length_mean",)),
    ("KL estimate", ("train/kl_approx",)),
    ("clip fraction", ("train/clip_fraction",)),
    ("entropy (nats per token)", ("train/entropy",)),
    ("completions without signal (advantage 0, share)", ("train/zero_advantage_fraction",)),
    ("learning rate", ("train/lr",)),
    ("seconds per batch", ("time/generate", "time/score", "time/forward_backward", "time/optimizer",
                           "time/weight_sync")),
)


class ReportError(UserError, ValueError):
    """A folder that holds no run's event files."""


def matches(tag: str, pattern: str) -> bool:
    head, star, tail = pattern.partition("*")
    return tag == pattern if not star else tag.startswith(head) and tag.endswith(tail) and len(tag) > len(pattern) - 1


def panel_series(scalars: dict[str, Series]) -> list[tuple[str, dict[str, Series]]]:
    """The panels a run's scalars fill: [(title, {tag: series})], in PANELS' order; empty ones and those that are
    off in the run (:func:`is_off`) left out."""
    panels = []
    for title, patterns in PANELS:
        tags = [t for p in patterns for t in sorted(scalars) if matches(t, p)]
        series = {t: scalars[t] for t in dict.fromkeys(tags)}
        if series and not is_off(series):
            panels.append((title, series))
    return panels


def is_off(series: dict[str, Series]) -> bool:
    """A quantity the run never turned on: 0 at every logged batch (the KL estimate with kl_coef 0, the clip
    fraction of one on-policy epoch, whose ratio is 1)."""
    return all(value == 0 for points in series.values() for _, value in points)


def off_panels(runs: dict[str, dict[str, Series]]) -> list[str]:
    """The panels every run logged at 0 throughout: left out of the figure, named in the summary."""
    out = []
    for title, patterns in PANELS:
        logged = [{t: s[t] for t in s if any(matches(t, p) for p in patterns)} for s in runs.values()]
        if any(logged) and all(is_off(series) for series in logged):
            out.append(title)
    return out


def read_runs(run_dirs: list[Path]) -> dict[str, dict[str, Series]]:
    """Each run's scalars by its folder's name (a folder named twice gets its parent's name too)."""
    from grpo_accel.reporting.event_files import read_scalars

    runs = {}
    for run in run_dirs:
        if not run.is_dir():
            raise ReportError(f"{run}: no such folder; give a run's output_dir.")
        events = run / "tensorboard"
        if not any(events.glob("events.out.tfevents.*")):
            raise ReportError(f"{run}: no event files in {events}; give a run's output_dir (it holds tensorboard/).")
        name = run.resolve().name if run.resolve().name not in runs else f"{run.resolve().parent.name}/{run.name}"
        runs[name] = read_scalars(events)
    return runs


def draw(runs: dict[str, dict[str, Series]]):
    """One figure, a panel per quantity any run logged; a line per (run, tag). Returns the matplotlib Figure."""
    try:
        import matplotlib
    except ImportError:
        raise ReportError("grpo-accel report draws with matplotlib, which is not installed here: pip install "
                          "'grpo_accel[report]'.") from None

    matplotlib.use("Agg")
    from matplotlib.figure import Figure

    titles = [title for title, _ in PANELS if any(t == title for s in runs.values() for t, _ in panel_series(s))]
    columns = min(3, len(titles))
    rows = math.ceil(len(titles) / columns)
    figure = Figure(figsize=(5 * columns, 3.4 * rows), layout="constrained")
    axes = {title: figure.add_subplot(rows, columns, i + 1) for i, title in enumerate(titles)}
    styles = ("-", "--", ":", "-.")
    for index, (run, scalars) in enumerate(runs.items()):
        for title, series in panel_series(scalars):
            for number, (tag, points) in enumerate(series.items()):
                steps, values = zip(*points)
                label = tag.removeprefix("train/").removeprefix("time/")
                if len(runs) > 1:  # a colour per run, a line style per quantity
                    axes[title].plot(steps, values, f"C{index % 10}", linestyle=styles[number % len(styles)],
                                     label=f"{run}: {label}")
                else:
                    axes[title].plot(steps, values, label=label)
    for title, ax in axes.items():
        ax.set_title(title)
        ax.set_xlabel("batch")
        ax.grid(alpha=0.3)
        if len(ax.lines) > 1:
            ax.legend(fontsize=7)
    return figure


def summary_markdown(runs: dict[str, dict[str, Series]]) -> str:
    """A table: per run, its batches and the first and last value of each panel's main quantity."""
    tags = [("train/reward_mean", "reward"), ("train/completion_length_mean", "length"), ("train/kl_approx", "KL"),
            ("train/entropy", "entropy"), ("time/iteration", "s/batch")]
    shown = [(t, n) for t, n in tags if any(t in s for s in runs.values())]
    lines = ["| run | batches | " + " | ".join(f"{n} first -> last" for _, n in shown) + " |",
             "|---" * (2 + len(shown)) + "|"]
    for run, scalars in runs.items():
        batches = max((p[-1][0] for p in scalars.values() if p), default=0)
        cells = [f"{scalars[t][0][1]:.3g} -> {scalars[t][-1][1]:.3g}" if scalars.get(t) else "" for t, _ in shown]
        lines.append(f"| {run} | {batches} | " + " | ".join(cells) + " |")
    if off := off_panels(runs):
        lines.append(f"\nOff in every run (0 at every logged batch, so not drawn): {', '.join(off)}.")
    return "\n".join(lines) + "\n"


def report(run_dirs: list[str | Path], out: str | Path | None = None):
    """Write ``report.png`` and ``report.md`` for ``run_dirs`` into ``out`` (default: the first run's folder);
    returns the Figure."""
    run_dirs = [Path(r) for r in run_dirs]
    runs = read_runs(run_dirs)
    out = Path(out) if out is not None else run_dirs[0]
    out.mkdir(parents=True, exist_ok=True)
    figure = draw(runs)
    figure.savefig(out / "report.png", dpi=110)
    (out / "report.md").write_text(f"# {', '.join(runs)}\n\n![curves](report.png)\n\n{summary_markdown(runs)}")
    logger.info("wrote %s and %s", out / "report.png", out / "report.md")
    return figure
