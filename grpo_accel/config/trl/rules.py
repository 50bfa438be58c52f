"""The pieces of :mod:`grpo_accel.config.trl.translate`: TRL's batch arithmetic (:class:`TrlLayout`), the translation
being built (:class:`Translation`: each setting with the line and the TRL key it came from), and the rules for TRL's
logging, evaluation, vLLM and reward keys."""
from __future__ import annotations

import importlib.util
import math
from typing import Any, Callable

from grpo_accel.config.checks import ConfigError

TRL_DEFAULTS = {  # TRL 1.16's, where they matter here
    "learning_rate": 1e-6, "lr_scheduler_type": "linear", "adam_beta1": 0.9, "adam_beta2": 0.999, "epsilon": 0.2,
    "seed": 42, "max_completion_length": 512, "num_train_epochs": 3.0, "max_steps": -1, "logging_steps": 10,
    "save_steps": 500, "save_strategy": "steps", "per_device_train_batch_size": 8, "gradient_accumulation_steps": 1,
    "num_generations": 8, "num_iterations": 1, "loss_type": "dapo", "use_bias_correction_kl": True,
    "vllm_mode": "colocate", "vllm_server_host": "0.0.0.0", "vllm_server_port": 8000,
    "vllm_gpu_memory_utilization": 0.3, "vllm_importance_sampling_correction": True,
    "vllm_importance_sampling_mode": "sequence_mask", "vllm_importance_sampling_clip_max": 3.0,
    "dataset_test_split": "test",
}
TRL_REWARDS = {"accuracy_reward": "trl.rewards:accuracy_reward", "think_format_reward": "trl.rewards:think_format_reward",
               "reasoning_accuracy_reward": "trl.rewards:reasoning_accuracy_reward"}
OPEN_R1_REWARDS = {  # open-r1's REWARD_FUNCS_REGISTRY names (src/open_r1/rewards.py, get_reward_funcs)
    "accuracy": "open_r1.rewards:accuracy_reward", "format": "open_r1.rewards:format_reward",
    "reasoning_steps": "open_r1.rewards:reasoning_steps_reward", "tag_count": "open_r1.rewards:tag_count_reward",
    "length": "open_r1.rewards:len_reward",
}
OPEN_R1_FACTORIES = ("cosine", "repetition_penalty", "code", "binary_code", "ioi_code", "cf_code", "code_format")
"""open-r1's rewards built from its script arguments with its own sandboxes: named, refused in one line."""
TRACKERS = ("tensorboard", "wandb", "mlflow", "trackio", "comet_ml", "aim", "clearml", "dvclive", "swanlab")
LOG_LEVELS = {"passive": "info", "debug": "debug", "info": "info", "warning": "warning", "error": "error",
              "critical": "error"}

class TrlLayout:
    """TRL's batch arithmetic for one config (``GRPOConfig.__post_init__``, TRL 1.16) over ``processes``."""

    def __init__(self, trl: dict, processes: int) -> None:
        get = lambda k: trl.get(k, TRL_DEFAULTS.get(k))  # noqa: E731
        self.per_device, self.accumulation = int(get("per_device_train_batch_size")), int(get("gradient_accumulation_steps"))
        self.group, self.iterations = int(get("num_generations")), int(get("num_iterations"))
        per_step = self.per_device * processes  # completions of one micro-step over every process
        generation, steps = trl.get("generation_batch_size"), trl.get("steps_per_generation")
        if generation is not None and steps is not None:
            raise ConfigError("generation_batch_size and steps_per_generation: TRL takes one of them, not both; "
                              "drop one.")
        if generation is None:
            steps = steps or self.accumulation
            generation = per_step * steps
        elif generation % per_step:
            raise ConfigError(f"generation_batch_size={generation}: TRL needs it divisible by per_device_train_batch_"
                              f"size x processes = {per_step}; change one of them.")
        self.steps_per_generation, self.generation = generation // per_step, generation
        if generation % self.group:
            raise ConfigError(f"generation_batch_size={generation}: TRL needs whole prompt groups, divisible by "
                              f"num_generations={self.group}; change one of them.")
        optimizer_steps = self.steps_per_generation * self.iterations
        if optimizer_steps % self.accumulation:
            raise ConfigError(f"gradient_accumulation_steps={self.accumulation}: {self.steps_per_generation} micro-steps "
                              f"per generation x num_iterations={self.iterations} are not whole optimizer steps; make "
                              "steps_per_generation a multiple of it.")
        self.optimizer_steps = optimizer_steps // self.accumulation  # per generation (= per collected batch here)

    @property
    def prompts(self) -> int:
        return self.generation // self.group

    def frames(self, steps: float) -> int:
        """Frames (completions collected) over ``steps`` optimizer steps: whole generations."""
        return math.ceil(steps / self.optimizer_steps) * self.generation


