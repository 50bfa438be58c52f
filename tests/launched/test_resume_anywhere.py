"""Resume anywhere (issue 71): a checkpoint continues on another process count and another ZeRO stage, through its
portable form, with real ``accelerate launch`` runs and real DeepSpeed (gloo)."""
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time

import pytest
import torch

from grpo_accel.checkpoint import Checkpoint, CheckpointError, CheckpointRotation
from launching import ROOT, launch
from trainer_utils import train_in_process

BATCH = 128  # frames per collected batch (16 prompts x 8)
COMMON = ["trainer.progress_bar=false", "trainer.micro_batch_completions=64", f"trainer.total_frames={4 * BATCH}",
          f"checkpoint.interval_frames={2 * BATCH}", "optim.scheduler=cosine", "optim.warmup_steps=1"]  # mid-curve at 2
LORA = ("model.lora.r=4", "model.lora.alpha=8", "loss.kl_coef=0.05")  # an adapter over a frozen base, a reference
ONE = ["--num_processes", "1"]


def contents(folder):
    """Relative path -> SHA-256 of every file."""
    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def source(tmp_path_factory):
    """``source(config, *settings)``: a run of 4 batches under ``config`` with checkpoints after batches 2 and 4
    (made once)."""
    made = {}

    def get(config, *settings):
        if (config, settings) not in made:
            made[config, settings] = tmp_path_factory.mktemp("source") / "run"
            launch(config, [f"output_dir={made[config, settings]}", *COMMON, *settings])
        return made[config, settings]
    return get


def from_batch_2(run, where):
    """A copy of ``run`` as a job killed after batch 2's checkpoint left it (no step 4, TensorBoard to step 2)."""
    shutil.copytree(run, where)
    shutil.rmtree(where / "checkpoints" / "step_00000004")
    return where


def resumed_state(config, run, tmp_path, launcher_args=(), settings=()):
    """What a run under ``config`` holds right after loading ``run``'s newest checkpoint
    (tests/helpers/resumed_state.py), and the launch's output."""
    out = tmp_path / f"state-{config}-{len(launcher_args)}-{run.name}.pt"
    proc = launch(config, [f"output_dir={run}", *COMMON, *settings, "checkpoint.resume=auto"],
                  launcher_args=list(launcher_args),
                  script=(str(ROOT / "tests" / "helpers" / "resumed_state.py"),), env={"RESUMED_STATE": str(out)})
    return torch.load(out, weights_only=False), proc


def assert_same_state(got, want):
    assert got["params"].keys() == want["params"].keys() and len(want["params"]) >= 8
    for name, tensors in want["params"].items():
        assert tensors.keys() == {"fp32", "exp_avg", "exp_avg_sq", "step"}
        for key, value in tensors.items():
            assert torch.equal(got["params"][name][key], value), (name, key)
    assert float(want["params"][name]["step"]) > 0 and float(want["params"][name]["exp_avg_sq"].abs().sum()) > 0
    for key in ("lr", "counters", "collector", "accelerator_step"):
        assert got[key] == want[key], key


@pytest.mark.parametrize("saved, resumed, resumed_args, settings", [
    ("zero2.yaml", "single_process.yaml", (), ()),  # a requeue on fewer GPUs, out of DeepSpeed
    ("zero3.yaml", "zero1.yaml", ONE, ()),  # ZeRO-3's flat shards into ZeRO-1 on one process
    ("single_process.yaml", "zero3.yaml", (), ()),  # one GPU grown to two, and sharded
    ("zero2.yaml", "zero3.yaml", (), LORA),  # the move to ZeRO-3 after an out-of-memory, of a LoRA run
], ids=["zero2x2-to-1", "zero3x2-to-zero1x1", "1-to-zero3x2", "lora-zero2-to-zero3"])
def test_weights_and_adam_moments_arrive_bitwise_in_another_layout(tmp_path, source, saved, resumed, resumed_args,
                                                                   settings):
    """Every trainable parameter's fp32 master weight, exp_avg and exp_avg_sq (a LoRA run's: its adapter's), the
    optimizer step, the scheduled rate, the counters, the data position and the accumulation step, gathered whole
    right after the load, equal what the saved layout's own load (accelerate's load_state; DeepSpeed's for ZeRO)
    gives, bit for bit. The checkpoint is not modified; its portable form appears beside it, complete."""
    run = source(saved, *settings)
    native, _ = resumed_state(saved, from_batch_2(run, tmp_path / "native"), tmp_path, (), settings)
    moved = from_batch_2(run, tmp_path / "moved")
    before = contents(moved / "checkpoints" / "step_00000002")
    got, proc = resumed_state(resumed, moved, tmp_path, resumed_args, settings)
    if settings == LORA:
        assert all("lora_" in name for name in got["params"])
    assert_same_state(got, native)
    assert 0 < native["lr"] < 3e-4  # the cosine's rate after 2 of 4 steps, not its peak: the schedule came back
    assert contents(moved / "checkpoints" / "step_00000002") == before
    portable = moved / "checkpoints" / "step_00000002.portable"
    assert (portable / "COMPLETE").is_file() and not list((moved / "checkpoints").glob(".tmp-*"))
    assert "converted to its portable form step_00000002.portable" in proc.stderr
    if resumed == "zero3.yaml" and saved == "single_process.yaml":
        assert "processes 1-1 take rank 0's random streams" in proc.stderr


