"""A run's life after training: its command again changes nothing, a resume says what it changed, exports never
mix two models (issue 34's cases 2, 3 and 7, each failing before), a resumed run trains at the rate it was given."""
import logging
import math
import subprocess
import sys

import pytest

from grpo_accel.reporting.event_files import read_scalars
from launching import ROOT
from trainer_utils import main_in_process, train_in_process


RUN = ["trainer.total_frames=32", "rollout.prompts_per_batch=4", "rollout.group_size=4", "rollout.max_new_tokens=4",
       "trainer.progress_bar=false", "checkpoint.resume=auto", "checkpoint.keep_last=1"]


def contents(folder):
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def finished(tmp_path_factory):
    """A finished 2-batch run (resume=auto from the start, as a user scripts it) and its checkpoint."""
    out = tmp_path_factory.mktemp("finished") / "run"
    assert main_in_process("train", [f"output_dir={out}", *RUN]) == 0
    return out


def test_a_finished_runs_command_again_says_so_and_touches_nothing(finished, caplog):
    """Each rerun used to train one more batch (2560 -> 2688 -> 2816 frames) and rotate the real final checkpoint
    out; now it logs that the run is finished and exits 0 with every file as it was."""
    before = contents(finished)
    with caplog.at_level(logging.INFO):
        for _ in range(2):
            assert main_in_process("train", [f"output_dir={finished}", *RUN]) == 0
    assert contents(finished) == before
    assert caplog.text.count(f"the run in output_dir={str(finished)!r} is finished: its checkpoint ") == 2
    assert "holds 32 frames of trainer.total_frames=32; nothing to train (raise trainer.total_frames" in caplog.text


def test_raising_total_frames_continues_and_the_resume_names_what_changed(finished, tmp_path, caplog):
    import shutil

    from grpo_accel.checkpoint import Checkpoint

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    with caplog.at_level(logging.INFO):
        assert main_in_process("train", [f"output_dir={run}", *RUN, "trainer.total_frames=48", "optim.lr=1e-4"]) == 0
    assert Checkpoint(run / "checkpoints").read_metadata(Checkpoint(run / "checkpoints").complete()[-1])["frames"] == 48
    messages = [r.getMessage() for r in caplog.records]
    at = next(i for i, m in enumerate(messages) if m.startswith("resuming "))
    assert messages[at].endswith("with 3 setting(s) changed since it was saved:"), messages[at]
    assert messages[at + 1:at + 4] == ["  optim.lr: 0.0003 -> 0.0001", f"  output_dir: {str(finished)!r} -> {str(run)!r}",
                                       "  trainer.total_frames: 32 -> 48"]  # one line each; the copy moved the folder
    done = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("done: "))
    assert done.splitlines()[0].startswith("done: 48 frames (completions) in 3 batches; this run ")
    assert done.splitlines()[1:] == [done.splitlines()[1], f"  final checkpoint: {run / 'checkpoints' / 'step_00000003'}",
                                     f"  curves: tensorboard --logdir {run / 'tensorboard'}"]
    assert done.splitlines()[1].startswith("  reward: ") and done.splitlines()[1].endswith(" (1 batch)")  # this run's


def test_the_trainer_api_resumed_on_a_finished_checkpoint_collects_nothing(finished):
    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.tasks.tiny import build_char_tokenizer, build_tiny_model
    from trainer_utils import make_trainer

    tokenizer = build_char_tokenizer()
    trainer = make_trainer(tokenizer, build_tiny_model(tokenizer, seed=0), total_frames=32,
                           checkpoint=Checkpoint(finished / "checkpoints", resume="auto"))
    trainer.collector.collect = lambda: pytest.fail("a finished run collected a batch")
    trainer.train()
    assert trainer.frames == 32


def export(*args):
    return subprocess.run([sys.executable, "-m", "grpo_accel.cli", "export", *map(str, args)], cwd=ROOT, capture_output=True,
                          text=True, timeout=300)


def test_export_refuses_what_would_mix_and_replaces_whole(finished, tmp_path):
    from transformers import AutoModelForCausalLM

    from grpo_accel.checkpoint import Checkpoint

    last = Checkpoint(finished / "checkpoints").complete()[-1]
    target = tmp_path / "exported"
    target.mkdir()
    (target / "chat_template.jinja").write_text("an older export's template")
    refused = export(last, target)
    assert refused.returncode == 2 and refused.stderr.strip().splitlines()[-1] == (
        f"error: export target {target} is not empty (chat_template.jinja); name a new folder, or pass --replace to "
        "replace it whole.")
    assert [p.name for p in target.iterdir()] == ["chat_template.jinja"]
    replaced = export(last, target, "--replace")
    assert replaced.returncode == 0, replaced.stderr
    assert not (target / "chat_template.jinja").exists() and (target / "model.safetensors").is_file()
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")], "the staging folder is gone"
    AutoModelForCausalLM.from_pretrained(target)
    afile = tmp_path / "afile"
    afile.write_text("x")
    for out, message in [(afile, f"error: export target {afile} is a file; name a folder to write the model into."),
                         ("/proc/grpo_accel_export", "error: export target /proc/grpo_accel_export: cannot write there ("),
                         (tmp_path / "no" / "such", f"error: export target {tmp_path / 'no' / 'such'}: its parent folder "
                                                    f"{tmp_path / 'no'} does not exist")]:
        proc = export(last, out)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr
        assert proc.stderr.strip().splitlines()[-1].startswith(message), proc.stderr
    assert afile.read_text() == "x"


