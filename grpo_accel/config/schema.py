"""Typed run configuration: one dataclass per section, a docstring under every field. YAML files and ``key=value``
overrides become a :class:`GRPOConfig` through :func:`grpo_accel.config.loading.load_config`.

Units are in the names: ``prompts_per_batch`` counts prompts, ``micro_batch_completions`` counts completions.
Every error names the key, the value and the fix. The rollout, rewards and weight_sync sections are in
:mod:`grpo_accel.config.rollout_schema`.

Example:
    >>> cfg = load_config("launch/configs/default.yaml", ["trainer.total_frames=256", "rollout.group_size=4"])
    >>> cfg.rollout.prompts_per_batch * cfg.rollout.group_size
    64
"""
from __future__ import annotations

import dataclasses
import typing
from dataclasses import dataclass, field

from grpo_accel.data.prompts import OVERLONG
from grpo_accel.config.checks import check_choice, check_key, check_rules
from grpo_accel.config.defaults import BUILT_IN_MODEL_SIZES, fill_model_defaults
from grpo_accel.config.outputs import CheckpointConfig, EvalConfig, HubConfig
from grpo_accel.config.rollout_schema import RewardConfig, RolloutConfig, WeightSyncConfig
from grpo_accel.config.secrets import expand_secrets
from grpo_accel.rules import TRAINING_DTYPES
from grpo_accel.tasks import BUILTIN_TASKS, task_max_operand
from grpo_accel.tasks.tiny import TinyModelSpec  # the built-in model's sizes, written once there


@dataclass
class LoraConfig:
    r: int = 0
    """Adapter rank; 0 trains every weight (full fine-tuning), r > 0 trains only a LoRA adapter (PEFT)."""
    alpha: float = 32.0
    """Scale: the adapter adds alpha / r * B A to each targeted weight."""
    dropout: float = 0.0
    """Dropout on the adapter's input while training (0 keeps logprobs deterministic, as pi_old assumes)."""
    target_modules: str | list[str] = "all-linear"
    """Which layers get an adapter: "all-linear" (every linear layer but the output head) or module names such as
    [q_proj, v_proj]."""

    def __post_init__(self) -> None:
        check_key(self.r >= 0, "model.lora.r", self.r, "use 0 (no LoRA) or a positive rank such as 16.")
        check_key(self.alpha > 0, "model.lora.alpha", self.alpha, "use a positive scale such as 2 x r.")
        check_key(0 <= self.dropout < 1, "model.lora.dropout", self.dropout, "use a probability in [0, 1), e.g. 0.")
        check_key(bool(self.target_modules), "model.lora.target_modules", self.target_modules,
                  'use "all-linear" or a list of module names such as [q_proj, v_proj].')


ATTENTION_KERNELS = ("sdpa", "eager", "flash_attention_2", "flash_attention_3", "flash_attention_4", "flex_attention")
"""``model.attn_implementation``'s names (transformers' attention functions); a hub kernel is written org/repo."""


@dataclass
class ModelConfig:
    name_or_path: str | None = None
    """Hugging Face model folder (or hub id); None builds the built-in tiny Llama with random weights."""
    hidden_size: int = TinyModelSpec.hidden_size
    """Built-in model only: width."""
    num_layers: int = TinyModelSpec.num_layers
    """Built-in model only: transformer blocks."""
    num_heads: int = TinyModelSpec.num_heads
    """Built-in model only: attention heads (must divide hidden_size)."""
    intermediate_size: int = TinyModelSpec.intermediate_size
    """Built-in model only: MLP width."""
    dtype: str = "float32"
    """Dtype the weights are loaded and trained in (float32 keeps full-precision weights under
    trainer.mixed_precision's autocast); auto: the checkpoint's own (a float16 one loads as float32, since float16
    weights train without loss scaling)."""
    gradient_checkpointing: bool | None = None
    """Recompute activations in backward instead of storing them (less memory, ~30% more compute); null follows
    the model and the hardware: on for a named model on a CUDA device (TRL's default), off on a CPU and for the
    built-in model (grpo_accel.config.defaults)."""
    attn_implementation: str | None = None
    """Attention kernels, as transformers' from_pretrained takes them: sdpa, eager, flash_attention_2 (needs the
    flash-attn package and a GPU), flash_attention_3, flex_attention, or a hub kernel (org/repo); null:
    transformers' choice (sdpa where the model supports it)."""
    trust_remote_code: bool = False
    """Run the modelling code a model folder or hub repository ships (its config's auto_map), as from_pretrained's
    trust_remote_code: only for models whose code you trust."""
    revision: str | None = None
    """Hub models: the branch, tag or commit to load (from_pretrained's revision); null: the default branch."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter settings (model.lora.r > 0 turns it on)."""
    chat_template: str | None = None
    """A Jinja chat template used in place of the tokenizer's own (open-r1's chat_template); null: its own."""

    def __post_init__(self) -> None:
        check_rules("model", self, hidden_size="positive_count", num_layers="positive_count",
                    num_heads="positive_count", intermediate_size="positive_count")
        check_key(self.hidden_size % self.num_heads == 0, "model.num_heads", self.num_heads,
                  f"must divide model.hidden_size={self.hidden_size}.")
        check_choice("model.dtype", self.dtype, (*TRAINING_DTYPES, "auto"))
        check_key(self.attn_implementation is None or self.attn_implementation in ATTENTION_KERNELS
                  or "/" in self.attn_implementation, "model.attn_implementation", self.attn_implementation,
                  f"use one of {list(ATTENTION_KERNELS)}, a hub kernel such as kernels-community/flash-attn, or null "
                  "(transformers' choice).")


