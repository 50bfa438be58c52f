"""Shared by embedded/, logprobs.py, loss/, recipe/, reporting/, rollout/, server_rollouts.py and trainer/.

The rollout TensorDict: its keys, shapes and padding rules, defined once.

A rollout of ``B`` prompts x ``G`` completions is a TensorDict with batch size ``[N] = [B*G]``; the G
completions of a prompt are contiguous: rows ``g*G .. g*G+G-1`` are the group of prompt ``g`` (the one record of
group membership; micro-batches of the replay buffer mix groups, and the loss finds equal prompts by their tokens).

| key               | shape   | dtype   | meaning                                                          |
|-------------------|---------|---------|------------------------------------------------------------------|
| prompt_ids        | [N, P]  | int64   | prompt tokens, LEFT-padded with the pad id                       |
| prompt_mask       | [N, P]  | int64   | 1 on real prompt tokens                                          |
| completion_ids    | [N, C]  | int64   | sampled tokens incl. the EOS that stopped them, RIGHT-padded     |
| completion_mask   | [N, C]  | int64   | 1 on sampled tokens (EOS included)                               |
| model_mask        | [N, C]  | int64   | episodes only: 1 on the model's own tokens, 0 on the environment's |
| engine_logprobs   | [N, C]  | float32 | engine's log_softmax(logits / temperature) at the sampled token  |
| finish_reason     | [N]     | int64   | FINISH_STOP, FINISH_LENGTH or FINISH_ABORT                       |
| weight_version    | [N]     | int64   | oldest version of the weights that generated a token of the row  |
| weight_version_last | [N]   | int64   | newest such version (> weight_version: a partial rollout, pushed |
|                   |         |         | to while it was generated; each token keeps its engine logprob)  |
| rewards           | [N]     | float32 | sub-TensorDict: one entry per reward function (unweighted)       |
| reward            | [N]     | float32 | weighted sum of ``rewards``                                      |
| advantages        | [N]     | float32 | group-relative advantage                                         |
| old_logprobs      | [N, C]  | float32 | optional: trainer's logprobs before optimisation (pi_old)        |
| ref_logprobs      | [N, C]  | float32 | optional: reference policy's logprobs (KL term)                  |
| episode           | [N]     | int64   | episodes only: sub-TensorDict of turns, tool_calls, tool_errors  |

A multi-turn episode (:mod:`grpo_accel.rollout.episodes`) is one row: its "completion" holds every token after
the prompt, the model's turns and the environment's answers in order; ``model_mask`` tells them apart, and the
loss trains on :func:`loss_mask` only.
"""
from __future__ import annotations

from typing import Sequence

import torch
from tensordict import TensorDict
from torch import Tensor

PROMPT_IDS = "prompt_ids"
PROMPT_MASK = "prompt_mask"
COMPLETION_IDS = "completion_ids"
COMPLETION_MASK = "completion_mask"
MODEL_MASK = "model_mask"
ENGINE_LOGPROBS = "engine_logprobs"
FINISH_REASON = "finish_reason"
WEIGHT_VERSION = "weight_version"
WEIGHT_VERSION_LAST = "weight_version_last"
REWARDS = "rewards"
REWARD = "reward"
ADVANTAGES = "advantages"
OLD_LOGPROBS = "old_logprobs"
REF_LOGPROBS = "ref_logprobs"
EPISODE = "episode"

FINISH_STOP, FINISH_LENGTH, FINISH_ABORT = 0, 1, 2
FINISH_REASONS = {"stop": FINISH_STOP, "length": FINISH_LENGTH, "abort": FINISH_ABORT}

LEFT_PADDED = (PROMPT_IDS, PROMPT_MASK)
RIGHT_PADDED = (COMPLETION_IDS, COMPLETION_MASK, MODEL_MASK, ENGINE_LOGPROBS, OLD_LOGPROBS, REF_LOGPROBS)


