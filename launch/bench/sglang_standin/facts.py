"""Facts of one SGLang release that live in code paths needing a GPU, read from its source (``source.py`` fetches
and holds the files): session guards, idle tests, limits, what /server_info carries, model classes."""
from __future__ import annotations

import ast
import functools
import os
import re
from dataclasses import dataclass


@dataclass(frozen=True)
class SessionGuard:
    refuse_when: str  # "open" or "closed": the session state in which the call is refused
    message: str


class SourceFacts:
    """Mixed into ``SGLangSource``: ``text(rel)``, ``has(rel)`` and ``root`` come from it."""

    @functools.cached_property
    def version_string(self) -> str:
        namespace: dict = {}
        exec(self.text("sglang/_version.py"), namespace)  # what /server_info reports as "version"
        return namespace["__version__"]

    @functools.cached_property
    def sampling_param_names(self) -> set[str]:
        tree = ast.parse(self.text("sglang/srt/sampling/sampling_params.py"))
        init = next(n for c in tree.body if isinstance(c, ast.ClassDef) and c.name == "SamplingParams"
                    for n in c.body if isinstance(n, ast.FunctionDef) and n.name == "__init__")
        return {a.arg for a in init.args.args + init.args.kwonlyargs} - {"self"}

    @functools.cached_property
    def session_guards(self) -> dict[str, SessionGuard]:
        """Scheduler methods that refuse a call by the weight-update session's state (0.5.21+), with SGLang's
        message: ``if self._session is None: return ...(success=False, message=...)``."""
        rel = "sglang/srt/managers/scheduler_components/weight_updater.py"
        if not self.has(rel):
            return {}
        guards = {}
        for node in ast.walk(ast.parse(self.text(rel))):
            if not isinstance(node, ast.FunctionDef) or not node.body:
                continue
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant):  # docstring
                first = node.body[1] if len(node.body) > 1 else None
            if not (isinstance(first, ast.If) and isinstance(first.test, ast.Compare)
                    and ast.unparse(first.test.left) == "self._session"
                    and isinstance(first.test.comparators[0], ast.Constant) and first.test.comparators[0].value is None):
                continue
            call = first.body[0].value if isinstance(first.body[0], ast.Return) else None
            message = next((ast.literal_eval(k.value) for k in getattr(call, "keywords", []) if k.arg == "message"), "")
            state = "closed" if isinstance(first.test.ops[0], ast.Is) else "open"
            guards[node.name] = SessionGuard(state, message)
        return guards

    @functools.cached_property
    def total_tokens_refused_at(self) -> str:
        """How ``TokenizerManager._validate_one_request`` (srt/managers/tokenizer_manager.py) compares prompt +
        max_new_tokens with the context length: ">=" (0.5.9: a request must stay below it) or ">" (0.5.23: it may
        fill it). A prompt alone is refused at ``>=`` in both."""

        match = re.search(r"\(max_new_tokens \+ input_token_num\) (>=|>) _max_req_len",
                          self.text("sglang/srt/managers/tokenizer_manager.py"))
        if match is None:
            raise RuntimeError(f"SGLang {self.version}: the context-length rule is not where it was")
        return match.group(1)

    @functools.cached_property
    def idle_counts_waiting(self) -> bool:
        """Whether "idle" (a memory release's assertion, a flush) counts the waiting queue: 0.5.23's
        ``is_fully_idle(ignore_waiting=<paused>)`` (scheduler_components/weight_updater.py) does, 0.5.9's
        ``_is_no_request()`` (scheduler_update_weights_mixin.py) looks at the running batch alone."""
        for rel in ("sglang/srt/managers/scheduler_components/weight_updater.py",
                    "sglang/srt/managers/scheduler_update_weights_mixin.py"):
            if self.has(rel):
                release = _function_text(self.text(rel), "release_memory_occupation")
                if "is_fully_idle(" in release:
                    return True
                if "_is_no_request()" in release:
                    return False
        raise RuntimeError(f"SGLang {self.version}: the memory release's idle check is not where it was")

    @functools.cached_property
    def release_idle_message(self) -> str:
        """The assertion message of a memory release while requests run."""

        for rel in ("sglang/srt/managers/scheduler_components/weight_updater.py",
                    "sglang/srt/managers/scheduler_update_weights_mixin.py"):
            if self.has(rel):
                match = re.search(r'"(release_memory_occupation should be called only when [^"]*)"', self.text(rel))
                if match:
                    return match.group(1)
        raise RuntimeError(f"SGLang {self.version}: the memory release's assertion is not where it was")

    @functools.cached_property
    def health_check_held_while(self) -> frozenset[str]:
        """What makes a scheduler hold a health check's one-token generation back instead of running it (it answers
        the check at its next batch result, ``return_health_check_ct``; an idle scheduler never has one), read from
        srt/managers/scheduler.py ``process_input_requests``: "running" (a running batch), "waiting" (a waiting
        request), "released" (a released memory tag). 0.5.9: running or released (``len(self.offload_tags) > 0``);
        0.5.23: anything short of ``is_fully_idle(for_health_check=True)``, running or waiting, released memory not
        counted (a check on an idle server with its memory released runs on freed memory)."""
        text = _function_text(self.text("sglang/srt/managers/scheduler.py"), "process_input_requests")
        start = text.find("is_health_check_generate_req(recv_req)")
        branch = text[start : text.find("continue", start)]
        held = {"running"} if "running_batch.is_empty()" in branch else set()
        held |= {"running", "waiting"} if "is_fully_idle(" in branch else set()
        held |= {"released"} if "offload_tags" in branch else set()
        if start < 0 or not held:
            raise RuntimeError(f"SGLang {self.version}: the health check's skip rule is not where it was")
        return frozenset(held)

    @functools.cached_property
    def health_check_timeout_s(self) -> int:
        """``HEALTH_CHECK_TIMEOUT`` (srt/entrypoints/http_server.py): how long /health waits for the scheduler before
        it answers 503; the environment's ``SGLANG_HEALTH_CHECK_TIMEOUT``, else the default written there."""
        match = re.search(r'HEALTH_CHECK_TIMEOUT = int\(os\.getenv\("SGLANG_HEALTH_CHECK_TIMEOUT", (\d+)\)\)',
                          self.text("sglang/srt/entrypoints/http_server.py"))
        if match is None:
            raise RuntimeError(f"SGLang {self.version}: HEALTH_CHECK_TIMEOUT is not where it was")
        return int(os.environ.get("SGLANG_HEALTH_CHECK_TIMEOUT", match.group(1)))

    @functools.cached_property
    def dp_attention_is_attn_dp(self) -> bool:
        """0.5.23 resolves ``--dp-size N --enable-dp-attention`` to ``attn_dp_size=N, dp_size=1`` and reports
        ``enable_dp_attention`` from the width (srt/arg_groups/parallel_hook.py ``handle_deprecated_dp_attention``,
        srt/server_args.py ``resolved_dict``); 0.5.9 reports the flags as given."""
        rel = "sglang/srt/arg_groups/parallel_hook.py"
        return self.has(rel) and "def handle_deprecated_dp_attention" in self.text(rel)

    @functools.cached_property
    def reports_startup_time(self) -> bool:
        """``/server_info`` carries ``startup_time`` (0.5.23); 0.5.9 has its server args alone (``random_seed`` is
        drawn at each start unless given)."""
        text = self.text("sglang/srt/entrypoints/http_server.py")
        return '"startup_time"' in _function_text(text, "server_info")

    @functools.cached_property
    def weights_by_name_architectures(self) -> set[str]:
        """Model classes (srt/models/*.py) that implement ``get_weights_by_name`` themselves or by inheritance.

        Only files that name a class already known to implement it are parsed, until no file adds one."""
        texts = {p: p.read_text(encoding="utf-8-sig") for p in (self.root / "sglang/srt/models").glob("*.py")}
        supported: set[str] = set()
        pending = [p for p, t in texts.items() if "def get_weights_by_name" in t]
        parsed: set = set()
        while pending:
            path = pending.pop()
            parsed.add(path)
            for node in ast.parse(texts[path]).body:
                if not isinstance(node, ast.ClassDef):
                    continue
                bases = {b.id for b in node.bases if isinstance(b, ast.Name)}
                defines = any(isinstance(f, ast.FunctionDef) and f.name == "get_weights_by_name" for f in node.body)
                if (defines or bases & supported) and node.name not in supported:
                    supported.add(node.name)
                    pending += [p for p, t in texts.items() if p not in parsed and p not in pending and node.name in t]
        return supported


def _function_text(source: str, name: str) -> str:
    """The source of the first function (or method) called ``name``."""
    node = next((n for n in ast.walk(ast.parse(source)) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
                 and n.name == name), None)
    return ast.get_source_segment(source, node) if node is not None else ""