class Translation:
    """The settings (dotted keys) a TRL config becomes, each with the line that says where it came from."""

    def __init__(self, trl: dict, processes: int, rows: Callable[[dict], int]) -> None:
        self.trl, self.processes, self._rows, self._count = trl, processes, rows, None
        self.settings: dict[str, Any] = {}
        self.lines: list[str] = []
        self.sources: dict[str, str] = {}  # setting -> the TRL key it came from ("" for TRL's defaults)
        self.inert: list[str] = []

    def get(self, name: str) -> Any:
        return self.trl.get(name, TRL_DEFAULTS.get(name))

    def put(self, key: str, value: Any, line: str, source: str = "") -> None:
        from grpo_accel.config.secrets import REDACTED, is_secret

        self.settings[key] = value
        self.sources[key] = source
        if is_secret(key) and value:  # a token's value in neither side of its line
            line, value = line.replace(str(value), REDACTED), REDACTED
        self.lines.append(f"{line} -> {key}={value}")

    def rows(self) -> int:
        """The training data's rows (for epochs), counted once."""
        if self._count is None:
            self._count = self._rows(self.settings)
        return self._count

    def no_effect(self, name: str, why: str = "") -> None:
        self.inert.append(f"{name} ({why})" if why else name)

    def named_inert(self, name: str) -> bool:
        """Whether ``name`` is in the "no effect here" line already (each key is named there once)."""
        return any(entry.split(" ")[0] == name for entry in self.inert)

    def epoch_frames(self, layout: TrlLayout, epochs: float = 1.0) -> int:
        """Frames of ``epochs`` passes over the training rows, in whole generations."""
        per_step = layout.generation / layout.optimizer_steps
        return layout.frames(math.ceil(epochs * self.rows() * layout.group / per_step))

    def steps_to_frames(self, layout: TrlLayout, name: str, total: int) -> int:
        """``name`` (optimizer steps, or a float below 1: a share of the run) as frames."""
        value = self.get(name)
        if isinstance(value, float) and 0 < value < 1:
            return max(1, round(value * total))
        return max(1, round(value * layout.generation / layout.optimizer_steps))


def logging_rules(t: Translation, layout: TrlLayout) -> None:
    total = t.settings["trainer.total_frames"]
    strategy = t.trl.get("logging_strategy", "steps")
    if strategy == "steps":
        t.put("trainer.log_interval", t.steps_to_frames(layout, "logging_steps", total),
              f"logging_steps={t.get('logging_steps')} optimizer steps", "logging_steps")
    elif strategy == "epoch":
        t.put("trainer.log_interval", t.epoch_frames(layout), f"logging_strategy='epoch' ({t.rows()} rows)",
              "logging_strategy")
    elif strategy == "no":
        t.put("trainer.log_interval", total, "logging_strategy='no' (once, at the end)", "logging_strategy")
    else:
        raise ConfigError(f"logging_strategy={strategy!r}: use steps, epoch or no.")
    if "logging_first_step" not in t.trl:
        t.put("trainer.log_first", False, "logging_first_step (TRL's default false)")
    if "log_level" in t.trl:
        level = t.trl["log_level"]
        if level not in LOG_LEVELS:
            raise ConfigError(f"log_level={level!r}: use one of {sorted(LOG_LEVELS)}.")
        t.put("trainer.log_level", LOG_LEVELS[level], f"log_level={level!r}", "log_level")
    if "disable_tqdm" in t.trl:
        t.put("trainer.progress_bar", not t.trl["disable_tqdm"], f"disable_tqdm={t.trl['disable_tqdm']!r}",
              "disable_tqdm")
    report = t.trl.get("report_to")
    if report is not None:
        names = [report] if isinstance(report, str) else list(report)
        if names in (["none"], []):
            names = []
        elif "all" in names:
            names = [n for n in TRACKERS if importlib.util.find_spec(n) is not None]
        t.put("trainer.report_to", names, f"report_to={report!r}", "report_to")
    for name, tracker, key in (("wandb_entity", "wandb", "entity"), ("wandb_run_group", "wandb", "group"),
                               ("trackio_space_id", "trackio", "space_id")):
        if t.trl.get(name) is not None:
            t.put(f"trainer.tracker_kwargs.{tracker}.{key}", t.trl[name], f"{name}={t.trl[name]!r}", name)
    if t.trl.get("log_completions"):
        count = t.trl.get("num_completions_to_print") or layout.generation  # None: every completion of a batch
        t.put("trainer.log_samples", count, f"log_completions=True, num_completions_to_print="
              f"{t.trl.get('num_completions_to_print')!r}", "log_completions")
    else:
        t.put("trainer.log_samples", 0, "log_completions=False (TRL's default)", "log_completions"
              if "log_completions" in t.trl else "")
        if "num_completions_to_print" in t.trl:
            t.no_effect("num_completions_to_print", "log_completions is off")


