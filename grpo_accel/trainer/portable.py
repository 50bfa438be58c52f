"""Checkpoints across layouts: a checkpoint written by N processes under one ZeRO stage (or without DeepSpeed)
resumed by M processes under another.

A *layout* is what decides how a checkpoint's files hold the weights and the optimizer: the process count, whether
DeepSpeed wrote it, and its ZeRO stage. A resume in the layout that saved goes through ``accelerator.load_state``
(bitwise, as always). Any other goes through the *portable form*: every trainable parameter's fp32 master weight
and Adam moments, whole, one folder per parameter, in DeepSpeed's universal-checkpoint layout::

    step_00000042.portable/
        zero/<parameter name>/fp32.pt         {"param": tensor [full shape]}
                              exp_avg.pt      the same for each optimizer moment
                              exp_avg_sq.pt
                              step.pt         the optimizer's step count (tensor)
        zero/optimizer_state.pt               hyperparameters of each parameter group, step, gradient clipping
        portable.json                         from which layout, when, how many bytes, how long it took
        COMPLETE                              written last: a folder without it is never loaded

DeepSpeed's own ``ds_to_universal`` converts the shards of ZeRO-1/2/3 (and of ZeRO-0's bf16 optimizer), merged
one parameter at a time: no process holds more than one rank's optimizer shard and one parameter. The whole files
of a run without DeepSpeed, or of ZeRO-0 in fp32, are split by parameter here. DeepSpeed's universal loader reads
the form into a ZeRO-1/2/3 run (each rank takes its own slice), or one with its bf16 optimizer; a run whose
parameters are whole loads it whole. Only trainable parameters are in it: frozen ones (a LoRA base, the KL
reference) come from the model the resumed run builds, as in every checkpoint.

The form is made once per checkpoint, beside it (``.tmp-`` first, renamed when complete), and reused by every
later resume; the checkpoint itself is never modified.
"""
from __future__ import annotations

import contextlib
import io
import json
import logging
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from grpo_accel.checkpoint import MARKER, file_manifest, write_marker
from grpo_accel.checkpoint import converted as portable_dir

logger = logging.getLogger(__name__)

MOMENTS = ("exp_avg", "exp_avg_sq")
DS_TAG = "pytorch_model"  # the folder accelerate's save_state gives DeepSpeed's checkpoint of the one prepared model


@dataclass(frozen=True)
class Layout:
    """How a checkpoint's model and optimizer files are laid out: by how many processes, under which ZeRO stage."""

    processes: int
    zero_stage: int
    deepspeed: bool

    def describe(self) -> str:
        who = f"{self.processes} process{'es' if self.processes > 1 else ''}"
        return f"{who} under ZeRO-{self.zero_stage}" if self.deepspeed else f"{who} without DeepSpeed"


def saved_layout(folder: Path, metadata: dict) -> Layout:
    """The layout ``folder`` was written in (its metadata; DeepSpeed's by its checkpoint folder)."""
    deepspeed = metadata.get("deepspeed", (Path(folder) / DS_TAG).is_dir())
    return Layout(metadata["num_processes"], metadata["zero_stage"], deepspeed)


def same_files(saved: Layout, run: Layout) -> bool:
    """Whether ``accelerator.load_state`` reads what ``saved`` wrote: the same layout, or accelerate's own whole
    files (without DeepSpeed) under any process count. DeepSpeed's ZeRO-0 files are whole too, except its bf16
    optimizer's, which shards like ZeRO-1: another process count goes through the portable form."""
    return saved == run or not (saved.deepspeed or run.deepspeed)


def staging_dir(checkpoint: Path) -> Path:
    """Where the portable form of ``checkpoint`` is written before it is complete."""
    final = portable_dir(checkpoint)
    return final.with_name(".tmp-" + final.name)


def is_complete(folder: Path) -> bool:
    return (Path(folder) / MARKER).is_file()


