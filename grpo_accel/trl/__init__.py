"""TRL's trainer API over grpo_accel: a TRL GRPO script runs here by changing its import.

    from grpo_accel.trl import GRPOConfig, GRPOTrainer   # was: from trl import GRPOConfig, GRPOTrainer

    args = GRPOConfig(output_dir="runs/len", max_steps=100, num_generations=8)
    trainer = GRPOTrainer(model="Qwen/Qwen2.5-0.5B-Instruct", reward_funcs=reward_len, args=args,
                          train_dataset=dataset)
    trainer.train()
    trainer.save_model()

``GRPOConfig`` takes TRL's keyword arguments (its GRPOConfig's and the ``trl grpo`` script's), checked by name;
``GRPOTrainer`` reads them as a TRL config file is read (:mod:`grpo_accel.config.trl`: the same translation, one
line per setting at start, what has no counterpart refused in one line) and runs them as ``grpo-accel train``
does (:func:`grpo_accel.cli.train.train_config`: the run folder, its checkpoints, config.yaml and summary.json).
Reward functions are passed by reference and found again by import path in every process, so they must be
defined at a module's top level (a script's own functions are: ``__main__``). The datasets are written to the
run folder as JSONL (``train_dataset.jsonl``, ``eval_dataset.jsonl``), which is what the run trains on and what a
resume checks.
"""
from __future__ import annotations

import difflib
import json
import os
from pathlib import Path
from typing import Any, Callable, Iterable

from grpo_accel.config.loading import config_from_settings
from grpo_accel.config.trl.fields import TRL_KEYS
from grpo_accel.config.trl.rules import TRL_DEFAULTS

OUTPUT_DIR = "trainer_output"  # transformers' TrainingArguments default


class GRPOConfig:
    """TRL's ``GRPOConfig(...)``: keyword arguments by TRL's names, read by :class:`GRPOTrainer`. An attribute is
    the value given, else TRL's default where it matters here (:data:`TRL_DEFAULTS`), else None."""

    def __init__(self, output_dir: str | None = None, **kwargs: Any) -> None:
        unknown = sorted(set(kwargs) - TRL_KEYS)
        if unknown:
            named = []
            for key in unknown:
                close = difflib.get_close_matches(key, sorted(TRL_KEYS), n=1, cutoff=0.75)
                named.append(f"{key} (did you mean {close[0]}?)" if close else key)
            raise TypeError(f"GRPOConfig: {', '.join(named)}: not TRL's GRPOConfig or trl grpo arguments; each "
                            "setting is TRL's name (learning_rate, num_generations, ...).")
        self.settings = {"output_dir": output_dir or OUTPUT_DIR, **kwargs}

    def __getattr__(self, name: str) -> Any:
        settings = self.__dict__.get("settings", {})
        if name in settings:
            return settings[name]
        if name in TRL_KEYS:
            return TRL_DEFAULTS.get(name)
        raise AttributeError(f"GRPOConfig has no setting {name!r}")

    def to_dict(self) -> dict[str, Any]:
        return dict(self.settings)