def without_unused(settings: dict) -> dict:
    """``settings`` (a config as nested dicts) less what does nothing: the built-in model's sizes when
    ``model.name_or_path`` names a model. What a run records and what a resume compares."""
    model = settings.get("model") or {}
    if model.get("name_or_path") is None:
        return settings
    return {**settings, "model": {k: v for k, v in model.items() if k not in BUILT_IN_MODEL_SIZES}}


@dataclass
class DataConfig:
    path: str | None = None
    """Prompt rows: a JSONL/Parquet file, a folder written by datasets' save_to_disk, or a Hugging Face dataset id;
    None uses the built-in task."""
    name: str | None = None
    """Hub datasets: the configuration name (load_dataset's second argument)."""
    split: str = "train"
    """Split to train on (hub datasets and saved folders holding several splits)."""
    rename_columns: dict = field(default_factory=dict)
    """Dataset column -> name used here, e.g. {question: prompt} (applied to training and held-out rows)."""
    prompt_field: str = "prompt"
    """Column holding the prompt: a string, or a list of chat messages [{role, content}] for the chat template;
    every other column is passed to the reward functions."""
    system_prompt: str | None = None
    """Prepended as a system message to every chat-formatted prompt that has none; a text prompt with it becomes a
    system and a user message for the chat template (open-r1's system_prompt), so chat rewards get messages."""
    eval_path: str | None = None
    """Held-out rows for evaluation, in any form data.path takes (the built-in task uses holdout instead)."""
    eval_split: str | None = None
    """Split of the held-out rows: of eval_path if set, else of path (e.g. test)."""
    answer_field: str = "answer"
    """Column holding each row's reference answer (the reward functions get it under this name)."""
    answer_format: str = "plain"
    """How that column is written: plain (the answer itself), gsm8k (a worked solution ending "#### 72": the text
    after the last ####) or boxed (a solution whose last \\boxed{...} holds it, as MATH's); applied to training and
    held-out rows."""
    row_transform: str | None = None
    """"package.module:function" called on every row (a dict, after rename_columns, before answer_format) that
    returns the row to train on: for layouts the settings above do not cover."""
    overlong_prompts: str = "error"
    """A prompt longer than rollout.max_prompt_tokens (after the chat template): error (names the row), drop (the
    row leaves the data, counted and said once at start: verl's filter_overlong_prompts) or truncate_left (the
    prompt keeps its last max_prompt_tokens tokens, counted and said once)."""
    task: str = "addition"
    """Built-in task when path is None: addition ("3+4=", for the tiny model), chat_arithmetic (two-digit sums
    and differences asked as chat messages, for a pretrained chat model) or calculator (products "What is
    347*29?", for multi-turn episodes with rollout.environment=calculator)."""
    max_operand: int | None = None
    """Built-in task only: operands are 0..max_operand (addition) or 10..max_operand (the others); null: the
    task's own (addition 4, chat_arithmetic 99, calculator 999)."""
    holdout: int = 0
    """Built-in task only: rows kept out of training for evaluation."""

    def __post_init__(self) -> None:
        check_choice("data.task", self.task, tuple(BUILTIN_TASKS))
        check_choice("data.overlong_prompts", self.overlong_prompts, OVERLONG)
        from grpo_accel.rewards import ANSWER_FORMATS  # the formats reference_answer reads (lazily: it imports torch)

        check_choice("data.answer_format", self.answer_format, ANSWER_FORMATS)
        if self.max_operand is None:  # follows the task
            self.max_operand = task_max_operand(self.task)
        check_rules("data", self, max_operand="positive_count")
        if self.task == "addition":
            check_key(0 <= self.holdout < (self.max_operand + 1) ** 2, "data.holdout", self.holdout,
                      f"must leave training rows: use 0..{(self.max_operand + 1) ** 2 - 1}.")
        check_key(all(isinstance(k, str) and isinstance(v, str) for k, v in self.rename_columns.items()),
                  "data.rename_columns", self.rename_columns,
                  "map column names to column names, e.g. {question: prompt}.")


