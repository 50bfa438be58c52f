"""A built-in task for pretrained chat models: two-digit sums and differences, asked as chat messages.

``{"prompt": [{"role": "user", "content": "What is 47+38? Answer with just the number."}], "answer": "85"}``,
operands in 10..max_operand, differences never negative. SmolLM2-135M-Instruct gets about one in six right
before training, greedy, often as "89 + 42 = 21" or a sentence cut off by the token budget (docs/pages/
benchmarks.md, "A real model learns"). Held-out rows share no (operation, a, b) with training rows.
"""
from __future__ import annotations

import random

QUESTION = "What is {a}{op}{b}? Answer with just the number."


def chat_arithmetic_rows(max_operand: int = 99, holdout: int = 200, count: int = 4000,
                         seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out) chat rows with a numeric ``answer``: ``count`` distinct problems (fewer when the
    operand range has fewer), the first ``holdout`` held out."""
    if max_operand < 10:
        raise ValueError(f"max_operand={max_operand}: chat_arithmetic uses operands 10..max_operand; use >= 10.")
    problems = [(op, a, b) for op in "+-" for a in range(10, max_operand + 1) for b in range(10, max_operand + 1)
                if op == "+" or a >= b]
    random.Random(seed).shuffle(problems)
    rows = [{"prompt": [{"role": "user", "content": QUESTION.format(a=a, op=op, b=b)}],
             "answer": str(a + b if op == "+" else a - b)} for op, a, b in problems[:count]]
    if holdout >= len(rows):
        raise ValueError(f"holdout={holdout}: max_operand={max_operand} gives {len(rows)} problems; hold out "
                         "fewer.")
    return rows[holdout:], rows[:holdout]
