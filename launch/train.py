"""The checkout's training script: ``grpo-accel train``'s code (grpo_accel/cli/train.py) run from a checkout,
installed or not.

    accelerate launch --config_file accelerate_configs/single_process.yaml launch/train.py [--config F] [key=value ...]
    python launch/train.py [--config F] [key=value ...]     (one process)
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from grpo_accel.cli.train import main, script_main  # noqa: E402,F401  (main: tests call it in-process)

if __name__ == "__main__":
    script_main()
