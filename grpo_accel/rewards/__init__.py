"""Reward functions: the protocol, a weighted set of them, and the built-ins.

A reward function is any callable ``fn(prompts, completions, **fields) -> list[float]``:

- ``prompts``: list[str], one per completion (a prompt repeated G times for its group): the text the model
  read, i.e. a chat-formatted row's messages after the chat template;
- ``completions``: list[str], decoded completion texts (special tokens skipped, as SGLang returns them);
- ``fields``: ``completion_ids`` (list[list[int]]), ``finish_reason`` (list[str]), ``prompt_messages`` (the
  row's chat messages with the system prompt, as TRL passes conversational prompts; None for a string prompt)
  and every extra column of the dataset row (e.g. ``answer``), each a list aligned with ``completions``.
  For multi-turn episodes (``rollout.environment``) the completion is the model's last turn, and two more fields
  come: ``conversation`` (the episode's messages, the model's turns as "assistant" messages) and
  ``env_rewards`` (the environment's per-turn reward terms summed over the episode: name -> float).

It returns one float per completion. Accept ``**fields`` so that new fields never break it. It may be declared
``async def``: a set's async functions are awaited together. Reward models, reward services and functions run in
worker processes with a time limit are such functions too (:mod:`grpo_accel.rewards.sources`).

Per-reward scaling: a set may standardise a function's values (``normalize`` "group": within each prompt's group,
"batch": over the batch this process scores) before the weighted sum, so that one reward's scale cannot drown
another's (GDPO's per-reward normalisation, trl#4785).
"""
from __future__ import annotations

import importlib

_EXPORTS = {  # name -> its module, imported on first use: a reward worker process imports this package cheaply
    "ANSWER_FORMATS": "builtin", "BUILTIN_REWARDS": "builtin", "RewardFn": "builtin", "answer_match": "builtin",
    "env_reward": "builtin", "final_answer": "builtin", "format_match": "builtin", "math_answer": "builtin",
    "overlong_penalty": "builtin", "reference_answer": "builtin", "same_answer": "builtin",
    "soft_overlong_penalty": "builtin", "stated_number": "builtin",
    "EPISODE_FIELDS": "reward_set", "NORMALIZE": "reward_set", "PROVIDED_FIELDS": "reward_set", "RewardError":
    "reward_set", "RewardSet": "reward_set", "is_async_reward": "reward_set", "standardise": "reward_set",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"grpo_accel.rewards.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'grpo_accel.rewards' has no attribute {name!r}")
