"""Multi-turn episodes: the model takes a turn, the environment answers (tool results, a user's reply) or ends
the episode, and so on; the whole episode is one row of the rollout, trained on the model's own tokens only.

An episode's tokens are the prompt followed by the model's and the environment's tokens in the order they came
(``completion_ids``); ``model_mask`` marks the model's. Each later turn is generated from exactly those tokens,
so what the model saw when it wrote a turn is the prefix the loss trains that turn on. The environment's
messages become tokens through the chat template: only the *new* part of the rendering is appended (see
:class:`TurnRenderer`), never a re-rendering of earlier turns, which some templates would change.

Grouping is GRPO's: the G episodes of a prompt form its group, each scored as a whole, and its advantage applies
to every model token of the episode.
"""
from __future__ import annotations

import concurrent.futures
import math
from dataclasses import dataclass, field
from typing import Callable, Mapping, Protocol, Sequence

import torch
from tensordict import TensorDict

from grpo_accel import batch
from grpo_accel.data.prompts import ROLES, Prompts, chat_messages, encode_prompts, is_chat_message, render_chat
from grpo_accel.errors import UserError
from grpo_accel.rollout.sampling import batch_seeds, completion_keys, turn_key
from grpo_accel.rules import check
from grpo_accel.rollout.tools import CallParser, TaggedCallParser, ToolRunner, tool_schema

SENTINEL = "\u2063GRPO_ACCEL_TURN\u2063"  # stands for a model turn's text while finding the template's framing


class EpisodeError(UserError, RuntimeError):
    """An environment failed or answered with something an episode cannot use; the message names it, the
    episode's row and the value."""


@dataclass
class Step:
    """The environment's answer to a model turn.

    ``messages``: what comes back (tool results, a user's reply); ``done``: the episode is over (then
    ``messages`` are not shown); ``rewards``: per-turn reward terms, summed over the episode and given to reward
    functions as ``env_rewards``; ``tool_calls`` / ``tool_errors``: counted for the metrics.
    """

    messages: list[dict] = field(default_factory=list)
    done: bool = False
    rewards: dict[str, float] = field(default_factory=dict)
    tool_calls: int = 0
    tool_errors: int = 0


class Environment(Protocol):
    """What an episode runs against. A collector makes one instance per episode (so it may keep state).

    ``tools``: functions offered to the model (their schemas go to the chat template; may be empty).
    ``reset(row)``: the episode's first messages for a dataset row; the same for the same row (the G episodes of
    a group start alike, and every row is rendered and checked before the first batch).
    ``step(messages)``: the conversation so far, the model's latest turn last -> :class:`Step`.
    """

    tools: Sequence[Callable]

    def reset(self, row: dict) -> list[dict]: ...

    def step(self, messages: list[dict]) -> Step: ...


class ToolEnvironment:
    """Episodes in which the model may call ``tools``: each turn's calls are run and answered with tool
    messages; the first turn without a call ends the episode (its text is the final answer).

    Args:
        tools: plain functions with docstrings (see :mod:`grpo_accel.rollout.tools`).
        parser: reads calls from a turn's text; the ``<tool_call>{json}</tool_call>`` format by default.
        timeout_s: each call's time limit; a call over it is answered with an error.
        prompt_field / system_prompt: the row's column with the first messages, and a system message to put
            first (as for single-turn prompts, :func:`grpo_accel.data.prompts.chat_messages`).

    Example:
        >>> make_env = lambda: ToolEnvironment([calculator], system_prompt="Use the calculator.")
        >>> collector = GRPOCollector(engine, tok, rows, rewards, layout=BatchLayout(8, 8),
        ...                           environment=make_env, max_turns=3)
    """

    def __init__(self, tools: Sequence[Callable], *, parser: CallParser | None = None, timeout_s: float = 10.0,
                 prompt_field: str = "prompt", system_prompt: str | None = None) -> None:
        self.tools = list(tools)
        self.parser = parser or TaggedCallParser()
        self.runner = ToolRunner(self.tools, timeout_s)  # the calls run on the pool all runners share
        self.prompt_field, self.system_prompt = prompt_field, system_prompt

    def reset(self, row: dict) -> list[dict]:
        prompt = row[self.prompt_field]
        return chat_messages([{"role": "user", "content": prompt}] if isinstance(prompt, str) else prompt,
                             self.system_prompt)

    def step(self, messages: list[dict]) -> Step:
        calls = self.parser.parse(messages[-1]["content"])
        if not calls:
            return Step(done=True)
        answers = self.runner.run(calls)
        return Step([{"role": "tool", "content": text} for text, _ in answers], tool_calls=len(calls),
                    tool_errors=sum(failed for _, failed in answers))


