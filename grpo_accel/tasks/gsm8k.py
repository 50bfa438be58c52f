"""GSM8K's rows as chat prompts, for ``data.row_transform`` (launch/configs/gsm8k.yaml).

A GSM8K row is ``{"question": "Natalia sold clips to 48 of her friends in April, ...", "answer": "Natalia sold
48/2 = <<48/2=24>>24 clips in May.\\n... \\n#### 72"}``; :func:`chat_row` makes the question one user message
that asks for the answer after "####" (the form ``math_answer`` reads first after ``\\boxed{}``), and keeps the
worked solution, which ``data.answer_format=gsm8k`` reduces to "72".
"""
from __future__ import annotations

INSTRUCTION = "Solve it step by step, then write the final answer as a number on its own line after \"####\"."


def chat_row(row: dict) -> dict:
    """``{"question", "answer", ...}`` -> ``{"prompt": [user message], "answer", ...}``."""
    question = row.pop("question")
    return {**row, "prompt": [{"role": "user", "content": f"{question}\n\n{INSTRUCTION}"}]}
