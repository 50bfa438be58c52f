"""The config sections of how completions are made, scored and kept current: ``rollout`` (the engine and the
batches it samples), ``rewards`` (one entry per reward) and ``weight_sync`` (pushing trained weights to the
servers).
The rest of the schema is :mod:`grpo_accel.config.schema`."""
from __future__ import annotations

from dataclasses import dataclass, field

from grpo_accel.config.checks import check_choice, check_key, check_rules
from grpo_accel.rules import DTYPES
from grpo_accel.sglang.api import LOAD_FORMATS, PAUSE_MODES


BACKENDS = ("embedded", "sglang", "vllm")


@dataclass
class RolloutConfig:
    backend: str = "embedded"
    """Inference engine: "embedded" (transformers generate in the trainer process), "sglang" or "vllm" (HTTP
    servers; vLLM's started with VLLM_SERVER_DEV_MODE=1, as trl vllm-serve does)."""
    urls: list[str] = field(default_factory=list)
    """SGLang and vLLM: one server URL per engine replica, e.g. [http://10.0.0.2:30000]."""
    api_key: str | None = None
    """SGLang and vLLM: the servers' --api-key, sent as a bearer token (SGLang: /generate, /server_info; weight
    endpoints too when the servers have no --admin-api-key; vLLM: its /v1 routes). A secret: ${NAME} reads
    environment variable NAME; the run's records hold the reference, or *** for a value given here."""
    health_timeout_s: float = 300.0
    """SGLang and vLLM: how long to wait for every server at start (SGLang: its /server_info, and again for its
    /health, a one-token generation, before the first batch; vLLM: its /health)."""
    request_retries: int = 3
    """SGLang and vLLM: retries (exponential backoff) of one request for 5xx answers, unreachable servers and timeouts,
    and aborts that brought no token (an abort with tokens is continued, never counted)."""
    request_size: int = 64
    """SGLang and vLLM: completions per request at most; a server's share of a batch goes out as several
    requests at once, each retried on its own (vLLM: one request per prompt, its completions sampled together)."""
    request_timeout_s: float = 600.0
    """SGLang and vLLM: seconds one request may take before it is aborted on the server and sent again."""
    prompts_per_batch: int = 16
    """Prompts per collected batch, over all processes."""
    group_size: int = 8
    """Completions sampled per prompt (GRPO's G); at least 2."""
    max_new_tokens: int | None = None
    """Completion budget in tokens; longer completions finish with reason "length". null follows the model: 256 for
    a model named by model.name_or_path (TRL's default), 4 for the built-in tiny one."""
    max_prompt_tokens: int | None = None
    """A longer prompt (after the chat template) is an error that names its dataset row. null follows the model:
    512 for a model named by model.name_or_path, 64 for the built-in tiny one."""
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
    """SGLang or vLLM on the trainer's own GPUs (SGLang started with --enable-memory-saver, vLLM with
    --enable-sleep-mode): they free their memory while the trainer optimises and take it back around each push."""
    zero3_gather_full: bool = False
    """ZeRO-3 only: gather the whole policy once around generation (every rank then holds the full model)
    instead of DeepSpeed fetching each module's shards at every decoding step (memory bounded by a module)."""

    def __post_init__(self) -> None:
        check_choice("rollout.backend", self.backend, BACKENDS)
        check_key(self.backend == "embedded" or bool(self.urls), "rollout.urls", self.urls,
                  f"rollout.backend={self.backend} needs the server URLs, e.g. rollout.urls=[http://host:30000].")
        check_rules("rollout", self, group_size="group_size", prompts_per_batch="positive_count",
                    max_new_tokens="model_count", max_prompt_tokens="model_count", temperature="temperature",
                    top_p="top_p", top_k="top_k", max_extra_rounds="non_negative_count", max_turns="max_turns",
                    max_episode_tokens="optional_count", tool_timeout_s="seconds", request_size="positive_count",
                    request_timeout_s="seconds", request_retries="non_negative_count")
        from grpo_accel.embedded.decode import DECODERS  # lazily: decode.py imports transformers

        check_choice("rollout.decoder", self.decoder, DECODERS)
        check_key(not self.embedded_worker or self.backend == "embedded", "rollout.embedded_worker", self.embedded_worker,
                  "a decode worker belongs to the embedded engine; set rollout.backend=embedded or drop it.")
        check_key(not self.colocate or self.backend != "embedded", "rollout.colocate", self.colocate,
                  "colocation shares the trainer's GPUs with inference servers; set rollout.backend=sglang or vllm, "
                  "or drop it.")

    @property
    def max_completion_tokens(self) -> int:
        """The most tokens the model writes in one completion (or episode): Dr. GRPO's constant normaliser."""
        from grpo_accel.rollout.episodes import completion_budget

        episodes = self.environment is not None
        return completion_budget(self.max_new_tokens, self.max_turns if episodes else None, self.max_episode_tokens)


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
    """remote: sent as a bearer token. A secret: ${NAME} reads environment variable NAME; the run's records hold
    the reference, or *** for a value given here."""
    dtype: str = "float32"
    """reward_model: the dtype it is loaded in (float32, bfloat16, float16)."""

    def __post_init__(self) -> None:
        from grpo_accel.rewards import NORMALIZE  # the reward set's choices (lazily: it imports torch)

        key = f"rewards[name={self.name}]"
        check_choice(f"{key}.normalize", self.normalize, NORMALIZE)
        check_key(self.name != "reward_model" or bool(self.path), f"{key}.path", self.path,
                  "a reward model needs its folder: path=DIR (a sequence-classification model and its tokenizer).")
        check_key(self.name != "remote" or bool(self.url), f"{key}.url", self.url,
                  "a reward service needs url=http://host:port/score (launch/reward_server.py serves one).")
        check_rules(key, self, processes="reward_processes", timeout_s="optional_seconds", batch_size="positive_count")
        check_choice(f"{key}.dtype", self.dtype, DTYPES)


