"""Prompt datasets: loading JSONL/Parquet files and validating rows before any training starts."""
from __future__ import annotations

import json
from pathlib import Path


class DataError(ValueError):
    """A dataset cannot be trained on; the message names the file or row, the column and the fix."""


def load_rows(path: str | Path) -> list[dict]:
    """Rows of a ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file as dicts."""
    path = Path(path)
    if not path.is_file():
        raise DataError(f"data.path={str(path)!r}: no such file; give a JSONL or Parquet file of prompts.")
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"data.path={str(path)!r} line {lineno} is not JSON ({exc}); one object per line.") from exc
        return rows
    if path.suffix == ".parquet":
        try:
            import datasets  # lazy: only for Parquet files
        except ImportError as exc:
            raise ImportError(f"data.path={str(path)!r} is Parquet, which needs `datasets`: pip install 'grpo_accel[data]'.") from exc

        return list(datasets.Dataset.from_parquet(str(path)))
    raise DataError(f"data.path={str(path)!r}: unknown file type {path.suffix!r}; use .jsonl or .parquet.")


def validate_rows(rows: list[dict], prompt_field: str, source: str) -> list[dict]:
    """Every row must be a dict with a non-empty string under ``prompt_field``; the dataset must not be empty."""
    if not rows:
        raise DataError(f"{source}: the dataset is empty; it needs at least one row with a {prompt_field!r} field.")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or prompt_field not in row:
            fields = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise DataError(
                f"{source}: row {i} has no prompt field {prompt_field!r} (its fields: {fields}); "
                "set data.prompt_field to the column that holds the prompt."
            )
        if not isinstance(row[prompt_field], str) or not row[prompt_field]:
            raise DataError(f"{source}: row {i} field {prompt_field!r} is {row[prompt_field]!r}; prompts must be non-empty strings.")
    return rows


def check_columns(rows: list[dict], needed: dict[str, list[str]], source: str = "dataset") -> None:
    """Every row has the columns of row 0 (reward functions get each column as one list over the batch) and the
    columns each reward function needs (``needed``: reward name -> its required arguments)."""
    first = set(rows[0]) if rows else set()
    for reward, columns in needed.items():
        if missing := [c for c in columns if c not in first]:
            raise DataError(f"{source}: reward {reward!r} needs column(s) {missing}, which the rows lack (row 0 "
                            f"has {sorted(first)}); add them to every row or drop that reward.")
    for i, row in enumerate(rows):
        if missing := sorted(first - set(row)):
            raise DataError(f"{source}: row {i} lacks column(s) {missing} that row 0 has; every row needs the same "
                            "columns (reward functions receive each as a list over the batch).")
