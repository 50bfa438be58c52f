"""Scalars of a batch, reduced over every process (the trainer logs them under train/)."""
from __future__ import annotations

import math

import torch
from tensordict import TensorDict

from grpo_accel import batch


def mean_over_processes(accelerator, stats: dict[str, float]) -> dict[str, float]:
    """Each scalar averaged over processes (one all-reduce)."""
    if not stats:
        return {}
    keys = sorted(stats)
    values = accelerator.reduce(torch.tensor([stats[k] for k in keys], device=accelerator.device), reduction="mean")
    return dict(zip(keys, values.tolist()))


def rollout_scalars(accelerator, rollout: TensorDict, with_rewards: bool = True) -> dict[str, float]:
    """Reward (total and per function), completion length, truncation, weight version, partial rollouts (rows a
    push landed in while they were generated: their share, and the most versions one row spans), the collector's
    ``stats`` (time_<phase> seconds -> time/<phase>) and, for multi-turn episodes, :func:`episode_scalars`, over
    all processes."""
    keys = [batch.REWARD] + [(batch.REWARDS, name) for name in rollout[batch.REWARDS].keys()]
    # e.g. dynamic sampling's "stats" and the reward functions' logged metrics: one value per row, averaged
    stats = [(group, k) for group in ("stats", "reward_metrics") if group in rollout.keys()
             for k in rollout[group].keys()]
    columns = [rollout[k].float() for k in keys] + [
        rollout[batch.COMPLETION_MASK].sum(-1).float(),
        (rollout[batch.FINISH_REASON] == batch.FINISH_LENGTH).float(),
        rollout[batch.WEIGHT_VERSION].float(),
        (rollout.get(batch.WEIGHT_VERSION_LAST, rollout[batch.WEIGHT_VERSION]) - rollout[batch.WEIGHT_VERSION]).float(),
    ] + [rollout[key].float() for key in stats]
    signal = batch.ADVANTAGES in rollout.keys()
    if signal:  # completions that teach nothing: advantage exactly 0 (mostly groups whose completions scored alike)
        columns.append((rollout[batch.ADVANTAGES] == 0).float())
    if batch.EPISODE in rollout.keys():
        columns += list(episode_columns(rollout).unbind(1))
    every = accelerator.gather(torch.stack(columns, dim=1).to(accelerator.device))  # [n * processes, k]: one gather
    n = len(keys)
    length, truncated = every[:, n], every[:, n + 1] > 0
    terminated = length[~truncated]  # ended by a stop token (TRL's "terminated"), not cut by the length limit
    out = {
        "train/completion_length_mean": float(length.mean()),
        "train/completion_length_min": float(length.min()),
        "train/completion_length_max": float(length.max()),
        **{f"train/terminated_length_{name}": float(getattr(terminated, name)()) if terminated.numel() else 0.0
           for name in ("mean", "min", "max")},
        "train/truncated_fraction": float(every[:, n + 1].mean()),
        "train/weight_version_mean": float(every[:, n + 2].mean()),
        "train/partial_rollout_fraction": float((every[:, n + 3] > 0).float().mean()),
        "train/weight_version_spread_max": float(every[:, n + 3].max()),
    }
    if batch.EPISODE in rollout.keys():  # multi-turn: the last columns
        out |= {f"train/{k}": v for k, v in episode_scalars(every[:, -len(EPISODE_COLUMNS):]).items()}
    for j, (_, name) in enumerate(stats, start=n + 4):  # the collector's seconds per phase go under time/
        out[f"time/{name[5:]}" if name.startswith("time_") else f"train/{name}"] = float(every[:, j].mean())
    if signal:
        out["train/zero_advantage_fraction"] = float(every[:, n + 4 + len(stats)].mean())
    if "reward_faults" in rollout.keys():  # counts over every process: completions that got a fallback
        names = sorted(rollout["reward_faults"].keys())
        local = torch.stack([rollout["reward_faults", k].float().sum() for k in names]).to(accelerator.device)
        totals = accelerator.reduce(local, reduction="sum") if accelerator.num_processes > 1 else local
        out |= {f"train/reward/{k}": float(v) for k, v in zip(names, totals.tolist())}
    if with_rewards:
        out["train/reward_mean"], out["train/reward_std"] = float(every[:, 0].mean()), float(every[:, 0].std())
        for j, key in enumerate(keys[1:], start=1):  # a function's None (NaN) rows left out, as TRL's nanmean
            judged = every[:, j][~every[:, j].isnan()]
            out[f"train/reward/{key[1]}_mean"] = float(judged.mean()) if judged.numel() else math.nan
            out[f"train/reward/{key[1]}_std"] = float(judged.std()) if judged.numel() > 1 else 0.0
    return out