@dataclass
class LossConfig:
    clip_eps_low: float = 0.2
    """Lower PPO clip: ratio >= 1 - clip_eps_low."""
    clip_eps_high: float = 0.28
    """Upper PPO clip (DAPO's clip-higher): ratio <= 1 + clip_eps_high."""
    kl_coef: float = 0.0
    """KL-to-reference weight; 0 builds no reference model and runs no reference forward."""
    kl_estimator: str = "k3"
    """KL estimator (k3 is the GRPO paper's)."""
    aggregation: str = "token_mean"
    """token_mean (DAPO), seq_mean_token_mean (GRPO), seq_mean_token_sum_norm (Dr. GRPO: / the completion budget,
    rollout.max_new_tokens, or for multi-turn episodes the episode's: max_turns x max_new_tokens, at most
    max_episode_tokens)."""
    importance_level: str = "token"
    """token: per-token ratio (GRPO); sequence: length-normalised sequence ratio (GSPO)."""
    tis_cap: float | None = None
    """Importance sampling against the engine's logprobs: weight pi_old/pi_engine, kept at most this; None = off."""
    tis_mode: str = "token_truncate"
    """token_truncate, token_mask (0 outside [tis_min, tis_cap]), sequence_truncate or sequence_mask."""
    tis_min: float | None = None
    """The lower bound of that range (None: none)."""
    kl_importance_weighted: bool = False
    """KL term x the ratio pi/pi_old (TRL's use_bias_correction_kl: the unbiased reverse-KL gradient)."""
    scale_advantages: bool = True
    """Divide group-centred rewards by the group's std (off for Dr. GRPO)."""
    leave_one_out: bool = False
    """Baseline = mean of the other G-1 rewards (RLOO) instead of the group mean."""
    mask_truncated: bool = False
    """Completions cut by rollout.max_new_tokens (finish reason "length") leave the loss (DAPO's overlong
    filtering, TRL's mask_truncated_completions); their rewards still count in their groups' mean and std, as in
    both. DAPO's soft length penalty is the reward overlong_penalty."""
    packing: bool = False
    """Padding-free training: rows packed with per-row position ids (checked against padded logprobs once)."""
    shared_prompts: bool = True
    """A group's prompt runs once for several of its completions in training's forwards (one row per prompt and k
    completions under a 4-D mask; checked against padded logprobs once; off with packing)."""

    def __post_init__(self) -> None:
        check_rules("loss", self, clip_eps_low="clip_epsilon", clip_eps_high="clip_epsilon", kl_coef="kl_coef",
                    tis_cap="tis_cap")
        from grpo_accel.loss import AGGREGATIONS, IMPORTANCE_LEVELS, KL_ESTIMATORS  # the registries are the choices

        check_choice("loss.kl_estimator", self.kl_estimator, tuple(KL_ESTIMATORS))
        check_choice("loss.aggregation", self.aggregation, tuple(AGGREGATIONS))
        check_choice("loss.importance_level", self.importance_level, tuple(IMPORTANCE_LEVELS))
        from grpo_accel.loss import TIS_MODES

        check_choice("loss.tis_mode", self.tis_mode, TIS_MODES)


LOG_LEVELS = ("debug", "info", "warning", "error")


