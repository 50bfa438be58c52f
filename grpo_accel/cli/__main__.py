"""``python -m grpo_accel.cli ...``: the ``grpo-accel`` command where its script is not on PATH."""
import sys

from grpo_accel.cli import main

if __name__ == "__main__":
    sys.exit(main())