# -- converting -----------------------------------------------------------------------------------------------


def convert(checkpoint: Path, layout: Layout, shapes: dict[str, tuple[int, ...]]) -> Path:
    """Write the portable form of ``checkpoint`` (saved in ``layout``; ``shapes``: each trainable parameter's full
    shape, in the optimizer's order) beside it and return its folder; one that is already complete is reused.

    One process calls this. A failure removes what it wrote and raises; the checkpoint is never touched.
    """
    final, staging = portable_dir(checkpoint), staging_dir(checkpoint)
    if is_complete(final):
        return final
    start = time.perf_counter()
    for stale in (staging, final):  # an interrupted conversion (SIGKILL, a full disk): never trusted, redone
        shutil.rmtree(stale, ignore_errors=True)
    try:
        staging.mkdir(parents=True)
        if layout.deepspeed and list((Path(checkpoint) / DS_TAG).glob("*optim_states.pt")):  # ZeRO-1/2/3, bf16
            _from_deepspeed_shards(Path(checkpoint) / DS_TAG, staging, shapes)
        else:
            _from_whole_files(Path(checkpoint), layout, staging, shapes)
        check_complete(staging, shapes)
        info = {"from": layout.describe(), "seconds": round(time.perf_counter() - start, 3),
                "bytes": sum(file_manifest(staging).values()), "parameters": len(shapes)}
        (staging / "portable.json").write_text(json.dumps(info, indent=2))
        write_marker(staging)
        os.replace(staging, final)
    except BaseException:
        shutil.rmtree(staging, ignore_errors=True)
        raise
    return final