Tokens = Sequence[Sequence[int]] | tuple[Tensor, Tensor]  # lists to pad, or (ids, mask) [N, W] already padded


def make_rollout(*, prompts: Tokens, completions: Tokens, engine_logprobs: Tensor | Sequence[Sequence[float]],
                 finish_reason: Tensor | Sequence[int], weight_version: Tensor | Sequence[int],
                 weight_version_last: Tensor | Sequence[int] | None = None, pad_id: int,
                 model_mask: Tensor | Sequence[Sequence[int]] | None = None,
                 episode: TensorDict | None = None) -> TensorDict:  # -> [N]
    """The rollout TensorDict of N completions: every engine (and the episode runner) makes it here.

    ``prompts`` / ``completions``: token lists (padded here, prompts on the left and completions on the right, with
    ``pad_id``) or ``(ids, mask)`` pairs already padded so. ``engine_logprobs`` and ``model_mask`` follow the
    completions (lists are padded with 0). ``weight_version_last`` defaults to ``weight_version`` (no push landed
    while the rows were generated). ``episode``: multi-turn episodes' counts, a TensorDict [N].
    """
    prompt_ids, prompt_mask = prompts if isinstance(prompts, tuple) else padded(prompts, pad_id, "left")
    completion_ids, completion_mask = (completions if isinstance(completions, tuple)
                                       else padded(completions, pad_id, "right"))
    n = prompt_ids.shape[0]
    as_long = lambda x: torch.as_tensor(x, dtype=torch.long)  # noqa: E731
    if not isinstance(engine_logprobs, Tensor):
        engine_logprobs = pad_sequences(engine_logprobs, 0.0, "right", dtype=torch.float32)
    td = TensorDict({
        PROMPT_IDS: prompt_ids, PROMPT_MASK: prompt_mask,
        COMPLETION_IDS: completion_ids, COMPLETION_MASK: completion_mask,
        ENGINE_LOGPROBS: engine_logprobs.float(),
        FINISH_REASON: as_long(finish_reason),
        WEIGHT_VERSION: as_long(weight_version),
        WEIGHT_VERSION_LAST: as_long(weight_version if weight_version_last is None else weight_version_last),
    }, batch_size=[n])
    if model_mask is not None:
        td[MODEL_MASK] = model_mask if isinstance(model_mask, Tensor) else pad_sequences(model_mask, 0, "right")
    if episode is not None:
        td[EPISODE] = episode
    return td


def loss_mask(td: TensorDict) -> Tensor:  # -> [N, C] int64
    """The tokens the loss trains on: the completion's, less the environment's in an episode."""
    mask = td[COMPLETION_MASK]
    return mask * td[MODEL_MASK] if MODEL_MASK in td.keys() else mask


def after_stop(completion_ids: Tensor, stop_ids: int | Sequence[int]) -> Tensor:  # [N, C] -> [N, C] bool
    """Positions strictly after each row's first stop token: not part of the completion (the stop itself is)."""
    is_stop = is_stop_token(completion_ids, stop_ids).long()
    return (is_stop.cumsum(1) - is_stop) > 0


def is_stop_token(ids: Tensor, stop_ids: int | Sequence[int]) -> Tensor:  # [...] -> [...] bool
    stops = torch.as_tensor([stop_ids] if isinstance(stop_ids, int) else list(stop_ids), device=ids.device)
    return torch.isin(ids, stops)


def stop_token_ids(tokenizer, generation_config=None) -> tuple[int, ...]:
    """Every id that ends a completion: the tokenizer's EOS and each one the model's generation config lists.
    Chat models end a turn on ids of their own (Llama-3 instruct ``<|eot_id|>``, Qwen2.5 ``<|im_end|>`` and
    ``<|endoftext|>``, Gemma-3 ``<end_of_turn>``): stopping on the EOS alone would run past the turn's end."""
    listed = getattr(generation_config, "eos_token_id", None)
    ids = [tokenizer.eos_token_id, *(listed if isinstance(listed, (list, tuple)) else [listed])]
    return tuple(dict.fromkeys(int(i) for i in ids if i is not None))


