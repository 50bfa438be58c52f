"""trainer.report_to: the real W&B (offline), MLflow (a local SQLite store) and Trackio (its local store) packages
through Accelerate's trackers, read back with their own packages, against what TensorBoard holds; a failed or
stopped run ends so in them, their messages keep their links, MLflow takes sample tables past its tag limit."""
import json
import os
import signal
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from grpo_accel.reporting.event_files import read_scalars
from launching import ROOT, launch, run_in_group, wait_for_training
from tracker_stores import tracker_env, wandb_records

BATCH = 128  # frames per collected batch (16 prompts x 8)


@pytest.fixture(scope="module")
def resumed_run(tmp_path_factory):
    """A run logging to all four trackers: 3 batches (a checkpoint after batch 2 and at the end), then resumed
    by a second launch up to 5 batches."""
    root = tmp_path_factory.mktemp("trackers")
    out = root / "run"
    common = [f"output_dir={out}", "trainer.report_to=[tensorboard, wandb, mlflow, trackio]", "trainer.project=grpo_test",
              "trainer.run_name=first", "trainer.tracker_kwargs={wandb: {tags: [grpo, test]}}",
              "trainer.progress_bar=false", f"checkpoint.interval_frames={2 * BATCH}"]
    env = tracker_env(root)  # and run from root: MLflow keeps its artifacts in ./mlruns of where the run starts
    first = launch("single_process.yaml", [*common, f"trainer.total_frames={3 * BATCH}"], env=env, cwd=root)
    second = launch("single_process.yaml", [*common, f"trainer.total_frames={5 * BATCH}", "checkpoint.resume=auto"],
                    env=env, cwd=root)
    assert (root / "mlruns").is_dir()
    assert "resumed from" in second.stderr
    return root, out, first


def tensorboard_rewards(out: Path) -> list[tuple[int, float]]:
    return read_scalars(out / "tensorboard")["train/reward_mean"]


def as_float32(points) -> list[tuple[int, float]]:
    """TensorBoard stores a scalar as float32: the trackers' float64 values rounded the same way."""
    return [(step, float(np.float32(value))) for step, value in points]


# ---------------------------------------------------------------------------------------------------- W&B

def wandb_run(out: Path) -> dict:
    """Every offline run file under output_dir/wandb: run ids, tags, config keys and history rows."""
    run = {"ids": set(), "tags": set(), "project": set(), "config": {}, "history": []}
    for path in sorted((out / "wandb").glob("offline-run-*/run-*.wandb")):
        for record in wandb_records(path):
            kind = record.WhichOneof("record_type")
            if kind == "run":
                run["ids"].add(record.run.run_id)
                run["tags"].update(record.run.tags)
                run["project"].add(record.run.project)
                run["config"].update({u.key: json.loads(u.value_json) for u in record.run.config.update})
            elif kind == "config":
                run["config"].update({u.key: json.loads(u.value_json) for u in record.config.update})
            elif kind == "history":
                run["history"].append({item.key or "/".join(item.nested_key): json.loads(item.value_json)
                                       for item in record.history.item})
    return run


def test_wandb_holds_every_step_the_config_and_sample_tables_in_one_run(resumed_run):
    root, out, _ = resumed_run
    run = wandb_run(out)
    assert len(run["ids"]) == 1 and run["project"] == {"grpo_test"} and run["tags"] == {"grpo", "test"}
    rewards = [(row["_step"], row["train/reward_mean"]) for row in run["history"] if "train/reward_mean" in row]
    assert as_float32(rewards) == tensorboard_rewards(out) and [s for s, _ in rewards] == [1, 2, 3, 4, 5]
    assert run["config"]["optim.lr"] == 3e-4 and run["config"]["trainer.report_to"] == (
        '["tensorboard", "wandb", "mlflow", "trackio"]')
    tables = [row for row in run["history"] if row.get("samples/_type") == "table-file"]
    assert len(tables) == 5
    table = json.loads(next((out / "wandb").glob("offline-run-*/files/media/table/samples_1_*.table.json")).read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "answer_match", "format_match"]
    assert len(table["data"]) == 3 and table["data"][0][0].endswith("=")  # a prompt of the addition task


# ------------------------------------------------------------------------------------------------- MLflow

