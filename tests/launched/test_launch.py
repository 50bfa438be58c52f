"""The recipe end to end through real ``accelerate launch`` subprocesses."""
import json
import re
import subprocess
import sys

import pytest

from grpo_accel.config.loading import load_config
from launching import ROOT, launch, run_in_group
from trainer_utils import train_in_process


def test_embedded_default_learns_and_logs_to_tensorboard(tmp_path):
    """The README's main run, full length, in this process (test_readme launches its command as written)."""
    out = tmp_path / "run"
    train_in_process([f"output_dir={out}", "trainer.total_frames=25600", "trainer.progress_bar=false"])
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 200
    assert summary["reward_last_mean"] > summary["reward_first_mean"] + 0.15, summary
    from grpo_accel.reporting.event_files import read_scalars

    scalars = read_scalars(out / "tensorboard")
    for tag in ("train/reward_mean", "train/reward_std", "train/loss", "train/clip_fraction", "train/kl_approx",
                "train/ESS", "train/entropy", "train/ratio_mean", "train/reward/answer_match_mean",
                "train/reward/format_match_mean", "train/lr", "time/generate", "time/score",
                "train/engine_logprob_abs_diff", "train/engine_prob_ratio_max"):
        assert len(scalars[tag]) == 200, tag
    assert {round(v, 9) for _, v in scalars["train/lr"]} == {3e-4} and min(v for _, v in scalars["time/generate"]) > 0
    # the embedded engine samples with the trained weights: only batching and kernels set them apart
    assert max(v for _, v in scalars["train/engine_logprob_abs_diff"]) < 1e-4
    from grpo_accel.reporting.event_files import read_texts

    samples = read_texts(out / "tensorboard")["samples"]
    assert [step for step, _ in samples][:2] == [1, 2] and len(samples) == 200
    assert samples[-1][1].count("**reward ") == 3 and "prompt:\n\n    " in samples[-1][1]
    assert [step for step, _ in scalars["train/reward_mean"]][:3] == [1, 2, 3]
    assert (out / "config.yaml").read_text().count("total_frames: 25600") == 1


def test_the_smollm2_recipe_runs_end_to_end_on_a_saved_chat_dataset(tmp_path, smollm2):
    """The recipe's path at a tiny scale (in this process): the converted model from its folder, chat rows from a
    saved dataset folder (columns renamed, a held-out split), the chat template with a system prompt, math_answer,
    evaluation before, during and after training, completion samples and the engine/trainer logprob gap."""
    import datasets

    from grpo_accel.reporting.event_files import read_scalars, read_texts
    from grpo_accel.tasks.chat_arithmetic import chat_arithmetic_rows

    train, held_out = chat_arithmetic_rows(99, holdout=2, count=6)
    renamed = lambda rows: datasets.Dataset.from_list(  # noqa: E731 - a dataset with its own column names
        [{"question": r["prompt"], "solution": r["answer"]} for r in rows])
    datasets.DatasetDict({"train": renamed(train), "test": renamed(held_out)}).save_to_disk(str(tmp_path / "data"))
    out = tmp_path / "run"
    train_in_process([
        "--config", str(ROOT / "launch" / "configs" / "smollm2_arithmetic.yaml"), f"output_dir={out}",
        f"model.name_or_path={smollm2}", f"data.path={tmp_path / 'data'}", "data.eval_split=test",
        "data.rename_columns={question: prompt, solution: answer}", "data.system_prompt=Be brief.",
        "rollout.prompts_per_batch=2", "rollout.group_size=2", "rollout.max_new_tokens=6", "trainer.total_frames=8",
        "eval.every_iterations=1", "eval.k=2", "trainer.progress_bar=false",
    ])
    assert json.loads((out / "summary.json").read_text())["iterations"] == 2
    scalars = read_scalars(out / "tensorboard")
    assert [step for step, _ in scalars["eval/math_answer/greedy_mean"]] == [0, 1, 2]
    assert [step for step, _ in scalars["eval/math_answer/pass@2"]] == [0, 1, 2]
    assert max(v for _, v in scalars["train/engine_logprob_abs_diff"]) < 1e-3
    sample = read_texts(out / "tensorboard")["samples"][0][1]
    assert "    <|im_start|>system\n    Be brief.<|im_end|>\n    <|im_start|>user\n    What is " in sample
    assert "math_answer " in sample


