"""A newcomer's cases (issue 49), each run as a user runs it: one line naming the setting, the file and the fix."""
import subprocess
import sys

from launching import ROOT, TINY_FOLDER, run_in_group


def test_a_folder_that_is_not_a_dataset_and_a_model_folder_without_weights_are_one_line(tmp_path, model_dir):
    """Issue 49 items 3 and 4, run as a user runs them: data.path at a model folder gave a 150-line CastError
    traceback, model.name_or_path at a folder with a config and a tokenizer but no weights an OSError traceback."""
    import shutil

    def one_line(*args):
        proc = run_in_group([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={tmp_path}/run",
                             "trainer.progress_bar=false", *args], cwd=tmp_path, timeout=300)
        assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
        return proc.stderr.strip().splitlines()[-1]

    assert one_line(f"data.path={model_dir}") == (
        f"error: data.path='{model_dir}' is a model folder (config.json and weights), not a dataset; give a JSONL or "
        "Parquet file, a folder written by Dataset.save_to_disk, or a hub dataset id (model.name_or_path takes model "
        "folders).")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "readme.md").write_text("no rows here")
    assert one_line(f"data.path={tmp_path / 'notes'}").startswith(
        f"error: data.path='{tmp_path / 'notes'}' is a folder with no data files (.jsonl, .json, .parquet")
    no_weights = tmp_path / "no_weights"
    shutil.copytree(model_dir, no_weights, ignore=shutil.ignore_patterns("*.safetensors", "*.bin"))
    assert one_line(f"model.name_or_path={no_weights}", *TINY_FOLDER) == (
        f"error: model.name_or_path='{no_weights}': {no_weights} has a config.json but no weights (model.safetensors, "
        "model-*.safetensors, model.safetensors.index.json, pytorch_model.bin, pytorch_model-*.bin, "
        "pytorch_model.bin.index.json); write them with model.save_pretrained there (a tokenizer's save_pretrained "
        "writes none), or point it at the folder that has them.")


def test_ctrl_c_while_waiting_for_an_sglang_server_is_one_line(tmp_path):
    """Issue 49 item 9, as a user meets it: Ctrl-C while the run waits for a server that is not up printed a
    KeyboardInterrupt traceback; it is one line and exit code 130."""
    import signal

    from launching import free_port

    url = f"http://127.0.0.1:{free_port()}"
    with subprocess.Popen([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={tmp_path}/run",
                           "rollout.backend=sglang", f"rollout.urls=[{url}]", "rollout.health_timeout_s=120"],
                          cwd=tmp_path, stderr=subprocess.PIPE, text=True) as proc:
        said = []
        for line in proc.stderr:  # the wait says what it waits for every 10 s
            said.append(line)
            if "waiting for SGLang server" in line:
                break
        signals = signal_masks(proc.pid)  # SIGINT caught by Python's handler, neither ignored nor blocked
        proc.send_signal(signal.SIGINT)
        rest = proc.stderr.read()
        # twice, in a whole suite's run, it ended with exit code 2 (the wait's timeout) instead: show its state
        assert proc.wait(timeout=60) == 130, f"{signals}\n" + "".join(said)[-2000:] + rest[-3000:]
    assert signals["SigCgt"] & 1 << signal.SIGINT - 1 and not signals["SigIgn"] & 1 << signal.SIGINT - 1, signals
    assert "Traceback" not in rest and "KeyboardInterrupt" not in rest, rest[-3000:]
    assert rest.strip().splitlines()[-1] == "stopped (Ctrl-C) before training began; nothing was trained or saved"


def signal_masks(pid: int) -> dict[str, int]:
    """A process's signal sets from /proc (bit ``n - 1`` is signal ``n``): blocked, ignored, caught by a handler."""
    with open(f"/proc/{pid}/status") as status:
        fields = dict(line.split(":", 1) for line in status if line.startswith(("SigBlk", "SigIgn", "SigCgt")))
    return {name: int(value, 16) for name, value in fields.items()}