def pad_sequences(seqs: Sequence[Sequence[int | float]], value, side: str, dtype=torch.long) -> Tensor:
    """Lists of unequal length -> [len(seqs), max_len], padded with ``value`` on ``side`` ("left"/"right")."""
    width = max((len(s) for s in seqs), default=0)
    out = torch.full((len(seqs), width), value, dtype=dtype)
    for i, s in enumerate(seqs):
        if len(s):
            row = torch.as_tensor(list(s), dtype=dtype)
            if side == "left":
                out[i, width - len(s) :] = row
            else:
                out[i, : len(s)] = row
    return out


def padded(seqs: Sequence[Sequence[int]], value: int, side: str) -> tuple[Tensor, Tensor]:  # -> [N, W] each
    """``seqs`` padded with ``value`` on ``side`` and the mask of their real positions (1) against padding (0)."""
    return pad_sequences(seqs, value, side), pad_sequences([[1] * len(s) for s in seqs], 0, side)


def _pad_width(x: Tensor, width: int, side: str, value) -> Tensor:  # [N, w] -> [N, width]
    extra = width - x.shape[1]
    if extra == 0:
        return x
    pad = torch.full((x.shape[0], extra), value, dtype=x.dtype, device=x.device)
    return torch.cat([pad, x] if side == "left" else [x, pad], dim=1)


def concat_rollouts(tds: Sequence[TensorDict], pad_id: int) -> TensorDict:
    """Concatenate rollouts whose prompt/completion widths differ, re-padding each key on its own side."""
    if len(tds) == 1:
        return tds[0]
    widened = []
    for keys, side in ((LEFT_PADDED, "left"), (RIGHT_PADDED, "right")):
        for key in keys:
            if key in tds[0].keys():
                width = max(td[key].shape[1] for td in tds)
                value = pad_id if key in (PROMPT_IDS, COMPLETION_IDS) else 0
                widened.append((key, [_pad_width(td[key], width, side, value) for td in tds]))
    parts = [td.exclude(*(k for k, _ in widened)) for td in tds]
    out = torch.cat(parts, dim=0)
    for key, xs in widened:
        out.set(key, torch.cat(xs, dim=0))
    return out


def pack_rows(lengths: Sequence[int], capacity: int) -> list[list[int]]:
    """First-fit decreasing: row indices grouped into bins whose lengths sum to at most ``capacity``.

    >>> pack_rows([4, 1, 3, 2], capacity=4)
    [[0], [2, 1], [3]]
    """
    if any(n > capacity for n in lengths):
        raise ValueError(f"pack_rows: a row of {max(lengths)} tokens does not fit capacity={capacity}")
    bins: list[list[int]] = []
    free: list[int] = []
    for row in sorted(range(len(lengths)), key=lambda i: -lengths[i]):
        slot = next((b for b, room in enumerate(free) if room >= lengths[row]), len(bins))
        if slot == len(bins):
            bins.append([])
            free.append(capacity)
        bins[slot].append(row)
        free[slot] -= lengths[row]
    return bins


def trim_padding(td: TensorDict) -> TensorDict:
    """Drop columns that are padding in every row: prompt columns on the left, completion ones on the right."""
    p_keep = int(td[PROMPT_MASK].any(0).long().argmax()) if td[PROMPT_MASK].any() else td[PROMPT_MASK].shape[1]
    c_any = td[COMPLETION_MASK].any(0)
    c_keep = int(c_any.nonzero().max()) + 1 if c_any.any() else 0
    out = td.clone(recurse=False)
    for key in LEFT_PADDED:
        out.set(key, td[key][:, p_keep:])
    for key in RIGHT_PADDED:
        if key in td.keys():
            out.set(key, td[key][:, :c_keep])
    return out
