"""A config from defaults, a YAML file and ``key=value`` overrides, checked key by key (a resume's comparison with
the settings its checkpoint saved: :mod:`grpo_accel.config.resume`).

Example:
    >>> cfg = load_config("launch/configs/default.yaml", ["trainer.total_frames=256"])
    >>> to_dict(cfg)["rollout"]["group_size"]
    8
"""
from __future__ import annotations

import dataclasses
import difflib
import logging
import types
import typing
from pathlib import Path
from typing import Any

import yaml

from grpo_accel.config.checks import ConfigError, check_key
from grpo_accel.config.rollout_schema import RewardConfig
from grpo_accel.config.schema import GRPOConfig
from grpo_accel.config.trl.fields import trl_hint

log = logging.getLogger(__name__)


def load_config(path: str | Path | None = None, overrides: list[str] | tuple[str, ...] = ()) -> GRPOConfig:
    """Defaults, then the YAML file at ``path`` (if any), then ``key=value`` overrides (values parsed as YAML)."""
    data: dict = {}
    if path is not None:
        path = Path(path)
        if not path.is_file():
            raise ConfigError(f"config file {str(path)!r} does not exist; pass an existing YAML file.")
        try:
            text = path.read_text()
            data = yaml.safe_load(text) or {}
        except yaml.YAMLError as exc:
            raise ConfigError(f"config file {str(path)!r} is not valid YAML: {exc}") from exc
        for key, lines in repeated_keys(text).items():
            _say_once(f"config file {path}: {key} is given {len(lines)} times (lines {', '.join(map(str, lines))}); "
                      f"the last (line {lines[-1]}) is used. Keep one.")
    return config_from_settings(data, path or "the command line", overrides)


def config_from_settings(data: dict, source: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> GRPOConfig:
    """A config from ``data``, a mapping of grpo_accel's settings, TRL's or both (:func:`from_trl`; ``source``
    names where it came from in messages: a file, or ``GRPOConfig`` for :mod:`grpo_accel.trl`), then ``key=value``
    overrides; every key checked."""
    data, trl_sources = from_trl(data, source)
    given: dict[str, list[str]] = {}
    for item in overrides:
        key, sep, raw = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"override {item!r} is not key=value; write e.g. trainer.total_frames=256.")
        given.setdefault(key.strip(), []).append(raw)
        _set_dotted(data, key.strip(), override_value(key.strip(), raw))
    for key, values in given.items():
        if len(values) > 1:
            _say_once(f"the command line gives {key} {len(values)} times ({', '.join(values)}); the last, "
                      f"{key}={values[-1]}, is used.")
    if problems := key_problems(GRPOConfig, data, ""):  # every unknown key at once, not one per run
        raise ConfigError(problems[0] if len(problems) == 1 else
                          f"{len(problems)} settings are not keys here:\n  " + "\n  ".join(problems))
    cfg = _resolve_paths(_build(GRPOConfig, data, ""))
    cfg.trl_sources = {key: source for key, source in trl_sources.items()  # the file's, unless overridden
                       if source and key not in given}
    return cfg


def override_value(key: str, raw: str) -> Any:
    """A command line's ``key=raw`` value: ``raw`` read as YAML (``256``, ``[a, b]``, ``null``), or the text itself
    where YAML cannot read it (a newline, ``<think>``, ``{%``) or where ``key`` is a text setting and YAML reads
    something else (``Answer: 42`` is a mapping to YAML)."""
    if not raw.strip():
        return None
    try:
        value = yaml.safe_load(raw)
    except yaml.YAMLError:
        return raw
    if value is not None and not isinstance(value, str) and _takes_text(key):
        return raw
    return value


def repeated_keys(text: str) -> dict[str, list[int]]:
    """Each setting a YAML text gives more than once -> the lines that give it (YAML keeps the last, silently).
    A setting is a dotted path, however it is written: ``trainer.lr: 1`` and ``trainer: {lr: 2}`` give the same."""
    lines: dict[str, list[int]] = {}

    def walk(node, prefix: str) -> None:
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode) and key.value != "<<":
                    name = f"{prefix}{key.value}"
                    if isinstance(value, yaml.MappingNode):
                        walk(value, name + ".")
                    else:
                        lines.setdefault(name, []).append(key.start_mark.line + 1)

    walk(yaml.compose(text, Loader=yaml.SafeLoader), "")
    return {key: at for key, at in lines.items() if len(at) > 1}


def _say_once(line: str) -> None:
    from grpo_accel.distributed import first_process

    if first_process():
        log.warning("%s", line)


