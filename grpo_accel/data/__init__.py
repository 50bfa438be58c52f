"""The data room: a dataset's files become checked prompts. Rows from JSONL/JSON/CSV/Parquet files, saved
``datasets`` folders and Hub ids, renamed, transformed and validated (``files.py``); chat messages and columns
checked, every prompt rendered through the chat template and tokenised before training starts (``prompts.py``)."""