class TurnRenderer:
    """Token ids of what the chat template puts between one model turn and the next.

    The model's turn is generated after the template's assistant header and usually ends with the EOS token
    (``<|im_end|>``); the template then closes the turn (e.g. a newline), renders the environment's messages and
    opens the next assistant turn. That text is found by rendering a fixed stand-in conversation with a marker as
    the assistant's text, with and without the new messages, and taking the difference: earlier turns are never
    re-rendered, so a template that rewrites them (e.g. drops reasoning from past turns) cannot change tokens the
    model already saw.
    """

    def __init__(self, tokenizer, tools: list[dict] | None = None) -> None:
        self.tokenizer, self.tools = tokenizer, tools
        self._eos_text = tokenizer.decode([tokenizer.eos_token_id])
        base = [{"role": "system", "content": "s"}, {"role": "user", "content": "u"},
                {"role": "assistant", "content": SENTINEL}]
        closed = render_chat(tokenizer, base, tools, add_generation_prompt=False)
        self._after_turn = closed[closed.index(SENTINEL) + len(SENTINEL):]  # e.g. "<|im_end|>\n"
        self._base, self._closed = base, closed

    def between(self, messages: list[dict]) -> list[int]:
        """Ids after a model turn that stopped on the EOS token up to and including the next assistant header,
        with ``messages`` rendered in between. When the template closes a turn with the EOS text, the model wrote
        that token itself: it is not repeated."""
        text = render_chat(self.tokenizer, [*self._base, *messages], self.tools, add_generation_prompt=True)
        if not text.startswith(self._closed):
            raise ValueError("the chat template renders a conversation's earlier turns differently once messages "
                             "follow them; multi-turn episodes need a template that renders turns one after another.")
        close = self._after_turn
        if close.startswith(self._eos_text):
            close = close[len(self._eos_text):]
        return self.tokenizer(close + text[len(self._closed):], add_special_tokens=False)["input_ids"]


@dataclass
class _Episode:
    """One episode's running state."""

    env: Environment
    row: dict  # the dataset row it was reset with
    messages: list[dict]
    key: int  # its random stream: later turns draw with keys derived from it
    room: int | None  # tokens after the prompt at most: the episode budget and the engine's context, if any
    tokens: list[int] = field(default_factory=list)  # after the prompt: model and environment tokens
    model: list[int] = field(default_factory=list)  # 1 where the model wrote the token
    logprobs: list[float] = field(default_factory=list)
    turn_ids: list[int] = field(default_factory=list)  # the latest model turn
    turns: int = 0
    tool_calls: int = 0
    tool_errors: int = 0
    version: int | None = None  # the oldest weights of any of its tokens
    last_version: int = 0  # the newest
    finish: int | None = None
    env_rewards: dict[str, float] = field(default_factory=dict)


def completion_budget(max_new_tokens: int, max_turns: int | None = None, max_episode_tokens: int | None = None) -> int:
    """The most tokens the model writes in one completion, or in one episode of ``max_turns`` model turns of
    ``max_new_tokens`` each, capped by ``max_episode_tokens`` (what :class:`EpisodeRunner` enforces): Dr. GRPO's
    constant normaliser."""
    if max_turns is None:
        return max_new_tokens
    turns = max_turns * max_new_tokens
    return turns if max_episode_tokens is None else min(turns, max_episode_tokens)


