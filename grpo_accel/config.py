"""Typed run configuration: dataclasses (one per concern), YAML files and ``key=value`` overrides.

Units are in the names: ``prompts_per_batch`` counts prompts, ``micro_batch_completions`` counts completions.
Every error names the key, the value and the fix.

Example:
    >>> cfg = load_config("launch/configs/default.yaml", ["trainer.total_frames=256", "rollout.group_size=4"])
    >>> cfg.rollout.completions_per_batch
    64
"""
from __future__ import annotations

import dataclasses
import types
import typing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import yaml

from grpo_accel.layout import CONFIG_NAMES, BatchLayout
from grpo_accel.sglang_api import PAUSE_MODES
from grpo_accel.rules import check, require
from grpo_accel.tasks import BUILTIN_TASKS


class ConfigError(ValueError):
    """A configuration value is missing, unknown or invalid; the message says which and how to fix it."""


def _check(ok: bool, key: str, value: Any, fix: str) -> None:
    require(ok, key, value, fix, ConfigError)


def _rules(section: str, values: Any, **rules: str) -> None:
    """Each field named in ``rules`` kept to its rule in :mod:`grpo_accel.rules` (the one the API checks too)."""
    for name, rule in rules.items():
        check(rule, f"{section}.{name}", getattr(values, name), ConfigError)


DECODERS = ("auto", "fast", "compiled", "generate")  # the embedded engine's decode paths (rollout.decoder)


def _choice(key: str, value: Any, options: tuple) -> None:
    _check(value in options, key, value, f"must be one of {list(options)}.")


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
        _check(self.r >= 0, "model.lora.r", self.r, "use 0 (no LoRA) or a positive rank such as 16.")
        _check(self.alpha > 0, "model.lora.alpha", self.alpha, "use a positive scale such as 2 x r.")
        _check(0 <= self.dropout < 1, "model.lora.dropout", self.dropout, "use a probability in [0, 1), e.g. 0.")
        _check(bool(self.target_modules), "model.lora.target_modules", self.target_modules,
               'use "all-linear" or a list of module names such as [q_proj, v_proj].')


@dataclass
class ModelConfig:
    name_or_path: str | None = None
    """Hugging Face model folder (or hub id); None builds the built-in tiny Llama with random weights."""
    hidden_size: int = 64
    """Built-in model only: width."""
    num_layers: int = 2
    """Built-in model only: transformer blocks."""
    num_heads: int = 4
    """Built-in model only: attention heads (must divide hidden_size)."""
    intermediate_size: int = 128
    """Built-in model only: MLP width."""
    dtype: str = "float32"
    """Dtype the weights are loaded in (mixed precision is trainer.mixed_precision)."""
    gradient_checkpointing: bool = False
    """Recompute activations in backward instead of storing them (less memory, ~30% more compute)."""
    lora: LoraConfig = field(default_factory=LoraConfig)
    """LoRA adapter settings (model.lora.r > 0 turns it on)."""

    def __post_init__(self) -> None:
        for key in ("hidden_size", "num_layers", "num_heads", "intermediate_size"):
            _check(getattr(self, key) > 0, f"model.{key}", getattr(self, key), "must be a positive integer.")
        _check(self.hidden_size % self.num_heads == 0, "model.num_heads", self.num_heads,
               f"must divide model.hidden_size={self.hidden_size}.")
        _choice("model.dtype", self.dtype, ("float32", "bfloat16"))


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
    """Prepended as a system message to every chat-formatted prompt that has none."""
    eval_path: str | None = None
    """Held-out rows for evaluation, in any form data.path takes (the built-in task uses holdout instead)."""
    eval_split: str | None = None
    """Split of the held-out rows: of eval_path if set, else of path (e.g. test)."""
    task: str = "addition"
    """Built-in task when path is None: addition ("3+4=", for the tiny model), chat_arithmetic (two-digit sums
    and differences asked as chat messages, for a pretrained chat model) or calculator (products "What is
    347*29?", for multi-turn episodes with rollout.environment=calculator)."""
    max_operand: int = 4
    """Built-in task only: operands are 0..max_operand (addition) or 10..max_operand (the others)."""
    holdout: int = 0
    """Built-in task only: rows kept out of training for evaluation."""

    def __post_init__(self) -> None:
        _choice("data.task", self.task, tuple(BUILTIN_TASKS))
        _check(self.max_operand >= 1, "data.max_operand", self.max_operand, "must be >= 1.")
        if self.task == "addition":
            _check(0 <= self.holdout < (self.max_operand + 1) ** 2, "data.holdout", self.holdout,
                   f"must leave training rows: use 0..{(self.max_operand + 1) ** 2 - 1}.")
        _check(all(isinstance(k, str) and isinstance(v, str) for k, v in self.rename_columns.items()),
               "data.rename_columns", self.rename_columns, "map column names to column names, e.g. {question: prompt}.")


