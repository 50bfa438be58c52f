"""Prompt datasets: loading files, saved folders and hub datasets; rendering and checking every prompt before
any training starts.

A row's prompt is a string (the model reads it as is) or a list of chat messages, TRL's conversational format
``[{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]``, which goes through the
tokenizer's chat template with the generation prompt added (``data.system_prompt`` is prepended as a system
message first).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Callable, Mapping, Sequence

ROLES = ("system", "user", "assistant", "tool")
DATASET_FILES = (".jsonl", ".json", ".parquet")


class DataError(ValueError):
    """A dataset cannot be trained on; the message names the file or row, the column and the fix."""


# ------------------------------------------------------------------------------------------------ loading


def load_rows(path: str | Path, *, name: str | None = None, split: str = "train",
              rename: Mapping[str, str] | None = None, key: str = "data.path") -> list[dict]:
    """Rows (dicts) of a dataset: a ``.jsonl``/``.json`` (one object per line) or ``.parquet`` file, a folder
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
    elif not local.exists() and (local.suffix in DATASET_FILES or str(path).startswith(("/", ".", "~"))):
        raise DataError(f"{where}: no such file or folder (cwd {Path.cwd()}); give a JSONL or Parquet file, a "
                        "folder written by Dataset.save_to_disk, or a Hugging Face dataset id.")
    else:
        rows = _read_hub(str(path), name, split, where)
    return rename_columns(rows, rename or {}, where)


def _read_file(path: Path, where: str) -> list[dict]:
    if path.suffix in (".jsonl", ".json"):
        rows = []
        for lineno, line in enumerate(path.read_text().splitlines(), start=1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as exc:
                    raise DataError(f"{where} line {lineno} is not JSON ({exc}); one object per line.") from exc
        return rows
    if path.suffix == ".parquet":
        return list(_datasets(where).Dataset.from_parquet(str(path)))
    raise DataError(f"{where}: unknown file type {path.suffix!r}; use .jsonl or .parquet, or a dataset folder.")


def _is_saved_dataset(folder: Path) -> bool:
    return (folder / "dataset_dict.json").is_file() or (folder / "state.json").is_file()


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
    except ImportError as exc:
        raise ImportError(f"{where} needs the `datasets` package: pip install 'grpo_accel[data]'.") from exc
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


# ----------------------------------------------------------------------------------------------- checking


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
            _check_messages(prompt, f"{source}: row {i}, column {prompt_field!r},")
        elif not isinstance(prompt, str) or not prompt:
            raise DataError(f"{source}: row {i} column {prompt_field!r} is {prompt!r}; a prompt is a non-empty "
                            "string or a list of chat messages [{role, content}].")
    return rows


def is_chat_message(m) -> bool:
    """``{"role": one of ROLES, "content": a string}``."""
    return isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)


def _check_messages(messages: list, where: str) -> None:
    if not messages:
        raise DataError(f"{where} is an empty list of messages; give at least one user message.")
    for j, m in enumerate(messages):
        if not is_chat_message(m):
            raise DataError(f"{where} message {j} is {m!r}; each message is {{'role': one of {list(ROLES)}, "
                            "'content': a string}.")
    if not any(m["content"].strip() for m in messages if m["role"] != "system"):
        raise DataError(f"{where} has only empty messages besides the system prompt; the model would be asked "
                        "nothing: give the user message its text or drop that row.")


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


# ---------------------------------------------------------------------------------------------- rendering


@dataclass(frozen=True)
class Prompts:
    """Every row's prompt as the model reads it, rendered and tokenised once.

    ``texts[i]``: the prompt text (a string prompt as is; chat messages through the chat template);
    ``ids[i]``: its token ids; ``messages[i]``: the chat messages (system prompt included), None for a string.
    """

    texts: list[str]
    ids: list[list[int]]
    messages: list[list[dict] | None]

    def take(self, indices: Sequence[int]) -> "Prompts":
        return Prompts([self.texts[i] for i in indices], [self.ids[i] for i in indices],
                       [self.messages[i] for i in indices])


def chat_messages(prompt: str | list[dict], system_prompt: str | None) -> list[dict] | None:
    """The conversation of a chat prompt, ``system_prompt`` first unless it starts with its own; None for text."""
    if isinstance(prompt, str):
        return None
    if system_prompt is None or prompt[0]["role"] == "system":
        return list(prompt)
    return [{"role": "system", "content": system_prompt}, *prompt]


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The chat template's text of ``messages``. ``tools`` (function schemas) go to the template as ``tools=``
    when it uses them; a template that does not (SmolLM2's) gets them as text in the system message instead
    (:func:`grpo_accel.tools.tools_system_prompt`), so that the model always sees them."""
    if tools and "tools" not in (tokenizer.chat_template or ""):
        from grpo_accel.tools import tools_system_prompt

        text = tools_system_prompt(tools)
        if messages and messages[0]["role"] == "system":
            messages = [{"role": "system", "content": f"{messages[0]['content']}\n\n{text}"}, *messages[1:]]
        else:
            messages = [{"role": "system", "content": text}, *messages]
        tools = None
    return tokenizer.apply_chat_template(messages, tools=tools or None, add_generation_prompt=add_generation_prompt,
                                         tokenize=False)


def encode_prompts(rows: list[dict], tokenizer, *, prompt_field: str = "prompt", system_prompt: str | None = None,
                   max_tokens: int | None = None, source: str = "dataset", tools: list[dict] | None = None,
                   start: Callable[[dict], list[dict]] | None = None) -> Prompts:
    """Render and tokenise every row's prompt; an error names the first row that cannot be trained on.

    ``start(row)`` gives a row's first messages instead of its ``prompt_field`` (an environment's ``reset``);
    ``tools`` are function schemas shown to the model (see :func:`render_chat`)."""
    texts, ids, conversations = [], [], []
    for i, row in enumerate(rows):
        messages = start(row) if start is not None else chat_messages(row[prompt_field], system_prompt)
        where = f"{source} row {i}: column {prompt_field!r}"
        if messages is None:
            text = row[prompt_field]
            tokens = tokenizer(text)["input_ids"]
        else:
            if getattr(tokenizer, "chat_template", None) is None:
                raise DataError(f"{where} is a list of chat messages, but the tokenizer has no chat template; use a "
                                "chat model's folder (model.name_or_path) or give prompts as plain strings.")
            if start is not None:
                _check_messages(messages, f"{where}: the environment's first messages")
            text = render_chat(tokenizer, messages, tools)
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own
        if not tokens:
            raise DataError(f"{where} encodes to no tokens; check the tokenizer (model.name_or_path) or drop that row.")
        if max_tokens is not None and len(tokens) > max_tokens:
            raise DataError(f"{where} is {len(tokens)} tokens{' after the chat template' if messages else ''}, more "
                            f"than rollout.max_prompt_tokens={max_tokens}; raise rollout.max_prompt_tokens or "
                            "drop/shorten that prompt.")
        texts.append(text)
        ids.append(tokens)
        conversations.append(messages)
    return Prompts(texts, ids, conversations)
