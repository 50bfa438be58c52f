"""Evaluation on held-out prompts: greedy accuracy and sampled pass@k of each reward function."""
from __future__ import annotations

import torch

from grpo_accel import batch as K
from grpo_accel.rewards import RewardSet
from grpo_accel.rollout.collector import score_rollout


class Evaluator:
    """A ``post_iteration`` hook: every ``every`` iterations, scores held-out ``rows`` and logs under eval/.

    For each reward function: ``eval/<fn>/greedy_mean`` (one greedy completion per prompt) and
    ``eval/<fn>/pass@<k>`` (share of prompts where at least one of ``k`` samples reaches
    ``success_threshold``). Sampling is keyed by ``seed``, so every evaluation draws the same random streams.
    Every process evaluates all rows (the results are identical); the main process logs them.

    Example:
        >>> trainer.register_op("post_iteration", Evaluator(engine, tok, held_out, rewards, every=50), "evaluate")
    """

    def __init__(self, engine, tokenizer, rows: list[dict], rewards: RewardSet, *, every: int, k: int = 4,
                 prompt_field: str = "prompt", success_threshold: float = 1.0, seed: int = 1_000_003) -> None:
        if not rows:
            raise ValueError("Evaluator: no held-out rows; set data.holdout (built-in task) or data.eval_path.")
        if every < 1 or k < 1:
            raise ValueError(f"Evaluator: every={every} and k={k} must be >= 1.")
        self.engine, self.tokenizer, self.rows, self.rewards = engine, tokenizer, rows, rewards
        self.every, self.k, self.prompt_field = every, k, prompt_field
        self.success_threshold, self.seed = success_threshold, seed
        self.history: list[dict[str, float]] = []

    def __call__(self, trainer) -> None:
        if trainer.iterations % self.every == 0:
            scalars = self.evaluate()
            self.history.append(scalars)
            trainer.log_scalars(scalars)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        prompts = [self.tokenizer(row[self.prompt_field])["input_ids"] for row in self.rows]
        greedy = self.engine.generate(prompts, 1, greedy=True)
        greedy_scores = score_rollout(greedy, self.rows, 1, self.tokenizer, self.rewards, self.prompt_field)
        sampled = self.engine.generate(prompts, self.k, seeds=[self.seed + i for i in range(len(prompts))])
        sampled_scores = score_rollout(sampled, self.rows, self.k, self.tokenizer, self.rewards, self.prompt_field)
        out = {"eval/reward_greedy_mean": float(greedy_scores[K.REWARD].mean())}
        for name in self.rewards.names:
            per_prompt = sampled_scores[K.REWARDS, name].view(len(prompts), self.k)  # [P, k]
            out[f"eval/{name}/greedy_mean"] = float(greedy_scores[K.REWARDS, name].mean())
            out[f"eval/{name}/pass@{self.k}"] = float((per_prompt >= self.success_threshold).any(-1).float().mean())
        return out