@dataclass
class OptimConfig:
    lr: float | None = None
    """AdamW learning rate (the peak, after warmup); null follows the model: 1e-6 for a model named by
    model.name_or_path (TRL's default), 3e-4 for the built-in tiny one (grpo_accel.config.defaults)."""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas: the gradient and squared-gradient moving averages."""
    eps: float = 1e-8
    """AdamW's epsilon, added to the squared-gradient root (TRL's adam_epsilon)."""
    clip_norm: float | None = 1.0
    """Gradient clipping norm; null turns it off."""
    scheduler: str = "constant"
    """Learning rate after warmup, over the run's optimizer steps: constant, linear (down to 0 at the last step) or
    cosine (half a cosine down to optim.min_lr_ratio x optim.lr at the last step)."""
    min_lr_ratio: float = 0.0
    """cosine's floor as a share of optim.lr (TRL's cosine_with_min_lr's min_lr_rate)."""
    warmup_steps: int = 0
    """Optimizer steps over which the learning rate rises linearly from 0 to optim.lr (0: none)."""
    warmup_ratio: float = 0.0
    """Warmup as a share of the run's optimizer steps (e.g. 0.1); give warmup_steps or warmup_ratio, not both."""

    def __post_init__(self) -> None:
        check_key(self.lr is None or self.lr > 0, "optim.lr", self.lr, "must be > 0.")
        check_key(len(self.betas) == 2, "optim.betas", self.betas, "give two values, e.g. [0.9, 0.99].")
        from grpo_accel.trainer.stepper import SCHEDULES
        check_choice("optim.scheduler", self.scheduler, SCHEDULES)
        check_key(0 <= self.min_lr_ratio < 1, "optim.min_lr_ratio", self.min_lr_ratio,
                  "use a share of optim.lr in [0, 1), e.g. 0.1.")
        check_key(self.eps > 0, "optim.eps", self.eps, "must be > 0, e.g. 1e-8.")
        check_rules("optim", self, warmup_steps="non_negative_count")
        check_key(0 <= self.warmup_ratio < 1, "optim.warmup_ratio", self.warmup_ratio,
                  "use a share of the run's optimizer steps in [0, 1), e.g. 0.1.")
        check_key(not (self.warmup_steps and self.warmup_ratio), "optim.warmup_ratio", self.warmup_ratio,
                  f"optim.warmup_steps={self.warmup_steps} is set too; give one of them (the other 0).")

    def warmup(self, total_steps: int) -> int:
        """Warmup in optimizer steps for a run of ``total_steps``."""
        return self.warmup_steps or round(self.warmup_ratio * total_steps)


@dataclass
class GRPOTrainerConfig:
    total_frames: int = 128 * 1000
    """Completions to collect over the run (a frame is one completion)."""
    num_epochs: int = 1
    """Passes over each collected batch."""
    micro_batch_completions: int | typing.Literal["auto"] = "auto"
    """Completions per forward/backward on one process (the replay buffer's batch size); "auto": each process's
    completions per collected batch / gradient_accumulation_steps, so that any process count dividing the prompts fits."""
    gradient_accumulation_steps: int = 1
    """Micro-batches per optimizer step."""
    optim_steps_per_batch: int | None = None
    """Micro-batches drawn per batch and epoch; null = the whole buffer once per epoch."""
    empty_replay_buffer_on_weight_update: bool = True
    """Empty the replay buffer after each weight push (synchronous, on-policy GRPO)."""
    mixed_precision: str | None = None
    """Autocast for forward/backward: no | bf16 | fp16 (fp16 adds a gradient scaler); null follows the model and the
    hardware: bf16 for a named model on a CUDA device (fp16 on one without bfloat16), as TRL's default; no on a
    CPU and for the built-in model (grpo_accel.config.defaults)."""
    async_collection: bool = False
    """Generate the next batches in a background thread while optimising (the engine gets its own weights copy)."""
    max_staleness: int | None = 1
    """Async: drop batches generated with weights more than this many pushes old (null: keep all)."""
    weight_update_frequency: int = 1
    """Async: optimizer steps between weight pushes to the engine (sync pushes once per batch)."""
    seed: int = 0
    """Seeds torch, the data order and every sampling key: the same seed draws the same run."""
    log_interval: int = 1
    """Frames between logs (1: every collected batch)."""
    log_first: bool = True
    """Log the first collected batch whatever log_interval says (TRL's logging_first_step; TRL's default: false)."""
    log_level: str = "info"
    """The main process's console: debug, info, warning or error (grpo_accel's own lines)."""
    progress_bar: bool = True
    """A tqdm bar over completions (frames) on the main process."""
    log_timings: bool = False
    """Log wall time of each phase under time/."""
    log_rewards: bool = True
    """Log the reward mean and std, total and per reward function (train/reward_*, train/reward/*)."""
    log_kl: bool = True
    """Log the loss's KL scalars (false drops the loss's kl_outputs: train/loss_kl, train/kl_ref and
    train/kl_approx; other scalars with "kl" in their names stay)."""
    log_samples: int = 3
    """Completions logged at each log (prompt, completion, rewards): a table in W&B, MLflow and Trackio, text in
    TensorBoard; 0: none."""
    report_to: list[str] = field(default_factory=lambda: ["tensorboard"])
    """Experiment trackers, as Accelerate's log_with names them (TRL's report_to): tensorboard, wandb, mlflow,
    trackio, comet_ml, aim, clearml, dvclive, swanlab; [] for none. Each gets every logged scalar, the resolved
    config as hyperparameters, and samples; wandb, mlflow and trackio continue their run on a resume."""
    project: str = "grpo_accel"
    """Trackers' project (W&B and Trackio project, MLflow experiment)."""
    run_name: str | None = None
    """Trackers' run name; null: the name of output_dir's folder."""
    tracker_kwargs: dict = field(default_factory=dict)
    """Each tracker's own start-up arguments, e.g. {wandb: {entity: my-team, tags: [grpo]}} (Accelerate's
    init_kwargs); an entry named like a secret (api_key, token, password, ...) is one: ${NAME} reads it from the
    environment, and the run's records hold *** or the reference."""

    def __post_init__(self) -> None:
        check_rules("trainer", self, total_frames="positive_count", num_epochs="positive_count",
                    gradient_accumulation_steps="positive_count", log_interval="positive_count",
                    weight_update_frequency="positive_count", optim_steps_per_batch="optional_count",
                    log_samples="log_samples", max_staleness="max_staleness")
        check_choice("trainer.log_level", self.log_level, LOG_LEVELS)
        check_key(self.micro_batch_completions == "auto" or self.micro_batch_completions >= 1,
                  "trainer.micro_batch_completions", self.micro_batch_completions, "must be >= 1 or auto.")
        if self.mixed_precision is not None:  # null: filled by GRPOConfig (grpo_accel.config.defaults)
            check_choice("trainer.mixed_precision", self.mixed_precision, ("no", "bf16", "fp16"))
        from grpo_accel.reporting.trackers import TRACKERS

        for name in self.report_to:
            check_choice(f"trainer.report_to[{name!r}]", name, TRACKERS)
        check_key(len(set(self.report_to)) == len(self.report_to), "trainer.report_to", self.report_to,
                  "name each tracker once.")
        check_key(set(self.tracker_kwargs) <= set(self.report_to), "trainer.tracker_kwargs", self.tracker_kwargs,
                  f"give arguments only for trackers in trainer.report_to={self.report_to}.")


