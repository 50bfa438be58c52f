"""The collector: prompts from a dataset -> engine rollouts -> rewards -> group-relative advantages."""
from __future__ import annotations

import logging
import random
import time
from functools import partial
from typing import TYPE_CHECKING, Callable, Mapping

import torch
from tensordict import TensorDict

from grpo_accel import batch
from grpo_accel.advantages import group_advantages
from grpo_accel.contracts import Collector, RolloutEngine
from grpo_accel.data.prompts import DataError, Prompts, check_prompts, encode_prompts
from grpo_accel.distributed import any_process
from grpo_accel.layout import BatchLayout
from grpo_accel.rewards import EPISODE_FIELDS, PROVIDED_FIELDS, RewardSet
from grpo_accel.rewards.calling import TRAINER_ARGUMENTS
from grpo_accel.rules import setting
from grpo_accel.rollout.episodes import completion_budget
from grpo_accel.rollout.sampling import group_seeds

if TYPE_CHECKING:
    from grpo_accel.rollout.episodes import Environment, EpisodeRunner

logger = logging.getLogger(__name__)

RESERVED_FIELDS = ("prompts", "completions", *PROVIDED_FIELDS, *EPISODE_FIELDS, *TRAINER_ARGUMENTS)
TIMED = ("time_generate", "time_score")
FINISH_NAMES = {code: name for name, code in batch.FINISH_REASONS.items()}


def score_rollout(td: TensorDict, rows: list[dict], prompts: Prompts, group_size: int, tokenizer,
                  rewards: RewardSet, prompt_field: str = "prompt", episodes: list | None = None) -> TensorDict:
    """Rewards of a rollout whose groups come from ``rows`` (one row per group, ``prompts`` their rendered
    prompts): decode, call every function. For ``episodes`` (:class:`~grpo_accel.rollout.episodes.EpisodeRunner`'s)
    the completion is the model's last turn; ``conversation`` and ``env_rewards`` come as fields too."""
    repeat = lambda values: [v for v in values for _ in range(group_size)]  # noqa: E731 - one per completion
    fields = {k: repeat(row[k] for row in rows) for k in rows[0] if k != prompt_field}
    if episodes is None:
        ids = [c[m.bool()].tolist() for c, m in zip(td[batch.COMPLETION_IDS], td[batch.COMPLETION_MASK])]
        texts = tokenizer.batch_decode(ids, skip_special_tokens=True)
    else:
        ids, texts = [ep.turn_ids for ep in episodes], [ep.messages[-1]["content"] for ep in episodes]
        fields |= {"conversation": [ep.messages for ep in episodes], "env_rewards": [ep.env_rewards for ep in episodes]}
    return rewards(
        repeat(prompts.texts),
        texts,
        group_size=group_size,
        completion_ids=ids,
        finish_reason=[FINISH_NAMES[int(r)] for r in td[batch.FINISH_REASON]],
        prompt_messages=repeat(prompts.messages),
        **fields,
    )


def _split_tied_groups(td: TensorDict, group_size: int) -> tuple[list[TensorDict], list[TensorDict]]:
    """(groups whose rewards differ, groups whose rewards all tie), each group a TensorDict [G]."""
    groups = [td[i : i + group_size] for i in range(0, td.shape[0], group_size)]
    tied = [bool((g[batch.REWARD] == g[batch.REWARD][0]).all()) for g in groups]
    return [g for g, t in zip(groups, tied) if not t], [g for g, t in zip(groups, tied) if t]


