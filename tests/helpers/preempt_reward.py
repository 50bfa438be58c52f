"""A reward function (weight 0) that sends signals to its own process: preemption at a chosen moment."""
import os
import signal
import time
from pathlib import Path

_calls = 0


def signal_once(prompts, completions, at_call: int = 3, rank: int = 1, signals: int = 1, flag: str = "",
                gap_s: float = 0.0, **fields):
    """On call ``at_call`` of process ``rank``, send ``signals`` SIGTERMs to this process, ``gap_s`` apart, unless
    ``flag`` exists (it is created on firing, so a resumed run is not signalled again)."""
    global _calls
    _calls += 1
    if _calls == at_call and int(os.environ.get("RANK", "0")) == rank and not Path(flag).exists():
        Path(flag).touch()
        for i in range(signals):
            if i:
                time.sleep(gap_s)
            os.kill(os.getpid(), signal.SIGTERM)
    return [0.0] * len(completions)
