"""Rewards beyond a Python function in the trainer's thread: time-limited functions in worker processes
(:class:`TimedReward`), reward services over HTTP (:class:`RemoteReward`) and sequence-classification reward
models (:class:`RewardModel`). Each is a reward function, ``fn(prompts, completions, **fields) -> floats``, that
:class:`~grpo_accel.rewards.RewardSet` calls like any other; each may have a ``fallback``: the value of a call
that fails or overruns (None: the failure stops the run, naming the reward).

Faults are counted per completion in ``faults`` (``{"timeouts": [...], "errors": [...]}`` of the last call), which
RewardSet returns beside the rewards so that the trainer logs ``train/reward/<name>_timeouts`` / ``_errors``.
Messages name each setting as ``names`` says (:func:`grpo_accel.rules.setting`; the recipe passes the config's
``rewards[name=...].<key>``).
"""
from __future__ import annotations

import json
import logging
import math
import multiprocessing
import multiprocessing.connection
import os
import time
from pathlib import Path
from typing import Callable, Mapping

from grpo_accel.errors import UserError
from grpo_accel.rewards.calling import call_reward, per_completion
from grpo_accel.rules import setting

logger = logging.getLogger(__name__)


class RewardFault(UserError, RuntimeError):
    """A reward source failed with no fallback set; the message names the reward and its setting."""


class RewardSource:
    """What the rewards here share beyond a function's call: the ``faults`` of their last call, per completion
    (``{"timeouts": [...], "errors": [...]}``), and ``close()`` (stop what they hold; nothing by default). A source
    that wraps a function (``fn``) takes what that function takes; the others read text (``reads_text``)."""

    faults: dict[str, list[int]] = {"timeouts": [], "errors": []}  # replaced (never changed) by each call
    reads_text = False

    def close(self) -> None:
        """Stop what the reward holds (worker processes), once training is over."""


class AsyncReward(RewardSource):
    """An ``async def`` reward function with a time limit per call (the batch): a call over ``timeout_s`` gives
    every completion ``fallback`` (counted as timeouts), or raises :class:`RewardFault` when it is None."""

    def __init__(self, name: str, fn: Callable, *, timeout_s: float | None = None,
                 fallback: float | None = None, names: Mapping[str, str] | None = None) -> None:
        import inspect

        self.name, self.fn, self.timeout_s, self.fallback, self.names = name, fn, timeout_s, fallback, names
        self.__signature__ = inspect.signature(fn)

    async def __call__(self, prompts: list[str], completions: list[str], **fields) -> list[float]:
        import asyncio

        n = len(completions)
        try:
            values = await asyncio.wait_for(call_reward(self.fn, {"prompts": prompts, "completions": completions,
                                                                  **fields}), self.timeout_s)
        except asyncio.TimeoutError:
            if self.fallback is None:
                raise RewardFault(f"reward function {self.name!r} took more than {self.timeout_s:g} s "
                                  f"({setting(self.names, 'timeout_s')}); speed it up, raise the limit, or set "
                                  f"{setting(self.names, 'fallback')}.") from None
            self.faults = {"timeouts": [1] * n, "errors": [0] * n}
            return [float(self.fallback)] * n
        self.faults = {"timeouts": [0] * n, "errors": [0] * n}
        return values


def is_finite_number(value) -> bool:
    """Whether ``value`` is a finite real number, as a reward must be: an int, float, bool (0 or 1), numpy or
    one-element torch number; not a string, even one that reads as a number (``"1.0"`` is a bug upstream)."""
    if isinstance(value, (str, bytes)):
        return False
    try:
        return math.isfinite(float(value))
    except (TypeError, ValueError):
        return False


# ---------------------------------------------------------------------------------- time-limited functions


def _serve(conn, fn: Callable) -> None:
    """A worker: score one completion per message until the pipe closes."""
    while True:
        try:
            prompt, completion, fields = conn.recv()
        except EOFError:
            return
        try:
            value = list(call_reward(fn, {"prompts": [prompt], "completions": [completion], **fields}))
            conn.send(("ok", value[0] if len(value) == 1 else f"{len(value)} values for one completion"))
        except Exception as exc:  # noqa: BLE001 - reported to the trainer, which decides
            conn.send(("error", f"{type(exc).__name__}: {exc}"))