@dataclass
class RolloutConfig:
    backend: str = "embedded"
    """Inference engine: "embedded" (transformers generate in the trainer process) or "sglang" (HTTP servers)."""
    urls: list[str] = field(default_factory=list)
    """SGLang: one server URL per engine replica, e.g. [http://10.0.0.2:30000]."""
    api_key: str | None = None
    """SGLang: the servers' --api-key, sent as a bearer token (/generate, /server_info; weight endpoints too when
    the servers have no --admin-api-key)."""
    health_timeout_s: float = 300.0
    """SGLang: how long to wait for /health on every server at start."""
    request_retries: int = 3
    """SGLang: retries (exponential backoff) of one request for 5xx answers, unreachable servers and timeouts,
    and aborts that brought no token (an abort with tokens is continued, never counted)."""
    request_size: int = 64
    """SGLang: completions per /generate request at most; a server's share of a batch goes out as several
    requests at once, each retried on its own."""
    request_timeout_s: float = 600.0
    """SGLang: seconds one /generate request may take before it counts as failed and is sent again."""
    prompts_per_batch: int = 16
    """Prompts per collected batch, over all processes."""
    group_size: int = 8
    """Completions sampled per prompt (GRPO's G); at least 2."""
    max_new_tokens: int = 4
    """Completion budget in tokens; longer completions finish with reason "length"."""
    max_prompt_tokens: int = 64
    """A longer prompt (after the chat template) is an error that names its dataset row."""
    temperature: float = 1.0
    """Sampling temperature; the loss divides logits by the same value."""
    top_p: float = 1.0
    """Nucleus sampling (1.0 = off). Filters bias the importance ratio: engine logprobs are pre-filter."""
    top_k: int = 0
    """Top-k sampling (0 = off). Same caveat as top_p."""
    dynamic_sampling: bool = False
    """Drop groups whose rewards all tie and sample more prompts to refill the batch (DAPO)."""
    max_extra_rounds: int = 4
    """Dynamic sampling: extra generation rounds per batch at most; tied groups fill what is still missing."""
    decoder: str = "auto"
    """Embedded: "fast" (the model's forward in grpo_accel's decode loop), "compiled" (the same, the forward under
    torch.compile: seconds to minutes at start, then faster steps), "generate" (transformers' generate), "auto"
    (fast unless the model has sliding-window or linear attention). Same tokens for the same seeds."""
    embedded_worker: bool = False
    """Embedded, with trainer.async_collection on CPU: decode in a worker process of its own, so that generation
    runs on another core beside training (in one process they take turns on Python's interpreter lock)."""
    environment: str | None = None
    """Multi-turn episodes: "calculator" (the built-in tool environment: a calculator the model may call) or
    "package.module:factory", a callable returning a fresh grpo_accel.rollout.episodes.Environment per episode.
    None: one completion per prompt."""
    max_turns: int = 4
    """Episodes: model turns per episode at most; an episode still calling tools after them is cut ("length")."""
    max_episode_tokens: int | None = None
    """Episodes: tokens after the prompt (the model's and the environment's) at most; None: no limit besides
    max_turns x max_new_tokens of the model's own."""
    tool_timeout_s: float = 10.0
    """Episodes with the built-in tool environment: each tool call's time limit; a slower call is answered with
    an error message, as are failing calls."""
    colocate: bool = False
    """SGLang on the trainer's own GPUs (servers started with --enable-memory-saver): they free their KV cache,
    weights and CUDA graphs while the trainer optimises and take them back around each push."""
    zero3_gather_full: bool = False
    """ZeRO-3 only: gather the whole policy once around generation (every rank then holds the full model)
    instead of DeepSpeed fetching each module's shards at every decoding step (memory bounded by a module)."""

    def __post_init__(self) -> None:
        _choice("rollout.backend", self.backend, ("embedded", "sglang"))
        _check(self.backend != "sglang" or bool(self.urls), "rollout.urls", self.urls,
               "rollout.backend=sglang needs the server URLs, e.g. rollout.urls=[http://host:30000].")
        _rules("rollout", self, group_size="group_size", prompts_per_batch="positive_count",
               max_new_tokens="positive_count", max_prompt_tokens="positive_count", temperature="temperature",
               top_p="top_p", top_k="top_k", max_extra_rounds="non_negative_count", max_turns="max_turns",
               max_episode_tokens="optional_count", tool_timeout_s="seconds", request_size="positive_count",
               request_timeout_s="seconds", request_retries="non_negative_count")
        _choice("rollout.decoder", self.decoder, DECODERS)
        _check(not self.embedded_worker or self.backend == "embedded", "rollout.embedded_worker", self.embedded_worker,
               "a decode worker belongs to the embedded engine; set rollout.backend=embedded or drop it.")
        _check(not self.colocate or self.backend == "sglang", "rollout.colocate", self.colocate,
               "colocation shares the trainer's GPUs with SGLang servers; set rollout.backend=sglang or drop it.")

    @property
    def completions_per_batch(self) -> int:
        return self.prompts_per_batch * self.group_size

    @property
    def model_tokens_per_completion(self) -> int:
        """The most tokens the model writes in one completion (or episode): Dr. GRPO's constant normaliser."""
        if self.environment is None:
            return self.max_new_tokens
        turns = self.max_turns * self.max_new_tokens
        return turns if self.max_episode_tokens is None else min(turns, self.max_episode_tokens)


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
    """token_mean (DAPO), seq_mean_token_mean (GRPO), seq_mean_token_sum_norm (Dr. GRPO, / max_new_tokens)."""
    importance_level: str = "token"
    """token: per-token ratio (GRPO); sequence: length-normalised sequence ratio (GSPO)."""
    tis_cap: float | None = None
    """Truncated importance sampling against the engine's logprobs: weight min(pi_old/pi_engine, cap); None = off."""
    scale_advantages: bool = True
    """Divide group-centred rewards by the group's std (off for Dr. GRPO)."""
    leave_one_out: bool = False
    """Baseline = mean of the other G-1 rewards (RLOO) instead of the group mean."""
    packing: bool = False
    """Padding-free training: rows packed with per-row position ids (checked against padded logprobs once)."""

    def __post_init__(self) -> None:
        _rules("loss", self, clip_eps_low="clip_epsilon", clip_eps_high="clip_epsilon", kl_coef="kl_coef",
               tis_cap="tis_cap")
        from grpo_accel.loss import AGGREGATIONS, IMPORTANCE_LEVELS, KL_ESTIMATORS  # the registries are the choices

        _choice("loss.kl_estimator", self.kl_estimator, tuple(KL_ESTIMATORS))
        _choice("loss.aggregation", self.aggregation, tuple(AGGREGATIONS))
        _choice("loss.importance_level", self.importance_level, tuple(IMPORTANCE_LEVELS))