class GRPOTrainer:
    """TRL's ``GRPOTrainer(model, reward_funcs, args, train_dataset, eval_dataset, processing_class,
    peft_config)``: the settings are read (and checked) here; :meth:`train` runs them.

    Args:
        model: a model folder or Hub id (what TRL's scripts pass); a loaded model is refused in one line.
        reward_funcs: one or a list of: functions ``f(prompts, completions, **columns) -> list[float]`` defined
            at a module's top level, TRL's reward names (``accuracy_reward``) or dotted import paths.
        args: a :class:`GRPOConfig` (None: TRL's defaults, output_dir ``trainer_output``).
        train_dataset / eval_dataset: a ``datasets.Dataset`` or a list of row dicts (``prompt`` and the columns
            the rewards read); eval_dataset is evaluated when args set eval_strategy.
        processing_class: None or the model's own tokenizer (the run loads it from ``model``).
        peft_config: a ``peft.LoraConfig``: LoRA with its r, alpha, dropout and target modules.
    """

    def __init__(self, model: Any, reward_funcs: Any, args: GRPOConfig | None = None, train_dataset: Any = None,
                 eval_dataset: Any = None, processing_class: Any = None, reward_processing_classes: Any = None,
                 callbacks: Any = None, optimizers: tuple = (None, None), peft_config: Any = None) -> None:
        args = args or GRPOConfig()
        path = _model_path(model)
        for name, value, fix in (("callbacks", callbacks, "register a function with trainer.register_op(stage, fn) "
                                  "on grpo_accel.build_trainer's trainer"),
                                 ("optimizers", None if optimizers == (None, None) else optimizers,
                                  "set optim (learning_rate, lr_scheduler_type, ...) in GRPOConfig"),
                                 ("reward_processing_classes", reward_processing_classes,
                                  "a reward model's tokenizer is its own (its folder's)")):
            if value is not None:
                raise TypeError(f"GRPOTrainer: {name} is not taken here: {fix}.")
        tokenizer_path = getattr(processing_class, "name_or_path", path)
        if processing_class is not None and str(tokenizer_path) != str(path):
            raise ValueError(f"GRPOTrainer: processing_class is the tokenizer of {tokenizer_path!r}; the run loads "
                             f"the model's own ({path!r}): pass None, or save yours in the model's folder.")
        out = Path(args.output_dir)
        settings = {**args.to_dict(), "model_name_or_path": path,
                    "reward_funcs": [_reward_name(f) for f in _as_list(reward_funcs)]}
        if train_dataset is not None:
            settings["dataset_name"] = str(_written(train_dataset, out / "train_dataset.jsonl"))
        if eval_dataset is not None:
            settings["data.eval_path"] = str(_written(eval_dataset, out / "eval_dataset.jsonl"))
        if peft_config is not None:
            settings |= {"use_peft": True, "lora_r": peft_config.r, "lora_alpha": peft_config.lora_alpha,
                         "lora_dropout": peft_config.lora_dropout,
                         "lora_target_modules": _target_modules(peft_config.target_modules)}
        from grpo_accel.cli.train import quiet_console

        quiet_console()  # the lines that say how TRL's settings were read show, as the command's do
        self.args = args
        self.config = config_from_settings(settings, "GRPOConfig")  # every setting read and checked now

    def train(self, resume_from_checkpoint: bool | str | None = None) -> int:
        """Train as ``grpo-accel train`` does; ``resume_from_checkpoint``: True (the run folder's newest
        checkpoint) or a checkpoint folder. Returns 0 once done."""
        from grpo_accel.cli.train import train_config

        if resume_from_checkpoint:
            self.config.checkpoint.resume = "auto" if resume_from_checkpoint is True else str(resume_from_checkpoint)
        return train_config(self.config)

    def save_model(self, output_dir: str | None = None) -> Path:
        """The trained model (the run's newest checkpoint) as a Hugging Face folder in ``output_dir`` (default:
        args.output_dir, beside the run's checkpoints, as TRL writes it); the first process writes it."""
        from grpo_accel.distributed import first_process
        from grpo_accel.run.export import export_checkpoint

        out = Path(output_dir or self.config.output_dir)
        if first_process():
            staged = out.with_name(f".{out.name}.model")
            export_checkpoint(self.config.output_dir, staged, replace=True)
            out.mkdir(parents=True, exist_ok=True)
            for item in staged.iterdir():  # the model's files join the run folder's
                os.replace(item, out / item.name)
            staged.rmdir()
        return out


def _model_path(model: Any) -> str:
    if isinstance(model, (str, Path)):
        return str(model)
    raise TypeError(f"GRPOTrainer: model={type(model).__name__}: give its folder or Hub id (as TRL's scripts do): "
                    "the run loads it in every process, under ZeRO-3 in shards; save a loaded model with "
                    "model.save_pretrained(folder) first.")


def _as_list(value: Any) -> list:
    return list(value) if isinstance(value, (list, tuple)) else [value]


def _reward_name(fn: str | Callable) -> str:
    """TRL's reward name, or a function's import path (``module.function``): every process imports it."""
    if isinstance(fn, str):
        return fn
    module, name = getattr(fn, "__module__", None), getattr(fn, "__qualname__", "")
    if not module or not name.isidentifier():
        raise TypeError(f"GRPOTrainer: reward_funcs: {fn!r} has no import path (a lambda, a method or a function "
                        "defined inside another); define it at the top of a module or of the script: every process "
                        "imports reward functions by name.")
    return f"{module}.{name}"


def _target_modules(modules: Iterable[str] | str | None) -> Any:
    return modules if modules is None or isinstance(modules, str) else sorted(modules)


def _written(rows: Iterable[dict], path: Path) -> Path:
    """``rows`` (a ``datasets.Dataset`` or dicts) as JSONL at ``path``, written whole under another name first
    (every process writes the same file)."""
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(f".{path.name}.{os.getpid()}")
    with partial.open("w") as f:
        for row in rows:
            f.write(json.dumps(dict(row), default=str) + "\n")
    os.replace(partial, path)
    return path
