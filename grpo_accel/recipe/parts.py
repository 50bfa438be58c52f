"""The parts a config's sections describe: tokenizer and model (with LoRA and a reference), the dataset's rows,
the reward set, the multi-turn environment. :mod:`grpo_accel.recipe.build` wires them into a trainer."""
from __future__ import annotations

import collections

import copy
import dataclasses
import functools
import gc
import importlib
from pathlib import Path

from grpo_accel.config.checks import ConfigError
from grpo_accel.data.files import extract_answers, load_rows, transform_rows, validate_rows
from grpo_accel.config.rollout_schema import RewardConfig, RolloutConfig
from grpo_accel.config.schema import DataConfig, LoraConfig, ModelConfig
from grpo_accel.rewards import BUILTIN_REWARDS, RewardSet, is_async_reward
from grpo_accel.rules import TRAINING_DTYPES
from grpo_accel.tasks import task_rows


def build_tokenizer_and_model(cfg: ModelConfig, seed: int = 0):
    """(tokenizer, causal LM): the built-in tiny pair when ``name_or_path`` is None, else loaded from it."""
    tokenizer = build_tokenizer(cfg)
    return tokenizer, build_model(cfg, tokenizer, seed)


def build_tokenizer(cfg: ModelConfig):
    """The built-in character tokenizer, or the named model's, after checking that its folder holds a model:
    everything about ``model.name_or_path`` that can be refused before any process group starts; with
    ``model.chat_template``, that template in place of its own."""
    tokenizer = _named_tokenizer(cfg)
    if cfg.chat_template is not None:
        _check_template(cfg.chat_template)
        tokenizer.chat_template = cfg.chat_template
    return tokenizer


def _check_template(template: str) -> None:
    """A Jinja syntax error in ``model.chat_template`` is one line naming it, before any prompt is rendered (parsed
    as transformers renders it: a sandbox with loop controls)."""
    from jinja2 import TemplateSyntaxError
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    try:
        ImmutableSandboxedEnvironment(extensions=["jinja2.ext.loopcontrols"]).parse(template)
    except TemplateSyntaxError as exc:
        raise ConfigError(f"model.chat_template: line {exc.lineno}: {exc.message}; fix the Jinja template, or drop "
                          "model.chat_template to use the tokenizer's own.") from None


def _named_tokenizer(cfg: ModelConfig):
    if cfg.name_or_path is None:
        from grpo_accel.tasks.tiny import build_char_tokenizer

        return build_char_tokenizer()
    from transformers import AutoTokenizer

    key = f"model.name_or_path={cfg.name_or_path!r}"
    local = Path(cfg.name_or_path).expanduser()
    if local.exists():
        if not (local / "config.json").is_file():
            raise ConfigError(f"{key}: {local} has no config.json, so it is not a model folder; point it at a folder "
                              "written by save_pretrained (or grpo-accel models smollm2-135m OUT).")
        if not any(next(local.glob(pattern), None) for pattern in WEIGHT_FILES):
            raise ConfigError(f"{key}: {local} has a config.json but no weights ({', '.join(WEIGHT_FILES)}); "
                              "write them with model.save_pretrained there (a tokenizer's save_pretrained writes "
                              "none), or point it at the folder that has them.")
    elif _looks_like_a_path(cfg.name_or_path):
        raise ConfigError(f"{key}: no such folder (cwd {Path.cwd()}); point it at a model folder written by "
                          "save_pretrained, e.g. grpo-accel models smollm2-135m runs/smollm2-135m.")
    no_tokenizer = (f"{local} has no tokenizer files (tokenizer.json or tokenizer_config.json and its vocabulary); "
                    f"save them beside the model with tokenizer.save_pretrained('{local}')")
    if local.is_dir() and not any((local / name).is_file() for name in TOKENIZER_FILES):
        raise ConfigError(f"{key}: {no_tokenizer}.")  # transformers would build an empty one from config.json alone
    try:
        tokenizer = AutoTokenizer.from_pretrained(cfg.name_or_path, padding_side="left",
                                                  trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)
    except (OSError, ValueError) as exc:
        where = no_tokenizer if local.exists() else (
                 "it is no folder here, and loading it as a Hugging Face hub id failed; use a model folder, or a "
                 "hub id on a machine that reaches the hub")
        raise ConfigError(f"{key}: {where} ({type(exc).__name__}: {str(exc).splitlines()[0][:200]}).") from exc
    if tokenizer.pad_token_id is None:
        tokenizer.pad_token = tokenizer.eos_token
    if len(tokenizer) == 0 or not tokenizer("1+2=")["input_ids"]:
        raise ConfigError(f"{key}: its tokenizer is empty (it encodes text to no tokens); save the model's own "
                          "tokenizer beside it with tokenizer.save_pretrained.")
    return tokenizer