@dataclass
class RewardConfig:
    name: str = "answer_match"
    """A built-in (answer_match, format_match, math_answer, env_reward), reward_model (path), remote (url) or
    "package.module:function"."""
    weight: float = 1.0
    """Weight in the total reward."""
    kwargs: dict = field(default_factory=dict)
    """Keyword arguments bound to the function (e.g. {pattern: "\\\\d+"} for format_match; reward_model:
    output_index, scale, max_length)."""
    normalize: str = "none"
    """Standardise this reward before the weighted sum: none, group (within each prompt's group) or batch."""
    processes: int = 0
    """A function: > 0 runs it in that many worker processes, each call (one completion) limited to timeout_s."""
    timeout_s: float | None = None
    """Seconds a call may take: per completion in worker processes (default 10), per batch for an async
    function or a reward service (default 30 for a service); null: no limit."""
    fallback: float | None = None
    """The value of a call that overruns or fails; null: such a failure stops the run."""
    path: str | None = None
    """reward_model: the Hugging Face sequence-classification model folder (its tokenizer beside it)."""
    url: str | None = None
    """remote: the reward service's URL, e.g. http://host:8000/score (launch/reward_server.py serves one)."""
    retries: int = 2
    """remote: retries of a batch after a 5xx answer, a timeout or an unreachable service."""
    batch_size: int = 32
    """reward_model and remote: completions scored per forward / per request."""
    api_key: str | None = None
    """remote: sent as a bearer token."""
    dtype: str = "float32"
    """reward_model: the dtype it is loaded in (float32, bfloat16, float16)."""

    def __post_init__(self) -> None:
        key = f"rewards[name={self.name}]"
        _choice(f"{key}.normalize", self.normalize, ("none", "group", "batch"))
        _check(self.name != "reward_model" or bool(self.path), f"{key}.path", self.path,
               "a reward model needs its folder: path=DIR (a sequence-classification model and its tokenizer).")
        _check(self.name != "remote" or bool(self.url), f"{key}.url", self.url,
               "a reward service needs url=http://host:port/score (launch/reward_server.py serves one).")
        _check(self.processes >= 0, f"{key}.processes", self.processes, "must be >= 0 (0: in the trainer's process).")
        _check(self.timeout_s is None or self.timeout_s > 0, f"{key}.timeout_s", self.timeout_s, "must be > 0 seconds.")
        _check(self.batch_size >= 1, f"{key}.batch_size", self.batch_size, "must be >= 1.")
        _choice(f"{key}.dtype", self.dtype, ("float32", "bfloat16", "float16"))


