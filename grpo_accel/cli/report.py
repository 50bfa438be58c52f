"""``grpo-accel report RUN_DIR [RUN_DIR ...] [--out DIR]``: runs' curves (PNG) and a summary (Markdown) from their
event files, through :func:`grpo_accel.reporting.report.report`; a missing folder or matplotlib is one line."""
from __future__ import annotations

import logging

from grpo_accel.cli.text import command_parser
from grpo_accel.reporting import report as library
from grpo_accel.reporting.report import ReportError, report


def main(argv: list[str] | None = None) -> int:
    parser = command_parser(library.__doc__)
    parser.add_argument("runs", nargs="+", help="run folders (each a run's output_dir)")
    parser.add_argument("--out", help="where to write report.png and report.md (default: the first run's folder)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    logging.getLogger("tensorboard").setLevel(logging.WARNING)  # its "No path found after ..." once per run
    try:
        report(args.runs, args.out)
    except ReportError as err:
        parser.exit(2, f"error: {err}\n")
    return 0
