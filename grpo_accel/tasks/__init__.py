"""Built-in tiny model, tokenizer and task: everything the default run and the tests need, no downloads."""