@pytest.mark.parametrize(
    "overrides, message",
    [(["rollout.group_size=1"], "rollout.group_size=1: GRPO compares completions"),
     (["data.path=/nonexistent.jsonl"], "data.path='/nonexistent.jsonl': no such file"),
     (["data.path={empty}"], "the dataset is empty"),
     (["eval.every_iterations=5"], "eval.every_iterations=5: there are no held-out rows")],
)
def test_bad_input_is_a_named_error_before_anything_is_built(tmp_path, monkeypatch, overrides, message):
    """launch/train.py's checks, in-process: each error names the setting or file (how a launch prints it, one
    line, is the launched tests' below)."""
    from grpo_accel.errors import UserError
    from grpo_accel.recipe.build import build_trainer
    from grpo_accel.config.loading import load_config

    empty = tmp_path / "empty.jsonl"
    empty.write_text("\n")
    with pytest.raises(UserError) as err:
        build_trainer(load_config(None, [f"output_dir={tmp_path / 'run'}", *(o.format(empty=empty) for o in overrides)]))
    assert message in str(err.value)
    if message == "the dataset is empty":
        assert str(empty) in str(err.value)  # the file is named


def test_an_error_of_ours_is_one_line_and_exit_code_2(tmp_path):
    """Run directly (a data error), it is the last line; under a 2-process launch (a batch layout that does not
    split) one process says it, before any process group exists, and torch's launcher report names it instead of
    pointing at its docs. (The layout's messages are tested in-process in test_config.py.)"""
    direct = run_in_group([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={tmp_path}/direct",
                           "rollout.max_prompt_tokens=2"], timeout=120)
    assert direct.returncode == 2 and 'launch/train.py", line' not in direct.stderr  # not a traceback
    assert direct.stderr.splitlines()[-1] == (
        "error: dataset row 0: column 'prompt' is 4 tokens, more than rollout.max_prompt_tokens=2; raise "
        "rollout.max_prompt_tokens, shorten or drop that prompt, or set data.overlong_prompts=drop (such rows leave "
        "the data) or truncate_left (each keeps its last 2 tokens, what older TRL did with max_prompt_length)."
    ), direct.stderr[-3000:]
    bad = [f"output_dir={tmp_path}/ddp", "trainer.micro_batch_completions=24", "trainer.gradient_accumulation_steps=4"]
    proc = launch("ddp.yaml", bad, expect_ok=False, timeout=120)
    said = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(said) == 1 and "(64 completions / 24) is not a multiple of trainer.gradient_accumulation_steps=4" in said[0]
    assert f"traceback : {said[0]}" in proc.stderr and 'launch/train.py", line' not in proc.stderr
    assert "process group ready" not in proc.stderr


TINY_MODEL_CONFIGS = sorted(p.name for p in (ROOT / "launch" / "configs").glob("*.yaml")
                            if load_config(p).model.name_or_path is None)


# the recipes naming a pretrained model: test_the_smollm2_recipe_runs_end_to_end, test_user_path's GSM8K recipe
@pytest.mark.parametrize("config", TINY_MODEL_CONFIGS)
def test_every_experiment_config_runs(tmp_path, config):
    """Each shipped config trained by launch/train.py in this process (launching a single process adds nothing
    the launched tests do not cover)."""
    from trainer_utils import train_in_process

    out = tmp_path / "run"
    assert train_in_process([
        "--config", str(ROOT / "launch" / "configs" / config), f"output_dir={out}", "trainer.total_frames=512",
        "trainer.progress_bar=false", "eval.every_iterations=2",
        *(["data.holdout=4"] if config != "dapo.yaml" else []),
        *(["rollout.embedded_worker=true"] if config == "async.yaml" else [])]) == 0  # and the decode worker
    from grpo_accel.reporting.event_files import read_scalars

    scalars = read_scalars(out / "tensorboard")
    assert len(scalars["train/loss"]) == 4
    assert [step for step, _ in scalars["eval/answer_match/pass@4"]] == [0, 2, 4]  # before training, every 2
    if config == "async.yaml":
        assert [v for _, v in scalars["train/staleness"]][1:] == [1.0, 1.0, 1.0]
    if config == "dapo.yaml":
        assert "train/dropped_group_fraction" in scalars