def build_model(cfg: ModelConfig, tokenizer, seed: int = 0):
    """The built-in tiny Llama (random weights from ``seed``), or the named model with the ``model.*`` loading
    settings (:func:`pretrained_kwargs`). Under a ZeRO-3 Accelerator, transformers builds it under DeepSpeed's
    ``zero.Init``: each process holds only its shard of every weight from the start, filled from the checkpoint
    one module at a time (the built-in model is constructed directly, whole, the same on every stage)."""
    if cfg.name_or_path is None:
        from grpo_accel.tasks.tiny import TinyModelSpec, build_tiny_model

        spec = TinyModelSpec(cfg.hidden_size, cfg.num_layers, cfg.num_heads, cfg.intermediate_size)
        return build_tiny_model(tokenizer, spec, seed=seed)
    from transformers import AutoModelForCausalLM

    key = f"model.name_or_path={cfg.name_or_path!r}"
    model = load_pretrained(AutoModelForCausalLM, cfg.name_or_path, pretrained_kwargs(cfg), key)
    rows = model.get_input_embeddings().num_embeddings
    if len(tokenizer) > rows:
        raise ConfigError(f"{key}: the tokenizer has {len(tokenizer)} tokens but the model embeds only {rows}; "
                          "they do not belong together: save the model's own tokenizer beside it.")
    return model


def pretrained_config(cfg: ModelConfig):
    """The named model's transformers config, read with the ``model.*`` loading settings."""
    from transformers import AutoConfig

    return AutoConfig.from_pretrained(cfg.name_or_path, trust_remote_code=cfg.trust_remote_code, revision=cfg.revision)


def model_context(cfg: ModelConfig) -> int | None:
    """The named model's positions per sequence (its config's ``max_position_embeddings``; None if it says none)."""
    return getattr(pretrained_config(cfg), "max_position_embeddings", None)


def pretrained_kwargs(cfg: ModelConfig) -> dict:
    """What ``model.*`` hands to ``from_pretrained``: dtype (``auto``: the checkpoint's, float16 read as float32),
    attn_implementation (when set), trust_remote_code and revision."""
    import torch

    dtype = checkpoint_dtype(cfg) if cfg.dtype == "auto" else cfg.dtype
    kwargs = {"dtype": getattr(torch, dtype), "trust_remote_code": cfg.trust_remote_code, "revision": cfg.revision}
    if cfg.attn_implementation is not None:
        kwargs["attn_implementation"] = cfg.attn_implementation
    return kwargs


def checkpoint_dtype(cfg: ModelConfig) -> str:
    """``model.dtype=auto``: the dtype the checkpoint's config names, when it is one weights train in (float32,
    bfloat16); anything else (float16, none named) float32."""
    config = pretrained_config(cfg)
    named = str(getattr(config, "dtype", None) or getattr(config, "torch_dtype", None) or "").removeprefix("torch.")
    return named if named in TRAINING_DTYPES else "float32"


def load_pretrained(auto_class, name: str, kwargs: dict, key: str):
    """``auto_class.from_pretrained(name, **kwargs)``; what the loading settings cause (remote code not trusted, an
    attention kernel that is not installed) is one line naming the setting, ``key`` the model's."""
    try:
        return auto_class.from_pretrained(name, **kwargs)
    except (ImportError, ValueError) as exc:
        text = " ".join(str(exc).split())
        attn = kwargs.get("attn_implementation")
        if attn is not None and (attn in text or isinstance(exc, ImportError)):
            raise ConfigError(f"model.attn_implementation={attn!r}: {key} cannot load with it ({text[:240]}); install "
                              "what it needs, or use sdpa (or null, transformers' choice).") from None
        if "trust_remote_code" in text:
            raise ConfigError(f"model.trust_remote_code={kwargs.get('trust_remote_code')!r}: {key} ships its own "
                              "modelling code (auto_map in its config.json), which runs only when trusted; set "
                              "model.trust_remote_code=true if you trust it.") from None
        raise


TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "vocab.json", "vocab.txt",
                   "spiece.model")
"""A tokenizer's files in a model folder, one of which must be there (save_pretrained writes the first two)."""
WEIGHT_FILES = ("model.safetensors", "model-*.safetensors", "model.safetensors.index.json", "pytorch_model.bin",
                "pytorch_model-*.bin", "pytorch_model.bin.index.json")
"""What transformers' from_pretrained loads weights from in a folder (safetensors, sharded or not; PyTorch bins)."""