def test_a_zero2_job_requeued_on_one_process_keeps_its_batch_and_curves(tmp_path, source):
    """The issue's own commands: 2 processes under ZeRO-2 saved at batch 2, resumed by one process without
    DeepSpeed. The batch stays the batch (128 completions per optimizer step: 64 x 2 accumulation now), every
    frame is counted once, the curves are the straight run's (other reduction order: to 1e-5), the tracker continues.
    A second resume of the same checkpoint reuses its portable form; a rotation deletes it with its checkpoint."""
    from grpo_accel.reporting.event_files import read_scalars

    straight = source("zero2.yaml")
    run = from_batch_2(straight, tmp_path / "run")
    proc = launch("single_process.yaml", [f"output_dir={run}", *COMMON, "checkpoint.resume=auto"])
    assert ("the batch as saved: 128 completions per optimizer step (2 processes x 64 x 1 accumulation) -> 1 processes "
            "x 64 x 2") in proc.stderr
    assert "checkpoint step_00000002: saved by 2 processes under ZeRO-2, resumed by 1 process without DeepSpeed: " \
           "converted to its portable form" in proc.stderr
    assert "random streams" not in proc.stderr  # no process the saved run did not have
    saved = Checkpoint.read_metadata(run / "checkpoints" / "step_00000004")
    assert (saved["frames"], saved["optim_steps"], saved["num_processes"]) == (4 * BATCH, 4, 1)
    assert saved["deepspeed"] is False
    assert saved["user"]["config"]["trainer"]["gradient_accumulation_steps"] == 2
    a, b = read_scalars(straight / "tensorboard"), read_scalars(run / "tensorboard")
    for tag in ("train/loss", "train/reward_mean", "train/frames", "train/optim_steps"):
        assert [s for s, _ in b[tag]] == [s for s, _ in a[tag]] == [1, 2, 3, 4]  # each step once
        assert [v for _, v in b[tag]] == pytest.approx([v for _, v in a[tag]], rel=1e-5, abs=1e-7)

    again = launch("single_process.yaml", [f"output_dir={run}", *COMMON,
                                           f"checkpoint.resume={run / 'checkpoints' / 'step_00000002'}"])
    assert "through its portable form step_00000002.portable" in again.stderr
    assert "made by an earlier resume" in again.stderr
    assert not (run / "checkpoints" / "step_00000004.portable").exists()
    # the rotation deletes a checkpoint with its portable form
    assert (run / "checkpoints" / "step_00000002.portable").is_dir()
    Checkpoint(run / "checkpoints").rotate(CheckpointRotation(keep_last=1), current=4)
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000004"]


