"""Built-in tiny model, tokenizer and task: everything the default run and the tests need, no downloads."""

BUILTIN_TASKS = {  # data.task -> the function that makes its (train, held-out) rows from (max_operand, holdout)
    "addition": "grpo_accel.tasks.addition:addition_rows",
    "chat_arithmetic": "grpo_accel.tasks.chat_arithmetic:chat_arithmetic_rows",
    "calculator": "grpo_accel.tasks.calculator:calculator_rows",
}