def _setting_type(key: str) -> Any:
    """The schema's type of the setting ``key`` (dotted), or None where it is no setting."""
    cls: Any = GRPOConfig
    for part in key.split("."):
        if not dataclasses.is_dataclass(cls):
            return None
        cls = typing.get_type_hints(cls).get(part)
        if cls is None:
            return None
    return cls


def _takes_text(key: str) -> bool:
    """The setting ``key`` (dotted) holds text: its type is ``str`` (or ``str | None``)."""
    tp = _setting_type(key)
    args = [a for a in typing.get_args(tp) if a is not type(None)]
    return tp is str or (typing.get_origin(tp) in (typing.Union, types.UnionType) and args == [str])


def key_problems(cls, data: Any, prefix: str) -> list[str]:
    """One line per key of ``data`` (and of its sections and reward entries) that ``cls`` has not: renamed, TRL's
    name, or a likely misspelling (did you mean ...?)."""
    if not isinstance(data, dict):
        return []  # _build names what is not a mapping
    hints, names = typing.get_type_hints(cls), [f.name for f in dataclasses.fields(cls)]
    out = []
    for key, value in data.items():
        if f"{prefix}{key}" in RENAMED:
            new = RENAMED[f"{prefix}{key}"]
            out.append(f"{prefix}{key}: renamed {new} (the same setting); write {new} instead.")
        elif key not in names and (glued := _glued(key, value, names)):
            out.append(f"{prefix}{key}: unknown key: YAML read {key!r} as one key (with no value), as a colon with "
                       f"no space after it does not end a key; write {{{glued}}} (a space after the colon).")
        elif key not in names:
            close = difflib.get_close_matches(str(key), names, n=1, cutoff=0.75)
            guess = f" did you mean {prefix}{close[0]}?" if close else ""
            out.append(f"{prefix}{key}: unknown key;{guess}{trl_hint(key) or ''} valid keys under "
                       f"{prefix.rstrip('.') or 'the top level'}: {names}.")
        elif dataclasses.is_dataclass(hints[key]):
            out += key_problems(hints[key], value, f"{prefix}{key}.")
        elif key == "rewards" and isinstance(value, list):
            for i, entry in enumerate(value):
                out += key_problems(RewardConfig, entry, f"{prefix}rewards[{i}].")
    return out


def _glued(key: Any, value: Any, names: list[str]) -> str | None:
    """``name: value`` for a key YAML read with its value glued on (``{name:'mod:fn'}`` is the key
    ``name:'mod:fn'`` with no value), where ``name`` is a key here; else None."""
    head, colon, rest = str(key).partition(":")
    return f"{head}: {rest}" if colon and value is None and head in names else None


def _unknown_in_trl_file(data: dict, names: set[str]) -> list[str]:
    """One line per top-level key of a TRL config file (``names``: its TRL keys) that is neither TRL's nor the
    start of one of grpo_accel's settings: the closest of either's names, and how a TRL file names its data."""
    from grpo_accel.config.trl.fields import TRL_KEYS

    ours = [f.name for f in dataclasses.fields(GRPOConfig)]
    out = []
    for key in map(str, data):
        if key in names or key.split(".")[0] in ours:
            continue
        close = difflib.get_close_matches(key, sorted(TRL_KEYS) + ours, n=1, cutoff=0.75)
        guess = f" did you mean {close[0]}?" if close else ""
        where = (" A TRL file names its data by dataset_name (a local file or folder, or a Hub id), with "
                 "dataset_config and dataset_train_split." if "data" in key.lower() else "")
        out.append(f"{key}: unknown key;{guess}{where}" if guess or where else f"{key}: unknown key.")
    return out


def from_trl(data: dict, path: str | Path) -> tuple[dict, dict[str, str]]:
    """``data`` with its dotted keys nested; where it holds ``trl grpo`` keys (:mod:`grpo_accel.config.trl.translate`),
    their translation, said once (one line per setting), under grpo_accel's own settings of the same file. A
    setting that both give is an error naming the two. Also returns, per setting translated, the TRL key it came
    from ("" for TRL's defaults)."""
    from grpo_accel.config.trl.translate import translation, trl_keys

    if not isinstance(data, dict):
        return data, {}
    names = trl_keys(data)
    if names and (unknown := _unknown_in_trl_file(data, names)):  # answered in the file's own terms
        raise ConfigError(f"{path} holds TRL's settings and {len(unknown)} key(s) that are neither TRL's nor "
                          "grpo_accel's:\n  " + "\n  ".join(unknown))
    ours: dict = {}
    for key, value in data.items():
        if key not in names:
            _set_dotted(ours, str(key), value)
    if not names:
        return ours, {}
    from grpo_accel.distributed import first_process, launch_world_size

    given = flatten_keys(ours)
    t = translation({k: data[k] for k in data if k in names}, launch_world_size(),
                    lambda settings: _dataset_rows({**settings, **given}))
    if "rewards" not in t.settings and "rewards" not in given:
        raise ConfigError(f"{path}: TRL's settings without reward_funcs or reward_model_name_or_path: TRL's trainer "
                          "needs a reward; give reward_funcs (e.g. [accuracy_reward]) or grpo_accel's rewards.")
    both = [f"{key}: given as {key} and by TRL's {t.sources[key]}" for key in given if t.sources.get(key)]
    if both:
        raise ConfigError(f"{path}: " + "; ".join(both) + "; keep one of each.")
    if first_process():
        log.info("%s holds TRL's settings; read as (TRL's batch arithmetic over %d process(es)):\n  %s", path,
                 launch_world_size(), "\n  ".join(t.lines))
    nested: dict = {}
    for key, value in {**t.settings, **given}.items():
        _set_dotted(nested, key, value)
    return nested, t.sources


