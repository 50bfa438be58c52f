"""TRL's reward functions run unchanged (issue 57 item 1): called as TRL's GRPOTrainer calls them, on chat rows with
TRL's message lists, ``None`` left out of a completion's weighted sum, ``trainer_state``, ``log_extra`` and
``log_metric`` given; grpo_accel's own functions and ones marked ``@text_reward`` get text."""
import json
import logging
import math

import pytest

from grpo_accel.config.checks import ConfigError
from grpo_accel.rewards import RewardError, RewardSet, answer_match, text_reward
from grpo_accel.reporting.event_files import read_scalars
from trainer_utils import train_in_process

MESSAGES = [[{"role": "system", "content": "be brief."}, {"role": "user", "content": f"{a}+{a}="}] for a in (1, 2)]
TEXTS = [f"<system>be brief.\n<user>{a}+{a}=\n<assistant>" for a in (1, 2)]


def test_a_function_gets_what_trl_passes_and_a_text_function_text():
    seen = {}

    def trl_style(completions, solution, **kwargs):  # reads completion[0]["content"], as TRL's own functions do
        seen["trl"] = dict(kwargs, completions=completions, solution=solution)
        return [float(c[0]["content"] == s) for c, s in zip(completions, solution)]

    @text_reward
    def mine(prompts, completions, solution, **fields):
        seen["mine"] = (prompts, completions)
        return [1.0] * len(completions)

    rewards = RewardSet({"trl": trl_style, "mine": mine, "builtin": answer_match})
    out = rewards(TEXTS, ["2", "5"], prompt_messages=MESSAGES, solution=["2", "4"], answer=["2", "4"],
                  completion_ids=[[5], [8]], finish_reason=["stop", "stop"])
    assert seen["trl"]["completions"] == [[{"role": "assistant", "content": "2"}], [{"role": "assistant", "content": "5"}]]
    assert seen["trl"]["prompts"] == MESSAGES and seen["trl"]["completion_ids"] == [[5], [8]]
    assert {"trainer_state", "log_extra", "log_metric", "finish_reason", "answer"} <= set(seen["trl"])
    assert seen["mine"] == (TEXTS, ["2", "5"])  # the prompt as the model read it, the completion text
    assert out["rewards", "trl"].tolist() == [1.0, 0.0] and out["rewards", "builtin"].tolist() == [1.0, 0.0]

    def any_form(completions, **kwargs):
        seen["any"] = completions
        return [0.0] * len(completions)

    RewardSet({"any": any_form})(["1+1="], ["2"], prompt_messages=[None])  # a text row: text, in TRL too
    assert seen["any"] == ["2"]


def test_none_is_left_out_of_the_weighted_sum_and_a_completion_nobody_judged_gets_0(caplog):
    def sometimes(completions, **kwargs):
        return [None, 1.0, None, 0.5]

    def never(completions, **kwargs):
        return [None, None, 2.0, None]

    rewards = RewardSet({"sometimes": sometimes, "never": never}, {"never": 0.5},
                        normalize={"sometimes": "none", "never": "none"})
    with caplog.at_level(logging.WARNING):
        out = rewards(["p"] * 4, ["a", "b", "c", "d"])
    assert out["reward"].tolist() == [0.0, 1.0, 1.0, 0.5]  # row 0: no function judged it
    assert math.isnan(out["rewards", "sometimes"][0]) and out["rewards", "never"][2] == 2.0
    assert "no reward function judged completion 0" in caplog.text and "its reward is 0 (as in TRL)" in caplog.text
    grouped = RewardSet({"sometimes": sometimes}, normalize={"sometimes": "group"})(["p"] * 4, ["a"] * 4, group_size=2)
    assert grouped["reward"].tolist() == [0.0, 0.0, 0.0, 0.0]  # one judged value per group: centred to 0


