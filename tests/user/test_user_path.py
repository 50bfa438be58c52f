"""A user's own pretrained model on a real dataset's layout: defaults that follow the model, learning-rate
schedules, GSM8K-style answers, TRL's names, and the GSM8K recipe at a tiny scale."""
import json
import math
import subprocess
import sys

import pytest
import torch
import yaml

from grpo_accel.config.checks import ConfigError
from grpo_accel.config.defaults import MODEL_DEFAULTS, unusual_settings
from grpo_accel.config.loading import flatten_keys, load_config, to_dict
from grpo_accel.config.schema import GRPOConfig
from grpo_accel.reporting.event_files import read_scalars
from launching import ROOT
from trainer_utils import train_in_process

# Two GSM8K rows in the dataset's own layout (openai/gsm8k, config "main": question, answer), written out here.
GSM8K_ROWS = [
    {"question": "Natalia sold clips to 48 of her friends in April, and then she sold half as many clips in May. "
                 "How many clips did Natalia sell altogether in April and May?",
     "answer": "Natalia sold 48/2 = <<48/2=24>>24 clips in May.\nNatalia sold 48+24 = <<48+24=72>>72 clips "
               "altogether in April and May.\n#### 72"},
    {"question": "A shop sold 1,200 pens on Monday and 3 times as many on Tuesday. How many pens did it sell on "
                 "Tuesday?",
     "answer": "On Tuesday it sold 1,200 * 3 = <<1200*3=3600>>3,600 pens.\n#### 3,600"},
]


def write_jsonl(path, rows):
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


# ------------------------------------------------------------------------------------ defaults by model

def test_unset_settings_follow_the_model_and_set_ones_are_kept():
    toy, named = load_config(), load_config(None, ["model.name_or_path=Org/some-model"])
    for key, default in MODEL_DEFAULTS.items():
        assert flatten_keys(to_dict(toy))[key] == default.builtin
        assert flatten_keys(to_dict(named))[key] == default.pretrained
    assert (named.optim.lr, named.rollout.max_new_tokens, named.rollout.max_prompt_tokens) == (1e-6, 256, 512)
    kept = load_config(None, ["model.name_or_path=Org/some-model", "optim.lr=2e-5", "rollout.max_new_tokens=64"])
    assert (kept.optim.lr, kept.rollout.max_new_tokens) == (2e-5, 64)
    assert GRPOConfig().optim.lr == 3e-4  # the Python dataclass resolves the same way


def test_a_setting_unusual_for_a_pretrained_model_is_one_warning_naming_its_key():
    cfg = load_config(None, ["model.name_or_path=Org/some-model", "optim.lr=3e-4", "rollout.max_new_tokens=4"])
    lines = unusual_settings(cfg, 135_000_000)
    assert len(lines) == 2 and lines[0].startswith("optim.lr=0.0003 is high for a pretrained model of 135M")
    assert lines[1].startswith("rollout.max_new_tokens=4 cuts a pretrained model's replies")
    assert unusual_settings(cfg, 84_544) == []  # the built-in tiny model: the toy's settings are its own
    assert unusual_settings(load_config(None, ["model.name_or_path=Org/some-model"]), 135_000_000) == []


def test_a_pretrained_model_given_alone_trains_with_its_defaults_and_the_toys_lr_warns(tmp_path, smollm2, caplog):
    """SmolLM2 with a data file and nothing else about the model: lr 1e-6, 256 new tokens (cut here to keep the
    test short); the toy's lr on it draws the warning, once."""
    data = write_jsonl(tmp_path / "rows.jsonl", [{"prompt": "2+2=", "answer": "4"}] * 4)
    out = tmp_path / "run"
    common = [f"model.name_or_path={smollm2}", f"data.path={data}", "rollout.prompts_per_batch=2",
              "rollout.group_size=2", "trainer.total_frames=4", "trainer.progress_bar=false",
              "checkpoint.interval_frames=null"]
    assert train_in_process([*common, f"output_dir={out}", "rollout.max_new_tokens=8"]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["optim"]["lr"] == 1e-6 and saved["rollout"]["max_prompt_tokens"] == 512
    assert read_scalars(out / "tensorboard")["train/lr"] == [(1, pytest.approx(1e-6))]
    assert not [r for r in caplog.records if "is high for a pretrained model" in r.getMessage()]
    caplog.clear()
    assert train_in_process([*common, f"output_dir={tmp_path / 'high'}", "optim.lr=3e-4",
                             "rollout.max_new_tokens=8"]) == 0
    warned = [r.getMessage() for r in caplog.records if "is high for a pretrained model" in r.getMessage()]
    assert len(warned) == 1 and warned[0].startswith("optim.lr=0.0003 is high for a pretrained model of 135M")


# ----------------------------------------------------------------------------------- learning-rate schedules

def lrs(scheduler, warmup, total, lr=1e-3, *more):
    """The rate of each optimizer step 0..total-1 under optim.scheduler=``scheduler``."""
    from grpo_accel.recipe.build import build_scheduler

    optimizer = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(1))], lr=lr)
    o = load_config(None, [f"optim.scheduler={scheduler}", f"optim.warmup_steps={warmup}", f"optim.lr={lr}",
                           *more]).optim
    schedule = build_scheduler(o, optimizer, total)
    out = []
    for _ in range(total):
        out.append(optimizer.param_groups[0]["lr"])
        optimizer.step()
        if schedule is not None:
            schedule.step()
    return out