def check_context(prompts: list[list[int]], limit: int | None, max_new_tokens: int,
                  max_prompt_tokens: int | None, names: Mapping[str, str] | None = None) -> None:
    """Refuse, before the first batch, a prompt that cannot be followed by ``max_new_tokens`` within the engine's
    context (``limit`` tokens per sequence)."""
    if limit is None or not prompts:
        return
    row = max(range(len(prompts)), key=lambda i: len(prompts[i]))
    longest = len(prompts[row])
    new, prompt = setting(names, "max_new_tokens"), setting(names, "max_prompt_tokens")
    if longest >= limit:  # no budget can help: the prompt alone fills the context
        raise DataError(
            f"dataset row {row}: its prompt is {longest} tokens, as long as or longer than the {limit} tokens a "
            f"sequence may hold ({_CONTEXT}), so nothing can follow it; set {prompt} (now {max_prompt_tokens}) below "
            f"{limit} so that such rows are refused when loaded, shorten the prompts, or use a longer context.")
    if longest + max_new_tokens > limit:
        raise DataError(
            f"{new}={max_new_tokens}: the longest prompt (row {row}, {longest} tokens) and that many new tokens "
            f"exceed the {limit} tokens a sequence may hold ({_CONTEXT}). Lower {new} to {limit - longest} or less, "
            f"or {prompt} (now {max_prompt_tokens}) below {longest} so that such rows are refused when loaded, or "
            "serve a longer context (SGLang: --context-length or a larger KV pool, --max-total-tokens; vLLM: "
            "--max-model-len).")


_CONTEXT = ("SGLang: the servers' shortest context less one, at most their max_req_input_len; vLLM: the servers' "
            "shortest --max-model-len less one; embedded: the model's max_position_embeddings")


