"""Checkpoints in one process: atomicity, rotation, verified and exact resume, legacy files, export."""
import json
import logging
import shutil

import pytest
import torch

from grpo_accel.checkpoint import MARKER, Checkpoint, CheckpointError, CheckpointRotation, file_manifest
from grpo_accel.run.export import export_checkpoint
from grpo_accel.tasks.tiny import TinyModelSpec, build_tiny_model
from trainer_utils import (fresh_accelerate_state, make_trainer, reset_accelerate_state,  # noqa: F401
                           without_wall_times)

FRAMES = 16  # one batch of 4 prompts x 4 completions


def weights(model):
    return torch.cat([p.detach().flatten() for p in model.parameters()])


def run(tokenizer, tmp_path, total_batches, resume=None, spec=None, **kw):
    reset_accelerate_state()
    model = build_tiny_model(tokenizer, spec, seed=0)
    trainer = make_trainer(tokenizer, model, total_frames=FRAMES * total_batches,
                           checkpoint=Checkpoint(tmp_path / "ckpt", resume=resume), **kw)
    trainer.train()
    return trainer, model


def test_rotation_keeps_newest_last_n_and_best():
    rot = CheckpointRotation(keep_last=2, keep_best=1, metric="r", mode="max")
    assert rot.to_delete([(1, 0.9), (2, 0.1), (3, 0.2), (4, 0.3)]) == [2]  # keeps 3, 4 (last) and 1 (best)
    assert CheckpointRotation(keep_last=1).to_delete([(5, None), (7, None), (6, None)]) == [5, 6]
    assert CheckpointRotation(keep_last=1, keep_best=1, mode="min").to_delete([(1, 0.5), (2, 0.9)]) == []
    # resumed from step 5 while 6 and 7 remain from before: the step just saved stays, whatever the settings
    assert CheckpointRotation(keep_last=1).to_delete([(5, None), (7, None), (6, None)], current=6) == [5]
    with pytest.raises(ValueError, match="keep_last=0"):
        CheckpointRotation(keep_last=0)


def test_stop_and_resume_equals_a_straight_run(tokenizer, tmp_path):
    straight, straight_model = run(tokenizer, tmp_path / "a", 6)
    first, _ = run(tokenizer, tmp_path / "b", 3)
    assert [p.name for p in Checkpoint(tmp_path / "b" / "ckpt").complete()] == ["step_00000003"]
    resumed, resumed_model = run(tokenizer, tmp_path / "b", 6, resume="auto")
    assert resumed.iterations == 6 and resumed.frames == 6 * FRAMES and resumed.optim_steps == 6
    # bitwise: every logged scalar of every step, wall times aside
    assert without_wall_times(first.history + resumed.history) == without_wall_times(straight.history)
    assert torch.equal(weights(resumed_model), weights(straight_model))


def test_interval_saves_rotate_to_keep_last(tokenizer, tmp_path):
    trainer, _ = run(tokenizer, tmp_path, 7, save_trainer_interval=2 * FRAMES,
                     checkpoint_rotation=CheckpointRotation(keep_last=2),
                     checkpoint_metadata=lambda: {"note": "hello"})
    done = Checkpoint(tmp_path / "ckpt").complete()
    assert [p.name for p in done] == ["step_00000006", "step_00000007"]  # saved at 2, 4, 6 and the end (7)
    meta = json.loads((done[-1] / "metadata.json").read_text())
    assert meta["user"] == {"note": "hello"} and meta["reason"] == "end of training" and meta["frames"] == 7 * FRAMES
    assert meta["step"] == 7 and meta["metrics"]["train/frames"] == 7 * FRAMES
    assert (done[-1] / "hf" / "config.json").is_file() and (done[-1] / "hf" / "tokenizer.json").is_file()
    assert not list((tmp_path / "ckpt").glob(".tmp-*"))


def test_half_written_checkpoint_is_skipped_with_a_warning(tokenizer, tmp_path, caplog):
    run(tokenizer, tmp_path, 2)
    ckpt = Checkpoint(tmp_path / "ckpt", resume="auto")
    half = tmp_path / "ckpt" / "step_00000009"
    shutil.copytree(tmp_path / "ckpt" / "step_00000002", half)
    (half / MARKER).unlink()
    with caplog.at_level(logging.WARNING):
        assert ckpt.resume_path().name == "step_00000002"
    assert "skipping checkpoint" in caplog.text and "step_00000009" in caplog.text
    with pytest.raises(CheckpointError, match="has no COMPLETE marker"):
        Checkpoint(tmp_path / "ckpt", resume=str(half)).resume_path()
    with pytest.raises(CheckpointError, match="does not exist"):
        Checkpoint(tmp_path / "ckpt", resume=str(tmp_path / "nope")).resume_path()