@dataclass
class WeightSyncConfig:
    """How trained weights reach the servers (rollout.backend=sglang or vllm)."""

    method: str = "distributed"
    """distributed (NCCL/gloo broadcast), disk (safetensors the servers load: SGLang's /update_weights_from_disk,
    vLLM's reload_weights) or tensor (CUDA IPC). vLLM: disk."""
    bucket_mb: float = 512.0
    """Megabytes per bucket: bounds the extra memory of the ZeRO-3 gather on every rank."""
    load_format: str = "per_tensor"
    """distributed: per_tensor (one broadcast per tensor) or flattened_bucket (one per bucket; SGLang's
    ``load_format`` of the update request)."""
    backend: str = "auto"
    """distributed: nccl, gloo, or auto (nccl when CUDA is available)."""
    master_address: str | None = None
    """distributed: address of training rank 0 that the servers connect to; null: its address on the route to
    the first server (a loopback address when the servers run on this machine)."""
    master_port: int | None = None
    """Port of the weight-update process group's rendezvous on master_address; null: a free one, said at start
    (two trainers on one host would collide on a fixed one)."""
    dtype: str = "bfloat16"
    """dtype the servers hold the weights in."""
    disk_path: str | None = None
    """disk: folder the servers can read (default output_dir/weights)."""
    admin_api_key: str | None = None
    """The servers' --admin-api-key: weight, pause and session endpoints need it when a server has one. A secret:
    ${NAME} reads environment variable NAME; the run's records hold the reference, or *** for a value given here."""
    verify_tensors: int = 2
    """After each update, compare this many parameters (the smallest trained ones: a server lists a whole
    parameter to answer) with /get_weights_by_name, or where the served model does not implement it, a 32-token
    logprob probe and the reported weight version (0: no check)."""
    max_attempts: int = 2
    """Full pushes tried before stopping with an error and a checkpoint."""
    timeout_s: float = 600.0
    """Seconds each HTTP request to a server may take (a weight push, a check) before it is an error."""
    pause_mode: str = "retract"
    """How a push pauses the servers: retract (in-flight requests keep their tokens and finish with the new
    weights: partial rollouts; vLLM's pause mode keep) or abort (they come back cut short and are continued from
    what they had)."""

    def __post_init__(self) -> None:
        check_choice("weight_sync.method", self.method, ("distributed", "disk", "tensor"))
        check_choice("weight_sync.load_format", self.load_format, LOAD_FORMATS)
        check_choice("weight_sync.backend", self.backend, ("auto", "nccl", "gloo"))
        check_choice("weight_sync.dtype", self.dtype, DTYPES)
        check_choice("weight_sync.pause_mode", self.pause_mode, PAUSE_MODES)
        check_key(self.bucket_mb > 0, "weight_sync.bucket_mb", self.bucket_mb, "must be > 0.")
        check_rules("weight_sync", self, max_attempts="positive_count")
        check_key(self.master_port is None or 0 < self.master_port < 65536, "weight_sync.master_port",
                  self.master_port, "must be a port (1..65535), or null for a free one.")
