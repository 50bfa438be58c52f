"""Prompts: checking chat messages and dataset columns, rendering every prompt through the chat template and
tokenising it, before any training starts. (Loading a config's dataset: :mod:`grpo_accel.data.files`.)

A row's prompt is a string (the model reads it as is) or a list of chat messages, TRL's conversational format
``[{"role": "system" | "user" | "assistant" | "tool", "content": str}, ...]``, which goes through the
tokenizer's chat template with the generation prompt added (a ``system_prompt`` is prepended as a system
message first; a string prompt with a ``system_prompt`` becomes a system and a user message).
"""
from __future__ import annotations

import json
import logging
from dataclasses import dataclass
from typing import Callable, Mapping, Sequence

from grpo_accel.errors import UserError
from grpo_accel.rules import check_choice, setting

logger = logging.getLogger(__name__)

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
            limit, overlong = setting(names, "max_prompt_tokens"), setting(names, "overlong_prompts")
            raise DataError(f"{where} is {len(tokens)} tokens{' after the chat template' if messages else ''}, more "
                            f"than {limit}={max_tokens}; raise {limit}, shorten or drop that prompt, or set "
                            f"{overlong}=drop (such rows leave the data) or truncate_left (each keeps its last "
                            f"{max_tokens} tokens, what older TRL did with max_prompt_length).")
        texts.append(text)
        ids.append(tokens)
        conversations.append(messages)
    return Prompts(texts, ids, conversations)


def check_prompts(rows: list[dict], tokenizer, encode: Callable[..., Prompts], *, required: dict[str, list[str]],
                  max_prompt_tokens: int | None, overlong_prompts: str, prompts_per_batch: int, say: bool = True,
                  names: Mapping[str, str] | None = None) -> tuple[list[dict], Prompts]:
    """The rows a run trains on and their prompts, every one rendered, tokenised and checked before any batch:
    the columns the reward functions need (``required``, per function), each prompt within ``max_prompt_tokens``
    (``encode(rows, max_tokens=...)`` refuses a longer one naming its row; ``overlong_prompts`` may drop its row
    or keep its last tokens instead, said once), fewer rows than a batch's prompts said once (``say``: on one
    process), text the tokenizer cannot read."""
    check_columns(rows, required)
    check_choice(setting(names, "overlong_prompts"), overlong_prompts, OVERLONG, owner="GRPOCollector: ")
    encoded = encode(rows, max_tokens=max_prompt_tokens if overlong_prompts == "error" else None)
    kept, prompts, changed = (rows, encoded, []) if max_prompt_tokens is None else fit_prompts(
        rows, encoded, max_prompt_tokens, overlong_prompts, tokenizer)
    if changed and say:
        logger.warning("%s=%s: %s %d of %d rows whose prompts are longer than %s=%d tokens (row %d: %d tokens)",
                       setting(names, "overlong_prompts"), overlong_prompts,
                       "dropped" if overlong_prompts == "drop" else "kept the last tokens of", len(changed),
                       len(rows), setting(names, "max_prompt_tokens"), max_prompt_tokens, changed[0],
                       len(encoded.ids[changed[0]]))
    if rows and not kept:
        raise DataError(f"{setting(names, 'overlong_prompts')}=drop dropped every row: all {len(rows)} prompts are "
                        f"longer than {setting(names, 'max_prompt_tokens')}={max_prompt_tokens}; raise it.")
    if say and len(kept) < prompts_per_batch:
        logger.warning("%s=%d is more than the data's %d rows: every batch repeats rows (each about %.1f times), "
                       "so its groups are not independent prompts; use more rows or fewer prompts per batch",
                       setting(names, "prompts_per_batch"), prompts_per_batch, len(kept), prompts_per_batch / len(kept))
    warn_unknown_tokens(tokenizer, prompts)
    return kept, prompts


def warn_unknown_tokens(tokenizer, prompts: Prompts) -> None:
    """Prompts the model cannot read as written: text mapped to the unknown token, or dropped by the
    tokenizer (a round trip, decode(encode(text)), that loses characters)."""
    unk = getattr(tokenizer, "unk_token_id", None)
    if unk is None:
        return
    rows = [i for i, ids in enumerate(prompts.ids) if unk in ids]
    if rows:
        logger.warning("%d of %d prompts hold text the tokenizer maps to its unknown token %r (first: row %d, %r); "
                       "the model cannot read that text: use a tokenizer that covers it",
                       len(rows), len(prompts.ids), tokenizer.unk_token, rows[0], prompts.texts[rows[0]][:80])
    unknown = set(rows)
    lost = [(i, back) for i, text in enumerate(prompts.texts) if i not in unknown
            and (back := read_back(tokenizer, text)) is not None]
    if lost:  # a tokenizer that drops what it cannot encode: nothing maps to the unknown token
        row, back = lost[0]
        logger.warning("%d of %d prompts do not read back as written: the tokenizer drops text it cannot encode "
                       "(first: row %d, %r reads back as %r); the model trains on what it reads: use the model's "
                       "own tokenizer, or normalise the text (e.g. unicodedata NFKC)", len(lost), len(prompts.ids),
                       row, prompts.texts[row][:80], back[:80])


def read_back(tokenizer, text: str) -> str | None:
    """``decode(encode(text))`` when it differs from ``text`` beyond whitespace (a tokenizer that drops or changes
    characters), else None."""
    back = tokenizer.decode(tokenizer(text, add_special_tokens=False)["input_ids"], clean_up_tokenization_spaces=False)
    return None if back.split() == text.split() else back
