"""GRPO training: a config becomes a trainer (:func:`grpo_accel.recipe.build.build_trainer`: tokenizer, model,
data, engine, rewards, loss, optimizer), which trains; this adds the command line, the console, the run
folder's lock, the summary and one-line errors.

    grpo-accel train [--accelerate-config NAME|FILE] [--config NAME|FILE] [key=value ...]
    accelerate launch --config_file accelerate_configs/single_process.yaml launch/train.py [--config F] [key=value ...]

``--config`` takes a YAML file or a shipped recipe by name (``grpo-accel configs`` lists them), or a
``trl grpo`` config file (:mod:`grpo_accel.config.trl.translate`).

With no model named, this trains the built-in tiny Llama (random weights) on the built-in addition task.
Outputs in ``output_dir``: config.yaml (resolved), tensorboard/ (event files), checkpoints/, summary.json.
``checkpoint.resume=auto`` continues from the newest complete checkpoint; SIGTERM/SIGINT checkpoint and exit 0.
"""
from __future__ import annotations

import json
import logging
import os
import re
import sys
import time
import warnings
from pathlib import Path

sys.path.insert(1, str(Path.cwd()))  # reward functions named `module:function` may live where the run starts

import yaml

from grpo_accel.cli.text import command_parser, plain
from grpo_accel.distributed import first_process
from grpo_accel.errors import UserError
from grpo_accel.config.loading import load_config
from grpo_accel.config.secrets import record, redact_text
from grpo_accel.run.folder import RunFinished, RunFolderLock
from grpo_accel.config.schema import GRPOConfig

log = logging.getLogger("grpo_accel.train")


def write_config(out: Path, cfg: GRPOConfig) -> None:
    out.mkdir(parents=True, exist_ok=True)
    (out / "config.yaml").write_text(yaml.safe_dump(record(cfg), sort_keys=False))  # secrets: *** or ${NAME}


def quiet_console() -> None:
    """Our log lines; each warning once per process (DeepSpeed's ZeRO-3 collectives raised torch's deprecation
    warning ~40 times per batch); Accelerate's per-checkpoint INFO lines dropped (we log one line per checkpoint).
    ``python -W``/``PYTHONWARNINGS`` still win."""
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s: %(message)s")
    if not sys.warnoptions:
        warnings.showwarning = shown_once(warnings.showwarning)
    for name in ("accelerate.accelerator", "accelerate.checkpointing"):
        logging.getLogger(name).setLevel(logging.WARNING)


def shown_once(showwarning):
    """``showwarning`` for each (text, category) once. The "once" filter cannot do it: every change to the
    filters (each ``warnings.catch_warnings`` block, which torch and DeepSpeed enter per step) clears its memory."""
    seen = set()

    def show(message, category, filename, lineno, file=None, line=None):
        if (key := (str(message), category)) not in seen:
            seen.add(key)
            showwarning(message, category, filename, lineno, file, line)

    return show


def dashed_settings(argv: list[str], options: tuple[str, ...] = ("--config",)) -> list[str]:
    """``argv`` with settings written as options, TRL's and argparse's habit (``--learning_rate 1e-6``,
    ``--optim.lr=1e-6``, ``--max-new-tokens 64``, a bare ``--overwrite`` for true), as ``key=value`` overrides;
    ``options`` and ``--help`` stay options, and what follows ``--`` stays as it is."""
    out, rest = [], list(argv)
    while rest:
        arg = rest.pop(0)
        name, eq, value = arg.partition("=")
        if arg == "--":
            return [*out, arg, *rest]
        if not arg.startswith("--") or name in (*options, "--help"):
            out.append(arg)
            if name in options and not eq and rest:
                out.append(rest.pop(0))
            continue
        if not eq:  # the value is the next argument, unless that is another option or a key=value (a flag: true)
            takes = rest and not rest[0].startswith("--") and not re.match(r"[A-Za-z_][\w.\[\]]*=", rest[0])
            value = rest.pop(0) if takes else "true"
        out.append(f"{name[2:].replace('-', '_')}={value}")
    return out