def test_a_short_runs_summary_compares_windows_that_do_not_overlap(tmp_path, caplog):
    """Issue 49 item 10: under 20 batches the "first 10 -> last 10" means overlapped (4 batches: the same 4)."""
    import json

    with caplog.at_level(logging.INFO):
        assert main_in_process("train", [f"output_dir={tmp_path / 'run'}", "trainer.total_frames=512",
                                         "trainer.progress_bar=false"]) == 0
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    done = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("done: "))
    assert summary["reward_window"] == 2 and " (first 2 batches) -> " in done and done.splitlines()[1].endswith("(last 2)")


def test_an_export_into_a_place_it_cannot_write_is_refused_before_the_weights_are_read(finished, monkeypatch):
    """Issue 49 item 10: the refusal came after the ZeRO shards had been consolidated (minutes at scale)."""
    from grpo_accel.checkpoint import Checkpoint, CheckpointError
    from grpo_accel.run import export

    read = []
    monkeypatch.setattr(export, "load_policy", lambda checkpoint: read.append(checkpoint))
    last = Checkpoint(finished / "checkpoints").complete()[-1]
    with pytest.raises(CheckpointError, match="export target /proc/grpo_accel_export: cannot write there"):
        export.export_checkpoint(last, "/proc/grpo_accel_export")
    assert read == []


def test_a_resume_takes_settings_that_do_not_change_the_math_and_refuses_one_that_does(finished, tmp_path, caplog):
    """Issue 56 item 4: gradient checkpointing turned on after an out-of-memory, another attention kernel and a
    reward's retries continue the run, one line each; the weights' dtype is still refused, naming it."""
    import shutil

    from grpo_accel.config.checks import ConfigError

    run = tmp_path / "run"
    shutil.copytree(finished, run)
    rewards = "rewards=[{name: answer_match, retries: 5}, {name: format_match, weight: 0.2}]"
    changed = ["model.gradient_checkpointing=true", "model.attn_implementation=eager", rewards]
    with pytest.raises(ConfigError, match="trained with other settings: model.dtype: 'float32' -> 'bfloat16'; resume"):
        main_in_process("train", [f"output_dir={run}", *RUN, "trainer.total_frames=48", *changed, "model.dtype=bfloat16"])
    with caplog.at_level(logging.INFO):
        assert main_in_process("train", [f"output_dir={run}", *RUN, "trainer.total_frames=48", *changed]) == 0
    messages = [r.getMessage() for r in caplog.records]
    at = next(i for i, m in enumerate(messages) if m.startswith("resuming "))
    assert messages[at + 1:at + 6] == [
        "  model.attn_implementation: None -> 'eager'", "  model.gradient_checkpointing: False -> True",
        f"  output_dir: {str(finished)!r} -> {str(run)!r}", "  rewards[0].retries: 2 -> 5",
        "  trainer.total_frames: 32 -> 48"]
    assert any(m.startswith("done: 48 frames (completions) in 3 batches") for m in messages)


RESUMABLE = ["trainer.progress_bar=false", "checkpoint.resume=auto"]  # 128 completions a batch, one optimizer step each


def lrs(out) -> list[float]:
    return [v for _, v in read_scalars(out / "tensorboard")["train/lr"]]


def test_a_resumed_run_trains_at_the_rate_it_was_given(tmp_path, caplog):
    """Item 1: a constant rate changed at resume applies from the first resumed step; a cosine run extended with a
    new peak continues on the new, longer curve at the step it had reached (not at the old curve's end, 0)."""
    constant = tmp_path / "constant"
    assert train_in_process([f"output_dir={constant}", *RESUMABLE, "trainer.total_frames=256"]) == 0
    with caplog.at_level(logging.INFO):
        assert train_in_process([f"output_dir={constant}", *RESUMABLE, "trainer.total_frames=512", "optim.lr=1e-3"]) == 0
    assert lrs(constant) == pytest.approx([3e-4, 3e-4, 1e-3, 1e-3])
    assert "learning rate: the checkpoint's peak 0.0003 -> 0.001, this run's, from its first step" in caplog.text
    cosine = tmp_path / "cosine"
    assert train_in_process([f"output_dir={cosine}", *RESUMABLE, "trainer.total_frames=256", "optim.scheduler=cosine"]) == 0
    assert lrs(cosine) == pytest.approx([3e-4, 3e-4 * (1 + math.cos(math.pi / 2)) / 2])  # 2 steps: half a cosine
    assert train_in_process([f"output_dir={cosine}", *RESUMABLE, "trainer.total_frames=512", "optim.scheduler=cosine",
                             "optim.lr=1e-3"]) == 0
    expected = [1e-3 * (1 + math.cos(math.pi * step / 4)) / 2 for step in (2, 3)]  # steps 2, 3 of the 4-step curve
    assert lrs(cosine)[2:] == pytest.approx(expected)


def test_a_lock_the_folder_no_longer_lets_go_of_is_one_line(tmp_path, caplog):
    """The folder turns read-only during the run (the checkpoint's own error is what the user must read): releasing
    the lock says so in a line instead of raising over that error; the next run takes the dead run's lock over."""
    from grpo_accel.run.folder import LOCK_FILE, RunFolderLock

    disk = tmp_path / "disk"
    disk.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "size=1m", "tmpfs", str(disk)], check=True)
    try:
        lock = RunFolderLock(disk / "run")
        lock.acquire()
        subprocess.run(["mount", "-o", "remount,ro", str(disk)], check=True)
        lock.release()
        assert f"its lock {disk / 'run' / LOCK_FILE} could not be removed (Read-only file system)" in caplog.text
        assert not lock.held and (disk / "run" / LOCK_FILE).exists()
    finally:
        subprocess.run(["umount", str(disk)], check=True)
