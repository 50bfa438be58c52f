"""Tools for multi-turn episodes: a Python function becomes a tool, a model turn's text becomes tool calls, a
call becomes a tool message.

A tool is a plain function with a docstring and annotated arguments; :func:`tool_schema` turns it into the
OpenAI-style JSON schema that chat templates take as ``tools=``. :class:`TaggedCallParser` reads calls written
as ``<tool_call>{"name": ..., "arguments": {...}}</tool_call>`` (the Qwen / Hermes / SmolLM format); any object
with the same ``parse(text)`` replaces it. :class:`ToolRunner` runs calls on a thread pool with a time limit each,
and every failure (an unknown tool, bad JSON, wrong arguments, an exception, a timeout) comes back as the text of
a tool message, never as an exception: the model reads it and can try again.

Example:
    >>> def add(a: int, b: int) -> int:
    ...     '''Add two integers.'''
    ...     return a + b
    >>> tool_schema(add)["function"]["parameters"]["properties"]
    {'a': {'type': 'integer'}, 'b': {'type': 'integer'}}
    >>> TaggedCallParser().parse('<tool_call>{"name": "add", "arguments": {"a": 1, "b": 2}}</tool_call>')
    [ToolCall(name='add', arguments={'a': 1, 'b': 2}, error=None)]
"""
from __future__ import annotations

import concurrent.futures
import inspect
import json
import re
import threading
from dataclasses import dataclass, field
from typing import Callable, Protocol, Sequence

JSON_TYPES = {str: "string", int: "integer", float: "number", bool: "boolean", list: "array", dict: "object"}


def tool_schema(fn: Callable) -> dict:
    """The function-calling schema of ``fn``: its name, its docstring's first paragraph, one property per
    argument (typed from its annotation; arguments without a default are required)."""
    doc = inspect.getdoc(fn)
    if not doc:
        raise ValueError(f"tool {fn.__name__!r} has no docstring; the model learns what a tool does from it: add one.")
    properties, required = {}, []
    for name, p in inspect.signature(fn).parameters.items():
        annotation = p.annotation if not isinstance(p.annotation, str) else _BUILTIN_NAMES.get(p.annotation)
        properties[name] = {"type": JSON_TYPES[annotation]} if annotation in JSON_TYPES else {}
        if p.default is p.empty:
            required.append(name)
    return {"type": "function", "function": {
        "name": fn.__name__, "description": doc.split("\n\n")[0].replace("\n", " "),
        "parameters": {"type": "object", "properties": properties, "required": required}}}


_BUILTIN_NAMES = {t.__name__: t for t in JSON_TYPES}  # annotations written as strings (from __future__ import)


@dataclass
class ToolCall:
    """A call read from a model turn; ``error`` says why it cannot be run (then ``name`` may be empty)."""

    name: str
    arguments: dict = field(default_factory=dict)
    error: str | None = None


class CallParser(Protocol):
    def parse(self, text: str) -> list[ToolCall]: ...


class TaggedCallParser:
    """Calls written as ``<tool_call>{"name": str, "arguments": {...}}</tool_call>``, any number per turn."""

    def __init__(self, open_tag: str = "<tool_call>", close_tag: str = "</tool_call>") -> None:
        self.open_tag, self.close_tag = open_tag, close_tag
        self._pattern = re.compile(re.escape(open_tag) + r"(.*?)(?:" + re.escape(close_tag) + r"|$)", re.DOTALL)

    def parse(self, text: str) -> list[ToolCall]:
        calls = []
        for body in self._pattern.findall(text):
            try:
                call = json.loads(body)
            except json.JSONDecodeError as exc:
                calls.append(ToolCall("", error=f"the call is not valid JSON ({exc.msg} at character {exc.pos})"))
                continue
            if not (isinstance(call, dict) and isinstance(call.get("name"), str)
                    and isinstance(call.get("arguments", {}), dict)):
                calls.append(ToolCall("", error='a call is {"name": "<tool>", "arguments": {...}}'))
                continue
            calls.append(ToolCall(call["name"], call.get("arguments", {})))
        return calls


class ToolRunner:
    """Runs tool calls on one thread pool that every runner of the process shares (``MAX_WORKERS`` threads,
    started on first use), each call limited to ``timeout_s`` seconds; a runner is cheap to make per episode.

    Calls given together run concurrently and share one deadline. A call that times out is answered with an
    error; its thread runs on to its end (Python cannot stop a thread), so tools that may hang should limit
    themselves too.
    """

    MAX_WORKERS = 32
    _pool: concurrent.futures.ThreadPoolExecutor | None = None
    _pool_lock = threading.Lock()

    def __init__(self, tools: Sequence[Callable], timeout_s: float = 10.0) -> None:
        self.tools = {fn.__name__: fn for fn in tools}
        self.timeout_s = timeout_s

    def run(self, calls: Sequence[ToolCall]) -> list[tuple[str, bool]]:
        """One (tool message text, failed) per call, in order; failures are texts starting with "error:"."""
        futures = [self._submit(call) for call in calls]
        concurrent.futures.wait([f for f in futures if f is not None], timeout=self.timeout_s)
        return [self._answer(call, future) for call, future in zip(calls, futures)]

    @classmethod
    def _shared_pool(cls) -> concurrent.futures.ThreadPoolExecutor:
        with cls._pool_lock:
            if ToolRunner._pool is None:
                ToolRunner._pool = concurrent.futures.ThreadPoolExecutor(cls.MAX_WORKERS, thread_name_prefix="grpo-tool")
            return ToolRunner._pool

    def _submit(self, call: ToolCall) -> concurrent.futures.Future | None:
        if call.error is None and call.name not in self.tools:
            call.error = f"there is no tool {call.name!r}; the tools are {sorted(self.tools)}"
        return None if call.error is not None else self._shared_pool().submit(self.tools[call.name], **call.arguments)

    def _answer(self, call: ToolCall, future: concurrent.futures.Future | None) -> tuple[str, bool]:
        if future is None:
            return f"error: {call.error}", True
        if not future.done():
            future.cancel()
            return f"error: {call.name} timed out after {self.timeout_s:g} s", True
        try:
            value = future.result()
        except Exception as exc:  # a tool's failure is the model's to read, not a crash
            return f"error: {call.name} raised {type(exc).__name__}: {exc}", True
        return (value if isinstance(value, str) else json.dumps(value)), False
