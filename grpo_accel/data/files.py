"""A config's dataset: rows from a JSONL/JSON, CSV or Parquet file, a folder written by ``datasets``' ``save_to_disk``
(one split of it) or a Hugging Face dataset id, columns renamed, every row checked; each error names the
``data.*`` setting, the file or row and the fix."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Mapping

from grpo_accel.data.prompts import DataError, check_messages

DATASET_FILES = (".jsonl", ".json", ".parquet", ".csv")


def load_rows(path: str | Path, *, name: str | None = None, split: str = "train",
              rename: Mapping[str, str] | None = None, key: str = "data.path") -> list[dict]:
    """Rows (dicts) of a dataset: a ``.jsonl`` or ``.json`` file (one object per line, or one JSON array of
    them), a ``.csv`` (a header line) or ``.parquet`` file, a folder
    written by ``datasets``' ``save_to_disk`` (its ``split`` when it holds several), or anything
    ``datasets.load_dataset(path, name, split=split)`` reads (a hub id; a folder of data files). ``rename`` maps
    the dataset's column names to the ones used here (e.g. ``{"question": "prompt"}``). ``key`` names the
    setting in errors."""
    where = f"{key}={str(path)!r}"
    local = Path(path).expanduser()
    if local.is_file():
        rows = _read_file(local, where)
    elif local.is_dir() and _is_saved_dataset(local):
        rows = _read_saved(local, split, where)
    elif local.is_dir():
        _check_data_folder(local, where)
        rows = _read_hub(str(path), name, split, where)
    elif not local.exists() and (local.suffix in DATASET_FILES or str(path).startswith(("/", ".", "~"))):
        raise DataError(f"{where}: no such file or folder (cwd {Path.cwd()}); give a JSONL or Parquet file, a "
                        "folder written by Dataset.save_to_disk, or a Hugging Face dataset id.")
    else:
        rows = _read_hub(str(path), name, split, where)
    return rename_columns(rows, rename or {}, where)


def _read_file(path: Path, where: str) -> list[dict]:
    text = path.read_text() if path.suffix in (".jsonl", ".json") else ""
    if path.suffix == ".json" and text.lstrip().startswith("["):  # one JSON array of row objects
        try:
            rows = json.loads(text)
        except json.JSONDecodeError as exc:
            raise DataError(f"{where} is not JSON ({exc}); a .json file holds one array of row objects, or one "
                            "object per line.") from exc
        if not all(isinstance(row, dict) for row in rows):
            raise DataError(f"{where} holds a JSON array whose items are not all objects; each must be one row "
                            '({"prompt": ..., ...}).')
        return rows
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for lineno, line in enumerate(text.splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where} line {lineno} is not JSON ({exc}); one object per line.") from exc
        return rows
    if path.suffix == ".csv":
        return _read_csv(path, where)
    if path.suffix == ".parquet":
        datasets = _datasets(where)
        try:
            rows = list(datasets.Dataset.from_parquet(str(path)))
        except (ValueError, OSError) as exc:  # e.g. a CSV with a header and no rows: "corresponds to no data"
            raise DataError(f"{where}: datasets could not read it ({type(exc).__name__}: {str(exc).splitlines()[0][:160]}"
                            "); a .parquet file needs at least one row.") from exc
        if not rows:
            raise DataError(f"{where} holds no rows; give a file with at least one.")
        return rows
    raise DataError(f"{where}: unknown file type {path.suffix!r}; use .jsonl, .json, .csv or .parquet, or a dataset "
                    "folder.")


def _read_csv(path: Path, where: str) -> list[dict]:
    """A CSV file's rows under its header line, read without ``datasets`` (it is plain text); a column whose every
    value is a number is read as numbers, as ``datasets`` reads it; an empty cell is None."""
    import csv

    with path.open(newline="") as handle:
        reader = csv.reader(handle, strict=True)
        try:
            lines = [(reader.line_num, cells) for cells in reader if cells]
        except csv.Error as exc:
            raise DataError(f"{where} line {reader.line_num} is not CSV ({exc}); quote cells that hold commas or "
                            "newlines.") from exc
    if len(lines) < 2:
        raise DataError(f"{where} holds {'no header' if not lines else 'a header and no rows'}; a .csv file needs a "
                        "header line (the column names) and at least one row.")
    (_, header), body = lines[0], lines[1:]
    if len(set(header)) != len(header) or not all(name.strip() for name in header):
        raise DataError(f"{where} line 1, the header {header}, has an empty or repeated column name; name each "
                        "column once.")
    for lineno, cells in body:
        if len(cells) != len(header):
            raise DataError(f"{where} line {lineno} has {len(cells)} cells, the header {len(header)}; quote cells "
                            "that hold commas, one row per line.")
    columns = [_typed([cells[i] for _, cells in body]) for i in range(len(header))]
    return [dict(zip(header, values)) for values in zip(*columns)]


def _typed(cells: list[str]) -> list:
    """One CSV column: ints, or floats, where every non-empty cell is one; else the text. Empty cells: None."""
    for kind in (int, float):
        try:
            return [kind(c) if c.strip() else None for c in cells]
        except ValueError:
            continue
    return [c if c != "" else None for c in cells]


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


DATA_FOLDER_FILES = (".jsonl", ".json", ".parquet", ".csv", ".arrow")
"""What a folder of data files holds for ``datasets.load_dataset(folder)`` (its packaged builders)."""


def _check_data_folder(folder: Path, where: str) -> None:
    """A folder that is no dataset (a model folder, one without data files) is refused before datasets reads
    it: it would fail with a long cast error over the files it found (config.json read as rows)."""
    files = [p for p in folder.rglob("*") if p.is_file()]
    if (folder / "config.json").is_file() and any(p.suffix in (".safetensors", ".bin", ".gguf") for p in files):
        raise DataError(f"{where} is a model folder (config.json and weights), not a dataset; give a JSONL or Parquet "
                        "file, a folder written by Dataset.save_to_disk, or a hub dataset id (model.name_or_path "
                        "takes model folders).")
    data = [p for p in files if p.suffix in DATA_FOLDER_FILES and p.name not in ("config.json",)]
    if not data:
        raise DataError(f"{where} is a folder with no data files ({', '.join(DATA_FOLDER_FILES)}) and no dataset "
                        "saved by Dataset.save_to_disk (dataset_dict.json or state.json); give a JSONL or Parquet "
                        "file, or such a folder.")


def _read_saved(folder: Path, split: str, where: str) -> list[dict]:
    saved = _datasets(where).load_from_disk(str(folder))
    if hasattr(saved, "keys"):  # a DatasetDict: one dataset per split
        if split not in saved:
            raise DataError(f"{where} has splits {sorted(saved)}, not {split!r}; set data.split (or data.eval_split).")
        saved = saved[split]
    return list(saved)


def _read_hub(path: str, name: str | None, split: str, where: str) -> list[dict]:
    try:
        return list(_datasets(where).load_dataset(path, name, split=split))
    except (FileNotFoundError, ValueError, ConnectionError, OSError) as exc:
        raise DataError(f"{where} (data.name={name!r}, split={split!r}): datasets could not load it "
                        f"({type(exc).__name__}: {str(exc).splitlines()[0][:200]}); give a file, a saved dataset "
                        "folder, or a hub id on a machine that reaches the hub.") from exc


def _datasets(where: str):
    try:
        import datasets  # lazy: only for Parquet files, saved folders and hub datasets
    except ImportError:
        raise DataError(f"{where} needs the `datasets` package (Parquet files, saved dataset folders and hub ids): "
                        "pip install 'grpo_accel[data]', or give a .jsonl or .csv file.") from None
    return datasets


def rename_columns(rows: list[dict], rename: Mapping[str, str], where: str) -> list[dict]:
    """Rows with the columns named in ``rename`` (dataset name -> name here) renamed; a missing one is an error."""
    if not rename:
        return rows
    first = rows[0] if rows else {}
    if missing := [src for src in rename if src not in first]:
        raise DataError(f"{where}: data.rename_columns names {missing}, which the rows lack (row 0 has "
                        f"{sorted(first)}); map existing columns, e.g. {{question: prompt}}.")
    return [{rename.get(k, k): v for k, v in row.items()} for row in rows]


def transform_rows(rows: list[dict], transform: Callable[[dict], dict], name: str, where: str) -> list[dict]:
    """Each row through ``transform`` (``data.row_transform``, called ``name``): it must return a dict."""
    out = []
    for i, row in enumerate(rows):
        try:
            new = transform(dict(row))
        except Exception as exc:
            raise DataError(f"{where}: data.row_transform={name!r} failed on row {i} ({type(exc).__name__}: {exc}); "
                            "fix the function.") from exc
        if not isinstance(new, dict):
            raise DataError(f"{where}: data.row_transform={name!r} returned {type(new).__name__} for row {i}; it must "
                            "return the row as a dict.")
        out.append(new)
    return out


def extract_answers(rows: list[dict], field: str, answer_format: str, where: str) -> list[dict]:
    """Rows whose ``field`` holds the reference answer alone (:func:`grpo_accel.rewards.reference_answer` of
    ``answer_format``); "plain" leaves the rows as they are."""
    from grpo_accel.rewards import reference_answer

    if answer_format == "plain":
        return rows
    out = []
    for i, row in enumerate(rows):
        if field not in row:
            raise DataError(f"{where}: row {i} has no answer column {field!r} (its fields: {sorted(row)}) for "
                            f"data.answer_format={answer_format}; set data.answer_field to the column holding it.")
        try:
            out.append({**row, field: reference_answer(row[field], answer_format)})
        except ValueError as exc:
            raise DataError(f"{where}: row {i} column {field!r} ({str(row[field])[-80:]!r}) {exc}, which "
                            f"data.answer_format={answer_format} reads; choose the format the column is written in "
                            "(plain, gsm8k, boxed) or a data.row_transform.") from None
    return out


def validate_rows(rows: list[dict], prompt_field: str, source: str) -> list[dict]:
    """Every row is a dict whose ``prompt_field`` holds a non-empty string or a list of chat messages; the
    dataset is not empty."""
    if not rows:
        raise DataError(f"{source}: the dataset is empty; it needs at least one row with a {prompt_field!r} field.")
    for i, row in enumerate(rows):
        if not isinstance(row, dict) or prompt_field not in row:
            fields = sorted(row) if isinstance(row, dict) else type(row).__name__
            raise DataError(
                f"{source}: row {i} has no prompt field {prompt_field!r} (its fields: {fields}); "
                "set data.prompt_field to the column that holds the prompt (or data.rename_columns)."
            )
        prompt = row[prompt_field]
        if isinstance(prompt, list):
            check_messages(prompt, f"{source}: row {i}, column {prompt_field!r},")
        elif not isinstance(prompt, str) or not prompt:
            raise DataError(f"{source}: row {i} column {prompt_field!r} is {prompt!r}; a prompt is a non-empty "
                            "string or a list of chat messages [{role, content}].")
    return rows