@dataclass
class OptimConfig:
    lr: float = 3e-4
    """AdamW learning rate."""
    weight_decay: float = 0.0
    """AdamW weight decay (decoupled)."""
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    """AdamW betas: the gradient and squared-gradient moving averages."""
    clip_norm: float | None = 1.0
    """Gradient clipping norm; null turns it off."""

    def __post_init__(self) -> None:
        _check(self.lr > 0, "optim.lr", self.lr, "must be > 0.")
        _check(len(self.betas) == 2, "optim.betas", self.betas, "give two values, e.g. [0.9, 0.99].")


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
    mixed_precision: str = "no"
    """Autocast for forward/backward: no | bf16 | fp16 (fp16 adds a gradient scaler)."""
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
    progress_bar: bool = True
    """A tqdm bar over completions (frames) on the main process."""
    log_timings: bool = False
    """Log wall time of each phase under time/."""
    log_rewards: bool = True
    """Log the reward mean and std, total and per reward function (train/reward_*, train/reward/*)."""
    log_kl: bool = True
    """Log the KL and KL-estimator scalars (false drops every scalar with "kl" in its name)."""
    log_samples: int = 3
    """Completions written to TensorBoard as text at each log (prompt, completion, rewards); 0: none."""

    def __post_init__(self) -> None:
        _rules("trainer", self, total_frames="positive_count", num_epochs="positive_count",
               gradient_accumulation_steps="positive_count", log_interval="positive_count",
               weight_update_frequency="positive_count", optim_steps_per_batch="optional_count",
               log_samples="log_samples", max_staleness="max_staleness")
        _check(self.micro_batch_completions == "auto" or self.micro_batch_completions >= 1,
               "trainer.micro_batch_completions", self.micro_batch_completions, "must be >= 1 or auto.")
        _choice("trainer.mixed_precision", self.mixed_precision, ("no", "bf16", "fp16"))