def build_policy(cfg: ModelConfig, tokenizer, with_reference: bool, seed: int = 0):
    """(policy, reference or None). With ``lora.r`` the policy is the model with a fresh LoRA adapter and the
    reference is that model with its adapter off; otherwise the reference is a second, frozen load of the same
    weights (under ZeRO-3 partitioned like the policy; never a copy of a whole model)."""
    from grpo_accel.runtime.resources import freed_memory_returned

    with freed_memory_returned():  # the whole weights zero.Init makes, then shards, do not stay in the heap
        model = build_model(cfg, tokenizer, seed)
        reference = None
        if with_reference and not cfg.lora.r:
            reference = build_model(cfg, tokenizer, seed) if cfg.name_or_path is not None else copy.deepcopy(model)
        # A ZeRO-3 parameter is in a reference cycle with the gather methods DeepSpeed gives it, so one a model
        # dropped while loading (a tied head's own weight) kept its shard until Python's collector next ran: 28 MB
        # per model at SmolLM2's shape (tests/launched/test_zero3_load.py), GPU memory on a GPU.
        gc.collect()
    if cfg.gradient_checkpointing:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    if cfg.lora.r:
        from grpo_accel.lora import BasePolicy

        model = lora_policy(model, cfg.lora, seed)
        reference = BasePolicy(model) if with_reference else None
    return model, reference


def lora_policy(model, cfg: LoraConfig, seed: int):
    """``model`` with a fresh LoRA adapter of ``cfg`` (:func:`grpo_accel.lora.apply_lora`); errors name the
    ``model.lora`` keys."""
    from grpo_accel.lora import apply_lora

    try:
        return apply_lora(model, r=cfg.r, alpha=cfg.alpha, dropout=cfg.dropout, target_modules=cfg.target_modules,
                          seed=seed)
    except ValueError as exc:
        raise ConfigError(f"model.lora.{str(exc).removeprefix('apply_lora: ')}") from exc
    except ImportError as exc:
        raise ConfigError(f"model.lora.r={cfg.r}: {exc} Or set model.lora.r=0.") from exc


def _looks_like_a_path(name: str) -> bool:
    """Hub ids are "name" or "org/name"; anything else that does not exist here was meant as a folder."""
    return name.startswith(("/", ".", "~")) or name.count("/") > 1 or "\\" in name or name.endswith("/")


