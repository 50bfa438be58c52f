"""The configuration reference, read from the schema: every key with its type, default and meaning (the docstring
under its field in :mod:`grpo_accel.config.schema`, :mod:`grpo_accel.config.rollout_schema` and
:mod:`grpo_accel.config.outputs`). One text serves
``grpo-accel train --help`` and the documentation's configuration page (docs/hooks.py renders it there)."""
from __future__ import annotations

import ast
import dataclasses
import functools
import inspect
import json
import textwrap
from dataclasses import dataclass

from grpo_accel.config.rollout_schema import RewardConfig
from grpo_accel.config.schema import GRPOConfig


@dataclass(frozen=True)
class Key:
    name: str  # dotted: "rollout.group_size"; a reward entry's "rewards[].weight"
    type: str  # as annotated: "int", "str | None"
    default: str  # JSON: "8", "null", "\"embedded\""
    meaning: str


@functools.cache
def field_docs(cls: type) -> dict[str, str]:
    """Field name -> the docstring written under it (``x: int = 1`` then ``\"\"\"...\"\"\"``)."""
    body = ast.parse(textwrap.dedent(inspect.getsource(cls))).body[0].body
    docs = {}
    for node, after in zip(body, body[1:]):
        if (isinstance(node, ast.AnnAssign) and isinstance(after, ast.Expr) and isinstance(after.value, ast.Constant)
                and isinstance(after.value.value, str)):
            docs[node.target.id] = " ".join(after.value.value.split())
    return docs


def _default(f: dataclasses.Field):
    return f.default_factory() if f.default_factory is not dataclasses.MISSING else f.default


def keys(cls: type = GRPOConfig, prefix: str = "") -> list[Key]:
    """Every key of ``cls`` in order, sections flattened; ``rewards`` once as a list and once per entry field."""
    out = []
    for f in dataclasses.fields(cls):
        value, doc = _default(f), field_docs(cls).get(f.name, "")
        if dataclasses.is_dataclass(value):  # a section: its own keys
            out += keys(type(value), f"{prefix}{f.name}.")
            continue
        shown = [dataclasses.asdict(v) for v in value] if f.name == "rewards" else value
        kind = str(f.type).replace("typing.", "")  # int | Literal['auto']
        out.append(Key(prefix + f.name, kind, json.dumps(shown), doc or _section_doc(f.name)))
        if f.name == "rewards":
            out += keys(RewardConfig, "rewards[].")
    return out


def _section_doc(name: str) -> str:
    return "One entry per reward function; each entry's keys are the rewards[] rows." if name == "rewards" else ""


def help_text(width: int = 116) -> str:
    """Every key as ``key=default  (type)`` with its meaning indented below: ``grpo-accel train --help``'s epilog."""
    lines = ["keys (key=default (type), then what it means; null defaults that follow the model are resolved at "
             "start):"]
    for key in keys():
        lines.append(f"  {key.name}={key.default}  ({key.type})")
        lines += textwrap.wrap(key.meaning, width, initial_indent="      ", subsequent_indent="      ",
                               break_on_hyphens=False)
    return "\n".join(lines)


def markdown() -> str:
    """A table per section (model, data, rollout, ...): key, type, default, meaning."""
    sections: dict[str, list[Key]] = {}
    for key in keys():
        head = key.name.split(".")[0] if "." in key.name else "run"
        sections.setdefault(head.removesuffix("[]"), []).append(key)
    parts = []
    for section, rows in sections.items():
        parts.append(f"## {section}\n\n| key | type | default | meaning |\n|---|---|---|---|")
        parts += [f"| `{k.name}` | `{k.type}` | `{k.default}` | {k.meaning.replace('|', '&#124;')} |" for k in rows]
        parts.append("")
    return "\n".join(parts)


def trl_markdown() -> str:
    """The three lists of :mod:`grpo_accel.config.trl.fields` as the docs' tables (docs/pages/coming-from-trl.md,
    rendered at build time)."""
    from grpo_accel.config.trl.fields import NO_EFFECT, REFUSED, TRANSLATED

    def rows(entries):
        return "\n".join(entries)

    translated = rows(f"| `{name}` | {f'`{t.key}`' if t.key else '—'} | {t.note} |" for name, t in TRANSLATED.items())
    inert = rows(f"| `{name}` | {i.why} |" for name, i in NO_EFFECT.items())
    refused = rows(f"| `{name}` | {r.why} | {', '.join(f'`{v!r}`' for v in r.harmless)} |"
                   for name, r in REFUSED.items())
    return (f"### Translated ({len(TRANSLATED)})\n\n| TRL | here | unit / note |\n|---|---|---|\n{translated}\n\n"
            f"### No effect here ({len(NO_EFFECT)})\n\nAccepted, and named once at start.\n\n| TRL | why |\n"
            f"|---|---|\n{inert}\n\n### Refused ({len(REFUSED)})\n\nOne line each, with the reason; the values "
            f"in the last column ask for nothing and are accepted.\n\n| TRL | why | accepted |\n|---|---|---|\n"
            f"{refused}\n")