class GRPOCollector(Collector):
    """Iterable of scored rollouts, one per optimisation round (the spec's ``collector``).

    Each item holds this process's share of a collected batch of ``layout.prompts`` x ``layout.group_size``
    completions: every process walks the same shuffled order and takes slice ``rank`` of each batch. Rows are
    visited in a new seeded order each pass over the dataset.

    Args:
        engine: a :class:`~grpo_accel.contracts.RolloutEngine`.
        tokenizer: encodes prompts and decodes completions for the reward functions.
        rows: dataset rows (dicts); ``prompt_field`` holds the prompt, other fields reach reward functions.
        rewards: the reward functions and their weights.
        layout: the run's :class:`~grpo_accel.layout.BatchLayout` (prompts per batch, group size, processes).
        rank: the share of each batch this process collects, ``accelerator.process_index`` under several
            processes (the trainer checks it).
        max_prompt_tokens: a longer prompt (after the chat template) is an error naming its row, or, by
            ``overlong_prompts`` (:data:`grpo_accel.data.prompts.OVERLONG`), its row is dropped or its prompt cut to its last
            ``max_prompt_tokens`` tokens (counted and said once).
        system_prompt: prepended as a system message to every chat-formatted prompt (see :mod:`grpo_accel.data.prompts`).
        scale_advantages / leave_one_out: see :func:`grpo_accel.advantages.group_advantages`.
        dynamic_sampling: drop groups whose rewards all tie (they carry no gradient) and sample more prompts
            until the batch is full, for at most ``max_extra_rounds`` extra rounds; tied groups fill what is
            still missing, so the batch size never changes. ``stats`` in the rollout reports the fraction dropped.
        sync_any: with several processes, ``sync_any(flag)`` returns True on every process when any passed True
            (an all-reduce over the default process group unless given), so that all take the same number of
            extra rounds (and episode turns).
        environment: makes a fresh :class:`~grpo_accel.rollout.episodes.Environment` per episode: completions
            become multi-turn episodes (the model's turns, the environment's answers) of at most ``max_turns``
            model turns and ``max_episode_tokens`` tokens after the prompt; the first messages come from its
            ``reset(row)`` (rendered with its tools' schemas), and reward functions also get ``conversation`` and
            ``env_rewards``. None: one completion per prompt, as always.
        names: what messages call the settings they name (:func:`grpo_accel.rules.setting`; the recipe passes
            the config's keys).

    Example:
        >>> collector = GRPOCollector(engine, tok, rows, RewardSet({"answer": answer_match}),
        ...                           layout=BatchLayout(prompts=16, group_size=8))
        >>> rollout = next(iter(collector))     # TensorDict [128] with rewards and advantages
    """

    def __init__(
        self,
        engine: RolloutEngine,
        tokenizer,
        rows: list[dict],
        rewards: RewardSet,
        *,
        layout: BatchLayout,
        rank: int = 0,
        prompt_field: str = "prompt",
        max_prompt_tokens: int | None = None,
        overlong_prompts: str = "error",
        system_prompt: str | None = None,
        scale_advantages: bool = True,
        leave_one_out: bool = False,
        seed: int = 0,
        dynamic_sampling: bool = False,
        max_extra_rounds: int = 4,
        sync_any: Callable[[bool], bool] = any_process,
        environment: Callable[[], "Environment"] | None = None,
        max_turns: int = 4,
        max_episode_tokens: int | None = None,
        names: Mapping[str, str] | None = None,
    ) -> None:
        if not 0 <= rank < layout.processes:
            raise ValueError(f"GRPOCollector: rank={rank} is not one of the layout's {layout.processes} processes; "
                             "pass rank=accelerator.process_index.")
        clash = [f for f in RESERVED_FIELDS if rows and f in rows[0]]
        if clash:
            raise DataError(f"dataset fields {clash} clash with reward-function arguments; rename those columns.")
        self.engine, self.tokenizer, self.rows, self.rewards = engine, tokenizer, rows, rewards
        self.layout, self.group_size = layout, layout.group_size
        self.prompt_field = prompt_field
        self.scale_advantages, self.leave_one_out = scale_advantages, leave_one_out
        self.seed, self.rank = seed, rank
        self.dynamic_sampling, self.max_extra_rounds, self.sync_any = dynamic_sampling, max_extra_rounds, sync_any
        self.epoch, self.position, self.batches = 0, 0, 0
        self._seconds = dict.fromkeys(TIMED, 0.0)  # this batch's seconds per phase
        self.episodes: EpisodeRunner | None = None
        self.completion_budget = completion_budget(engine.max_new_tokens, max_turns if environment else None,
                                                   max_episode_tokens)  # the engine's cap, or an episode's
        if environment is not None:
            from grpo_accel.rollout.episodes import EpisodeRunner

            self.episodes = EpisodeRunner(engine, tokenizer, environment, max_turns=max_turns,
                                          max_episode_tokens=max_episode_tokens, sync_any=lambda f: self.sync_any(f))
        for name, columns in rewards.required_columns().items():
            if environment is None and (needs := [c for c in columns if c in EPISODE_FIELDS]):
                raise DataError(f"reward {name!r} needs {needs}, which only multi-turn episodes provide; set "
                                f"{setting(names, 'environment')}, or drop that reward.")
        encode = (partial(self.episodes.encode, names=names) if self.episodes is not None else
                  partial(encode_prompts, tokenizer=tokenizer, prompt_field=prompt_field, system_prompt=system_prompt,
                          names=names))
        self.rows, self.prompts = check_prompts(  # every row rendered, tokenised and checked before any batch
            rows, tokenizer, encode, required=rewards.required_columns(
                PROVIDED_FIELDS + (EPISODE_FIELDS if environment else ())), max_prompt_tokens=max_prompt_tokens,
            overlong_prompts=overlong_prompts, prompts_per_batch=layout.prompts, say=rank == 0, names=names)
        self._order = self._shuffled(0)
        check_context(self.prompts.ids, engine.context_limit, engine.max_new_tokens, max_prompt_tokens, names)

    @property
    def collective(self) -> bool:
        """Dynamic sampling's extra rounds (and, with an engine that is collective, every episode turn) are agreed
        with the other processes while collecting."""
        many = self.layout.processes > 1
        return many and (self.dynamic_sampling or (self.episodes is not None and self.engine.collective))

    def close(self) -> None:
        """Stop the engine's and the reward functions' helpers (a decode worker, reward worker processes)."""
        self.engine.close()
        self.rewards.close()

    def _shuffled(self, epoch: int) -> list[int]:
        order = list(range(len(self.rows)))
        random.Random(self.seed + epoch).shuffle(order)
        return order

    def _next_indices(self) -> list[int]:
        """The global batch's row indices (same on every process), advancing through seeded epochs."""
        out = []
        while len(out) < self.layout.prompts:
            if self.position == len(self._order):
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._shuffled(self.epoch)
            out.append(self._order[self.position])
            self.position += 1
        return out

    def collect(self) -> TensorDict:
        """One scored rollout TensorDict [layout.completions_per_process] (keys: grpo_accel.batch). Its ``stats`` hold
        this batch's seconds spent generating and scoring (``time_generate``, ``time_score``) and, with dynamic
        sampling, the fraction of groups dropped and the extra rounds taken."""
        self._seconds = dict.fromkeys(TIMED, 0.0)
        td = self._collect_round()
        stats = {}
        if self.dynamic_sampling:
            td, stats = self._refill(td)
        n = td.shape[0]
        td["stats"] = TensorDict({k: torch.full((n,), float(v)) for k, v in (stats | self._seconds).items()},
                                 batch_size=[n])
        return td

    def _refill(self, td: TensorDict) -> tuple[TensorDict, dict[str, float]]:
        """Dynamic sampling: replace groups whose rewards tie with informative ones from extra rounds."""
        groups = self.layout.prompts_per_process
        informative, tied = _split_tied_groups(td, self.group_size)
        seen, rounds = td.shape[0] // self.group_size, 0
        while rounds < self.max_extra_rounds and self.sync_any(len(informative) < groups):
            rounds += 1
            more = self._collect_round()
            new_informative, new_tied = _split_tied_groups(more, self.group_size)
            informative, tied, seen = informative + new_informative, tied + new_tied, seen + len(new_informative) + len(new_tied)
        chosen = (informative + tied)[:groups]
        out = batch.concat_rollouts(chosen, pad_id=self.engine.pad_id)
        return out, {"dropped_group_fraction": len(tied) / seen, "extra_rounds": float(rounds)}

    def _collect_round(self) -> TensorDict:
        """Generate and score the next global batch's share of this process."""
        global_indices = self._next_indices()
        share = self.layout.prompts_per_process
        indices = global_indices[self.rank * share : (self.rank + 1) * share]
        first_group = self.batches * self.layout.prompts + self.rank * share
        group_ids = list(range(first_group, first_group + share))
        seeds = group_seeds(self.seed, group_ids)  # the same samples whatever the number of processes
        start = time.perf_counter()
        prompt_ids = [self.prompts.ids[i] for i in indices]
        if self.episodes is None:
            td, episodes = self.engine.generate(prompt_ids, self.group_size, seeds=seeds), None
        else:
            td, episodes = self.episodes.run([self.rows[i] for i in indices], self.prompts.take(indices),
                                             self.group_size, seeds)
        scored = time.perf_counter()
        td.update(score_rollout(td, [self.rows[i] for i in indices], self.prompts.take(indices), self.group_size,
                                self.tokenizer, self.rewards, self.prompt_field, episodes))
        self._seconds["time_generate"] += scored - start
        self._seconds["time_score"] += time.perf_counter() - scored
        td[batch.ADVANTAGES] = group_advantages(
            td[batch.REWARD], self.group_size, scale_by_std=self.scale_advantages, leave_one_out=self.leave_one_out
        )
        self.batches += 1
        return td

    def state_dict(self) -> dict:
        """Dataset position (what a resumed run needs to continue exactly; the weight version is the trainer's,
        which a resumed trainer pushes to the engine before it collects)."""
        return {"epoch": self.epoch, "position": self.position, "batches": self.batches}

    def load_state_dict(self, state: dict) -> None:  # a checkpoint of an earlier build also holds "weight_version"
        self.epoch, self.position, self.batches = state["epoch"], state["position"], state["batches"]
        self._order = self._shuffled(self.epoch)
