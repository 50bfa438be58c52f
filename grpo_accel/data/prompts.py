"""Prompts: checking chat messages and dataset columns, rendering every prompt through the chat template and
tokenising it, before any training starts. (Loading a config's dataset: :mod:`grpo_accel.data.files`.)

A row's prompt is a string (the model reads it as is) or a list of chat messages, TRL's conversational format
``[{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]``, which goes through the
tokenizer's chat template with the generation prompt added (a ``system_prompt`` is prepended as a system
message first; a string prompt with a ``system_prompt`` becomes a system and a user message).
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from grpo_accel.errors import UserError
from grpo_accel.rules import setting

ROLES = ("system", "user", "assistant", "tool")


class DataError(UserError, ValueError):
    """A dataset cannot be trained on; the message names the file or row, the column and the fix."""


def is_chat_message(m) -> bool:
    """``{"role": one of ROLES, "content": a string}``."""
    return isinstance(m, dict) and m.get("role") in ROLES and isinstance(m.get("content"), str)


def check_messages(messages: list, where: str) -> None:
    """A prompt's chat messages: a non-empty list of ``{role, content}``, not all empty besides the system's."""
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


OVERLONG = ("error", "drop", "truncate_left")
"""What to do with a prompt longer than its limit: refuse it (naming the row), drop its row (verl's
filter_overlong_prompts), or keep its last tokens."""


def fit_prompts(rows: list[dict], prompts: Prompts, max_tokens: int, policy: str,
                tokenizer) -> tuple[list[dict], Prompts, list[int]]:
    """(rows, prompts, the rows it changed) with every prompt longer than ``max_tokens`` dropped or, for
    "truncate_left", cut to its last ``max_tokens`` tokens (its text then the decoded tail; its messages stay whole
    for the reward functions). "error" changes nothing (:func:`encode_prompts` refused them already)."""
    over = [i for i, ids in enumerate(prompts.ids) if len(ids) > max_tokens]
    if policy == "error" or not over:
        return rows, prompts, over
    overlong = set(over)
    if policy == "drop":
        kept = [i for i in range(len(rows)) if i not in overlong]
        return [rows[i] for i in kept], prompts.take(kept), over
    ids = [row[-max_tokens:] for row in prompts.ids]
    texts = [tokenizer.decode(ids[i]) if i in overlong else text for i, text in enumerate(prompts.texts)]
    return rows, Prompts(texts, ids, prompts.messages), over


def chat_messages(prompt: str | list[dict], system_prompt: str | None) -> list[dict] | None:
    """The conversation of a chat prompt, ``system_prompt`` first unless it starts with its own; a text prompt with
    a ``system_prompt`` is a system and a user message (as TRL-based recipe scripts make them: open-r1's
    ``make_conversation``); None for text alone."""
    if isinstance(prompt, str):
        return None if system_prompt is None else [{"role": "system", "content": system_prompt},
                                                   {"role": "user", "content": prompt}]
    if system_prompt is None or prompt[0]["role"] == "system":
        return list(prompt)
    return [{"role": "system", "content": system_prompt}, *prompt]


def tools_system_prompt(schemas: list[dict], open_tag: str = "<tool_call>", close_tag: str = "</tool_call>") -> str:
    """What a chat template without tool support is given instead, in the system message: the tools' schemas
    and how to call them (the tagged format :class:`grpo_accel.rollout.tools.TaggedCallParser` reads)."""
    lines = "\n".join(json.dumps(s["function"]) for s in schemas)
    return (f"You can call these tools:\n{lines}\nTo call one, reply with {open_tag}"
            f'{{"name": "<tool>", "arguments": {{...}}}}{close_tag}; its result comes back as a tool message.')


def render_chat(tokenizer, messages: list[dict], tools: list[dict] | None = None,
                add_generation_prompt: bool = True) -> str:
    """The chat template's text of ``messages``. ``tools`` (function schemas) go to the template as ``tools=``
    when it uses them; a template that does not (SmolLM2's) gets them as text in the system message instead
    (:func:`tools_system_prompt`), so that the model always sees them."""
    if tools and "tools" not in (tokenizer.chat_template or ""):
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
                   start: Callable[[dict], list[dict]] | None = None,
                   names: Mapping[str, str] | None = None) -> Prompts:
    """Render and tokenise every row's prompt; an error names the first row that cannot be trained on.

    ``start(row)`` gives a row's first messages instead of its ``prompt_field`` (an environment's ``reset``);
    ``tools`` are function schemas shown to the model (see :func:`render_chat`); ``names`` says what the messages
    call ``max_tokens`` (:func:`grpo_accel.rules.setting`; default ``max_prompt_tokens``)."""
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
                                "chat model's tokenizer or give prompts as plain strings.")
            if start is not None:  # the environment's reset() wrote them, not a dataset column
                check_messages(messages, f"{getattr(start, '__qualname__', 'the environment reset')}() for {source} "
                                         f"row {i} returned messages that are not a conversation:")
            text = render_chat(tokenizer, messages, tools)
            tokens = tokenizer(text, add_special_tokens=False)["input_ids"]  # the template writes its own
        if not tokens:
            raise DataError(f"{where} encodes to no tokens; check the tokenizer (the model's own?) or drop that row.")
        if max_tokens is not None and len(tokens) > max_tokens:
            limit = setting(names, "max_prompt_tokens")
            raise DataError(f"{where} is {len(tokens)} tokens{' after the chat template' if messages else ''}, more "
                            f"than {limit}={max_tokens}; raise {limit} or drop/shorten that prompt.")
        texts.append(text)
        ids.append(tokens)
        conversations.append(messages)
    return Prompts(texts, ids, conversations)
