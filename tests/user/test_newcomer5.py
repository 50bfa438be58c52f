"""A newcomer's cases (issue 58), each run as a user runs it: a resumed run trains at the rate it says, a failed run
looks failed in the trackers, no silent evaluation on training rows, a warmup longer than the run is one line,
defaults that follow the model are said, grpo-accel report and export say what they do."""
import json
import logging
import math
import signal
import subprocess
import sys
import time

import pytest

from grpo_accel.config.checks import ConfigError
from grpo_accel.config.loading import load_config
from grpo_accel.reporting.event_files import read_scalars
from launching import ROOT, run_in_group
from trainer_utils import train_in_process

RUN = ["trainer.progress_bar=false", "checkpoint.resume=auto"]  # 128 completions a batch, one optimizer step each


def lrs(out) -> list[float]:
    return [v for _, v in read_scalars(out / "tensorboard")["train/lr"]]


def test_a_resumed_run_trains_at_the_rate_it_was_given(tmp_path, caplog):
    """Item 1: a constant rate changed at resume applies from the first resumed step; a cosine run extended with a
    new peak continues on the new, longer curve at the step it had reached (not at the old curve's end, 0)."""
    constant = tmp_path / "constant"
    assert train_in_process([f"output_dir={constant}", *RUN, "trainer.total_frames=256"]) == 0
    with caplog.at_level(logging.INFO):
        assert train_in_process([f"output_dir={constant}", *RUN, "trainer.total_frames=512", "optim.lr=1e-3"]) == 0
    assert lrs(constant) == pytest.approx([3e-4, 3e-4, 1e-3, 1e-3])
    assert "learning rate: the checkpoint's peak 0.0003 -> 0.001, this run's, from its first step" in caplog.text
    cosine = tmp_path / "cosine"
    assert train_in_process([f"output_dir={cosine}", *RUN, "trainer.total_frames=256", "optim.scheduler=cosine"]) == 0
    assert lrs(cosine) == pytest.approx([3e-4, 3e-4 * (1 + math.cos(math.pi / 2)) / 2])  # 2 steps: half a cosine
    assert train_in_process([f"output_dir={cosine}", *RUN, "trainer.total_frames=512", "optim.scheduler=cosine",
                             "optim.lr=1e-3"]) == 0
    expected = [1e-3 * (1 + math.cos(math.pi * step / 4)) / 2 for step in (2, 3)]  # steps 2, 3 of the 4-step curve
    assert lrs(cosine)[2:] == pytest.approx(expected)


def tracked_ends(root):
    """(W&B's exit codes, MLflow's statuses) of the runs stored under ``root``."""
    import mlflow

    from tracker_stores import wandb_records

    codes = [r.exit.exit_code for p in sorted(root.rglob("run-*.wandb")) for r in wandb_records(p)
             if r.WhichOneof("record_type") == "exit"]
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    runs = client.search_runs([client.get_experiment_by_name("grpo_accel").experiment_id])
    return codes, [r.info.status for r in runs]


def test_a_failed_or_stopped_run_ends_so_in_the_trackers(tmp_path):
    """Item 2: a reward that raises (exit 2) ended W&B with exit code 0 and MLflow FINISHED; now 1 and FAILED, and a
    SIGTERM-stopped run 143 (SIGTERM's) and KILLED."""
    from tracker_stores import tracker_env

    (tmp_path / "bad_reward.py").write_text("def bad(prompts, completions, **kw):\n    raise RuntimeError('no')\n")
    common = [sys.executable, str(ROOT / "launch" / "train.py"), "trainer.report_to=[wandb, mlflow]", *RUN]
    env = {**__import__("os").environ, **tracker_env(tmp_path / "failed")}
    (tmp_path / "failed").mkdir()
    proc = run_in_group([*common, f"output_dir={tmp_path / 'failed' / 'run'}", "rewards=[{name: 'bad_reward:bad'}]"],
                        cwd=tmp_path, env={**env, "PYTHONPATH": str(tmp_path)}, timeout=300)
    assert proc.returncode == 2 and "reward function 'bad' raised RuntimeError" in proc.stderr
    assert tracked_ends(tmp_path / "failed") == ([1], ["FAILED"])
    root = tmp_path / "stopped"
    root.mkdir()
    env = {**__import__("os").environ, **tracker_env(root)}
    with (root / "stderr").open("w") as err, subprocess.Popen(
            [*common, f"output_dir={root / 'run'}", "trainer.total_frames=128000"], cwd=root, env=env,
            stderr=err) as trainer:
        wait_for_training(root / "stderr")
        trainer.send_signal(signal.SIGTERM)
        trainer.wait(timeout=120)
    assert trainer.returncode == 0, (root / "stderr").read_text()[-3000:]
    assert tracked_ends(root) == ([143], ["KILLED"])


def wait_for_training(stderr, timeout: float = 120) -> None:
    """Until the run's first generation (its decode path is said then): training has begun."""
    deadline = time.monotonic() + timeout
    while "decode: " not in stderr.read_text() and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(0.3)