def _dataset_rows(settings: dict) -> int:
    """Rows of the training data the translated ``settings`` (dotted keys) name (TRL's num_train_epochs counts passes
    over it)."""
    from grpo_accel.data.files import load_rows

    if settings.get("data.path") is None:
        raise ConfigError("num_train_epochs: a TRL config needs dataset_name (a file, a saved folder or a hub id) to "
                          "count its rows; or give max_steps.")
    return len(load_rows(settings["data.path"], name=settings.get("data.name"),
                         split=settings.get("data.split", "train"), key="dataset_name"))


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
    """``data[a][b] = value`` for ``key`` ``a.b``; a mapping given for a section is merged into what is already
    there (``trainer.lr`` then ``trainer: {...}`` keeps both); any other value replaces."""
    node = data
    parts = key.split(".")
    for part in parts[:-1]:
        if not isinstance(node.get(part), dict):
            node[part] = {}
        node = node[part]
    if isinstance(value, dict) and isinstance(node.get(parts[-1]), dict) and dataclasses.is_dataclass(
            _setting_type(key)):
        for inner, item in value.items():  # key is a path from data's top: the section's settings one by one
            _set_dotted(data, f"{key}.{inner}", item)
    else:
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
            raise ConfigError(f"{prefix}{key}: unknown key;{trl_hint(key) or ''} valid keys under "
                              f"{prefix.rstrip('.') or 'the top level'}: {names}.")
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
        if len(inner) == 1:  # X | None: X's own message (e.g. YAML's no read as false)
            return _coerce(value, inner[0], key)
        for option in inner:  # e.g. int | Literal["auto"]: the first that takes the value
            try:
                return _coerce(value, option, key)
            except ConfigError:
                pass
        raise ConfigError(f"{key}={value!r}: must be {' or '.join(_describe(t) for t in inner)}.")
    if origin is typing.Literal:
        check_key(value in args, key, value, f"must be one of {list(args)}.")
        return value
    if origin is list:
        check_key(isinstance(value, list), key, value, "must be a list.")
        return [_coerce(v, args[0], f"{key}[{i}]") for i, v in enumerate(value)] if args else value
    if tp is dict or origin is dict:
        check_key(isinstance(value, dict), key, value, "must be a mapping.")
        return value
    if tp is bool:
        check_key(isinstance(value, bool), key, value, "must be true or false.")
        return value
    if tp is int:
        check_key(isinstance(value, int) and not isinstance(value, bool), key, value, "must be an integer.")
        return value
    if tp is float:
        if isinstance(value, str):  # YAML 1.1 reads 1e-3 as a string
            try:
                value = float(value)
            except ValueError:
                pass
        check_key(isinstance(value, (int, float)) and not isinstance(value, bool), key, value, "must be a number.")
        return float(value)
    if tp is str:
        from grpo_accel.config.secrets import REDACTED, is_secret

        check_key(isinstance(value, str), key, REDACTED if is_secret(key) else value, "must be a string." + (
            " YAML reads no/yes/on/off as false/true: quote it, e.g. 'no'." if isinstance(value, bool) else ""))
        return value
    return value


def _describe(tp: Any) -> str:
    if typing.get_origin(tp) is typing.Literal:
        return " or ".join(map(repr, typing.get_args(tp)))
    return {int: "an integer", float: "a number", str: "a string", bool: "true or false"}.get(tp, str(tp))


# Keys an earlier release called otherwise: a config that uses one is told the new name; a checkpoint saved with
# one still resumes.
RENAMED = {"rollout.prompts_per_step": "rollout.prompts_per_batch", "weight_sync.verify_names": "weight_sync.verify_tensors",
           "weight_sync.layout": "weight_sync.load_format"}


def flatten_keys(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        if isinstance(v, dict) and k != "kwargs":
            out.update(flatten_keys(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out
