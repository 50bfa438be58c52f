"""Resume and preemption for real: ``accelerate launch`` runs stopped, signalled and resumed."""
import json
import shutil

import pytest
import torch

from grpo_accel.checkpoint import Checkpoint
from grpo_accel.run.export import checkpoint_state_dict, policy_weights
from launching import launch
from trainer_utils import train_in_process

BASE = ["trainer.progress_bar=false", "trainer.micro_batch_completions=64", "checkpoint.interval_frames=null"]
BATCH = 128  # frames per collected batch (16 prompts x 8)


def signal_rewards(flag, signals=1, gap_s=0.0):
    return ("rewards=[{name: answer_match}, {name: format_match, weight: 0.2}, {name: 'tests.helpers.preempt_reward:signal_once',"
            f" weight: 0.0, kwargs: {{at_call: 3, rank: 1, signals: {signals}, flag: '{flag}', gap_s: {gap_s}}}}}]")


def contents(folder):
    """Relative path -> SHA-256 of every file: a same-length rewrite counts as a change."""
    import hashlib

    return {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in sorted(folder.rglob("*")) if p.is_file()}


def curves(out):
    from grpo_accel.reporting.event_files import read_scalars

    scalars = read_scalars(out / "tensorboard")
    return {tag: scalars[tag] for tag in ("train/loss", "train/reward_mean", "train/entropy", "train/grad_norm")}


def final_policy(out):
    last = Checkpoint(out / "checkpoints").complete()[-1]
    return policy_weights(checkpoint_state_dict(last))


@pytest.fixture(scope="module")
def never(tmp_path_factory):
    """The rewards setting of every run here: the signal reward, with its flag already set so it never fires."""
    flag = tmp_path_factory.mktemp("flag") / "never"
    flag.touch()
    return signal_rewards(flag)


@pytest.fixture(scope="module")
def straight(tmp_path_factory, never):
    """``straight(config)``: the output_dir of 4 batches run straight under ``config``, with a checkpoint after
    batch 2 and at the end (made once, shared)."""
    made = {}

    def get(config):
        if config not in made:
            made[config] = tmp_path_factory.mktemp("straight") / "run"
            launch(config, [f"output_dir={made[config]}", f"trainer.total_frames={4 * BATCH}", *BASE,
                            f"checkpoint.interval_frames={2 * BATCH}", never])
        return made[config]
    return get


def test_a_warmup_and_cosine_run_killed_after_a_checkpoint_resumes_to_the_straight_run(tmp_path, straight, never):
    """ZeRO-3 (parameters, gradients and optimizer state sharded; ZeRO-2's resume is the SIGTERM test's) under a
    learning-rate schedule (2 warmup steps, then cosine over the 4). The run is the straight one killed after
    batch 4 before its final save (a lost node, SIGKILL): its folder holds the checkpoint of batch 2 and
    TensorBoard points up to 4. The resume drops points 3-4 and logs them again, bitwise the straight run's; the
    schedule's state comes back with the checkpoint, so the resumed steps 3-4 use the rates the straight run
    used."""
    schedule = ["optim.scheduler=cosine", "optim.warmup_steps=2"]
    straight_out = tmp_path / "straight"
    common = [f"trainer.total_frames={4 * BATCH}", *BASE, f"checkpoint.interval_frames={2 * BATCH}", never, *schedule]
    launch("zero3.yaml", [f"output_dir={straight_out}", *common])
    killed = tmp_path / "killed"
    shutil.copytree(straight_out, killed)
    shutil.rmtree(killed / "checkpoints" / "step_00000004")
    proc = launch("zero3.yaml", [f"output_dir={killed}", "checkpoint.resume=auto", *common])
    assert "resumed from" in proc.stderr and "at iteration 2" in proc.stderr
    from grpo_accel.reporting.event_files import read_scalars

    lrs = [v for _, v in read_scalars(straight_out / "tensorboard")["train/lr"]]
    assert lrs == pytest.approx([0.0, 1.5e-4, 3e-4, 1.5e-4], rel=1e-6)  # warmup, then cos at 0 and 1/2 of 2 steps
    assert read_scalars(killed / "tensorboard")["train/lr"] == read_scalars(straight_out / "tensorboard")["train/lr"]
    assert curves(killed) == curves(straight_out)  # steps 1-4, bitwise, once each; steps 3-4 from the resumed run
    a, b = final_policy(straight_out), final_policy(killed)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    constant = final_policy(straight("zero3.yaml"))  # DeepSpeed's optimizer took the schedule's rates
    assert not all(torch.equal(a[k], constant[k]) for k in a)