@pytest.mark.parametrize("damage, message", [
    (lambda p: (p / "trainer_state_rank0.pt").write_bytes(b"x"), "trainer_state_rank0.pt has 1 bytes"),
    (lambda p: (p / "random_states_0.pkl").unlink(), "file random_states_0.pkl is missing"),
    (lambda p: (p / "model.safetensors").write_bytes(b"\0" * (p / "model.safetensors").stat().st_size),
     "could not be loaded"),
])
def test_failed_resume_names_the_file_and_deletes_nothing(tokenizer, tmp_path, damage, message):
    run(tokenizer, tmp_path, 2)
    folder = tmp_path / "ckpt" / "step_00000002"
    damage(folder)
    before = file_manifest(tmp_path)
    with pytest.raises(CheckpointError, match=message):
        run(tokenizer, tmp_path, 4, resume="auto")
    assert file_manifest(tmp_path) == before


def test_checkpoint_of_another_model_is_refused(tokenizer, tmp_path):
    run(tokenizer, tmp_path, 1)
    with pytest.raises(CheckpointError, match="holds another model"):
        run(tokenizer, tmp_path, 2, resume="auto", spec=TinyModelSpec(hidden_size=32))


def test_legacy_file_round_trip_with_load_from_file(tokenizer, tmp_path):
    legacy = tmp_path / "trainer.pt"
    trainer, model = run(tokenizer, tmp_path, 2, save_trainer_file=legacy, save_trainer_interval=FRAMES)
    reset_accelerate_state()
    fresh_model = build_tiny_model(tokenizer, seed=1)
    fresh = make_trainer(tokenizer, fresh_model, total_frames=FRAMES * 4)
    assert fresh.load_from_file(legacy) is fresh  # weights_only=True and mmap=True by default
    assert torch.equal(weights(fresh_model), weights(model))
    assert (fresh.frames, fresh.iterations, fresh.collector.batches) == (2 * FRAMES, 2, 2)
    with pytest.raises(Exception, match="Weights only load failed|Unsupported global"):
        torch.save({"model": {}, "trainer": object()}, tmp_path / "evil.pt")
        fresh.load_from_file(tmp_path / "evil.pt")
    partial = torch.load(legacy, weights_only=True)
    del partial["model"]["policy.lm_head.weight"]
    torch.save(partial, tmp_path / "partial.pt")
    with pytest.raises(CheckpointError, match=r"missing \['policy.lm_head.weight'\].*strict=False"):
        fresh.load_from_file(tmp_path / "partial.pt")
    assert fresh.load_from_file(tmp_path / "partial.pt", strict=False, mmap=False) is fresh  # the rest loads


def test_load_from_file_accepts_a_checkpoint_folder(tokenizer, tmp_path):
    _, model = run(tokenizer, tmp_path, 2)
    reset_accelerate_state()
    other = build_tiny_model(tokenizer, seed=5)
    trainer = make_trainer(tokenizer, other, total_frames=FRAMES * 4)
    trainer.load_from_file(tmp_path / "ckpt" / "step_00000002")
    assert torch.equal(weights(other), weights(model)) and trainer.iterations == 2


def test_export_round_trips_logits(tokenizer, tmp_path):
    from transformers import AutoModelForCausalLM, AutoTokenizer

    _, model = run(tokenizer, tmp_path, 2)
    out = export_checkpoint(tmp_path / "ckpt" / "step_00000002", tmp_path / "hf")
    exported = AutoModelForCausalLM.from_pretrained(out)
    ids = torch.tensor([tokenizer("12+3=4")["input_ids"]])
    torch.testing.assert_close(exported(ids).logits, model(ids).logits, rtol=0, atol=0)
    assert AutoTokenizer.from_pretrained(out)("1+1=")["input_ids"] == tokenizer("1+1=")["input_ids"]
    with pytest.raises(CheckpointError, match="is neither a complete checkpoint .* nor a run folder holding one"):
        export_checkpoint(tmp_path, tmp_path / "x")