def test_a_zero2_run_moved_to_zero3_after_an_out_of_memory_trains_on(tmp_path, source):
    """Same processes, ZeRO-2 -> ZeRO-3 (the move after an out-of-memory): the run ends with the frames it asked for,
    each batch logged once, the curves the straight run's."""
    from grpo_accel.reporting.event_files import read_scalars

    straight = source("zero2.yaml")
    run = from_batch_2(straight, tmp_path / "run")
    proc = launch("zero3.yaml", [f"output_dir={run}", *COMMON, "checkpoint.resume=auto"])
    assert "saved by 2 processes under ZeRO-2, resumed by 2 processes under ZeRO-3" in proc.stderr
    assert "random streams" not in proc.stderr  # each rank takes its own
    assert json.loads((run / "summary.json").read_text())["final_iteration"] == 4
    a, b = read_scalars(straight / "tensorboard"), read_scalars(run / "tensorboard")
    assert [v for _, v in b["train/loss"]] == pytest.approx([v for _, v in a["train/loss"]], rel=1e-5, abs=1e-7)


# -- faults: one line, nothing half-written that a later resume would trust, the checkpoint as it was -------------


@pytest.fixture
def tmpfs(tmp_path):
    """A small tmpfs (``mount(size_kb)``), unmounted at the end (we are root here, as in CI)."""
    mounted = []

    def mount(size_kb):
        where = tmp_path / f"tmpfs{len(mounted)}"
        where.mkdir()
        subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size_kb}k", "tmpfs", str(where)], check=True)
        mounted.append(where)
        return where
    yield mount
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], check=False)


def refused(run, error=CheckpointError, match=None):
    """launch/train.py in this process (one process, no DeepSpeed) resuming ``run``: refused, ``run`` untouched."""
    before = contents(run)
    with pytest.raises(error, match=match) as err:
        train_in_process([f"output_dir={run}", *COMMON, "checkpoint.resume=auto"])
    assert {k: v for k, v in contents(run).items() if k != ".grpo_accel.lock"} == before
    assert not [p.name for p in (run / "checkpoints").iterdir() if "portable" in p.name]
    print(err.value)
    return str(err.value)


