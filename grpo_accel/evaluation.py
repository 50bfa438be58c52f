"""Evaluation on held-out prompts: greedy accuracy and sampled pass@k of each reward function."""
from __future__ import annotations

import torch

from grpo_accel import batch as K
from grpo_accel.data import encode_prompts
from grpo_accel.rewards import RewardSet
from grpo_accel.rollout.collector import score_rollout


class Evaluator:
    """Scores held-out ``rows`` and logs under eval/: before training (``pre_train`` hook
    :meth:`before_training`), every ``every`` iterations and after the last (``post_iteration`` hook, the call).

    For each reward function: ``eval/<fn>/greedy_mean`` (one greedy completion per prompt) and
    ``eval/<fn>/pass@<k>`` (share of prompts where at least one of ``k`` samples reaches
    ``success_threshold``). Sampling is keyed by ``seed``, so every evaluation draws the same random streams.
    Every process evaluates all rows (the results are identical); the main process logs them.

    Example:
        >>> evaluator = Evaluator(engine, tok, held_out, rewards, every=50)
        >>> trainer.register_op("pre_train", evaluator.before_training, "evaluate_untrained")
        >>> trainer.register_op("post_iteration", evaluator, "evaluate")
    """

    def __init__(self, engine, tokenizer, rows: list[dict], rewards: RewardSet, *, every: int, k: int = 4,
                 prompt_field: str = "prompt", system_prompt: str | None = None, success_threshold: float = 1.0,
                 seed: int = 1_000_003) -> None:
        if not rows:
            raise ValueError("Evaluator: no held-out rows; set data.holdout (built-in task) or data.eval_path.")
        if every < 1 or k < 1:
            raise ValueError(f"Evaluator: every={every} and k={k} must be >= 1.")
        self.engine, self.tokenizer, self.rows, self.rewards = engine, tokenizer, rows, rewards
        self.every, self.k, self.prompt_field = every, k, prompt_field
        self.prompts = encode_prompts(rows, tokenizer, prompt_field=prompt_field, system_prompt=system_prompt,
                                      source="held-out rows")
        self.success_threshold, self.seed = success_threshold, seed
        self.history: list[dict[str, float]] = []

    def __call__(self, trainer) -> None:
        """``post_iteration``: every ``every`` iterations and after the last."""
        if trainer.iterations % self.every == 0 or trainer.frames >= trainer.total_frames:
            self._log(trainer)

    def before_training(self, trainer) -> None:
        """``pre_train``: the untrained model's scores, logged at iteration 0 (a resumed run has them)."""
        if trainer.iterations == 0:
            self._log(trainer)

    def _log(self, trainer) -> None:
        scalars = self.evaluate()
        self.history.append(scalars)
        trainer.log_scalars(scalars)

    @torch.no_grad()
    def evaluate(self) -> dict[str, float]:
        prompts = self.prompts.ids
        greedy = self.engine.generate(prompts, 1, greedy=True)
        greedy_scores = self._score(greedy, 1)
        sampled = self.engine.generate(prompts, self.k, seeds=[self.seed + i for i in range(len(prompts))])
        sampled_scores = self._score(sampled, self.k)
        out = {"eval/reward_greedy_mean": float(greedy_scores[K.REWARD].mean())}
        for name in self.rewards.names:
            per_prompt = sampled_scores[K.REWARDS, name].view(len(prompts), self.k)  # [P, k]
            out[f"eval/{name}/greedy_mean"] = float(greedy_scores[K.REWARDS, name].mean())
            out[f"eval/{name}/pass@{self.k}"] = float((per_prompt >= self.success_threshold).any(-1).float().mean())
        return out

    def _score(self, td, group_size: int):
        return score_rollout(td, self.rows, self.prompts, group_size, self.tokenizer, self.rewards, self.prompt_field)