def test_run_folder_lock_names_a_live_holder_and_takes_over_from_a_dead_one(tmp_path, caplog):
    import os
    import signal
    import subprocess
    import sys

    from grpo_accel.run.folder import RunFolderBusy, RunFolderLock

    holder = subprocess.Popen([sys.executable, "-c", "import time; from grpo_accel.run.folder import RunFolderLock; "
                               f"RunFolderLock({str(tmp_path)!r}).acquire(); print(flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    lock = RunFolderLock(tmp_path)
    try:
        with pytest.raises(RunFolderBusy, match=f"is in use by pid {holder.pid} on .* since .*time.sleep"):
            lock.acquire()
    finally:
        os.kill(holder.pid, signal.SIGKILL)
        holder.wait()
    with caplog.at_level("WARNING", logger="grpo_accel.run.folder"):
        lock.acquire()
    assert f"taking over the lock of pid {holder.pid}" in caplog.text and lock.held
    with pytest.raises(RunFolderBusy, match=f"pid {os.getpid()}"):  # held by this live process now
        RunFolderLock(tmp_path).acquire()
    lock.release()
    assert not lock.path.exists()
    lock.path.write_text('{"host": "elsewhere", "pid": 1, "since": "today", "command": "train"}')
    with pytest.raises(RunFolderBusy, match="another host: if that run has ended, delete the lock file"):
        RunFolderLock(tmp_path).acquire()


def test_resume_from_a_folder_that_is_no_checkpoint_says_so(tmp_path):
    (tmp_path / "plain").mkdir()
    (tmp_path / ".tmp-step_00000004").mkdir()
    with pytest.raises(CheckpointError, match="plain' is not a checkpoint .*step_\\* folders"):
        Checkpoint(tmp_path, resume=str(tmp_path / "plain")).resume_path()
    with pytest.raises(CheckpointError, match="an interrupted save"):
        Checkpoint(tmp_path, resume=str(tmp_path / ".tmp-step_00000004")).resume_path()


@pytest.fixture
def small_disk(tmp_path):
    """A 2 MB tmpfs (the tiny model's checkpoint is about 1.1 MB: the second one does not fit)."""
    import subprocess

    disk = tmp_path / "disk"
    disk.mkdir()
    if subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(disk)], capture_output=True).returncode:
        pytest.skip("cannot mount a small tmpfs here (needs root): the disk-full case is not exercised")
    yield disk
    subprocess.run(["umount", "-l", str(disk)], check=True)


def test_a_full_disk_is_named_and_loses_nothing(tokenizer, small_disk):
    with pytest.raises(CheckpointError) as failure:  # raised by the loop's own checkpoint step
        run(tokenizer, small_disk, 4, save_trainer_interval=FRAMES)
    error = failure.value
    assert f"checkpoint step_00000002 could not be saved: no space left on {small_disk / 'ckpt'}" in str(error)
    assert "the last checkpoint needed 1.1 MB" in str(error) and "earlier checkpoints are kept (['step_00000001'])" in str(error)
    assert [p.name for p in (small_disk / "ckpt").iterdir()] == ["step_00000001"]  # the partial folder is gone
    assert Checkpoint(small_disk / "ckpt", resume="auto").resume_path().name == "step_00000001"


# -- another process count or ZeRO stage (grpo_accel.trainer.portable; the launched runs: test_resume_anywhere.py) --


def test_the_batch_is_kept_over_another_process_count():
    """Completions per optimizer step and optimizer steps per batch as saved: the micro-batch kept where it can be,
    else the accumulation; a count that cannot keep them is one line naming the settings and the counts that can."""
    from grpo_accel.layout import BatchLayout, resized_split

    saved = BatchLayout(16, 8, 2)
    assert resized_split(saved, 64, 1, BatchLayout(16, 8, 1)) == (64, 2)  # 2 x 64 -> 1 x 64 x 2
    assert resized_split(saved, 64, 1, BatchLayout(16, 8, 4)) == (32, 1)
    assert resized_split(saved, 32, 2, BatchLayout(16, 8, 1)) == (32, 4)
    assert resized_split(BatchLayout(16, 8, 1), 64, 1, BatchLayout(16, 8, 2)) == (32, 1)  # 2 steps per batch kept
    with pytest.raises(ValueError) as err:
        resized_split(BatchLayout(12, 2, 2), 4, 1, BatchLayout(12, 2, 3))
    assert str(err.value) == ("8 completions per optimizer step (batch_size=4 x gradient_accumulation_steps=1 x 2 "
                              "processes) cannot be kept over 3 processes (no batch_size x gradient_accumulation_steps "
                              "makes 2.66667 per process); resume on one of [1, 2, 4] processes.")