def _from_deepspeed_shards(ds_folder: Path, out: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """DeepSpeed's ``ds_to_universal`` over a ZeRO-1/2/3 checkpoint, then every tensor in its full shape with its
    step beside it (ZeRO-3's output is flat and keeps the step in the common file) and the common file reduced to
    what a loader reads (ZeRO-3's also holds rank 0's whole optimizer shard)."""
    from argparse import Namespace

    from deepspeed.checkpoint import ds_to_universal

    args = Namespace(input_folder=str(ds_folder), output_folder=str(out / "universal"), num_extract_workers=1,
                     num_merge_workers=1, keep_temp_folder=False, strict=True, inject_missing_state=True)
    said = io.StringIO()  # its progress lines and bars: kept for the error, not printed
    try:
        with contextlib.redirect_stdout(said), contextlib.redirect_stderr(said):
            ds_to_universal.main(args)
    except Exception as exc:
        raise RuntimeError(f"DeepSpeed's ds_to_universal failed ({type(exc).__name__}: {exc})") from exc
    converted = out / "universal" / "zero"
    common = torch.load(converted / "optimizer_state.pt", weights_only=False)
    nested = common.get("optimizer_state_dict", {})  # ZeRO-3 keeps its step here, ZeRO-1/2 a step.pt per parameter
    step = nested["state"][0]["step"] if nested.get("state") else None
    groups = [{k: v for k, v in g.items() if k != "params"} for g in common["param_groups"]]
    for name, shape in shapes.items():
        source, target = converted / name, out / "zero" / name
        if not source.is_dir():
            continue  # check_complete names it
        target.mkdir(parents=True)
        for key in ("fp32", *MOMENTS):
            if (source / f"{key}.pt").is_file():
                value = torch.load(source / f"{key}.pt", weights_only=False)
                tensor = value["param"] if isinstance(value, dict) else value
                torch.save({"param": tensor.reshape(shape).float().clone()}, target / f"{key}.pt")
        if (source / "step.pt").is_file():
            step = torch.load(source / "step.pt", weights_only=False)
        if step is not None:
            torch.save(torch.as_tensor(step), target / "step.pt")
    _write_common(out, groups, step, common.get("clip_grad", 0.0))
    shutil.rmtree(out / "universal")


def _from_whole_files(checkpoint: Path, layout: Layout, out: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """A checkpoint whose weights and optimizer are whole (without DeepSpeed: accelerate's model and optimizer
    files; ZeRO-0: DeepSpeed's model-states file): split by parameter. The optimizer indexes parameters by their
    order, which ``shapes`` gives."""
    if layout.deepspeed:
        states = torch.load(checkpoint / DS_TAG / "mp_rank_00_model_states.pt", weights_only=False)
        weights, optimizer = states["module"], states["optimizer"]
    else:
        weights, optimizer = _accelerate_model_file(checkpoint), torch.load(checkpoint / "optimizer.bin",
                                                                            weights_only=False)
    names = list(shapes)
    ids = [i for g in optimizer["param_groups"] for i in g["params"]]
    if len(ids) != len(names):
        raise RuntimeError(f"its optimizer holds {len(ids)} parameters, this model trains {len(names)}")
    step = None
    for index, name in zip(ids, names):
        if name not in weights:
            raise RuntimeError(f"its model file has no {name}")
        target = out / "zero" / name
        target.mkdir(parents=True)
        torch.save({"param": weights[name].reshape(shapes[name]).float().clone()}, target / "fp32.pt")
        state = optimizer["state"].get(index, {})
        for key in MOMENTS:
            if key in state:
                torch.save({"param": state[key].reshape(shapes[name]).float().clone()}, target / f"{key}.pt")
        if "step" in state:
            step = state["step"]
            torch.save(torch.as_tensor(step).clone(), target / "step.pt")
    groups = [{k: v for k, v in g.items() if k != "params"} for g in optimizer["param_groups"]]
    _write_common(out, groups, step, 0.0)


def _accelerate_model_file(checkpoint: Path) -> dict:
    """The weights accelerate's ``save_state`` wrote for the one prepared model (safetensors, else torch)."""
    if (checkpoint / "model.safetensors").is_file():
        from safetensors.torch import load_file

        return load_file(checkpoint / "model.safetensors")
    return torch.load(checkpoint / "pytorch_model.bin", weights_only=True)


def _write_common(out: Path, groups: list[dict], step, clip_grad: float) -> None:
    """``zero/optimizer_state.pt`` as both of DeepSpeed's universal loaders read it (ZeRO-1/2: the groups, the
    version, clipping; ZeRO-3: the step in a nested optimizer state dict)."""
    try:
        from importlib.metadata import version

        ds_version = version("deepspeed")
    except Exception:  # converted where DeepSpeed is not installed: only a run without it can load it there
        ds_version = "0.0.0"
    common = {"param_groups": groups, "clip_grad": clip_grad, "ds_version": ds_version,
              "optimizer_state_dict": {"state": {0: {"step": step}} if step is not None else {},
                                       "param_groups": groups}}
    torch.save(common, out / "zero" / "optimizer_state.pt")


def check_complete(folder: Path, shapes: dict[str, tuple[int, ...]]) -> None:
    """Every trainable parameter has its fp32 weight in ``folder``, of its full size."""
    for name, shape in shapes.items():
        file = Path(folder) / "zero" / name / "fp32.pt"
        if not file.is_file():
            raise RuntimeError(f"no weight for {name} came out of the conversion")
        numel = torch.load(file, weights_only=False)["param"].numel()
        if numel != int(torch.Size(shape).numel()):
            raise RuntimeError(f"{name} came out with {numel} values, the model's has {torch.Size(shape).numel()}")


# -- loading ----------------------------------------------------------------------------------------------------


def read(folder: Path, name: str, key: str) -> torch.Tensor | None:
    """Parameter ``name``'s ``key`` (fp32, exp_avg, exp_avg_sq) from a portable folder, or None when absent."""
    file = Path(folder) / "zero" / name / f"{key}.pt"
    return torch.load(file, weights_only=False)["param"] if file.is_file() else None


def load_into_deepspeed(engine, folder: Path) -> None:
    """Each rank takes its slice of ``folder`` through DeepSpeed's own universal loader (ZeRO-1/2/3, or its bf16
    optimizer); the run's gradient clipping is kept (the loader would take the saved one)."""
    optimizer = engine.optimizer
    clip = getattr(optimizer, "clip_grad", None)
    partitioned = engine.zero_optimization_partition_weights()
    if partitioned:
        optimizer.checkpoint_event_prologue()
    optimizer.load_state_dict(state_dict_list=None, load_optimizer_states=True, load_from_fp32_weights=True,
                              checkpoint_folder=str(folder))
    if partitioned:
        optimizer.checkpoint_event_epilogue()  # parameters kept whole on every rank (persistent) gathered again
    else:
        optimizer.update_lp_params()  # the model's weights from the loaded masters, gathered to every rank
    if clip is not None:
        optimizer.clip_grad = clip


def load_whole(module: torch.nn.Module, optimizer: torch.optim.Optimizer, folder: Path) -> None:
    """A run whose parameters are whole (without DeepSpeed, or ZeRO-0 in fp32): each trainable parameter of
    ``module`` and ``optimizer``'s state for it, by name, from ``folder``."""
    names = {id(p): name for name, p in module.named_parameters()}
    params = dict(module.named_parameters())
    common = torch.load(Path(folder) / "zero" / "optimizer_state.pt", weights_only=False)
    order = [names[id(p)] for group in optimizer.param_groups for p in group["params"]]
    state = {}
    with torch.no_grad():
        for index, name in enumerate(order):
            param = params[name]
            param.copy_(read(folder, name, "fp32").reshape(param.shape))
            moments = {key: value.reshape(param.shape) for key in MOMENTS
                       if (value := read(folder, name, key)) is not None}
            step_file = Path(folder) / "zero" / name / "step.pt"
            if moments:
                step = torch.load(step_file, weights_only=False) if step_file.is_file() else torch.tensor(0.0)
                state[index] = {"step": torch.as_tensor(step, dtype=torch.float32).clone(), **moments}
    groups, start = [], 0
    for own, saved in zip(optimizer.param_groups, common["param_groups"]):
        groups.append({**saved, "params": list(range(start, start + len(own["params"])))})
        start += len(own["params"])
    optimizer.load_state_dict({"state": state, "param_groups": groups})


# -- the trainer state of each rank ------------------------------------------------------------------------------


def rank_state_for(states: list[dict], rank: int, processes: int, pad_id: int) -> tuple[dict, list[str]]:
    """This rank's trainer state when the ``len(states)`` saved ranks become ``processes``: the counters, the data
    position (global: every rank holds the same) and the stepper are rank 0's; the replay buffers' rows, all ranks'
    in rank order, are dealt out again in equal shares (dropped, and said, when they do not divide; ``pad_id`` pads
    them to one width). Returns (state, what changed, in words)."""
    from tensordict import TensorDict

    from grpo_accel.batch import concat_rollouts, trim_padding

    own = states[rank] if rank < len(states) else states[0]
    state = {**states[0], "replay_buffer": dict(own["replay_buffer"])}
    stored = [s["replay_buffer"]["storage"] for s in states if s["replay_buffer"]["storage"] is not None]
    parts = [TensorDict(rows, batch_size=[len(rows["prompt_ids"])]) for rows in stored]
    total = sum(part.shape[0] for part in parts)
    state["replay_buffer"]["storage"], notes = None, []
    if total and total % processes:
        notes.append(f"the replay buffers' {total} completions dropped (they do not split over {processes} "
                     "processes; the next batch is collected as usual)")
    elif total:
        share = total // processes
        mine = concat_rollouts(parts, pad_id)[rank * share : (rank + 1) * share]
        state["replay_buffer"]["storage"] = trim_padding(mine).to_dict()
        notes.append(f"the replay buffers' {total} completions dealt out again, {share} per process")
    return state, notes
