"""The installed ``grpo-accel`` command: built as a wheel, installed in a fresh virtual environment, run from an
empty folder outside the checkout (one process, two under a shipped ZeRO-2 config by name, an export); and
``grpo-accel report``'s figure against the event files it was drawn from; report and export saying what they need
and what they took; the last line on screen is the run's own."""
import json
import re
import signal
import subprocess
import sys
import sysconfig
import tomllib
from pathlib import Path

import pytest

from launching import ROOT, free_port, run_in_group, wait_for_training
from trainer_utils import train_in_process


def test_every_package_folder_is_in_pyproject_and_the_configs_are_shipped_by_name():
    listed = tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]["packages"]
    folders = sorted(".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "grpo_accel").rglob("__init__.py"))
    assert sorted(p for p in listed if "._shipped." not in p) == folders
    from grpo_accel import shipped

    assert shipped.find("accelerate", "zero3") == ROOT / "accelerate_configs" / "zero3.yaml"
    assert shipped.find("recipe", "dapo") == ROOT / "launch" / "configs" / "dapo.yaml"
    assert shipped.find("recipe", "my/own.yaml") == Path("my/own.yaml")  # a path: the reader says if it is missing
    with pytest.raises(shipped.ShippedConfigError, match=r"--config 'dapoo': no such file, and no shipped config of "
                                                         r"that name; give a path, or one of async, dapo, default"):
        shipped.find("recipe", "dapoo")


@pytest.fixture(scope="module")
def installed(tmp_path_factory):
    """A fresh venv with the wheel built from this checkout installed (its dependencies are the checkout venv's,
    reached through a .pth file, so nothing is downloaded), and an empty folder outside the checkout to run in."""
    root = tmp_path_factory.mktemp("installed")
    build = run_in_group([sys.executable, "-m", "build", "--wheel", "--no-isolation", "-o", str(root / "dist"),
                          str(ROOT)], timeout=300, cwd=root)
    assert build.returncode == 0, build.stderr[-3000:]
    venv = root / "venv"
    subprocess.run([sys.executable, "-m", "venv", str(venv)], check=True)
    python = venv / "bin" / "python"
    site = subprocess.run([str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                          capture_output=True, text=True, check=True).stdout.strip()
    Path(site, "checkout_venv_dependencies.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    wheel = next((root / "dist").glob("grpo_accel-*.whl"))
    pip = subprocess.run([str(python), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(wheel)],
                         capture_output=True, text=True)
    assert pip.returncode == 0, pip.stderr[-3000:]
    empty = root / "elsewhere"
    empty.mkdir()
    return venv / "bin" / "grpo-accel", python, empty


def run(installed, *args, timeout=600):
    command, _, cwd = installed
    proc = run_in_group([str(command), *args], timeout=timeout, cwd=cwd,
                        env={"PATH": str(command.parent) + ":/usr/bin:/bin", "HOME": str(Path.home()),
                             "DS_ACCELERATOR": "cpu", "GRPO_ACCEL_THREADS": "1"})
    assert proc.returncode == 0, f"{args}\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def test_the_installed_command_trains_alone_and_under_zero2_by_name_and_exports(installed):
    command, python, empty = installed
    where = subprocess.run([str(python), "-c", "import grpo_accel; print(grpo_accel.__file__)"], cwd=empty,
                           capture_output=True, text=True, check=True).stdout
    assert str(ROOT) not in where and "site-packages" in where, "the wheel's copy, not the checkout"
    helped = run(installed, "train", "--help").stdout
    assert "grpo-accel train" in helped and "  trainer.total_frames=128000" in helped
    assert "zero3" in run(installed, "configs").stdout
    run(installed, "train", "output_dir=one", "trainer.total_frames=256", "trainer.progress_bar=false")
    assert json.loads((empty / "one" / "summary.json").read_text())["iterations"] == 2
    run(installed, "train", "--accelerate-config", "zero2", "output_dir=two", "trainer.total_frames=256",
        "trainer.progress_bar=false", f"weight_sync.master_port={free_port()}")
    summary = json.loads((empty / "two" / "summary.json").read_text())
    assert summary["iterations"] == 2 and summary["zero_stage"] == 2 and summary["num_processes"] == 2
    checkpoint = sorted((empty / "two" / "checkpoints").glob("step_*"))[-1]
    run(installed, "export", str(checkpoint), "exported")
    assert (empty / "exported" / "config.json").is_file() and list((empty / "exported").glob("*.safetensors"))


def test_settings_written_as_options_are_overrides():
    """Issue 74 item 7: ``--learning_rate 1e-6`` (TRL's and argparse's habit) was argparse's bare "unrecognized
    arguments"; settings may be written as options, and TRL's names are then answered as on any other line."""
    from grpo_accel.config.checks import ConfigError
    from grpo_accel.cli.train import dashed_settings

    assert dashed_settings(["--config", "dapo", "--optim.lr", "1e-6", "--overwrite", "trainer.seed=3",
                            "--max-new-tokens=64", "--loss.eps_low", "-0.1", "--help"]) == [
        "--config", "dapo", "optim.lr=1e-6", "overwrite=true", "trainer.seed=3", "max_new_tokens=64",
        "loss.eps_low=-0.1", "--help"]
    with pytest.raises(ConfigError, match=r"trainer.total_frames='abc': must be an integer"):
        train_in_process(["--trainer.total_frames", "abc"])  # read as the setting, through the trainer's command
    with pytest.raises(ConfigError, match=r"learning_rate: unknown key; `learning_rate` is TRL's name; here it is "
                                          r"`optim.lr`"):
        train_in_process(["--learning_rate", "1e-6"])


def test_version_env_and_help_text_are_what_a_terminal_and_a_bug_report_need(capsys, monkeypatch, tmp_path):
    """Issue 74 item 16: no --version nor env; --help showed reST markup (``x``, :func:`x`); models pip-installed
    gguf at run time."""
    import accelerate
    import torch

    from grpo_accel import __version__
    from grpo_accel.cli import main, models

    assert main(["--version"]) == 0 and capsys.readouterr().out == f"grpo-accel {__version__}\n"
    assert main(["env"]) == 0
    said = dict(line.split(": ", 1) for line in capsys.readouterr().out.splitlines())
    assert said["grpo_accel"] == __version__ and said["torch"] == torch.__version__
    assert said["accelerate"] == accelerate.__version__ and said["gpus"] == str(torch.cuda.device_count())
    assert {"deepspeed", "transformers", "python", "platform", "cuda", "sglang", "vllm"} <= set(said)
    for command in (["train"], ["export"], ["models"], ["report"], ["reward-server"], []):
        with pytest.raises(SystemExit):
            main([*command, "--help"])
        shown = capsys.readouterr().out
        assert "usage:" in shown and "``" not in shown and not re.search(r":\w+:`", shown), command
    monkeypatch.setitem(sys.modules, "gguf", None)  # installed without the models extra
    with pytest.raises(SystemExit) as exit_:
        models.main(["smollm2-135m", str(tmp_path / "smollm2")])
    assert exit_.value.code == 2 and capsys.readouterr().err == (
        "error: grpo-accel models reads GGUF files with the gguf package, which is not installed here: pip install "
        "'grpo_accel[models]'.\n")


def test_report_draws_the_event_files_points(tmp_path):
    out = tmp_path / "run"
    assert train_in_process([f"output_dir={out}", "trainer.total_frames=384", "trainer.progress_bar=false",
                             "trainer.log_timings=true"]) == 0
    from grpo_accel.cli import main
    from grpo_accel.reporting.event_files import read_scalars

    assert main(["report", str(out)]) == 0
    assert (out / "report.png").stat().st_size > 10_000
    assert re.search(r"\| run \| 3 \| \d\.\d+ -> \d\.\d+ \|", (out / "report.md").read_text())
    from grpo_accel.reporting.report import report

    figure = report([out, out], tmp_path / "both")  # a run named twice: two lines per quantity
    axes = {ax.get_title(): ax for ax in figure.axes}
    # the default run has kl_coef 0 and one on-policy epoch: its KL estimate and clip fraction are 0 throughout,
    # so not drawn (issue 65); what is on takes their place
    assert list(axes) == ["reward (mean)", "completion length (tokens, mean)", "entropy (nats per token)",
                          "completions without signal (advantage 0, share)", "learning rate", "seconds per batch"]
    assert "Off in every run (0 at every logged batch, so not drawn): KL estimate, clip fraction." in (
        out / "report.md").read_text()
    assert all(0 <= v <= 1 for _, v in read_scalars(out / "tensorboard")["train/zero_advantage_fraction"])
    scalars = read_scalars(out / "tensorboard")
    lines = {line.get_label(): line.get_xydata().tolist() for line in axes["reward (mean)"].lines}
    assert lines["run: reward_mean"] == [[s, v] for s, v in scalars["train/reward_mean"]]
    assert lines["run: reward/answer_match_mean"] == [[s, v] for s, v in scalars["train/reward/answer_match_mean"]]
    assert len(lines) == 2 * 3, "both runs: the reward and its two functions' means"
    timing = {line.get_label() for line in axes["seconds per batch"].lines}
    assert "run: forward_backward" in timing and len(axes["learning rate"].lines) == 2
    with pytest.raises(SystemExit):
        main(["report", str(tmp_path / "nothing")])


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
    assert re.search(r"read the policy \(0\.\dM parameters\) in \d+\.\d s; writing ", proc.stderr)  # item 16: progress
    assert re.search(rf"exported {run / 'checkpoints' / 'step_00000002'} -> {tmp_path / 'model'} \(\d+\.\d s\)",
                     proc.stderr)
    assert (tmp_path / "model" / "config.json").is_file()


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