def test_mlflow_holds_every_step_the_params_and_sample_tables_in_one_run(resumed_run):
    import mlflow

    root, out, _ = resumed_run
    client = mlflow.MlflowClient(tracking_uri=f"sqlite:///{root}/mlflow.db")
    experiment = client.get_experiment_by_name("grpo_test")
    runs = client.search_runs([experiment.experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "first"
    run_id = runs[0].info.run_id
    history = sorted((m.step, m.value) for m in client.get_metric_history(run_id, "train/reward_mean"))
    assert as_float32(history) == tensorboard_rewards(out)
    assert runs[0].data.params["optim.lr"] == "0.0003" and runs[0].data.params["model.name_or_path"] == "None"
    artifacts = [a.path for a in client.list_artifacts(run_id, "samples")]
    assert artifacts == [f"samples/step_{s:08d}.json" for s in range(1, 6)]
    table = json.loads(Path(client.download_artifacts(run_id, artifacts[0], str(root / "dl"))).read_text())
    assert table["columns"] == ["prompt", "completion", "reward", "answer_match", "format_match"]


# ------------------------------------------------------------------------------------------------ Trackio

def trackio_logs(root: Path) -> dict:
    """Trackio's own storage read in a process of its own (its folder is fixed when trackio is imported)."""
    code = ("import json; from trackio.sqlite_storage import SQLiteStorage as S; "
            "print(json.dumps({'runs': S.get_runs('grpo_test'), 'logs': S.get_logs('grpo_test', 'first'), "
            "'config': S.get_run_config('grpo_test', 'first')}, default=str))")
    run = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120,
                         env={**os.environ, **tracker_env(root)})
    assert run.returncode == 0, run.stderr[-3000:]
    return json.loads(run.stdout.strip().splitlines()[-1])


def test_trackio_holds_every_step_the_config_and_sample_tables_in_one_run(resumed_run):
    root, out, _ = resumed_run
    stored = trackio_logs(root)
    assert stored["runs"] == ["first"]
    rewards = [(row["step"], row["train/reward_mean"]) for row in stored["logs"] if "train/reward_mean" in row]
    assert as_float32(rewards) == tensorboard_rewards(out)
    assert stored["config"]["optim.lr"] == 3e-4
    assert sum("samples" in row for row in stored["logs"]) == 5


# ------------------------------------------------------------------------------------- choices and errors

def test_tensorboard_holds_hyperparameters_and_the_checkpoints_name_the_runs(resumed_run):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    root, out, _ = resumed_run
    acc = EventAccumulator(str(out / "tensorboard"))
    acc.Reload()
    assert "_hparams_/experiment" in acc.summary_metadata  # the HPARAMS tab's summaries
    assert [s for s, _ in tensorboard_rewards(out)] == [1, 2, 3, 4, 5]
    meta = json.loads((out / "checkpoints" / "step_00000005" / "metadata.json").read_text())
    assert set(meta["user"]["trackers"]) == {"wandb", "mlflow", "trackio"}
    assert meta["user"]["trackers"]["wandb"] == wandb_run(out)["ids"].pop()
    assert meta["user"]["trackers"]["trackio"] == "first"


def test_a_missing_tracker_package_is_one_line_naming_the_install(tmp_path, monkeypatch):
    from grpo_accel.reporting.trackers import check_trackers

    run = subprocess.run([sys.executable, str(Path(__file__).parents[2] / "launch" / "train.py"),
                          f"output_dir={tmp_path}", "trainer.report_to=[tensorboard, comet_ml]"],
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 2
    last = run.stderr.strip().splitlines()[-1]
    assert last.startswith("error: trainer.report_to=['tensorboard', 'comet_ml']: the comet_ml package is not "
                           "installed") and "pip install comet_ml, or leave comet_ml out of trainer.report_to" in last
    monkeypatch.setitem(sys.modules, "wandb", None)  # as where the extra is not installed
    with pytest.raises(ImportError, match=r"pip install 'grpo_accel\[wandb\]'"):
        check_trackers(["wandb"])


def test_report_to_takes_accelerates_names_and_nothing_else():
    from accelerate.utils import LoggerType

    from grpo_accel.config.checks import ConfigError
    from grpo_accel.config.loading import load_config
    from grpo_accel.reporting.trackers import TRACKERS

    assert set(TRACKERS) == {str(t) for t in LoggerType} - {"all"}
    with pytest.raises(ConfigError, match=r"trainer.report_to\['tensorbord'\]='tensorbord': must be one of"):
        load_config(None, ["trainer.report_to=[tensorbord]"])
    with pytest.raises(ConfigError, match="trainer.tracker_kwargs=.*give arguments only for trackers in"):
        load_config(None, ["trainer.tracker_kwargs={wandb: {entity: x}}"])
    assert load_config(None, ["trainer.report_to=[]"]).trainer.report_to == []


def test_no_tracker_at_all_trains(tmp_path):
    proc = launch("single_process.yaml", [f"output_dir={tmp_path}", "trainer.report_to=[]", "trainer.total_frames=128",
                                          "trainer.progress_bar=false"])
    assert not (tmp_path / "tensorboard").exists() and (tmp_path / "summary.json").is_file()
    assert "done: 128 frames" in proc.stderr and "tensorboard --logdir" not in proc.stderr


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
    common = [sys.executable, str(ROOT / "launch" / "train.py"), "trainer.report_to=[wandb, mlflow]", *RESUMABLE]
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


RESUMABLE = ["trainer.progress_bar=false", "checkpoint.resume=auto"]  # 128 completions a batch, one optimizer step each