def _row(fields: dict, row: int, n: int) -> dict:
    """Row ``row`` of the per-completion fields for a worker process, and the values for all (the trainer's state);
    not what cannot cross to another process (log_extra, log_metric: a worker's calls are not logged)."""
    shared = {k: v for k, v in fields.items() if not callable(v)}
    return {**shared, **{k: v[row : row + 1] for k, v in per_completion(fields, n).items()}}


class _Worker:
    def __init__(self, fn: Callable) -> None:
        ctx = multiprocessing.get_context("spawn")  # no fork of a process that holds threads and torch state
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_serve, args=(child, fn), daemon=True, name="grpo-reward")
        self.proc.start()
        child.close()

    def stop(self) -> None:
        self.proc.kill()
        self.proc.join()
        self.conn.close()


class TimedReward(RewardSource):
    """``fn`` run one completion at a time in ``processes`` worker processes, each call limited to ``timeout_s``.

    A call that overruns (its worker is killed and replaced) or raises (or whose worker dies) gives ``fallback``
    and is counted; with ``fallback`` None it raises :class:`RewardFault` naming the reward and the completion.
    The workers start at the first call; :meth:`close` stops them (the trainer's recipe calls it at the end).

    Example:
        >>> reward = TimedReward("verify", slow_verify, processes=4, timeout_s=5.0, fallback=0.0)
        >>> reward(prompts, completions, answer=answers)   # one float per completion, within ~5 s per call
    """

    def __init__(self, name: str, fn: Callable, *, processes: int = 1, timeout_s: float = 10.0,
                 fallback: float | None = None, names: Mapping[str, str] | None = None) -> None:
        import inspect

        self.name, self.fn, self.processes, self.timeout_s, self.fallback = name, fn, processes, timeout_s, fallback
        self.names = names
        self.__signature__ = inspect.signature(fn)  # the columns it needs are checked at start as the function's
        self._workers: list[_Worker] = []

    def __call__(self, prompts: list[str], completions: list[str], **fields) -> list[float]:
        n = len(completions)
        while len(self._workers) < min(self.processes, n):
            self._workers.append(_Worker(self.fn))
        values: list = [None] * n
        timeouts, errors = [0] * n, [0] * n
        todo, busy = list(range(n)), {}  # worker index -> (row, deadline)
        while todo or busy:
            for w in range(len(self._workers)):
                if w not in busy and todo:
                    row = todo.pop(0)
                    self._workers[w].conn.send((prompts[row], completions[row], _row(fields, row, n)))
                    busy[w] = (row, time.monotonic() + self.timeout_s)
            wait_s = max(0.0, min(deadline for _, deadline in busy.values()) - time.monotonic())
            ready = multiprocessing.connection.wait([self._workers[w].conn for w in busy], timeout=wait_s)
            for w, (row, deadline) in list(busy.items()):
                conn = self._workers[w].conn
                if conn in ready:
                    try:
                        status, value = conn.recv()
                    except EOFError:  # the worker died (a crash in the function)
                        status, value = "error", f"its worker process died (exit {self._workers[w].proc.exitcode})"
                        self._replace(w)
                    del busy[w]
                    if status == "ok" and (value is None or is_finite_number(value)):
                        values[row] = None if value is None else float(value)  # None: not judged (TRL's rule)
                        continue
                    message = value if status == "error" else f"returned {value!r}"
                    values[row], errors[row] = self._fail(row, prompts, completions, message), 1
                elif time.monotonic() >= deadline:
                    self._replace(w)  # a call that does not return is not waited for: its process goes
                    del busy[w]
                    values[row] = self._fail(row, prompts, completions, f"took more than {self.timeout_s:g} s "
                                             f"({setting(self.names, 'timeout_s')})")
                    timeouts[row] = 1
        self.faults = {"timeouts": timeouts, "errors": errors}
        return values

    def _fail(self, row: int, prompts, completions, what: str) -> float:
        if self.fallback is None:
            self.close()
            raise RewardFault(f"reward function {self.name!r} {what} on completion {row} (prompt {prompts[row]!r:.80}, "
                              f"completion {completions[row]!r:.80}); fix it, or set {setting(self.names, 'fallback')} "
                              "to score such completions with that value.")
        return float(self.fallback)

    def _replace(self, w: int) -> None:
        self._workers[w].stop()
        self._workers[w] = _Worker(self.fn)

    def close(self) -> None:
        for worker in self._workers:
            worker.stop()
        self._workers = []