def test_a_text_function_on_chat_rows_is_told_how_to_read_messages():
    def splits(prompts, completions, **fields):
        return [float(len(c.split())) for c in completions]

    with pytest.raises(RewardError) as err:
        RewardSet({"splits": splits})(TEXTS, ["2", "5"], prompt_messages=MESSAGES)
    assert "reward function 'splits' raised AttributeError" in str(err.value)
    assert ("On chat rows a function gets TRL's message lists (completions[i] = [{'role': 'assistant', 'content': "
            "text}], prompts[i] the prompt's messages); a function written for text reads completion[0]['content'], "
            "or is marked @grpo_accel.rewards.text_reward.") in str(err.value)


TRL_MODULE = '''
from trl.rewards import accuracy_reward, get_soft_overlong_punishment, think_format_reward

overlong = get_soft_overlong_punishment(max_completion_len=8, soft_punish_cache=4)


def half_judged(completions, solution, trainer_state, log_metric, log_extra, **kwargs):
    """None for odd solutions (TRL leaves them out); logs a metric and a column as TRL lets it."""
    log_metric("judged_fraction", sum(int(s) % 2 == 0 for s in solution) / len(solution))
    log_metric("seen_global_step", trainer_state.global_step)
    log_extra("parity", ["even" if int(s) % 2 == 0 else "odd" for s in solution])
    return [None if int(s) % 2 else float(len(c[0]["content"]) <= 4) for c, s in zip(completions, solution)]
'''


@pytest.fixture
def chat_model(tmp_path):
    """The tiny Llama with a character tokenizer that covers <think> tags and a chat template, saved."""
    from grpo_accel.tasks.tiny import build_char_tokenizer, build_tiny_model

    tokenizer = build_char_tokenizer("0123456789+-*= <>/\nabcdefghijklmnopqrstuvwxyz.$")
    tokenizer.chat_template = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
                               "{% if add_generation_prompt %}<assistant>{% endif %}")
    folder = tmp_path / "chat_model"
    build_tiny_model(tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_trls_own_reward_functions_train_a_chat_run_unchanged(tmp_path, chat_model, monkeypatch):
    """A module that imports accuracy_reward, think_format_reward and get_soft_overlong_punishment from trl.rewards,
    named as a TRL user names them, on chat rows with a solution column, no extra setting: each reward's mean is
    logged, None rows are left out, log_metric's scalars land in the trackers."""
    (tmp_path / "my_rewards.py").write_text(TRL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    rows = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "solution": str(2 * a + (a % 3 == 0))}
            for a in range(8)]
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "run"
    names = ["accuracy_reward", "think_format_reward", "overlong", "half_judged"]
    assert train_in_process([
        f"output_dir={out}", f"model.name_or_path={chat_model}", f"data.path={data}", "rollout.max_new_tokens=8",
        "optim.lr=3e-4", "rollout.prompts_per_batch=4", "rollout.group_size=4", "trainer.total_frames=48",
        "trainer.progress_bar=false", "rewards=[" + ", ".join(f"{{name: 'my_rewards:{n}'}}" for n in names) + "]",
    ]) == 0
    scalars = read_scalars(out / "tensorboard")
    for name in names:
        assert len(scalars[f"train/reward/{name}_mean"]) == 3, name
    assert all(not math.isnan(v) for _, v in scalars["train/reward/half_judged_mean"])  # None: left out
    assert [v for _, v in scalars["train/seen_global_step"]] == [0.0, 1.0, 2.0]  # trainer_state: steps before it
    judged = [v for _, v in scalars["train/judged_fraction"]]  # 3 of the 8 rows have an odd solution
    assert len(judged) == 3 and all(0 <= v <= 1 for v in judged) and sum(judged) < 3
    assert all(-1.0 <= v <= 0.0 for _, v in scalars["train/reward/overlong_mean"])


def test_a_reward_name_that_is_not_there_is_still_one_line(tmp_path, monkeypatch):
    (tmp_path / "my_rewards.py").write_text(TRL_MODULE)
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError, match="rewards name='my_rewards:accuracy': cannot import it"):
        train_in_process([f"output_dir={tmp_path / 'run'}", "rewards=[{name: 'my_rewards:accuracy'}]"])