def test_schedules_worked_by_hand():
    # 10 steps, 2 of warmup: steps 0, 1 rise 0 -> 5e-4; from step 2 the decay over the 8 steps left, at progress
    # p = (step - 2) / 8: linear 1e-3 * (1 - p), cosine 1e-3 * (1 + cos(pi p)) / 2.
    assert lrs("constant", 0, 4) == [1e-3] * 4
    assert lrs("constant", 2, 4) == pytest.approx([0.0, 5e-4, 1e-3, 1e-3])
    assert lrs("linear", 2, 10) == pytest.approx([0, 5e-4, 1e-3, 8.75e-4, 7.5e-4, 6.25e-4, 5e-4, 3.75e-4, 2.5e-4, 1.25e-4])
    cosine = lrs("cosine", 2, 10)
    assert cosine[:3] == pytest.approx([0, 5e-4, 1e-3]) and cosine[6] == pytest.approx(5e-4)  # p = 1/2
    assert cosine[4] == pytest.approx(1e-3 * (1 + math.cos(math.pi / 4)) / 2)  # p = 1/4: 8.536e-4
    floored = lrs("cosine", 2, 10, 1e-3, "optim.min_lr_ratio=0.1")  # transformers' cosine_with_min_lr, min_lr_rate 0.1
    assert floored[6] == pytest.approx(1e-3 * (0.1 + 0.9 * 0.5)) and floored[9] > 1e-4  # p = 1/2; never below 1e-4
    ratio = load_config(None, ["optim.warmup_ratio=0.25"]).optim
    assert ratio.warmup(40) == 10 and ratio.warmup_steps == 0


def test_the_run_logs_the_rate_of_each_optimizer_step(tmp_path):
    """5 batches of one optimizer step each, warmup 2 then cosine: train/lr is the rate each step used."""
    out = tmp_path / "run"
    assert train_in_process([f"output_dir={out}", "trainer.total_frames=640", "optim.scheduler=cosine",
                             "optim.warmup_steps=2", "trainer.progress_bar=false"]) == 0
    # steps 0..4 at 3e-4: warmup 0, 1.5e-4; then p = 0, 1/3, 2/3 of the 3 decaying steps
    expected = [0.0, 1.5e-4, 3e-4, 3e-4 * (1 + math.cos(math.pi / 3)) / 2, 3e-4 * (1 + math.cos(2 * math.pi / 3)) / 2]
    assert [v for _, v in read_scalars(out / "tensorboard")["train/lr"]] == pytest.approx(expected, rel=1e-6)


@pytest.mark.parametrize("overrides, message", [
    (["optim.warmup_steps=5", "optim.warmup_ratio=0.1"],
     "optim.warmup_ratio=0.1: optim.warmup_steps=5 is set too; give one of them (the other 0)."),
    (["optim.scheduler=step"], "optim.scheduler='step': must be one of ['constant', 'linear', 'cosine']."),
    (["optim.warmup_ratio=1.5"], "optim.warmup_ratio=1.5: use a share of the run's optimizer steps in [0, 1)"),
])
def test_bad_schedules_are_named(overrides, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, overrides)
    assert message in str(err.value)


# ----------------------------------------------------------------------------------- answers as datasets write them

def gsm8k_cfg(tmp_path, *extra):
    from grpo_accel.recipe.parts import build_rows

    data = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS)
    return build_rows(load_config(None, [f"data.path={data}", "data.rename_columns={question: prompt}", *extra]).data)


def test_gsm8k_rows_are_scored_right_with_answer_format_gsm8k(tmp_path):
    from grpo_accel.rewards import answer_match, math_answer

    rows, _ = gsm8k_cfg(tmp_path, "data.answer_format=gsm8k")
    assert [r["answer"] for r in rows] == ["72", "3600"]
    assert rows[0]["prompt"] == GSM8K_ROWS[0]["question"]
    replies = ["She sold 48 + 24 = 72 clips.\n#### 72", "It sold 3,600 pens.", "The answer is 71."]
    answers = [rows[0]["answer"], rows[1]["answer"], rows[0]["answer"]]
    assert math_answer([""] * 3, replies, answers) == [1.0, 1.0, 0.0]
    assert answer_match([""] * 3, replies, answers) == [1.0, 1.0, 0.0]