def main(argv: list[str] | None = None) -> int:
    from grpo_accel.config.reference import help_text

    parser = command_parser(__doc__, epilog=plain(help_text()))
    parser.add_argument("--config", help="YAML config file, or a shipped recipe's name, e.g. dapo (default: the "
                                         "built-in embedded run)")
    parser.add_argument("overrides", nargs="*",
                        help="key=value overrides, e.g. trainer.total_frames=256 (or --key value)")
    args = parser.parse_args(dashed_settings(sys.argv[1:] if argv is None else argv))
    quiet_console()
    from grpo_accel.shipped import find

    cfg = load_config(args.config and find("recipe", args.config), args.overrides)
    sys.argv[1:] = [redact_text(arg) for arg in sys.argv[1:]]  # trackers record the command line (W&B's args)
    return train_config(cfg)


def train_config(cfg: GRPOConfig) -> int:
    """A run of ``cfg`` as the training command makes it (the Python face of ``grpo-accel train``, and what
    :mod:`grpo_accel.trl` runs): the run folder's lock, the run, config.yaml and summary.json; 0 once done."""
    from grpo_accel.runtime import start_process

    if cfg.trainer.log_level != "info":  # info: the console's own level (quiet_console)
        logging.getLogger("grpo_accel").setLevel(cfg.trainer.log_level.upper())
    start_process()  # threads per process, the allocator for the ZeRO stage
    start = time.perf_counter()
    lock = RunFolderLock(cfg.output_dir) if first_process() else None
    if lock is not None:
        lock.acquire()  # before anything is read or written there: one run per folder
    try:
        return run(cfg, start)
    except RunFinished as done:  # the command of a finished run, again: nothing to do, nothing touched
        log.info("%s", done)
        return 0
    finally:
        if lock is not None:
            lock.release()


def run(cfg: GRPOConfig, start: float) -> int:
    from grpo_accel.recipe.build import build_trainer, close_parts, summarize

    trainer = build_trainer(cfg)
    out = Path(cfg.output_dir)
    main_process = trainer.accelerator.is_main_process
    # A resume can still fail (checkpoint checks run in train()): its config.yaml is written once it has run, so a
    # failed resume changes nothing in the run folder.
    resuming = trainer.checkpoint is not None and trainer.checkpoint.resume_path() is not None
    if main_process and not resuming:
        write_config(out, cfg)
    from tqdm.contrib.logging import logging_redirect_tqdm

    outcome = "failed"  # unless train() returns: an error, or a signal it did not catch (a second Ctrl-C)
    try:
        with logging_redirect_tqdm():  # log lines print above the progress bar, which stays one line
            trainer.train()
        outcome = "killed" if (trainer.stop_reason or "").startswith("received SIG") else "finished"
    except KeyboardInterrupt:
        outcome = "killed"
        raise
    finally:
        close_parts(trainer, outcome)
    trainer.accelerator.wait_for_everyone()
    if main_process:
        if resuming:
            write_config(out, cfg)
        summary = summarize(trainer, time.perf_counter() - start)
        (out / "summary.json").write_text(json.dumps(summary, indent=2))
        log.info("summary: %s", json.dumps(summary))
        saved = trainer.checkpoint.complete() if trainer.checkpoint is not None else []
        log.info("%s", human_summary(summary, trainer.frames, saved[-1] if saved else None, out))
        if trainer.stop_reason is not None and saved:
            said(f"stopped ({trainer.stop_reason}) after {trainer.frames} frames, saved in {saved[-1]}; to continue, "
                 "run the same command with checkpoint.resume=auto", log.warning)
    trainer.accelerator.end_training()
    return 0


