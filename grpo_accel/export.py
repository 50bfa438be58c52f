"""``python -m grpo_accel.export CHECKPOINT OUT [--dtype D] [--adapter]``: a checkpoint as a Hugging Face model
folder. The command's entry; the work is :mod:`grpo_accel.recipe.export`'s."""
import sys

from grpo_accel.recipe.export import main

if __name__ == "__main__":
    sys.exit(main())
