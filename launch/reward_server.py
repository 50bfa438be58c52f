"""The checkout's reward server script: ``grpo-accel reward-server``'s code (grpo_accel/cli/reward_server.py).

    python launch/reward_server.py [--config FILE.yaml] --reward NAME [--host 0.0.0.0] [--port 8000] [key=value ...]
"""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

from grpo_accel.cli.reward_server import main, make_app  # noqa: E402,F401  (tests import them from here)

if __name__ == "__main__":
    raise SystemExit(main())