def test_a_full_disk_during_the_conversion_is_one_line_and_leaves_nothing(tmp_path, source, tmpfs):
    staged = from_batch_2(source("zero2.yaml"), tmp_path / "staged")
    pages = sum(-(-p.stat().st_size // 4096) * 4 for p in staged.rglob("*") if p.is_file())  # KiB tmpfs holds
    disk = tmpfs(pages + 400)  # room for the run and its lock, not for the checkpoint's portable form (1.1 MB)
    copy = disk / "run"
    shutil.copytree(staged, copy)
    message = refused(copy, match="could not be converted")
    assert "no space left on" in message and "the checkpoint is as it was" in message
    assert "saved by 2 processes under ZeRO-2" in message and "1 process without DeepSpeed" in message


def test_a_corrupted_shard_is_one_line(tmp_path, source):
    """A shard of the right size whose bytes are not a torch file (a truncated one is the manifest's: its own line)."""
    run = from_batch_2(source("zero2.yaml"), tmp_path / "run")
    shard = run / "checkpoints" / "step_00000002" / "pytorch_model" / "zero_pp_rank_1_mp_rank_00_optim_states.pt"
    shard.write_bytes(b"\0" * shard.stat().st_size)
    message = refused(run, match="could not be converted")
    assert "ds_to_universal failed" in message and "\n" not in message
    with open(shard, "r+b") as f:
        f.truncate(100)
    assert "truncated or corrupted" in refused(run)


def test_a_conversion_killed_midway_is_redone_by_the_next_resume(tmp_path, source):
    """SIGKILL while the portable form is being written (torch.save slowed in that process): only a .tmp- folder is
    left, never trusted; the next resume writes the form again and trains on."""
    run = from_batch_2(source("zero3.yaml"), tmp_path / "run")
    checkpoint = run / "checkpoints" / "step_00000002"
    shapes = _tiny_trainable_shapes()
    code = ("import sys, time, torch; save = torch.save\n"
            "def slow(*a, **k):\n    save(*a, **k); print('saved', file=sys.__stdout__, flush=True); time.sleep(0.3)\n"
            "torch.save = slow\n"
            "from grpo_accel.trainer.portable import Layout, convert\n"
            f"convert({str(checkpoint)!r}, Layout(2, 3, True), {shapes!r})\n")
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, cwd=ROOT, text=True)
    for _ in range(5):
        child.stdout.readline()  # a few files of the form written
    os.kill(child.pid, signal.SIGKILL)
    child.wait()
    leftovers = sorted(p.name for p in (run / "checkpoints").iterdir() if "portable" in p.name)
    assert leftovers == [".tmp-step_00000002.portable"]
    assert train_in_process([f"output_dir={run}", *COMMON, "checkpoint.resume=auto"]) == 0
    assert (run / "checkpoints" / "step_00000002.portable" / "COMPLETE").is_file()
    assert not (run / "checkpoints" / ".tmp-step_00000002.portable").exists()
    assert Checkpoint.read_metadata(run / "checkpoints" / "step_00000004")["frames"] == 4 * BATCH


def _tiny_trainable_shapes():
    """The built-in tiny model's parameters as the loss module names them (the order the optimizer holds them)."""
    from grpo_accel.config.loading import load_config
    from grpo_accel.recipe.parts import build_policy, build_tokenizer

    cfg = load_config(None, [])
    model, _ = build_policy(cfg.model, build_tokenizer(cfg.model), with_reference=False, seed=cfg.trainer.seed)
    return {f"policy.{name}": tuple(p.shape) for name, p in model.named_parameters() if p.requires_grad}


def test_a_job_whose_machine_dies_comes_back_by_itself(tmp_path):
    """Two "machines" (network namespaces with host names of their own), 2 processes each, under
    ``MAX_RESTARTS=2 launch/multinode.sh``: SIGKILL machine 1's launcher and its ranks (a lost node) right after
    the first checkpoint. Without a person: machine 0's launcher ends, both are started again, meet again and
    resume from the newest checkpoint; the run ends with the frames it asked for, each batch logged once."""
    import psutil

    from grpo_accel.reporting.event_files import read_scalars
    from launching import free_port, sigkill_tree
    from netns import two_hosts

    out, batches = tmp_path / "run", 10  # the kill lands within 0.1 s of the checkpoint at 2
    env = {**os.environ, "NUM_MACHINES": "2", "PROCS_PER_MACHINE": "2", "MAX_RESTARTS": "2", "RESTART_DELAY": "2",
           "MAIN_PORT": str(free_port()), "PYTHON": sys.executable, "DS_ACCELERATOR": "cpu", "PYTHONUNBUFFERED": "1"}
    args = [f"output_dir={out}", "trainer.progress_bar=false", "trainer.micro_batch_completions=32",
            f"trainer.total_frames={batches * BATCH}", f"checkpoint.interval_frames={2 * BATCH}"]
    with two_hosts() as hosts:
        logs = [open(tmp_path / f"machine{i}.log", "w+") for i in (0, 1)]
        machines = [subprocess.Popen([*hosts.prefix(i, hostname=True), f"MAIN_ADDR={hosts.addresses[0]}",
                                      f"MACHINE_RANK={i}", "bash", str(ROOT / "launch" / "multinode.sh"), *args],
                                     env=env, stdout=logs[i], stderr=subprocess.STDOUT, cwd=ROOT,
                                     start_new_session=True) for i in (0, 1)]
        try:
            deadline = time.monotonic() + 240
            while not (out / "checkpoints" / "step_00000002").is_dir() and time.monotonic() < deadline:
                time.sleep(0.02)
            launcher = next(p for p in psutil.Process(machines[1].pid).children(recursive=True)
                            if p.status() != psutil.STATUS_ZOMBIE
                            and "accelerate.commands.launch" in " ".join(p.cmdline()))
            sigkill_tree(launcher.pid)
            codes = [m.wait(timeout=400) for m in machines]
        finally:
            for m in machines:
                sigkill_tree(m.pid)
        said = [log.seek(0) or log.read() for log in logs]
    assert codes == [0, 0], said[0][-4000:] + said[1][-4000:]
    assert "the launcher on machine 1 ended; starting it again" in said[1]
    assert "the launcher on machine 0 ended; starting it again" in said[0]  # its ranks lost their peers
    assert "resumed from" in said[0] and f"done: {batches * BATCH} frames (completions) in {batches} batches" in said[0]
    steps = [s for s, _ in read_scalars(out / "tensorboard")["train/frames"]]
    assert steps == list(range(1, batches + 1))  # every batch once: the ones after the checkpoint logged again
    assert json.loads((out / "summary.json").read_text())["final_iteration"] == batches