@dataclass
class WeightSyncConfig:
    """How trained weights reach SGLang servers (rollout.backend=sglang)."""

    method: str = "distributed"
    """distributed (NCCL/gloo broadcast), disk (safetensors + /update_weights_from_disk) or tensor (CUDA IPC)."""
    bucket_mb: float = 512.0
    """Megabytes per bucket: bounds the extra memory of the ZeRO-3 gather on every rank."""
    layout: str = "per_tensor"
    """distributed: per_tensor (one broadcast per tensor) or flattened_bucket (one per bucket)."""
    backend: str = "auto"
    """distributed: nccl, gloo, or auto (nccl when CUDA is available)."""
    master_address: str | None = None
    """distributed: address of training rank 0 that the servers connect to; null: its address on the route to
    the first server (a loopback address when the servers run on this machine)."""
    master_port: int = 29600
    """Port of the weight-update process group's rendezvous on master_address."""
    dtype: str = "bfloat16"
    """dtype the servers hold the weights in."""
    disk_path: str | None = None
    """disk: folder the servers can read (default output_dir/weights)."""
    admin_api_key: str | None = None
    """The servers' --admin-api-key: weight, pause and session endpoints need it when a server has one."""
    verify_tensors: int = 2
    """After each update, compare this many parameters with /get_weights_by_name, or where the served model does
    not implement it, a 32-token logprob probe and the reported weight version (0: no check)."""
    max_attempts: int = 2
    """Full pushes tried before stopping with an error and a checkpoint."""
    timeout_s: float = 600.0
    """Seconds each HTTP request to a server may take (a weight push, a check) before it is an error."""
    pause_mode: str = "retract"
    """How a push pauses the servers: retract (in-flight requests keep their tokens and finish with the new
    weights: partial rollouts) or abort (they come back cut short and are continued from what they had)."""

    def __post_init__(self) -> None:
        _choice("weight_sync.method", self.method, ("distributed", "disk", "tensor"))
        _choice("weight_sync.layout", self.layout, ("per_tensor", "flattened_bucket"))
        _choice("weight_sync.backend", self.backend, ("auto", "nccl", "gloo"))
        _choice("weight_sync.dtype", self.dtype, ("bfloat16", "float16", "float32"))
        _choice("weight_sync.pause_mode", self.pause_mode, PAUSE_MODES)
        _check(self.bucket_mb > 0, "weight_sync.bucket_mb", self.bucket_mb, "must be > 0.")
        _check(self.max_attempts >= 1, "weight_sync.max_attempts", self.max_attempts, "must be >= 1.")


@dataclass
class EvalConfig:
    every_iterations: int = 0
    """Evaluate every this many iterations on the held-out rows; 0 turns evaluation off."""
    k: int = 4
    """Samples per prompt for pass@k."""
    success_threshold: float = 1.0
    """A sample passes when a reward function's value reaches this."""

    def __post_init__(self) -> None:
        _rules("eval", self, every_iterations="non_negative_count", k="positive_count")


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
        _rules("checkpoint", self, interval_frames="optional_count", keep_last="keep_last",
               keep_best="non_negative_count", best_mode="best_mode")


# Settings a resumed run must share with its checkpoint (anything else, e.g. total_frames, may change).
RESUME_MUST_MATCH = ("model.", "data.", "rollout.prompts_per_batch", "rollout.group_size", "rollout.max_new_tokens",
                     "rollout.temperature", "loss.", "rewards")


# Keys an earlier release called otherwise: a config that uses one is told the new name; a checkpoint saved with
# one still resumes.
RENAMED = {"rollout.prompts_per_step": "rollout.prompts_per_batch", "weight_sync.verify_names": "weight_sync.verify_tensors"}


def resume_conflicts(saved: dict, current: dict) -> list[str]:
    """``key: saved -> current`` for every RESUME_MUST_MATCH setting that differs."""
    a = {RENAMED.get(k, k): v for k, v in flatten_keys(saved).items()}
    if isinstance(a.get("rewards"), list):  # entries saved before a reward setting existed have its default
        defaults = to_dict(RewardConfig())
        a["rewards"] = [{**{k: v for k, v in defaults.items() if k not in ("name", "weight", "kwargs")}, **r}
                        for r in a["rewards"]]
    b = flatten_keys(current)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if k.startswith(RESUME_MUST_MATCH) and a.get(k) != b.get(k)]


