"""The ``grpo-accel`` command (pyproject.toml ``[project.scripts]``): one entry, a subcommand per job.

    grpo-accel train [--accelerate-config NAME|FILE] [--num-processes N] [--config NAME|FILE] [key=value ...]
    grpo-accel export CHECKPOINT OUT [--dtype D] [--adapter]
    grpo-accel models NAME OUT
    grpo-accel reward-server --reward NAME [--config F] [--port P] [key=value ...]
    grpo-accel report RUN_DIR [RUN_DIR ...] [--out DIR]
    grpo-accel configs
    grpo-accel env
    grpo-accel --version

``train`` without ``--accelerate-config`` runs one process here; with one (a shipped name such as ``zero3``, or a
file) it hands the run to ``accelerate launch`` with that config, which starts the processes. Each subcommand's
``--help`` says the rest; each has its module here (``train.py``, ``export.py``, ``models.py``,
``reward_server.py``, ``report.py``), over the library code it calls.
"""
from __future__ import annotations

import argparse
import os
import sys

SUBCOMMANDS = {
    "train": "train a policy with GRPO (one process, or several under --accelerate-config)",
    "export": "a checkpoint as a Hugging Face model folder",
    "models": "a pretrained model the package registry ships, as a Hugging Face folder",
    "reward-server": "serve one reward of a config over HTTP",
    "report": "draw runs' curves (PNG) and a summary (Markdown) from their event files",
    "configs": "list the shipped accelerate configs and recipes by name",
    "env": "the versions and devices a bug report needs (torch, accelerate, deepspeed, transformers, CUDA, GPUs)",
}


def main(argv: list[str] | None = None) -> int:
    from grpo_accel.cli.text import command_parser

    argv = sys.argv[1:] if argv is None else list(argv)
    if argv[:1] in (["--version"], ["-V"]):
        from grpo_accel import __version__

        print(f"grpo-accel {__version__}")
        return 0
    if not argv or argv[0] not in SUBCOMMANDS:
        parser = command_parser(__doc__, prog="grpo-accel")
        parser.add_argument("--version", "-V", action="store_true", help="print the version and exit")
        parser.add_argument("command", choices=sorted(SUBCOMMANDS), help="; ".join(f"{k}: {v}" for k, v in
                                                                                SUBCOMMANDS.items()))
        parser.parse_args(argv[:1])  # --help, or an unknown command: argparse says so and exits
        return 2
    command, rest = argv[0], argv[1:]
    sys.argv[0] = f"grpo-accel {command}"  # each subcommand's usage line
    if command == "train":
        return launch_train(rest)  # not named train: the submodule cli.train, once imported, is that attribute
    if command == "export":
        from grpo_accel.cli.export import main as export

        return export(rest)
    if command == "models":
        from grpo_accel.cli.models import main as models

        return models(rest)
    if command == "reward-server":
        from grpo_accel.cli.reward_server import main as serve

        return serve(rest)
    if command == "report":
        from grpo_accel.cli.report import main as report

        return report(rest)
    if command == "env":
        from grpo_accel.cli.text import environment

        print("\n".join(environment()))
        return 0
    from grpo_accel import shipped

    for kind in ("accelerate", "recipe"):
        print(f"{shipped.FLAGS[kind]}: {' '.join(shipped.names(kind))}   ({shipped.folder(kind)})")
    return 0


def launch_train(argv: list[str]) -> int:
    """``grpo-accel train``: in this process, or under ``accelerate launch -m grpo_accel.cli.train`` when an
    accelerate config is named (this process becomes the launcher)."""
    parser = argparse.ArgumentParser(add_help=False)
    parser.add_argument("--accelerate-config")
    parser.add_argument("--num-processes", type=int)
    ours, rest = parser.parse_known_args(argv)
    if ours.accelerate_config is None:
        if ours.num_processes not in (None, 1):
            print("error: --num-processes needs --accelerate-config (e.g. --accelerate-config ddp)", file=sys.stderr)
            return 2
        from grpo_accel.cli.train import script_main

        script_main(rest)  # exits
    from grpo_accel.errors import UserError
    from grpo_accel.shipped import find

    try:
        config = find("accelerate", ours.accelerate_config)
        if not config.is_file():
            raise FileNotFoundError(f"--accelerate-config {ours.accelerate_config!r}: no such file")
    except (UserError, FileNotFoundError) as err:
        print(f"error: {err}", file=sys.stderr)
        return 2
    launch = [sys.executable, "-m", "accelerate.commands.launch", "--config_file", str(config)]
    launch += ["--num_processes", str(ours.num_processes)] if ours.num_processes else []
    return launch_with_last_line([*launch, "-m", "grpo_accel.cli.train", *rest])


def launch_with_last_line(command: list[str]) -> int:
    """Run Accelerate's launcher (``command``) to its end, its output passing through as it comes; then, when it
    failed, say the trainer's closing line once more (its error, or how it stopped), so that it is the last on
    screen, below what the launcher adds after it (a KeyboardInterrupt traceback, torch elastic's failure report);
    one that failed with no line of ours (a process killed) ends with a line saying so. Returns its exit code."""
    import signal
    import subprocess
    import tempfile

    from grpo_accel.cli.train import LAST_LINE

    with tempfile.NamedTemporaryFile("r", prefix="grpo-accel-last-line-", suffix=".txt") as last:
        previous = signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C is the trainer's to handle; we wait
        try:
            code = subprocess.call(command, env={**os.environ, LAST_LINE: last.name})
        finally:
            signal.signal(signal.SIGINT, previous)
        lines = [line for line in last.read().splitlines() if line.strip()]
    if lines and code != 0:  # a clean stop exits 0, after which the launcher says nothing
        print(lines[-1], file=sys.stderr, flush=True)
    elif code != 0:
        print(f"error: the launch failed (exit code {code}) with no error of the trainer's: a process was killed or "
              "crashed; its output above says which", file=sys.stderr, flush=True)
    return code


if __name__ == "__main__":
    raise SystemExit(main())