def test_the_recipe_refuses_a_process_count_that_cannot_keep_the_batch():
    from grpo_accel.layout import BatchLayout
    from grpo_accel.recipe.build import LAYOUT_NAMES
    from grpo_accel.config.checks import ConfigError
    from grpo_accel.config.loading import load_config
    from grpo_accel.run.folder import keep_the_batch

    cfg = load_config(None, ["rollout.prompts_per_batch=12", "rollout.group_size=2", "trainer.micro_batch_completions=4"])
    saved = {"num_processes": 2, "user": {"config": {"trainer": {"micro_batch_completions": 4,
                                                                  "gradient_accumulation_steps": 1}}}}
    with pytest.raises(ConfigError, match=r"checkpoint saved by 2 processes: 8 completions per optimizer step "
                                          r"\(trainer.micro_batch_completions=4 .* resume on one of \[1, 2, 4\]"):
        keep_the_batch(cfg, saved, BatchLayout(12, 2, 3, LAYOUT_NAMES), 4)
    micro = keep_the_batch(cfg, saved, BatchLayout(12, 2, 1, LAYOUT_NAMES), 4)
    assert (micro, cfg.trainer.micro_batch_completions, cfg.trainer.gradient_accumulation_steps) == (4, 4, 2)


def test_the_trainer_state_of_each_new_rank():
    """Counters and the data position are rank 0's (every rank holds the same); the replay buffers' rows are dealt
    out again, or dropped and said when they do not divide."""
    from grpo_accel.trainer.portable import rank_state_for

    def state(rank, rows):
        storage = None if rows == 0 else {
            "prompt_ids": torch.full((rows, 3 + rank), rank), "prompt_mask": torch.ones(rows, 3 + rank, dtype=torch.bool),
            "completion_ids": torch.full((rows, 2), rank), "completion_mask": torch.ones(rows, 2, dtype=torch.bool)}
        return {"frames": 256, "collector": {"epoch": 1, "position": 7, "batches": 2},
                "replay_buffer": {"storage": storage, "generator": f"g{rank}"}}

    got, notes = rank_state_for([state(0, 0), state(1, 0)], 0, 1, pad_id=0)
    assert got["collector"] == {"epoch": 1, "position": 7, "batches": 2} and got["replay_buffer"]["storage"] is None
    assert notes == []
    states = [state(0, 3), state(1, 3)]
    shares = [rank_state_for(states, r, 3, pad_id=0) for r in range(3)]
    assert [s["replay_buffer"]["storage"]["completion_ids"][:, 0].tolist() for s, _ in shares] == [[0, 0], [0, 1], [1, 1]]
    assert shares[2][0]["replay_buffer"]["generator"] == "g0"  # a new rank: rank 0's stream
    assert shares[0][1] == ["the replay buffers' 6 completions dealt out again, 2 per process"]
    dropped, notes = rank_state_for(states, 0, 4, pad_id=0)
    assert dropped["replay_buffer"]["storage"] is None and "6 completions dropped" in notes[0]


def test_which_layouts_load_without_conversion():
    from grpo_accel.trainer.portable import Layout, same_files

    ddp2, one, zero0, zero2, zero3 = Layout(2, 0, False), Layout(1, 0, False), Layout(2, 0, True), Layout(2, 2, True), \
        Layout(2, 3, True)
    assert same_files(ddp2, one) and same_files(zero2, zero2)
    assert not same_files(ddp2, zero0) and not same_files(zero2, Layout(1, 2, True)) and not same_files(zero2, zero3)
    assert not same_files(zero0, Layout(1, 0, True))  # a bf16 optimizer's files shard like ZeRO-1's
    assert zero3.describe() == "2 processes under ZeRO-3" and one.describe() == "1 process without DeepSpeed"