@dataclass
class GRPOConfig:
    output_dir: str = "runs/default"
    """Run folder: tensorboard/, checkpoints/, the resolved config.yaml, summary.json."""
    overwrite: bool = False
    """true: a fresh run deletes an earlier run's checkpoints/, tensorboard/ and summary.json in output_dir first
    (false: it refuses such a folder; checkpoint.resume=auto continues that run instead)."""
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    loss: LossConfig = field(default_factory=LossConfig)
    rewards: list[RewardConfig] = field(default_factory=lambda: [RewardConfig("answer_match", 1.0),
                                                                 RewardConfig("format_match", 0.2)])
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: GRPOTrainerConfig = field(default_factory=GRPOTrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)
    hub: HubConfig = field(default_factory=HubConfig)

    def as_dict(self) -> dict:
        """The settings as nested dicts, less those that do nothing here (:func:`without_unused`)."""
        return without_unused(dataclasses.asdict(self))

    def __post_init__(self) -> None:
        # null settings that follow the model and the hardware (grpo_accel.config.defaults); what they took is said
        # at start (no field: config.yaml records the values themselves)
        self.followed_defaults = fill_model_defaults(self)
        self.trl_sources: dict[str, str] = {}  # setting -> the TRL file's key it came from (load_config's)
        # secrets written ${NAME} read from the environment; their references are what the run records
        self.secret_references = expand_secrets(self)
        check_key(bool(self.rewards), "rewards", self.rewards, "list at least one reward function.")
        names = [r.name for r in self.rewards]
        check_key(len(set(names)) == len(names), "rewards", names, "each reward function may appear once.")
        check_key(not (self.rollout.colocate and self.trainer.async_collection), "rollout.colocate", True,
                  "colocated servers free their memory while the trainer trains, so they cannot generate then; set "
                  "trainer.async_collection=false, or run the servers on GPUs of their own.")
        check_key(not self.rollout.embedded_worker or self.trainer.async_collection, "rollout.embedded_worker",
                  self.rollout.embedded_worker, "a decode worker runs beside training only with "
                  "trainer.async_collection=true (synchronous GRPO waits for generation anyway); set both or neither.")