def test_an_evaluation_split_a_file_does_not_have_is_one_line(tmp_path):
    """Item 3: the GSM8K recipe on a local file evaluated on its training rows, silently."""
    data = tmp_path / "gsm.jsonl"
    data.write_text(json.dumps({"question": "1+1?", "answer": "2\n#### 2"}) + "\n")
    with pytest.raises(ConfigError) as err:
        train_in_process(["--config", str(ROOT / "launch" / "configs" / "gsm8k.yaml"), f"data.path={data}",
                          f"output_dir={tmp_path / 'run'}"])
    assert str(err.value).startswith(f"data.eval_split='test': data.path='{data}' is one file, which has no splits: "
                                     "its held-out rows would be the training rows.")


def test_a_warmup_as_long_as_the_run_is_one_line(tmp_path):
    """Item 4: warmup_steps=500 in a 2-step run was accepted and the peak never reached."""
    with pytest.raises(ConfigError, match=r"optim.warmup_steps=500: a warmup of 500 optimizer steps in a run of 2 "
                                          r"never reaches optim.lr=0.0003"):
        train_in_process([f"output_dir={tmp_path / 'run'}", "trainer.total_frames=256", "optim.warmup_steps=500"])


def test_an_unset_budget_that_does_not_fit_the_model_follows_it_and_says_so(tmp_path, model_dir, caplog):
    """Item 5: a named model of 128 positions with rollout.max_new_tokens unset (TRL's 256): the run stopped naming
    a key the user never set; now the budget is what the context leaves after the longest prompt (4 tokens)."""
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        assert train_in_process([f"output_dir={out}", f"model.name_or_path={model_dir}", "optim.lr=3e-4",
                                 "trainer.total_frames=128", "trainer.progress_bar=false"]) == 0
    assert ("rollout.max_new_tokens (unset) follows the model: 124, what its 128 positions leave after the longest "
            "prompt (4 tokens), not the default 256") in caplog.text
    said = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("unset settings that follow"))
    assert "rollout.max_new_tokens=124" in said and "rollout.max_prompt_tokens=512" in said
    assert json.loads((out / "summary.json").read_text())["iterations"] == 1
    with pytest.raises(Exception, match="rollout.max_new_tokens=200"):  # set by the user: kept, and refused
        train_in_process([f"output_dir={tmp_path / 'set'}", f"model.name_or_path={model_dir}",
                          "rollout.max_new_tokens=200", "trainer.total_frames=128"])


def test_report_says_what_it_needs_and_what_is_missing(tmp_path, monkeypatch, capsys):
    """Item 7: without matplotlib a ModuleNotFoundError traceback; a folder that does not exist was "no event files"."""
    from grpo_accel.cli import report

    with pytest.raises(SystemExit) as exit_:
        report.main([str(tmp_path / "nowhere")])
    assert exit_.value.code == 2
    assert capsys.readouterr().err.strip() == f"error: {tmp_path / 'nowhere'}: no such folder; give a run's output_dir."
    run = tmp_path / "run"
    assert train_in_process([f"output_dir={run}", "trainer.total_frames=128", "trainer.progress_bar=false"]) == 0
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # as if it were not installed
    with pytest.raises(SystemExit):
        report.main([str(run)])
    assert capsys.readouterr().err.strip() == ("error: grpo-accel report draws with matplotlib, which is not installed "
                                               "here: pip install 'grpo_accel[report]'.")


def test_every_unknown_key_at_once_with_what_was_meant(tmp_path):
    """Item 8: seven TRL names took seven runs; a misspelt key got no suggestion."""
    with pytest.raises(ConfigError) as err:
        load_config(None, ["num_generations=8", "learning_rate=1e-6", "trainer.totl_frames=64"])
    head, *lines = str(err.value).splitlines()
    assert head == "3 settings are not keys here:" and len(lines) == 3
    assert lines[0].startswith("  num_generations: unknown key; `num_generations` is TRL's name; here it is "
                               "`rollout.group_size`")
    assert lines[2].startswith("  trainer.totl_frames: unknown key; did you mean trainer.total_frames?")


