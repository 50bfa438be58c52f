"""The config sections of what a run leaves behind: ``eval`` (held-out pass@k while training), ``checkpoint``
(when to save, what to keep, where to resume from) and ``hub`` (the Hugging Face Hub upload, TRL's ``push_to_hub``
and ``hub_*`` keys; the uploader is :class:`grpo_accel.run.hub.HubPusher`). The rest of the schema is
:mod:`grpo_accel.config.schema`."""
from __future__ import annotations

from dataclasses import dataclass

from grpo_accel.config.checks import check_choice, check_key, check_rules

STRATEGIES = ("end", "every_save", "checkpoint", "all_checkpoints")
"""``hub.strategy``'s choices."""


@dataclass
class EvalConfig:
    every_iterations: int = 0
    """Evaluate every this many iterations on the held-out rows; 0 turns evaluation off."""
    k: int = 4
    """Samples per prompt for pass@k."""
    success_threshold: float = 1.0
    """A sample passes when a reward function's value reaches this."""

    def __post_init__(self) -> None:
        check_rules("eval", self, every_iterations="non_negative_count", k="positive_count")


@dataclass
class CheckpointConfig:
    interval_frames: int | None = 12800
    """Save every this many frames (completions); null: only at the end and when stopped (signal, request)."""
    resume: str | None = None
    """null: start fresh; "auto": newest complete checkpoint in output_dir/checkpoints (fresh if none); or a folder."""
    keep_last: int = 3
    """Complete checkpoints kept (the newest is never deleted)."""
    keep_best: int = 0
    """Additionally keep this many best checkpoints by best_metric."""
    best_metric: str = "train/reward_mean"
    """The logged scalar that ranks checkpoints for keep_best."""
    best_mode: str = "max"
    """"max" or "min": which end of best_metric is best."""
    legacy_file: str | None = None
    """Also write a single-file torch payload here (the spec's save_trainer_file; read by load_from_file)."""

    def __post_init__(self) -> None:
        check_rules("checkpoint", self, interval_frames="optional_count", keep_last="keep_last",
                    keep_best="non_negative_count", best_mode="best_mode")



@dataclass
class HubConfig:
    push: bool = False
    """Upload the trained model to the Hub (TRL's push_to_hub): the exported model folder at the repository's root."""
    model_id: str | None = None
    """The repository, namespace/name or a name under the token's user; null: output_dir's folder name (TRL's)."""
    strategy: str = "every_save"
    """When: end (once, after training), every_save (after every checkpoint), checkpoint (that, and the newest
    checkpoint folder under last-checkpoint/, to resume from), all_checkpoints (every checkpoint in its own folder)."""
    private: bool | None = None
    """Create the repository private (null: the Hub's default)."""
    token: str | None = None
    """A Hub token with write access (a secret: ${HF_TOKEN} reads the environment); null: the logged-in one."""
    revision: str | None = None
    """The branch to push to (null: main)."""
    always_push: bool = False
    """Wait for a push still running rather than skip a checkpoint."""
    endpoint: str | None = None
    """The Hub's address (null: HF_ENDPOINT, else huggingface.co): a private Hub or a mirror."""

    def __post_init__(self) -> None:
        check_choice("hub.strategy", self.strategy, STRATEGIES)
        check_key(self.model_id is None or self.model_id.count("/") <= 1, "hub.model_id", self.model_id,
                  "use name or namespace/name.")