# -------------------------------------------------------------------------------------------- services


class RemoteReward(RewardSource):
    """A reward service: per batch of at most ``batch_size`` completions, ``POST url`` with JSON
    ``{"prompts": [...], "completions": [...], "fields": {column: [...]}}``, answered ``{"rewards": [floats]}``
    (``launch/reward_server.py`` serves any reward of a config so). Unreachable, slow (``timeout_s``, after
    ``retries``), a wrong count or a non-finite value: :class:`RewardFault` naming the setting, or ``fallback``
    for the completions concerned (counted)."""

    reads_text = True  # the service's protocol and the model's tokenizer take text

    def __init__(self, name: str, url: str, *, timeout_s: float = 30.0, retries: int = 2, batch_size: int = 256,
                 api_key: str | None = None, fallback: float | None = None,
                 names: Mapping[str, str] | None = None) -> None:
        from grpo_accel.http import HTTPClient

        self.name, self.url, self.batch_size, self.fallback, self.names = name, url, batch_size, fallback, names
        parts = url.split("/", 3)
        self.client = HTTPClient("/".join(parts[:3]), api_key, timeout_s, retries, backoff_s=0.2,
                                 key_setting=setting(names, "api_key"))
        self.path = "/" + (parts[3] if len(parts) > 3 else "")

    def __call__(self, prompts: list[str], completions: list[str], **fields) -> list[float]:
        from grpo_accel.http import ServerError

        values: list[float] = []
        errors: list[int] = []
        for start in range(0, len(completions), self.batch_size):
            end = min(start + self.batch_size, len(completions))
            body = {"prompts": prompts[start:end], "completions": completions[start:end],
                    "fields": {k: v[start:end] for k, v in per_completion(fields, len(completions)).items()}}
            try:
                answer = self.client.post(self.path, json.loads(json.dumps(body, default=str)))
                got = answer.get("rewards") if isinstance(answer, dict) else None
                if not isinstance(got, list) or len(got) != end - start:
                    raise ValueError(f"answered {str(answer)[:120]!r}, not {{\"rewards\": [{end - start} floats]}}")
                bad = [i for i, v in enumerate(got) if v is not None and not is_finite_number(v)]
                if bad:
                    raise ValueError(f"answered {got[bad[0]]!r} for completion {start + bad[0]}")
                values += [None if v is None else float(v) for v in got]  # None: not judged (TRL's rule)
                errors += [0] * (end - start)
            except (ServerError, ValueError) as exc:
                if self.fallback is None:
                    raise_limit = (f"raise {setting(self.names, 'timeout_s')}, " if "did not answer within" in str(exc)
                                   else "")
                    raise RewardFault(f"reward service {self.name!r} at {setting(self.names, 'url')}={self.url!r}: "
                                      f"{exc}; check the service, {raise_limit}or set {setting(self.names, 'fallback')}."
                                      ) from exc
                logger.warning("reward service %s: %s; completions %d..%d get the fallback %s", self.url, exc, start,
                               end - 1, self.fallback)
                values += [float(self.fallback)] * (end - start)
                errors += [1] * (end - start)
        self.faults = {"timeouts": [0] * len(values), "errors": errors}
        return values


# ------------------------------------------------------------------------------------------ reward models


def check_classifier(path: str, trust_remote_code: bool = False) -> None:
    """A ValueError unless ``path`` names a sequence-classification model (a local folder, or a hub id where a
    hub is reachable): what it is instead and what is expected, in one line."""
    from transformers import AutoConfig

    local = Path(path)
    if local.exists() or local.is_absolute() or path.startswith((".", "~")):  # else maybe a hub id, "org/name"
        if not (local / "config.json").is_file():
            raise ValueError(f"{path!r} is not a model folder ({'no such path' if not local.exists() else 'no config.json'}); "
                             "name the folder a sequence-classification model was saved in (save_pretrained).")
    try:
        config = AutoConfig.from_pretrained(path, trust_remote_code=trust_remote_code)
    except (OSError, ValueError) as exc:  # neither a folder here nor a model the hub serves
        raise ValueError(f"{path!r} is not a model folder here and could not be read as a hub id "
                         f"({str(exc).splitlines()[0]}); name a sequence-classification model's folder.") from None
    architectures = config.architectures or []
    if not any(a.endswith("ForSequenceClassification") for a in architectures):
        raise ValueError(f"{path!r} is a {', '.join(architectures) or config.model_type} model, not a sequence "
                         "classifier: a reward model must be a *ForSequenceClassification model with a trained "
                         "score head (e.g. trained with TRL's RewardTrainer).")