def test_a_gsm8k_row_read_plain_makes_answer_match_say_why(tmp_path):
    from grpo_accel.rewards import RewardSet, answer_match

    rows, _ = gsm8k_cfg(tmp_path)  # answer_format=plain: the worked solution is the answer
    with pytest.raises(Exception) as err:
        RewardSet({"answer_match": answer_match})([""], ["72"], answer=[rows[0]["answer"]])
    assert "set data.answer_format=gsm8k" in str(err.value)


def test_boxed_answers_and_a_row_transform(tmp_path):
    from grpo_accel.recipe.parts import build_rows

    (tmp_path / "my_rows.py").write_text(
        "def to_chat(row):\n    return {'prompt': [{'role': 'user', 'content': row['problem']}], 'answer': row['solution']}\n")
    data = write_jsonl(tmp_path / "math.jsonl", [{"problem": "Half of 1?", "solution": "It is $\\boxed{\\frac{1}{2}}$."}])
    sys.path.insert(0, str(tmp_path))
    try:
        rows, _ = build_rows(load_config(None, [f"data.path={data}", "data.row_transform=my_rows:to_chat",
                                                "data.answer_format=boxed"]).data)
    finally:
        sys.path.remove(str(tmp_path))
    assert rows == [{"prompt": [{"role": "user", "content": "Half of 1?"}], "answer": "\\frac{1}{2}"}]


def test_answer_format_errors_name_the_row_and_the_setting(tmp_path):
    from grpo_accel.data.prompts import DataError

    with pytest.raises(DataError) as err:
        gsm8k_cfg(tmp_path, "data.answer_format=boxed")
    assert "row 0 column 'answer'" in str(err.value) and "has no \\boxed{...} answer" in str(err.value)
    assert "data.answer_format=boxed" in str(err.value)
    with pytest.raises(DataError, match="row 0 has no answer column 'solution'"):
        gsm8k_cfg(tmp_path, "data.answer_format=gsm8k", "data.answer_field=solution")
    with pytest.raises(ConfigError, match="data.answer_format='latex': must be one of"):
        load_config(None, ["data.answer_format=latex"])


# ----------------------------------------------------------------------------------------- TRL's names

def test_a_trl_name_gets_the_hint_in_one_line():
    run = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), "num_generations=8"],
                         capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert run.returncode == 2
    assert run.stderr.strip().splitlines()[-1].startswith(
        "error: num_generations: unknown key; `num_generations` is TRL's name; here it is `rollout.group_size` "
        "(completions per prompt).")
    with pytest.raises(ConfigError, match="`logging_steps` is TRL's name; here it is `trainer.log_interval` "
                                          r"\(optimizer steps in TRL, frames here"):
        load_config(None, ["trainer.logging_steps=10"])


# ----------------------------------------------------------------------------------------- the GSM8K recipe

def test_the_gsm8k_recipe_runs_at_a_tiny_scale_on_gsm8k_rows(tmp_path, smollm2):
    """launch/configs/gsm8k.yaml as shipped, with SmolLM2 for Qwen2.5-0.5B, a JSONL file in GSM8K's layout for
    the hub's dataset, and a short budget: its row transform, answer format, reward, schedule and trackers run."""
    from grpo_accel.reporting.event_files import read_texts

    data = write_jsonl(tmp_path / "gsm8k.jsonl", GSM8K_ROWS * 2)
    out = tmp_path / "run"
    assert train_in_process([
        "--config", str(ROOT / "launch" / "configs" / "gsm8k.yaml"), f"output_dir={out}",
        f"model.name_or_path={smollm2}", f"data.path={data}", "data.eval_split=null", "eval.every_iterations=0",
        "rollout.prompts_per_batch=2", "rollout.group_size=2", "rollout.max_new_tokens=8",
        "trainer.total_frames=8", "trainer.mixed_precision='no'", "trainer.progress_bar=false",
        "model.gradient_checkpointing=false", "optim.warmup_steps=1"]) == 0  # its 10 in a 2-step run: refused
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2
    scalars = read_scalars(out / "tensorboard")
    assert len(scalars["train/reward/math_answer_mean"]) == 2
    assert [v for _, v in scalars["train/lr"]] == [0.0, pytest.approx(1e-6)]  # warmup 1: 0, then the cosine's top
    sample = read_texts(out / "tensorboard")["samples"][0][1]
    assert "<|im_start|>user\n    Natalia sold clips" in sample or "<|im_start|>user\n    A shop sold" in sample
    assert 'after "####".' in sample