def build_rows(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    """(training rows, held-out rows), validated; a built-in task when ``path`` is None. A dataset's rows go
    through ``row_transform`` and ``answer_format`` (:func:`prepare_rows`)."""
    if cfg.path is None:
        train, held_out = _builtin_task(cfg)
        train = validate_rows(train, "prompt", f"built-in {cfg.task} task")
    else:
        where = f"data.path={cfg.path!r}"
        train = prepare_rows(load_rows(cfg.path, name=cfg.name, split=cfg.split, rename=cfg.rename_columns), cfg, where)
        held_out = []
    if cfg.eval_path is not None or cfg.eval_split is not None:
        path, key = (cfg.eval_path, "data.eval_path") if cfg.eval_path is not None else (cfg.path, "data.path")
        if path is None:
            raise ConfigError(f"data.eval_split={cfg.eval_split!r}: the built-in task has no splits; set data.holdout.")
        if cfg.eval_path is None and Path(path).expanduser().is_file():  # its one split is the training rows
            raise ConfigError(f"data.eval_split={cfg.eval_split!r}: data.path={path!r} is one file, which has no "
                              "splits: its held-out rows would be the training rows. Give the held-out rows as "
                              "data.eval_path=FILE, or set data.eval_split=null (and eval.every_iterations=0).")
        split = cfg.eval_split or "train"
        held_out = load_rows(path, name=cfg.name, split=split, rename=cfg.rename_columns, key=key)
        held_out = prepare_rows(held_out, cfg, f"{key}={path!r} (split {split!r})")
    return train, held_out


def prepare_rows(rows: list[dict], cfg: DataConfig, where: str) -> list[dict]:
    """A dataset's rows through ``data.row_transform`` and ``data.answer_format``, then validated."""
    if cfg.row_transform is not None:
        transform = import_named(cfg.row_transform, f"data.row_transform={cfg.row_transform!r}", [], "function")
        rows = transform_rows(rows, transform, cfg.row_transform, where)
    rows = extract_answers(rows, cfg.answer_field, cfg.answer_format, where)
    return validate_rows(rows, cfg.prompt_field, where)


def _builtin_task(cfg: DataConfig) -> tuple[list[dict], list[dict]]:
    try:
        return task_rows(cfg.task)(cfg.max_operand, cfg.holdout)
    except ValueError as exc:  # the task's own check of max_operand / holdout, naming its argument
        raise ConfigError(f"data.{exc}") from exc


def resolve_reward(name: str):
    """A built-in reward function by name, or ``package.module:function``."""
    if name in BUILTIN_REWARDS:
        return BUILTIN_REWARDS[name]
    return import_named(name, f"rewards name={name!r}", sorted(BUILTIN_REWARDS), "function")


def import_named(name: str, key: str, builtins: list[str], kind: str):
    """The object that ``package.module:attr`` names; errors start with ``key`` and list the ``builtins``."""
    module, sep, attr = name.partition(":")
    if not sep:
        raise ConfigError(f"{key}: not a built-in {builtins}; for your own {kind} write 'package.module:{kind}'.")
    try:
        return getattr(importlib.import_module(module), attr)
    except SyntaxError as exc:  # the module's own code: where, and what Python says
        raise ConfigError(f"{key}: {exc.filename}, line {exc.lineno}: {type(exc).__name__}: {exc.msg}; fix the "
                          "module.") from None
    except (ImportError, AttributeError) as exc:
        raise ConfigError(f"{key}: cannot import it ({exc}); check the module path and {kind} name (modules in the "
                          "directory the run starts from are importable).") from exc


def build_rewards(cfgs: list[RewardConfig], max_new_tokens: int | None = None,
                  model: ModelConfig | None = None) -> RewardSet:
    """The set of ``rewards`` (each entry: a function, a reward model or a reward service, with its limits);
    ``overlong_penalty`` gets ``max_tokens=max_new_tokens`` unless its kwargs set it; a reward model loads with
    ``model``'s trust_remote_code and attn_implementation unless its kwargs set them."""
    names = logged_names([c.name for c in cfgs])
    return RewardSet({names[c.name]: build_reward(c, max_new_tokens, model) for c in cfgs},
                     {names[c.name]: c.weight for c in cfgs}, {names[c.name]: c.normalize for c in cfgs})


def logged_names(names: list[str]) -> dict[str, str]:
    """Each reward's name in metrics and messages: a function named by its module path by the function's own name
    (``trl.rewards:accuracy_reward`` -> ``accuracy_reward``, as TRL logs it), the whole path where two share it."""
    short = {name: name.rsplit(":", 1)[-1] for name in names}
    counts = collections.Counter(short.values())
    return {name: s if counts[s] == 1 else name for name, s in short.items()}


def build_reward(c: RewardConfig, max_new_tokens: int | None = None, model: ModelConfig | None = None):
    """One reward entry as a reward function (see :mod:`grpo_accel.rewards.sources`)."""
    if c.name == "overlong_penalty":
        if "cache_tokens" not in c.kwargs:
            raise ConfigError(f"rewards[name=overlong_penalty].kwargs={c.kwargs}: give cache_tokens, the last tokens "
                              "before the limit over which the penalty grows to -1 (DAPO: a fifth of the budget), e.g. "
                              "kwargs: {cache_tokens: 64}.")
        c = dataclasses.replace(c, kwargs={"max_tokens": max_new_tokens, **c.kwargs}) if max_new_tokens else c
    from grpo_accel.rewards import sources as rs

    names = {key: f"rewards[name={c.name}].{key}" for key in ("timeout_s", "fallback", "url", "api_key")}
    if c.name == "reward_model":
        try:
            loading = {} if model is None else {"trust_remote_code": model.trust_remote_code,
                                                 "attn_implementation": model.attn_implementation}
            return rs.RewardModel(c.name, c.path, batch_size=c.batch_size, dtype=c.dtype, **{**loading, **c.kwargs})
        except ValueError as exc:  # not a classifier with its trained head: named with the setting
            raise ConfigError(f"rewards[name=reward_model].path={exc}") from None
    if c.name == "remote":
        return rs.RemoteReward(c.name, c.url, timeout_s=c.timeout_s or 30.0, retries=c.retries,
                               batch_size=c.batch_size, api_key=c.api_key, fallback=c.fallback, names=names)
    fn = resolve_reward(c.name)
    fn = functools.partial(fn, **c.kwargs) if c.kwargs else fn
    if is_async_reward(fn):
        return rs.AsyncReward(c.name, fn, timeout_s=c.timeout_s, fallback=c.fallback, names=names)
    if c.processes:
        return rs.TimedReward(c.name, fn, processes=c.processes, timeout_s=c.timeout_s or 10.0, fallback=c.fallback,
                              names=names)
    return fn


def build_environment(rollout: RolloutConfig, data: DataConfig):
    """The factory of multi-turn environments that ``rollout.environment`` names (a callable returning a fresh
    :class:`~grpo_accel.rollout.episodes.Environment` per episode), or None (single turn)."""
    name = rollout.environment
    if name is None:
        return None
    if name == "calculator":
        from grpo_accel.tasks.calculator import calculator_environment

        return calculator_environment(data.system_prompt, rollout.tool_timeout_s, data.prompt_field)
    factory = import_named(name, f"rollout.environment={name!r}", ["calculator"], "factory")
    if not callable(factory):
        raise ConfigError(f"rollout.environment={name!r} is a {type(factory).__name__}, not a callable that returns "
                          "an Environment.")
    return factory

