"""Evaluation on held-out prompts: greedy accuracy and sampled pass@k of each reward function."""
from __future__ import annotations

import torch

from grpo_accel import batch
from grpo_accel.data.prompts import encode_prompts
from grpo_accel.reporting.metrics import episode_columns, episode_scalars
from grpo_accel.rewards import RewardSet
from grpo_accel.rollout.collector import score_rollout
from grpo_accel.rules import check


class Evaluator:
    """Scores held-out ``rows`` and logs under eval/: before training (``pre_train`` hook
    :meth:`before_training`), every ``every`` iterations and after the last (``post_iteration`` hook, the call).

    For each reward function: ``eval/<fn>/greedy_mean`` (one greedy completion per prompt) and
    ``eval/<fn>/pass@<k>`` (share of prompts where at least one of ``k`` samples reaches
    ``success_threshold``), and ``eval/stopped_fraction`` (share of greedy replies that end on their own, not
    cut by the token limit). Sampling is keyed by ``seed``, so every evaluation draws the same random streams.
    Every process evaluates all rows (the results are identical); the main process logs them.

    Example:
        >>> evaluator = Evaluator(engine, tok, held_out, rewards, every=50)
        >>> trainer.register_op("pre_train", evaluator.before_training, "evaluate_untrained")
        >>> trainer.register_op("post_iteration", evaluator, "evaluate")
    """

    def __init__(self, engine, tokenizer, rows: list[dict], rewards: RewardSet, *, every: int, k: int = 4,
                 prompt_field: str = "prompt", system_prompt: str | None = None, success_threshold: float = 1.0,
                 seed: int = 1_000_003, episodes=None) -> None:
        if not rows:
            raise ValueError("Evaluator: rows is empty; pass the held-out rows to evaluate on.")
        check("positive_count", "every", every, owner="Evaluator: ")
        check("positive_count", "k", k, owner="Evaluator: ")
        self.engine, self.tokenizer, self.rows, self.rewards = engine, tokenizer, rows, rewards
        self.every, self.k, self.prompt_field = every, k, prompt_field
        self.episodes = episodes  # an EpisodeRunner: held-out rows are multi-turn episodes
        self.prompts = encode_prompts(rows, tokenizer, prompt_field=prompt_field, system_prompt=system_prompt,
                                      source="held-out rows") if episodes is None else episodes.encode(
                                          rows, source="held-out rows")
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
        n = len(self.rows)
        greedy_scores, greedy = self._rollout(1, [0] * n, greedy=True)
        sampled_scores, _ = self._rollout(self.k, [self.seed + i for i in range(n)])
        out = {"eval/reward_greedy_mean": float(greedy_scores[batch.REWARD].mean()),
               "eval/stopped_fraction": float((greedy[batch.FINISH_REASON] == batch.FINISH_STOP).float().mean())}
        for name in self.rewards.names:
            per_prompt = sampled_scores[batch.REWARDS, name].view(n, self.k)  # [P, k]
            out[f"eval/{name}/greedy_mean"] = float(greedy_scores[batch.REWARDS, name].nanmean())  # None: left out
            out[f"eval/{name}/pass@{self.k}"] = float((per_prompt >= self.success_threshold).any(-1).float().mean())
        if batch.EPISODE in greedy.keys():
            out |= {f"eval/{key}": value for key, value in episode_scalars(episode_columns(greedy)).items()}
        return out

    def _rollout(self, group_size: int, seeds: list[int], greedy: bool = False):
        """(scores, rollout) of every held-out row, ``group_size`` completions (or episodes) each."""
        if self.episodes is None:
            td, episodes = self.engine.generate(self.prompts.ids, group_size, seeds=seeds, greedy=greedy), None
        else:
            td, episodes = self.episodes.run(self.rows, self.prompts, group_size, seeds, greedy=greedy)
        return score_rollout(td, self.rows, self.prompts, group_size, self.tokenizer, self.rewards,
                             self.prompt_field, episodes), td