EPISODE_COLUMNS = ("turns", "tool_calls", "tool_errors", "model_tokens", "tokens")


def episode_columns(rollout: TensorDict) -> torch.Tensor:  # -> [N, len(EPISODE_COLUMNS)] float32
    """Per-episode counts of a multi-turn rollout, in the order of ``EPISODE_COLUMNS``."""
    ep = rollout[batch.EPISODE]
    return torch.stack([ep["turns"], ep["tool_calls"], ep["tool_errors"], batch.loss_mask(rollout).sum(-1),
                        rollout[batch.COMPLETION_MASK].sum(-1)], dim=1).float()


def episode_scalars(columns: torch.Tensor) -> dict[str, float]:
    """Turns and tool calls per episode, the share of tool calls that failed, episode length in tokens (after
    the prompt) and the share of those tokens the model wrote, from :func:`episode_columns` of all episodes."""
    turns, calls, errors, model, tokens = columns.unbind(1)
    return {"episode/turns_mean": float(turns.mean()), "episode/tool_calls_mean": float(calls.mean()),
            "episode/tool_error_rate": float(errors.sum() / calls.sum().clamp(min=1)),
            "episode/tokens_mean": float(tokens.mean()),
            "episode/model_token_fraction": float(model.sum() / tokens.sum().clamp(min=1))}


def sample_rows(rollout: TensorDict, tokenizer, n: int) -> list[dict]:
    """``n`` rows of ``rollout`` from different groups: the prompt as the model read it (special tokens shown), the
    completion as the reward functions read it, the reward and each reward function's value."""
    rows = range(0, rollout.shape[0], max(1, rollout.shape[0] // n))[:n]
    names = list(rollout[batch.REWARDS].keys())
    out = []
    for i in rows:
        prompt = tokenizer.decode(rollout[batch.PROMPT_IDS][i][rollout[batch.PROMPT_MASK][i].bool()])
        completion = tokenizer.decode(rollout[batch.COMPLETION_IDS][i][rollout[batch.COMPLETION_MASK][i].bool()],
                                      skip_special_tokens=True)
        extra = {k: rollout["extra", k][i] for k in rollout["extra"].keys()} if "extra" in rollout.keys() else {}
        out.append({"prompt": prompt, "completion": completion, "reward": float(rollout[batch.REWARD][i]),
                    **{name: float(rollout[batch.REWARDS, name][i]) for name in names}, **extra})
    return out


def samples_markdown(rows: list[dict]) -> str:
    """:func:`sample_rows` as Markdown: the reward and each function's value, then prompt and completion as code."""
    parts = []
    for row in rows:
        terms = ", ".join(f"{k} {v:.3g}" if isinstance(v, float) else f"{k} {v}"  # log_extra's columns: as text
                          for k, v in row.items() if k not in ("prompt", "completion", "reward"))
        parts.append(f"**reward {row['reward']:.3g}** ({terms})\n\nprompt:\n\n{_code(row['prompt'])}\n\n"
                     f"completion:\n\n{_code(row['completion'])}")
    return "\n\n---\n\n".join(parts)


def _code(text: str) -> str:
    """An indented Markdown code block: line breaks and markup in model text stay as they are."""
    return "\n".join("    " + line for line in (text or "(empty)").splitlines() or [""])
