"""Reward functions: the protocol, a weighted set of them, and the built-ins.

A reward function is any callable returning one float (or None) per completion, called as TRL's GRPOTrainer calls
it (:mod:`grpo_accel.rewards.calling`), so TRL's reward functions run unchanged. It gets keyword arguments, each a
list aligned with the completions (a prompt repeated G times for its group) unless said otherwise:

- ``prompts`` and ``completions``: on text rows the prompt and completion texts (special tokens skipped, as
  SGLang returns them); on chat rows TRL's forms, the prompt's messages and ``[{"role": "assistant", "content":
  text}]``, except for functions that read text (``@text_reward``: the built-ins, reward models and services),
  which get the prompt as the model read it (the chat template applied) and the text;
- ``completion_ids`` (list[list[int]]), ``finish_reason`` ("stop" or "length"), ``prompt_messages`` (a chat row's
  messages with the system prompt; None for a text row) and every other column of the dataset row (``answer``);
- ``trainer_state`` (one :class:`~grpo_accel.rewards.calling.TrainerState`: ``global_step``, ``max_steps``, ...),
  ``log_extra(column, values)`` (a column of the logged samples) and ``log_metric(name, value)`` (``train/<name>``);
- for multi-turn episodes (``rollout.environment``) the completion is the model's last turn, and ``conversation``
  (the episode's messages) and ``env_rewards`` (the environment's reward terms summed: name -> float) come too.

Accept ``**kwargs`` so that new arguments never break it (without it, a function gets the names it lists). None
leaves that reward out of the completion's weighted sum (TRL's rule). It may be ``async def``: a set's async
functions are awaited together. Reward models, reward services and functions run in worker processes with a time
limit are such functions too (:mod:`grpo_accel.rewards.sources`).

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
    "TrainerState": "calling", "text_reward": "calling", "reads_text": "calling", "call_reward": "calling",
}

__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(importlib.import_module(f"grpo_accel.rewards.{_EXPORTS[name]}"), name)
    raise AttributeError(f"module 'grpo_accel.rewards' has no attribute {name!r}")