def test_sigterm_on_one_rank_checkpoints_every_rank_and_exits_zero(tmp_path, straight):
    run = tmp_path / "run"
    rewards = signal_rewards(tmp_path / "fired")
    proc = launch("zero2.yaml", [f"output_dir={run}", f"trainer.total_frames={8 * BATCH}", *BASE, rewards])
    assert proc.returncode == 0 and (tmp_path / "fired").exists()
    summary = json.loads((run / "summary.json").read_text())
    assert summary["final_iteration"] == 3 and "another process requested a stop" in summary["stop_reason"]
    last = Checkpoint(run / "checkpoints").complete()[-1]
    assert last.name == "step_00000003"
    assert proc.stderr.strip().splitlines()[-1].endswith(  # the last line says how to go on
        f"stopped (another process requested a stop) after 384 frames, saved in {last}; to continue, run the same "
        "command with checkpoint.resume=auto")
    assert json.loads((last / "metadata.json").read_text())["reason"] == "another process requested a stop"
    assert (last / "trainer_state_rank0.pt").is_file() and (last / "trainer_state_rank1.pt").is_file()
    launch("zero2.yaml", [f"output_dir={run}", f"trainer.total_frames={4 * BATCH}", *BASE, rewards,
                          "checkpoint.resume=auto"])  # total_frames may change at a resume (8 -> 4 batches)
    assert f"total_frames: {4 * BATCH}" in (run / "config.yaml").read_text()  # written once the resume ran
    assert curves(run) == curves(straight("zero2.yaml"))  # steps 1-4, bitwise; 4 from the resumed run
    a, b = final_policy(straight("zero2.yaml")), final_policy(run)
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_second_signal_exits_at_once_and_keeps_earlier_checkpoints(tmp_path):
    """Two SIGTERMs on rank 1 during batch 3 of a run that checkpoints every batch, 1.5 s apart (one within
    RELAYED_WITHIN_S would be a launcher relaying the first): no checkpoint of batch 3 (complete or staged), those
    of batches 1 and 2 whole."""
    run = tmp_path / "run"
    proc = launch("zero2.yaml", [f"output_dir={run}", *BASE, f"trainer.total_frames={4 * BATCH}",
                                 f"checkpoint.interval_frames={BATCH}",
                                 signal_rewards(tmp_path / "fired", signals=2, gap_s=1.5)], expect_ok=False)
    assert proc.returncode != 0 and "second SIGTERM: exiting without a checkpoint" in proc.stderr
    saved = Checkpoint(run / "checkpoints").complete()
    assert [p.name for p in saved] == ["step_00000001", "step_00000002"]
    assert sorted(p.name for p in (run / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    signature = Checkpoint.read_metadata(saved[0])["signature"]
    for path in saved:  # every file its manifest lists, whole, and the same model
        Checkpoint.verify(path, signature=signature)


def refused_resume(tmp_path, zero2_run, never, settings: list[str], error: type, match: str) -> str:
    """A copy of the 2-process ZeRO-2 run resumed in-process with ``settings``: refused with ``error`` before
    anything is built (the message, returned), the run folder untouched."""
    run = tmp_path / "run"
    shutil.copytree(zero2_run, run)
    before = contents(run)
    with pytest.raises(error, match=match) as err:
        train_in_process([f"output_dir={run}", f"trainer.total_frames={8 * BATCH}", *BASE, never,
                          "checkpoint.resume=auto", *settings])
    assert contents(run) == before
    return str(err.value)


def test_resume_with_other_settings_names_them(tmp_path, straight, never):
    """launch/train.py's start point: refused before anything is built, the run folder untouched."""
    from grpo_accel.config.checks import ConfigError

    message = refused_resume(tmp_path, straight("zero2.yaml"), never, ["rollout.group_size=4", "model.hidden_size=32"],
                             ConfigError, "was trained with other settings")
    assert "model.hidden_size: 64 -> 32" in message and "rollout.group_size: 8 -> 4" in message


def test_a_fresh_run_never_lands_on_another_runs_outputs(tmp_path, caplog):
    """Reusing an output_dir used to rotate out the earlier run's checkpoints (and its own), mix TensorBoard
    files and feed resume=auto; and two live runs could write one folder. (launch/train.py in-process: the
    folder rules are decided before anything is built.)"""
    import os
    import signal
    import subprocess
    import sys

    from grpo_accel.config.checks import ConfigError
    from grpo_accel.run.folder import RunFolderBusy
    from grpo_accel.reporting.event_files import read_scalars

    run = tmp_path / "run"
    train_in_process([f"output_dir={run}", f"trainer.total_frames={2 * BATCH}", *BASE])
    before = contents(run)
    with pytest.raises(ConfigError, match="holds an earlier run's checkpoints, tensorboard, summary.json") as err:
        train_in_process([f"output_dir={run}", f"trainer.total_frames={BATCH}", *BASE])
    assert "checkpoint.resume=auto continues that run" in str(err.value) and "overwrite=true" in str(err.value)
    assert contents(run) == before

    holder = subprocess.Popen([sys.executable, "-c", "import sys, time; from grpo_accel.run.folder import RunFolderLock; "
                               f"RunFolderLock({str(run)!r}).acquire(); print(flush=True); time.sleep(300)"],
                              stdout=subprocess.PIPE, text=True)
    holder.stdout.readline()
    try:
        with pytest.raises(RunFolderBusy, match=f"is in use by pid {holder.pid} on"):
            train_in_process([f"output_dir={run}", f"trainer.total_frames={3 * BATCH}", *BASE,
                              "checkpoint.resume=auto"])
        assert {k: v for k, v in contents(run).items() if k != ".grpo_accel.lock"} == before
    finally:
        os.kill(holder.pid, signal.SIGKILL)  # leaves its lock behind, as a killed run does
        holder.wait()

    with caplog.at_level("INFO"):
        train_in_process([f"output_dir={run}", "trainer.total_frames=10", *BASE, "overwrite=true"])
    assert "trainer.total_frames=10 is rounded up to 128: batches are collected whole" in caplog.text
    assert f"taking over the lock of pid {holder.pid}" in caplog.text
    assert "deleted an earlier run's checkpoints, tensorboard, summary.json" in caplog.text
    assert [p.name for p in Checkpoint(run / "checkpoints").complete()] == ["step_00000001"]
    assert len(read_scalars(run / "tensorboard")["train/loss"]) == 1  # the new run's events only
    assert not (run / ".grpo_accel.lock").exists()


def test_zero3_export_matches_the_single_process_model(tmp_path, straight, never):
    from transformers import AutoModelForCausalLM

    from grpo_accel.run.export import export_checkpoint

    single, z3 = tmp_path / "single", straight("zero3.yaml")
    train_in_process([f"output_dir={single}", f"trainer.total_frames={4 * BATCH}", *BASE, never,
                      "trainer.micro_batch_completions=128"])  # the same global batch as 2 x 64
    exported = [AutoModelForCausalLM.from_pretrained(export_checkpoint(
        Checkpoint(run / "checkpoints").complete()[-1], tmp_path / f"hf_{run.name}")) for run in (single, z3)]
    ids = torch.tensor([[7, 14, 8, 17, 9]])
    with torch.no_grad():
        torch.testing.assert_close(exported[1](ids).logits, exported[0](ids).logits, rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("to_group, sent", [(True, "SIGINT"), (False, "SIGTERM")])
def test_ctrl_c_saves_and_ends_with_the_resume_line(tmp_path, to_group, sent):
    """Ctrl-C in a terminal signals the whole foreground group (launcher and trainer); a scheduler may signal the
    launcher alone: the trainer saves and its last line says how to go on. Accelerate's one-process launcher
    (1.16 and later) relays the signal it got as a SIGTERM, not a second stop, and SIGKILLs the trainer 5 s later,
    which the trainer says. (The launcher may still add its own KeyboardInterrupt traceback: not our process.)"""
    import os
    import signal
    import subprocess
    import time

    from launching import ACCELERATE, ROOT

    run = tmp_path / "run"
    cmd = [*ACCELERATE, "--config_file", str(ROOT / "accelerate_configs" / "single_process.yaml"),
           str(ROOT / "launch" / "train.py"), f"output_dir={run}", "trainer.progress_bar=false"]
    with subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, start_new_session=True,
                          cwd=ROOT) as proc:
        deadline = time.monotonic() + 120
        while not (run / "tensorboard").is_dir() and time.monotonic() < deadline:  # iteration 1 has been logged
            time.sleep(0.2)
        time.sleep(0.5)
        (os.killpg if to_group else os.kill)(proc.pid, getattr(signal, sent))
        try:
            out, err = proc.communicate(timeout=120)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    last = Checkpoint(run / "checkpoints").complete()[-1]
    frames = json.loads((last / "metadata.json").read_text())["frames"]
    ours = [line for line in err.splitlines() if " grpo_accel." in line]
    received = sent if to_group else "SIGTERM"  # relayed by the launcher
    assert ours[-1].endswith(f"stopped (received {received}) after {frames} frames, saved in {last}; to continue, run "
                             "the same command with checkpoint.resume=auto"), err[-3000:]
    assert 'launch/train.py", line' not in err and "second SIG" not in err  # no traceback, no second stop
    import accelerate

    if not to_group and tuple(int(x) for x in accelerate.__version__.split(".")[:2]) >= (1, 16):
        # (signalled with the group, the launcher may drop that line: 1.16 loses the stderr chunk it was copying)
        assert f"received {received}: the launcher (Accelerate {accelerate.__version__}) ends this process 5 s" in err


def test_ctrl_c_in_a_terminal_ends_with_the_resume_line_and_no_traceback(tmp_path):
    """The README's main command in a real terminal (a pseudo-terminal that is the launcher's controlling
    terminal, the launcher's group in its foreground, as a shell runs it): Ctrl-C (the terminal's ^C) reaches the
    trainer alone, which saves; Accelerate's launcher prints no KeyboardInterrupt traceback and exits 0, and the
    last line says how to go on."""
    import fcntl
    import os
    import pty
    import signal
    import subprocess
    import termios
    import threading
    import time

    from launching import ACCELERATE, ROOT

    run = tmp_path / "run"
    cmd = [*ACCELERATE, "--config_file", str(ROOT / "accelerate_configs" / "single_process.yaml"),
           str(ROOT / "launch" / "train.py"), f"output_dir={run}", "trainer.progress_bar=false"]
    master, slave = pty.openpty()
    proc = subprocess.Popen(cmd, stdin=slave, stdout=slave, stderr=slave, cwd=ROOT, start_new_session=True,
                            preexec_fn=lambda: fcntl.ioctl(0, termios.TIOCSCTTY, 0))  # the terminal is its own
    os.close(slave)
    chunks = []

    def read():
        while True:
            try:
                data = os.read(master, 4096)
            except OSError:  # EIO: every process holding the terminal has exited
                return
            if not data:
                return
            chunks.append(data)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    try:
        deadline = time.monotonic() + 120
        while not (run / "tensorboard").is_dir() and time.monotonic() < deadline:  # iteration 1 has been logged
            time.sleep(0.2)
        time.sleep(0.5)
        os.write(master, b"\x03")  # ^C, as typed
        assert proc.wait(timeout=120) == 0
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
    reader.join(timeout=10)
    os.close(master)
    out = b"".join(chunks).decode(errors="replace")
    last = Checkpoint(run / "checkpoints").complete()[-1]
    assert "Traceback" not in out and "KeyboardInterrupt" not in out, out[-3000:]
    lines = [line for line in out.splitlines() if line.strip()]
    assert lines[-1].endswith("to continue, run the same command with checkpoint.resume=auto"), out[-3000:]
    assert str(last) in lines[-1]
