"""``python launch/bench/sglang_standin --port P --model DIR --sglang-version V ...``: the stand-in server (``server.py``)."""
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # launch/bench/, where the package lives

from sglang_standin.server import main  # noqa: E402

if __name__ == "__main__":
    main()