class EpisodeRunner:
    """Runs the G episodes of each prompt turn by turn on a rollout engine and returns them as one rollout.

    Args:
        engine: a :class:`~grpo_accel.contracts.RolloutEngine`; the first turn is one ``generate``, every later
            one a ``continue_rows``.
        tokenizer: decodes turns into messages and encodes the environment's answers (:class:`TurnRenderer`).
        environment: makes a fresh :class:`Environment` per episode.
        max_turns: model turns per episode at most; an episode still calling tools after them is cut
            (finish reason "length").
        max_episode_tokens: tokens after the prompt (the model's and the environment's) at most; None: no limit
            besides ``max_turns`` x the engine's ``max_new_tokens``. An engine's ``context_limit`` (prompt +
            episode tokens one sequence may hold) bounds it too: an episode whose context is full ends "length".
        sync_any: under several processes, True on every process when any passes True. With an engine that is
            ``collective`` (embedded under ZeRO-3: generation gathers weights from every process), every
            process then takes the same number of turns, idle ones on a throwaway row; other engines' processes
            run their episodes on their own.
    """

    def __init__(self, engine, tokenizer, environment: Callable[[], Environment], *, max_turns: int,
                 max_episode_tokens: int | None = None, sync_any: Callable[[bool], bool] = bool) -> None:
        check("max_turns", "max_turns", max_turns, owner="EpisodeRunner: ")
        check("optional_count", "max_episode_tokens", max_episode_tokens, owner="EpisodeRunner: ")
        self.engine, self.tokenizer, self.environment = engine, tokenizer, environment
        self.max_turns, self.max_episode_tokens, self.sync_any = max_turns, max_episode_tokens, sync_any
        first = environment()
        self.tools, self._start = tool_schemas(first), first.reset
        self.renderer = TurnRenderer(tokenizer, self.tools)
        self._pool = concurrent.futures.ThreadPoolExecutor(32, thread_name_prefix="grpo-env")

    def encode(self, rows: list[dict], *, max_tokens: int | None = None, source: str = "dataset",
               names: Mapping[str, str] | None = None) -> Prompts:
        """Every row's first messages (the environment's ``reset``) rendered with the tools and checked."""
        return encode_prompts(rows, self.tokenizer, max_tokens=max_tokens, source=source, tools=self.tools,
                              start=self._start, names=names)

    def run(self, rows: list[dict], prompts: Prompts, group_size: int, seeds: list[int] | None = None,
            greedy: bool = False) -> tuple[TensorDict, list[_Episode]]:
        """(rollout [len(rows) * group_size] with ``model_mask`` and per-episode counts, the episodes) for
        ``rows`` and their :meth:`encode`-d ``prompts``. ``seeds``: one per row (random when None);
        ``greedy``: every turn takes the most likely tokens (evaluation)."""
        seeds = batch_seeds(seeds, len(rows))
        keys = iter(completion_keys(seeds, group_size))  # the first turn's, as the engine draws them
        prompt_ids, first_messages = prompts.ids, prompts.messages
        episodes = []
        context = self.engine.context_limit
        for row, messages, prompt in zip(rows, first_messages, prompt_ids):
            rooms = [r for r in (self.max_episode_tokens, None if context is None else context - len(prompt))
                     if r is not None]
            for _ in range(group_size):
                env = self.environment()
                env.reset(row)
                episodes.append(_Episode(env, row, list(messages), key=next(keys), room=min(rooms, default=None)))
        row_prompts = [p for p in prompt_ids for _ in range(group_size)]
        td = self.engine.generate(prompt_ids, group_size, seeds=seeds, greedy=greedy)  # the first turn
        active = list(range(len(episodes)))
        while True:
            self._take_turn([episodes[i] for i in active], td)
            self._answer([episodes[i] for i in active])
            active = [i for i in active if episodes[i].finish is None]
            if not (self.sync_any(bool(active)) if self.engine.collective else active):
                return self._rollout(row_prompts, episodes), episodes
            # an idle process keeps the others company (each turn is a collective there) on a throwaway row
            td = self._next_turn(prompt_ids, group_size, episodes, active or [0], greedy)
            if not active:
                td = None

    def _next_turn(self, prompt_ids: list[list[int]], group_size: int, episodes: list[_Episode], rows: list[int],
                   greedy: bool) -> TensorDict:
        """The next model turn of episodes ``rows``, from their prompt and their tokens so far (the embedded engine
        prefills each prompt once for all its episodes; SGLang's prefix cache shares the prompts)."""
        turn = episodes[rows[0]].turns
        keys = None if greedy else [turn_key(episodes[i].key, turn) for i in rows]
        used = sorted({i // group_size for i in rows})
        return self.engine.continue_rows([prompt_ids[p] for p in used], [used.index(i // group_size) for i in rows],
                                         [episodes[i].tokens for i in rows], keys)

    def _take_turn(self, episodes: list[_Episode], td: TensorDict | None) -> None:
        """Append each episode's new model turn (row i of ``td``), cut to the token budget."""
        if td is None:
            return
        columns = (batch.COMPLETION_IDS, batch.COMPLETION_MASK, batch.ENGINE_LOGPROBS, batch.FINISH_REASON,
                   batch.WEIGHT_VERSION, batch.WEIGHT_VERSION_LAST)
        for ep, ids, mask, logp, reason, version, last in zip(episodes, *(td[key] for key in columns)):
            n = int(mask.sum())
            room = n if ep.room is None else max(0, min(n, ep.room - len(ep.tokens)))
            ep.turn_ids = ids[:room].tolist()
            ep.tokens += ep.turn_ids
            ep.model += [1] * room
            ep.logprobs += logp[:room].tolist()
            ep.turns += 1
            ep.version = int(version) if ep.version is None else min(ep.version, int(version))
            ep.last_version = max(ep.last_version, int(last))
            stopped = room == n and int(reason) == batch.FINISH_STOP
            text = self.tokenizer.decode(ep.turn_ids, skip_special_tokens=True)
            ep.messages.append({"role": "assistant", "content": text})
            if not stopped:  # cut by the engine's or the episode's budget: the turn is unfinished
                ep.finish = batch.FINISH_LENGTH

    def _answer(self, episodes: list[_Episode]) -> None:
        """The environment's step for every episode whose turn finished, run concurrently."""
        waiting = [ep for ep in episodes if ep.finish is None]
        for ep, step in zip(waiting, self._pool.map(_step, waiting)):
            ep.tool_calls += step.tool_calls
            ep.tool_errors += step.tool_errors
            for name, value in step.rewards.items():
                ep.env_rewards[name] = ep.env_rewards.get(name, 0.0) + float(value)
            if step.done:
                ep.finish = batch.FINISH_STOP
                continue
            between = self.renderer.between(step.messages)
            over = ep.room is not None and len(ep.tokens) + len(between) >= ep.room  # no room for a model token
            if ep.turns >= self.max_turns or over:
                ep.finish = batch.FINISH_LENGTH  # the model never reads this answer: not part of the episode
                continue
            ep.messages += step.messages
            ep.tokens += between
            ep.model += [0] * len(between)
            ep.logprobs += [0.0] * len(between)

    def _rollout(self, prompts: list[list[int]], episodes: list[_Episode]) -> TensorDict:
        count = lambda attr: torch.tensor([getattr(ep, attr) for ep in episodes], dtype=torch.long)  # noqa: E731
        counts = TensorDict({"turns": count("turns"), "tool_calls": count("tool_calls"),
                             "tool_errors": count("tool_errors")}, batch_size=[len(episodes)])
        return batch.make_rollout(prompts=prompts, completions=[ep.tokens for ep in episodes],
                                  engine_logprobs=[ep.logprobs for ep in episodes], finish_reason=count("finish"),
                                  weight_version=count("version"), weight_version_last=count("last_version"),
                                  pad_id=self.engine.pad_id, model_mask=[ep.model for ep in episodes], episode=counts)

def _step(ep: _Episode) -> Step:
    """``ep.env.step`` on the conversation so far, its answer checked: a :class:`Step` of chat messages and
    finite per-turn rewards, or an :class:`EpisodeError` naming the environment, the row and the value."""
    where = f"{type(ep.env).__name__}.step() after model turn {ep.turns} of the episode of row {_short(ep.row)}"
    try:
        step = ep.env.step(ep.messages)
    except Exception as exc:
        raise EpisodeError(f"environment {where} raised {type(exc).__name__}: {exc}; fix the environment, or answer "
                           "what it cannot handle with a message (tool errors are messages too).") from exc
    if not isinstance(step, Step):
        raise EpisodeError(f"environment {where} returned {_short(step)}, a {type(step).__name__}; return "
                           "grpo_accel.rollout.episodes.Step(messages=[{'role': 'tool', 'content': '...'}], done=...).")
    messages = step.messages if isinstance(step.messages, list) else [step.messages]  # not a list: its value named
    for j, m in enumerate(messages):
        if messages is not step.messages or not is_chat_message(m):
            raise EpisodeError(f"environment {where} returned message {j} {_short(m)}; Step.messages is a list of "
                               f"{{'role': one of {list(ROLES)}, 'content': a string}}.")
    finite = lambda v: isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)  # noqa: E731
    if not isinstance(step.rewards, dict) or not all(finite(v) for v in step.rewards.values()):
        raise EpisodeError(f"environment {where} returned rewards {_short(step.rewards)}; Step.rewards maps names "
                           "to finite numbers.")
    return step


def _short(value, n: int = 120) -> str:
    text = repr(value)
    return text if len(text) <= n else text[: n - 3] + "..."


def tool_schemas(env: Environment) -> list[dict] | None:
    """The function schemas of an environment's tools (None without tools)."""
    return [tool_schema(fn) for fn in getattr(env, "tools", ())] or None