def flatten_keys(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "kwargs":
            out.update(flatten_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


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
    rewards: list[RewardConfig] = field(
        default_factory=lambda: [RewardConfig("answer_match", 1.0), RewardConfig("format_match", 0.2)]
    )
    optim: OptimConfig = field(default_factory=OptimConfig)
    trainer: GRPOTrainerConfig = field(default_factory=GRPOTrainerConfig)
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    weight_sync: WeightSyncConfig = field(default_factory=WeightSyncConfig)

    def __post_init__(self) -> None:
        _check(bool(self.rewards), "rewards", self.rewards, "list at least one reward function.")
        names = [r.name for r in self.rewards]
        _check(len(set(names)) == len(names), "rewards", names, "each reward function may appear once.")
        _check(not (self.rollout.colocate and self.trainer.async_collection), "rollout.colocate", True,
               "colocated servers free their memory while the trainer trains, so they cannot generate then; set "
               "trainer.async_collection=false, or run the servers on GPUs of their own.")
        _check(not self.rollout.embedded_worker or self.trainer.async_collection, "rollout.embedded_worker",
               self.rollout.embedded_worker, "a decode worker runs beside training only with "
               "trainer.async_collection=true (synchronous GRPO waits for generation anyway); set both or neither.")

    def batch_layout(self, num_processes: int) -> BatchLayout:
        """How each collected batch splits over ``num_processes`` (``micro_batch_completions: auto`` resolved);
        raises naming the setting to change when it does not."""
        r, t = self.rollout, self.trainer
        layout = BatchLayout(r.prompts_per_batch, r.group_size, num_processes, t.micro_batch_completions,
                             t.gradient_accumulation_steps, t.num_epochs, t.optim_steps_per_batch, CONFIG_NAMES)
        try:
            layout.check()
        except ValueError as exc:
            raise ConfigError(str(exc)) from None
        return layout


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


# ------------------------------------------------------------------------------------------ loading


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> GRPOConfig:
    """Defaults, then the YAML file at ``path`` (if any), then ``key=value`` overrides (values parsed as YAML)."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file.")
        try:
            data = yaml.safe_load(path.read_text()) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key:
            raise ConfigError(f"override {item!r} is not key=value; write e.g. trainer.total_frames=256.")
        _set_dotted(data, key.strip(), yaml.safe_load(raw) if raw.strip() else None)
    return _resolve_paths(_build(GRPOConfig, data, ""))


LOCAL_PATHS = (("model", "name_or_path"), ("data", "path"), ("data", "eval_path"))
"""Settings that may name a file or folder here: kept as the absolute path they resolve to, so that a resume
compares the files themselves (the same file given relatively or absolutely matches; the same relative text from
another folder does not)."""


def _resolve_paths(cfg: GRPOConfig) -> GRPOConfig:
    for section, key in LOCAL_PATHS:
        value = getattr(getattr(cfg, section), key)
        if isinstance(value, str) and Path(value).expanduser().exists():
            setattr(getattr(cfg, section), key, str(Path(value).expanduser().resolve()))
    return cfg


def to_dict(cfg) -> dict:
    return dataclasses.asdict(cfg)


def _set_dotted(data: dict, key: str, value: Any) -> None:
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    node[parts[-1]] = value


def build_section(cls, data: dict, key: str):
    """One section (e.g. ``ModelConfig`` from a saved run's ``model`` mapping), checked as ``load_config`` does."""
    return _build(cls, data, key + ".")


def _build(cls, data: Any, prefix: str):
    if not isinstance(data, dict):
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}={data!r}: must be a mapping of keys to values.")
    hints = typing.get_type_hints(cls)
    names = [f.name for f in dataclasses.fields(cls)]
    for key in data:
        if f"{prefix}{key}" in RENAMED:
            new = RENAMED[f"{prefix}{key}"]
            raise ConfigError(f"{prefix}{key}: renamed {new} (the same setting); write {new} instead.")
        if key not in names:
            raise ConfigError(f"{prefix}{key}: unknown key; valid keys under {prefix.rstrip('.') or 'the top level'}: {names}.")
    try:
        return cls(**{key: _coerce(value, hints[key], f"{prefix}{key}") for key, value in data.items()})
    except TypeError as exc:
        raise ConfigError(f"{prefix.rstrip('.') or 'config'}: {exc}") from exc


def _coerce(value: Any, tp: Any, key: str) -> Any:
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if dataclasses.is_dataclass(tp):
        return _build(tp, value, key + ".")
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return None
        inner = [a for a in args if a is not type(None)]
        for option in inner:  # e.g. int | Literal["auto"]: the first that takes the value
            try:
                return _coerce(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r}: must be {' or '.join(_describe(t) for t in inner)}.")
    if origin is typing.Literal:
        _check(value in args, key, value, f"must be one of {list(args)}.")
        return value
    if origin is list:
        _check(isinstance(value, list), key, value, "must be a list.")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else value
    if tp is dict or origin is dict:
        _check(isinstance(value, dict), key, value, "must be a mapping.")
        return value
    if tp is bool:
        _check(isinstance(value, bool), key, value, "must be true or false.")
        return value
    if tp is int:
        _check(isinstance(value, int) and not isinstance(value, bool), key, value, "must be an integer.")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        _check(isinstance(value, (int, float)) and not isinstance(value, bool), key, value, "must be a number.")
        return float(value)
    if tp is str:
        _check(isinstance(value, str), key, value, "must be a string.")
        return value
    return value
