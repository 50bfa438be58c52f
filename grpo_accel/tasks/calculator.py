"""A built-in multi-turn task: products of two numbers, with a calculator tool the model may call.

``{"prompt": [*DEMONSTRATION, {"role": "user", "content": "What is 47*29?"}], "answer": "1363"}``; the episode
runs in a :class:`~grpo_accel.rollout.episodes.ToolEnvironment` offering :func:`calculator`. SmolLM2-135M-Instruct
gets such products wrong on its own; a call such as ``<tool_call>{"name": "calculator", "arguments":
{"expression": "47*29"}}</tool_call>`` returns the result, which it then only has to repeat. Every prompt opens
with one worked exchange (:data:`DEMONSTRATION`): from the tools' description alone that model called the
calculator in 0 of 32 problems; after the example, in 7 of 32, all malformed, which is enough to learn from (docs/pages/
benchmarks.md, "Multi-turn episodes with a calculator tool").
"""
from __future__ import annotations

import ast
import operator
import random
from typing import Callable

QUESTION = "What is {a}*{b}?"
DEMONSTRATION = [
    {"role": "user", "content": "What is 12*34?"},
    {"role": "assistant", "content": '<tool_call>{"name": "calculator", "arguments": {"expression": "12*34"}}</tool_call>'},
    {"role": "tool", "content": "408"},
    {"role": "assistant", "content": "408"},
]
_OPERATORS = {ast.Add: operator.add, ast.Sub: operator.sub, ast.Mult: operator.mul, ast.Div: operator.truediv,
              ast.USub: operator.neg, ast.UAdd: operator.pos}


def calculator(expression: str) -> str:
    """Evaluate an arithmetic expression with + - * / and parentheses, e.g. "347*29"."""
    def value(node):
        if isinstance(node, ast.Constant) and type(node.value) in (int, float):
            return node.value
        if isinstance(node, ast.BinOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.left), value(node.right))
        if isinstance(node, ast.UnaryOp) and type(node.op) in _OPERATORS:
            return _OPERATORS[type(node.op)](value(node.operand))
        raise ValueError(f"unsupported expression {ast.unparse(node)!r}: use numbers, + - * / and parentheses")

    if len(expression) > 200:
        raise ValueError("expression longer than 200 characters")
    result = value(ast.parse(expression, mode="eval").body)
    return str(int(result)) if float(result).is_integer() else f"{result:.6g}"


def calculator_rows(max_operand: int = 999, holdout: int = 200, count: int = 4000,
                    seed: int = 0) -> tuple[list[dict], list[dict]]:
    """(train, held-out) chat rows asking for ``a*b`` (both in 10..max_operand) after :data:`DEMONSTRATION`, with
    the ``answer``; the first ``holdout`` of ``count`` distinct problems are held out."""
    if max_operand < 10:
        raise ValueError(f"max_operand={max_operand}: the calculator task multiplies numbers in 10..max_operand; "
                         "use >= 10.")
    span = max_operand - 9
    picks = random.Random(seed).sample(range(span * span), min(count, span * span))  # distinct (a, b) pairs
    rows = [{"prompt": [*DEMONSTRATION, {"role": "user", "content": QUESTION.format(a=10 + p // span, b=10 + p % span)}],
             "answer": str((10 + p // span) * (10 + p % span))} for p in picks]
    if holdout >= len(rows):
        raise ValueError(f"holdout={holdout}: max_operand={max_operand} gives {len(rows)} problems; hold out fewer.")
    return rows[holdout:], rows[:holdout]


def calculator_environment(system_prompt: str | None = None, timeout_s: float = 10.0,
                           prompt_field: str = "prompt") -> Callable:
    """A factory of :class:`~grpo_accel.rollout.episodes.ToolEnvironment` s offering :func:`calculator`."""
    from grpo_accel.rollout.episodes import ToolEnvironment

    return lambda: ToolEnvironment([calculator], timeout_s=timeout_s, system_prompt=system_prompt,
                                   prompt_field=prompt_field)