class RewardModel(RewardSource):
    """A Hugging Face sequence-classification model as a reward: prompt + completion rendered with the reward
    model's own chat template (chat prompts) or joined as text, scored in batches of ``batch_size`` in ``dtype``
    on ``device``; the reward is ``logits[:, output_index] * scale``. Every process holds a full copy (it is
    inference only: ZeRO never sees it).

    Example:
        >>> reward = RewardModel("rm", "runs/my-rm", batch_size=32, dtype="bfloat16")
    """

    reads_text = True  # the service's protocol and the model's tokenizer take text

    def __init__(self, name: str, path: str, *, batch_size: int = 32, dtype: str = "float32", device=None,
                 output_index: int = 0, scale: float = 1.0, max_length: int = 2048, trust_remote_code: bool = False,
                 attn_implementation: str | None = None) -> None:
        import torch
        from transformers import AutoModelForSequenceClassification, AutoTokenizer

        self.name, self.batch_size, self.output_index, self.scale, self.max_length = (name, batch_size, output_index,
                                                                                      scale, max_length)
        if device is None:  # this process's GPU: built before the Accelerator, where every process's current is 0
            local = int(os.environ.get("LOCAL_RANK", "0"))
            device = torch.device("cuda", local % torch.cuda.device_count()) if torch.cuda.is_available() else "cpu"
        self.device = torch.device(device)
        check_classifier(path, trust_remote_code)
        self.tokenizer = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
        self.tokenizer.padding_side = "right"
        if self.tokenizer.pad_token_id is None:
            self.tokenizer.pad_token = self.tokenizer.eos_token
        extra = {"attn_implementation": attn_implementation} if attn_implementation is not None else {}
        self.model, loaded = AutoModelForSequenceClassification.from_pretrained(
            path, dtype=getattr(torch, dtype), output_loading_info=True, trust_remote_code=trust_remote_code, **extra)
        if loaded["missing_keys"]:  # a fresh, random head would score every completion at random
            raise ValueError(f"{path!r}: the folder does not hold all of the model's weights (missing "
                             f"{sorted(loaded['missing_keys'])[:3]}), so its head would be random; a reward model "
                             "must be a sequence classifier saved with its trained head (save_pretrained).")
        self.model.config.pad_token_id = self.tokenizer.pad_token_id
        self.model.to(self.device).eval().requires_grad_(False)

    def texts(self, prompts: list[str], completions: list[str], prompt_messages=None) -> list[str]:
        """What the reward model reads: chat prompts through its own template, with the completion as the
        assistant's turn; plain prompts followed by the completion."""
        out = []
        chat = getattr(self.tokenizer, "chat_template", None) is not None
        for i, (prompt, completion) in enumerate(zip(prompts, completions)):
            messages = prompt_messages[i] if prompt_messages is not None else None
            if messages and chat:
                out.append(self.tokenizer.apply_chat_template(
                    [*messages, {"role": "assistant", "content": completion}], tokenize=False))
            else:
                out.append(prompt + completion)
        return out

    def __call__(self, prompts: list[str], completions: list[str], prompt_messages=None, **fields) -> list[float]:
        import torch

        texts = self.texts(prompts, completions, prompt_messages)
        values: list[float] = []
        with torch.no_grad():
            for start in range(0, len(texts), self.batch_size):
                batch = self.tokenizer(texts[start : start + self.batch_size], return_tensors="pt", padding=True,
                                       truncation=True, max_length=self.max_length).to(self.device)
                logits = self.model(**batch).logits.float()  # [B, labels]
                values += (logits[:, self.output_index] * self.scale).tolist()
        self.faults = {"timeouts": [0] * len(values), "errors": [0] * len(values)}
        return values
