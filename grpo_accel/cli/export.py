"""``grpo-accel export CHECKPOINT OUT``: a checkpoint (or a run's newest) as a Hugging Face model folder, through
:func:`grpo_accel.run.export.export_checkpoint`; a bad checkpoint or folder is one line and exit code 2."""
from __future__ import annotations

import logging
import os

from grpo_accel.cli.text import command_parser
from grpo_accel.checkpoint import CheckpointError
from grpo_accel.run import export as library
from grpo_accel.run.export import export_checkpoint
from grpo_accel.rules import DTYPES


def main(argv: list[str] | None = None) -> int:
    parser = command_parser(library.__doc__)
    parser.add_argument("checkpoint", help="a checkpoint folder (output_dir/checkpoints/step_*), or a run's "
                                           "output_dir: its newest complete checkpoint")
    parser.add_argument("out_dir", help="where to write the Hugging Face model folder")
    parser.add_argument("--dtype", choices=DTYPES, help="cast the weights")
    parser.add_argument("--adapter", action="store_true",
                        help="LoRA runs: write the PEFT adapter folder instead of the merged model")
    parser.add_argument("--replace", action="store_true",
                        help="out_dir may hold files (an earlier export): it is replaced whole")
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")  # export runs on the CPU: DeepSpeed's notice that it does, unsaid
    try:
        export_checkpoint(args.checkpoint, args.out_dir, args.dtype, adapter=args.adapter, replace=args.replace)
    except CheckpointError as err:  # names the checkpoint and the fix: one line on stderr, exit 2, no traceback
        parser.exit(2, f"error: {err}\n")
    return 0