def evaluation_rules(t: Translation, layout: TrlLayout) -> None:
    strategy = t.trl.get("eval_strategy", "no")
    if strategy == "no":
        t.inert += [f"{name} (eval_strategy is no)" for name in ("eval_steps", "dataset_test_split",
                                                                  "num_generations_eval") if name in t.trl]
        t.settings.pop("eval.k", None)
        return
    batches = max(1, t.settings["trainer.total_frames"] // layout.generation)
    if strategy == "steps":
        steps = t.trl.get("eval_steps") or t.get("logging_steps")  # TRL's default: logging_steps
        every = max(1, round(steps * batches)) if isinstance(steps, float) and steps < 1 else max(
            1, math.ceil(steps / layout.optimizer_steps))
        line = f"eval_steps={steps} optimizer steps"
    elif strategy == "epoch":
        every = max(1, math.ceil(t.rows() / layout.prompts))
        line = f"eval_strategy='epoch' ({t.rows()} rows)"
    else:
        raise ConfigError(f"eval_strategy={strategy!r}: use steps, epoch or no.")
    t.put("eval.every_iterations", every, f"{line}: batches", "eval_strategy")
    split = t.get("dataset_test_split")
    t.put("data.eval_split", split, f"dataset_test_split={split!r}", "dataset_test_split")


def vllm_rules(t: Translation) -> None:
    names = [k for k in t.trl if k.startswith("vllm_") and not t.named_inert(k)]
    if not t.trl.get("use_vllm"):
        t.inert += [f"{name} (use_vllm is off)" for name in names]
        return
    port, used = int(t.get("vllm_server_port")), set()
    serve = f"VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --port {port} --logprobs-mode processed_logprobs"
    if t.get("vllm_mode") == "server":
        host, base = t.get("vllm_server_host"), t.trl.get("vllm_server_base_url")
        url = base or f"http://{'127.0.0.1' if host == '0.0.0.0' else host}:{port}"
        used |= {"vllm_server_base_url"} if base else {"vllm_server_host", "vllm_server_port"}
        t.put("rollout.urls", [url], f"use_vllm=True, vllm_mode='server' (start it with {serve}, or trl "
              "vllm-serve, which runs that server)", "vllm_server_base_url" if base else "vllm_server_port")
    elif t.get("vllm_mode") == "colocate":
        share = t.get("vllm_gpu_memory_utilization")
        used |= {"vllm_server_port", "vllm_gpu_memory_utilization"}
        t.put("rollout.colocate", True, "vllm_mode='colocate' (TRL's default)", "vllm_mode")
        t.put("rollout.urls", [f"http://127.0.0.1:{port}"], f"use_vllm=True, colocated (vLLM on the trainer's GPUs, "
              f"a server of its own here: start it with {serve} --gpu-memory-utilization {share} "
              "--enable-sleep-mode)", "vllm_server_port")
    else:
        raise ConfigError(f"vllm_mode={t.get('vllm_mode')!r}: use server or colocate.")
    t.put("rollout.backend", "vllm", "use_vllm=True (rollout.backend=sglang to generate with SGLang instead)",
          "use_vllm")
    t.put("weight_sync.method", "disk", "use_vllm=True (vLLM loads the pushed weights from a folder: "
          "weight_sync.disk_path, default output_dir/weights)", "use_vllm")
    if "vllm_server_timeout" in t.trl:
        t.put("rollout.health_timeout_s", t.trl["vllm_server_timeout"], f"vllm_server_timeout="
              f"{t.trl['vllm_server_timeout']}", "vllm_server_timeout")
    if t.get("vllm_importance_sampling_correction"):
        cap = t.trl.get("vllm_importance_sampling_clip_max", t.trl.get("vllm_importance_sampling_cap",
                                                                       t.get("vllm_importance_sampling_clip_max")))
        mode = t.get("vllm_importance_sampling_mode")
        t.put("loss.tis_mode", mode, f"vllm_importance_sampling_mode={mode!r}", "vllm_importance_sampling_mode"
              if "vllm_importance_sampling_mode" in t.trl else "")
        t.put("loss.tis_cap", cap, f"vllm_importance_sampling_clip_max={cap}", "vllm_importance_sampling_clip_max"
              if "vllm_importance_sampling_clip_max" in t.trl else "")
        if t.trl.get("vllm_importance_sampling_clip_min") is not None:
            t.put("loss.tis_min", t.trl["vllm_importance_sampling_clip_min"], "vllm_importance_sampling_clip_min",
                  "vllm_importance_sampling_clip_min")
    t.inert += [f"{name} (the server's own setting)" for name in names if name in (
        "vllm_gpu_memory_utilization", "vllm_server_base_url", "vllm_server_host", "vllm_server_port") and
        name not in used]
    t.inert += ["vllm_group_port (the weights reach vLLM from disk here)"] * ("vllm_group_port" in t.trl)


def reward_rules(t: Translation) -> None:
    trl = t.trl
    names = list(trl.get("reward_funcs") or [])
    weights = trl.get("reward_weights") or [1.0] * (len(names) + bool(trl.get("reward_model_name_or_path")))
    entries = []
    if trl.get("reward_model_name_or_path"):
        entries.append({"name": "reward_model", "path": trl["reward_model_name_or_path"]})
    for name in names:
        if name in TRL_REWARDS:
            entries.append({"name": TRL_REWARDS[name]})
        elif name in OPEN_R1_REWARDS:
            _need_open_r1(name)
            entries.append({"name": OPEN_R1_REWARDS[name]})
        elif name in ("get_soft_overlong_punishment", "soft_overlong_punishment"):  # DAPO's penalty, built in here
            cap, cache = trl.get("max_completion_len", 1280), trl.get("soft_punish_cache", 256)  # trl grpo's values
            entries.append({"name": "overlong_penalty", "kwargs": {"max_tokens": cap, "cache_tokens": cache}})
        elif name in OPEN_R1_FACTORIES:
            raise ConfigError(f"reward_funcs: {name!r} is open-r1's, built by its script with its own arguments and "
                              "sandboxes; not available here: write it as a function and name it by its dotted path "
                              "(my_lib.rewards.custom_reward).")
        elif "." in name:
            module, attr = name.rsplit(".", 1)
            entries.append({"name": f"{module}:{attr}"})
        else:
            known = sorted([*TRL_REWARDS, *OPEN_R1_REWARDS, "get_soft_overlong_punishment"])
            raise ConfigError(f"reward_funcs: {name!r} is neither one of TRL's or open-r1's ({known}) nor a dotted "
                              "import path (my_lib.rewards.custom_reward).")
    if not entries:
        return
    if len(weights) != len(entries):
        raise ConfigError(f"reward_weights={weights}: {len(weights)} weights for {len(entries)} reward functions; give "
                          "one each.")
    t.put("rewards", [{**e, "weight": float(w)} for e, w in zip(entries, weights)],
          "reward_funcs" + (", reward_weights" if trl.get("reward_weights") else ""), "reward_funcs")
    for name in ("max_completion_len", "soft_punish_cache"):
        if name in trl and not set(names) & {"get_soft_overlong_punishment", "soft_overlong_punishment"}:
            t.no_effect(name, "no soft_overlong_punishment reward")


def _need_open_r1(name: str) -> None:
    if importlib.util.find_spec("open_r1") is None:
        raise ConfigError(f"reward_funcs: {name!r} is open-r1's reward (open_r1.rewards), and open_r1 is not "
                          "installed here; install it (pip install -e . in a clone of huggingface/open-r1), or name "
                          "a function by its dotted path.")
