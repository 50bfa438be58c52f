"""The built-in task: add two small numbers. ``"3+4="`` -> ``"7"``.

Small enough that a randomly initialised 0.1M-parameter model learns it with GRPO alone on 2 CPU cores in a
few minutes: the format reward (answer with digits, then stop) is found within a few dozen steps, and the
answer reward then rises as the model memorises the sums. Some pairs are held out for evaluation.
"""
from __future__ import annotations

import random


def addition_rows(max_operand: int = 4, holdout: int = 0, seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out) rows ``{"prompt": "a+b=", "answer": "a+b"}`` for 0 <= a, b <= max_operand."""
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(max_operand + 1) for b in range(max_operand + 1)]
    random.Random(seed).shuffle(rows)
    return rows[holdout:], rows[:holdout]