def human_summary(summary: dict, frames: int, checkpoint: Path | None, out: Path) -> str:
    """The end of a run in a few lines for a person (the JSON line above is for scripts)."""
    return "\n".join([
        f"done: {frames} frames (completions) in {summary['final_iteration']} batches; this run {summary['wall_time_s']:.1f} s",
        _reward_line(summary),
        f"  final checkpoint: {checkpoint if checkpoint is not None else 'none'}",
        *([f"  curves: tensorboard --logdir {out / 'tensorboard'}"] if (out / "tensorboard").is_dir() else [])])


def _reward_line(summary: dict) -> str:
    k = summary["reward_window"]
    if summary["iterations"] < 2:
        return f"  reward: {summary['reward_last_mean']:.3f} ({summary['iterations']} batch)"
    return (f"  reward: {summary['reward_first_mean']:.3f} (first {k} batches) -> {summary['reward_last_mean']:.3f} "
            f"(last {k})")


def main_reporting_errors(argv: list[str] | None = None) -> int:
    """``main()``; a :class:`~grpo_accel.errors.UserError` becomes one line on stderr and exit code 2 instead of a traceback
    per process. Before the process group exists every process meets the same error, so rank 0 alone says it
    (the others wait a moment, so that rank 0's is the first failure); after, each failing process says it with
    its rank. Under torchrun the line also goes to the agent's error file, so the launcher's failure report shows
    it instead of a pointer to the docs. A Ctrl-C before training begins is one line and exit code 130. Other
    errors keep their traceback."""
    from grpo_accel.trainer.hooks import HookError

    try:
        try:
            return main(argv)
        except HookError as err:  # e.g. a user hook (evaluation) meeting a bad setting or file
            if isinstance(err.__cause__, UserError):
                raise err.__cause__ from None
            raise
    except KeyboardInterrupt:  # Ctrl-C outside training (there it is a clean stop): while starting, e.g. waiting
        logging.shutdown()  # for a server; nothing was trained, so there is nothing to save
        if first_process():
            said("stopped (Ctrl-C) before training began; nothing was trained or saved")
        return 130
    except UserError as err:
        import torch.distributed as dist

        from grpo_accel.distributed import launch_world_size

        world = launch_world_size()
        grouped = dist.is_available() and dist.is_initialized() and world > 1
        line = f"error (rank {os.environ.get('RANK', '0')} of {world}): {err}" if grouped else f"error: {err}"
        if first_process() or grouped:
            logging.shutdown()  # pending log lines first: this one stays last
            said(line)
        if error_file := os.environ.get("TORCHELASTIC_ERROR_FILE"):
            Path(error_file).write_text(json.dumps({"message": line, "timestamp": int(time.time())}))
        if not grouped and not first_process():
            time.sleep(3)  # rank 0 fails first and says it: the launcher stops the others at the first failure
        return 2


LAST_LINE = "GRPO_ACCEL_LAST_LINE_FILE"
"""Set by ``grpo-accel train --accelerate-config``: a file each process appends its closing line to (an error, or
how it stopped), which the command prints again once the launcher has said its own."""


def said(line: str, log_with=None) -> None:
    """``line`` as the process's closing line: on stderr (through ``log_with``, a logging call, when given) and, under
    ``grpo-accel train --accelerate-config``, in its ``LAST_LINE`` file."""
    if log_with is not None:
        log_with("%s", line)
    else:
        print(line, file=sys.stderr, flush=True)
    if path := os.environ.get(LAST_LINE):
        with open(path, "a") as f:
            f.write(line.replace("\n", " ") + "\n")


def script_main(argv: list[str] | None = None) -> None:
    """The process's whole life: :func:`main_reporting_errors`, then exit (skipping a teardown that can hang)."""
    from grpo_accel.runtime.signals import exit_skipping_teardown, terminal_foreground

    with terminal_foreground():  # Ctrl-C reaches the trainer alone, not Accelerate's launcher too
        code = main_reporting_errors(argv)
    exit_skipping_teardown(code)


if __name__ == "__main__":  # accelerate launch -m grpo_accel.cli.train
    script_main()
