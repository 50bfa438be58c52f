"""Built-in tiny model, tokenizer and task: everything the default run and the tests need, no downloads."""

BUILTIN_TASKS = {  # data.task -> the function that makes its (train, held-out) rows from (max_operand, holdout)
    "addition": "grpo_accel.tasks.addition:addition_rows",
    "chat_arithmetic": "grpo_accel.tasks.chat_arithmetic:chat_arithmetic_rows",
    "calculator": "grpo_accel.tasks.calculator:calculator_rows",
}


def task_rows(task: str):
    """The function that makes ``task``'s (train, held-out) rows (a key of :data:`BUILTIN_TASKS`)."""
    import importlib

    module, _, name = BUILTIN_TASKS[task].partition(":")
    return getattr(importlib.import_module(module), name)


def task_max_operand(task: str) -> int:
    """``task``'s own operand range: its rows function's ``max_operand`` default."""
    import inspect

    return inspect.signature(task_rows(task)).parameters["max_operand"].default