def test_export_takes_a_run_folder_and_says_which_checkpoint(tmp_path):
    """Item 8: grpo-accel export <run folder> said "not a complete checkpoint"; DeepSpeed's accelerator notice
    showed."""
    run = tmp_path / "run"
    assert train_in_process([f"output_dir={run}", "trainer.total_frames=256", "trainer.progress_bar=false"]) == 0
    proc = subprocess.run([sys.executable, "-m", "grpo_accel.cli", "export", str(run), str(tmp_path / "model")],
                          capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert f"exporting {run / 'checkpoints' / 'step_00000002'}, the newest complete checkpoint of {run}" in proc.stderr
    assert "Setting accelerator to CPU" not in proc.stdout + proc.stderr
    assert (tmp_path / "model" / "config.json").is_file()


def test_fewer_rows_than_prompts_per_batch_are_said(tmp_path, caplog):
    """Item 8: 4 rows with 16 prompts per batch repeated rows, unsaid."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+1=", "answer": str(a + 1)}) + "\n" for a in range(4)))
    with caplog.at_level(logging.WARNING):
        assert train_in_process([f"output_dir={tmp_path / 'run'}", f"data.path={data}", "trainer.total_frames=128",
                                 "trainer.progress_bar=false"]) == 0
    assert ("rollout.prompts_per_batch=16 is more than the data's 4 rows: every batch repeats rows (each about 4.0 "
            "times)") in caplog.text


def test_a_trackers_message_keeps_its_link():
    from grpo_accel.reporting.trackers import one_line

    text = one_line(ValueError("the tracking URI is not valid.\n" + "detail " * 60 + "\nSee https://mlflow.org/docs/x."))
    assert text.endswith("... https://mlflow.org/docs/x") and "\n" not in text


def test_mlflow_keeps_taking_sample_tables_past_its_tag_limit(tmp_path, monkeypatch):
    """Found running item 2: MLflow's log_table lists every table in one run tag, cut at 8,000 characters, so the
    ~120th logged batch's samples raised JSONDecodeError and ended the run."""
    import mlflow

    from grpo_accel.reporting.trackers import open_trackers

    monkeypatch.setenv("MLFLOW_TRACKING_URI", f"sqlite:///{tmp_path}/mlflow.db")
    monkeypatch.chdir(tmp_path)
    trackers = open_trackers(["mlflow"], tmp_path / "run", project="p", run_name="r")
    row = {"prompt": "1+1=", "completion": "2", "reward": 1.0}
    for step in range(1, 201):
        trackers.log_samples([row], step)
    run_id = mlflow.active_run().info.run_id
    trackers.close()
    client = mlflow.MlflowClient()
    assert len(client.list_artifacts(run_id, "samples")) == 200
    assert client.get_run(run_id).info.status == "FINISHED"


def grpo_accel_train(tmp_path, *args, signal_after_start=None):
    """``grpo-accel train`` (as ``python -m grpo_accel.cli``) in a session of its own: (exit code, stderr lines)."""
    import os

    cmd = [sys.executable, "-m", "grpo_accel.cli", "train", *args]
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    with (tmp_path / "stderr").open("w") as err, subprocess.Popen(cmd, cwd=tmp_path, env=env, stderr=err,
                                                                  start_new_session=True) as proc:
        if signal_after_start is not None:
            wait_for_training(tmp_path / "stderr")
            signal_after_start(proc)
        code = proc.wait(timeout=300)
    return code, [line for line in (tmp_path / "stderr").read_text().splitlines() if line.strip()]


def test_the_last_line_on_screen_is_ours(tmp_path):
    """Item 6, through grpo-accel train --accelerate-config (it starts Accelerate's launcher): after our line a
    DeepSpeed typo ended in ~40 lines of torch elastic's report, Ctrl-C in the launcher's KeyboardInterrupt
    traceback, a killed rank in "Root Cause ... exitcode -9". Our line is said again below them."""
    import os

    ds = tmp_path / "typo.json"
    ds.write_text(json.dumps({"zero_optimization": {"stgae": 2}}))
    accelerate = tmp_path / "typo.yaml"
    accelerate.write_text((ROOT / "accelerate_configs" / "zero2.yaml").read_text().replace("ds_configs/zero2.json",
                                                                                            str(ds)))
    (tmp_path / "typo").mkdir()
    code, lines = grpo_accel_train(tmp_path / "typo", "--accelerate-config", str(accelerate), "output_dir=run")
    assert code != 0 and lines[-1].startswith(f"error: {ds}: zero_optimization.stgae is not a DeepSpeed setting")
    (tmp_path / "ctrl_c").mkdir()
    code, lines = grpo_accel_train(tmp_path / "ctrl_c", "--accelerate-config", "single_process", "output_dir=run",
                                   "trainer.progress_bar=false", "trainer.total_frames=128000",
                                   signal_after_start=lambda p: os.killpg(p.pid, signal.SIGINT))
    assert "stopped (received SIGINT) after " in lines[-1] and lines[-1].endswith(
        "to continue, run the same command with checkpoint.resume=auto"), lines[-6:]
    (tmp_path / "killed").mkdir()

    def kill_a_rank(launcher):
        import psutil

        ranks = [p for p in psutil.Process(launcher.pid).children(recursive=True)
                 if "grpo_accel.cli.train" in (line := " ".join(p.cmdline())) and "accelerate" not in line]
        max(ranks, key=lambda p: p.pid).kill()

    code, lines = grpo_accel_train(tmp_path / "killed", "--accelerate-config", "ddp", "output_dir=run",
                                   "trainer.progress_bar=false", "trainer.total_frames=128000",
                                   signal_after_start=kill_a_rank)
    assert code != 0 and lines[-1].startswith(("error (rank ", "error: the launch failed")), lines[-8:]