def test_import_is_cheap():
    code = (
        "import sys, grpo_accel\n"
        "heavy = [m for m in ('torch', 'transformers', 'accelerate', 'deepspeed', 'sglang') if m in sys.modules]\n"
        "assert not heavy, heavy\n"
        "from grpo_accel import GRPOTrainer, GRPOLoss\n"
        "assert 'deepspeed' not in sys.modules and 'sglang' not in sys.modules, 'optional packages imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=ROOT, check=True, timeout=120)


def test_a_launch_that_times_out_is_killed_with_its_children(tmp_path):
    """torch's elastic agent starts each rank in a session of its own; a timeout must still end every rank (a
    survivor holds DeepSpeed's build lock and our output pipe) and report where each one was."""
    import os
    import time

    pid_file = tmp_path / "rank.pid"
    rank = ("import os, time\n"
            f"open({str(pid_file)!r}, 'w').write(str(os.getpid()))\n"
            "def waiting_for_a_peer_that_never_comes():\n"
            "    time.sleep(300)\n"
            "waiting_for_a_peer_that_never_comes()\n")
    launcher = ("import subprocess, sys, time\n"  # the way torch's elastic agent starts a rank
                f"subprocess.Popen([sys.executable, '-c', {rank!r}], start_new_session=True).wait()\n")
    with pytest.raises(subprocess.TimeoutExpired) as timeout:
        run_in_group([sys.executable, "-c", launcher], timeout=1)
    assert "waiting_for_a_peer_that_never_comes" in str(timeout.value)  # the rank's stack, in the error
    child = int(pid_file.read_text())
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline:
        try:
            os.kill(child, 0)
        except ProcessLookupError:
            return
        time.sleep(0.1)
    raise AssertionError(f"the launcher's rank {child} (in a session of its own) outlived the timeout")


def test_model_folders_that_cannot_work_are_named_before_training(tmp_path, tokenizer, tiny_model):
    from grpo_accel.config.checks import ConfigError
    from grpo_accel.recipe.parts import build_tokenizer_and_model
    from grpo_accel.config.schema import ModelConfig
    from grpo_accel.tasks.tiny import build_char_tokenizer

    no_tokenizer, mismatched = tmp_path / "no_tokenizer", tmp_path / "mismatched"
    tiny_model.save_pretrained(no_tokenizer)
    tiny_model.save_pretrained(mismatched)
    build_char_tokenizer("0123456789+-*=abcdefghijklmnopqrstuvwxyz").save_pretrained(mismatched)
    cases = [(no_tokenizer, "has no tokenizer files"), (tmp_path / "missing" / "model", "no such folder"),
             (tmp_path, "has no config.json"), (mismatched, "the tokenizer has 44 tokens but the model embeds only 18")]
    for folder, message in cases:
        with pytest.raises(ConfigError, match=f"model.name_or_path='{folder}': .*{message}"):
            build_tokenizer_and_model(ModelConfig(name_or_path=str(folder)))


def test_a_reward_module_in_the_working_directory_needs_no_pythonpath(tmp_path):
    (tmp_path / "my_rewards.py").write_text("def always_one(prompts, completions, **fields):\n"
                                            "    return [1.0] * len(completions)\n")
    out = tmp_path / "run"  # launch/train.py puts the working directory on sys.path itself: run directly
    proc = run_in_group([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={out}",
                         "trainer.total_frames=256", "trainer.progress_bar=false",
                         "rewards=[{name: 'my_rewards:always_one'}]"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert json.loads((out / "summary.json").read_text())["reward_last_mean"] == 1.0


def test_help_lists_every_key_with_its_default(monkeypatch, capsys):
    monkeypatch.syspath_prepend(str(ROOT / "launch"))
    from train import main

    with pytest.raises(SystemExit) as done:
        main(["--help"])
    assert done.value.code == 0
    out = capsys.readouterr().out
    for line in ("  output_dir=\"runs/default\"  (str)", "  overwrite=false  (bool)", "  trainer.total_frames=128000  (int)",
                 "  trainer.micro_batch_completions=\"auto\"  (int | Literal['auto'])", "  weight_sync.timeout_s=600.0  (float)"):
        assert line in out.splitlines(), out[-3000:]


def test_the_api_example_splits_each_batch_across_processes_and_trains_as_one_process_does():
    """A script built on the Python API (launch/api_example.py) under ddp.yaml gave both processes world_size 1
    and the same prompts, and counted every frame twice; later its last reward was 0.114 on 2 processes and 0.095
    on one (issue 49: the replay buffer kept every batch, shuffled per process). Five batches: the same reward."""
    script = str(ROOT / "launch" / "api_example.py")
    proc = launch("ddp.yaml", ["640"], script=(script,))
    for rank in (0, 1):
        assert f"process {rank} of 2: share {rank} of 2 of each batch, 640 frames in all" in proc.stdout, proc.stdout
    alone = run_in_group([sys.executable, script, "640"], cwd=ROOT, timeout=300)
    assert alone.returncode == 0, alone.stderr[-3000:]
    reward = re.compile(r"process 0 of \d: .* mean reward (\d\.\d+)")
    assert reward.search(alone.stdout).group(1) == reward.search(proc.stdout).group(1), (alone.stdout, proc.stdout)


def test_the_api_under_deepspeed_runs_from_any_folder(tmp_path):
    """zero2.yaml names ds_configs/zero2.json relative to the checkout: the launcher found it from another folder,
    the API's accelerator set-up (make_accelerator, which both use now) did not (ValueError, ~100 lines)."""
    proc = launch("zero2.yaml", ["128"], script=(str(ROOT / "launch" / "api_example.py"),), cwd=tmp_path)
    for rank in (0, 1):
        assert f"process {rank} of 2: share {rank} of 2 of each batch, 128 frames in all" in proc.stdout, proc.stdout
