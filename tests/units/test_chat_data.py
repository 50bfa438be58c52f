"""Conversational rows, datasets loaded through ``datasets`` (saved folders, splits, renamed columns) and the
built-in chat arithmetic task: every prompt rendered, tokenised and checked before the first batch."""
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from grpo_accel import batch
from grpo_accel.data.prompts import DataError, encode_prompts
from grpo_accel.layout import BatchLayout
from grpo_accel.config.checks import ConfigError
from grpo_accel.data.files import load_rows, validate_rows
from grpo_accel.recipe.parts import build_rows
from grpo_accel.config.schema import DataConfig
from grpo_accel.rewards import RewardSet, text_reward
from grpo_accel.rollout.collector import GRPOCollector
from grpo_accel.embedded.engine import EmbeddedEngine

TEMPLATE = ("{% for m in messages %}<{{ m['role'] }}>{{ m['content'] }}\n{% endfor %}"
            "{% if add_generation_prompt %}<assistant>{% endif %}")
ROOT = Path(__file__).resolve().parents[2]
CHAT_ROWS = [{"prompt": [{"role": "user", "content": f"{a}+{a}="}], "answer": str(2 * a)} for a in range(4)]


@pytest.fixture(scope="module")
def chat_tokenizer():
    """A character tokenizer that covers the template's text, with a chat template (no hub needed)."""
    from grpo_accel.tasks.tiny import build_char_tokenizer

    tokenizer = build_char_tokenizer("0123456789+-*= <>\nabcdefghijklmnopqrstuvwxyz.")
    tokenizer.chat_template = TEMPLATE
    return tokenizer


def test_chat_rows_go_through_the_template_with_the_system_prompt_and_reach_rewards(chat_tokenizer):
    from grpo_accel.tasks.tiny import build_tiny_model

    seen = {}

    @text_reward  # the prompts as the model read them (unmarked, chat rows give TRL's messages: test_trl_rewards)
    def spy(prompts, completions, prompt_messages, answer, **fields):
        seen.update(prompts=prompts, prompt_messages=prompt_messages, answer=answer)
        return [0.0] * len(completions)

    rows = CHAT_ROWS[:3] + [{"prompt": "3+3=", "answer": "6"}]  # a string row: with a system prompt, a user message
    engine = EmbeddedEngine(build_tiny_model(chat_tokenizer, seed=0), chat_tokenizer, max_new_tokens=2)
    collector = GRPOCollector(engine, chat_tokenizer, rows, RewardSet({"spy": spy}), layout=BatchLayout(4, 2), system_prompt="be brief.")
    assert collector.prompts.texts[0] == "<system>be brief.\n<user>0+0=\n<assistant>"
    assert collector.prompts.texts[3] == "<system>be brief.\n<user>3+3=\n<assistant>"
    assert collector.prompts.ids[0] == chat_tokenizer("<system>be brief.\n<user>0+0=\n<assistant>",
                                                      add_special_tokens=False)["input_ids"]
    td = collector.collect()
    for i in range(0, 8, 2):  # what was generated from is what the rewards were told
        prompt = td[batch.PROMPT_IDS][i][td[batch.PROMPT_MASK][i].bool()].tolist()
        order = collector.prompts.ids.index(prompt)  # the row generated from
        assert seen["prompts"][i] == collector.prompts.texts[order] and seen["answer"][i] == rows[order]["answer"]
        asked = [{"role": "user", "content": "3+3="}] if order == 3 else rows[order]["prompt"]
        expected = [{"role": "system", "content": "be brief."}, *asked]
        assert seen["prompt_messages"][i] == seen["prompt_messages"][i + 1] == expected
    assert set(td["stats"].keys()) == {"time_generate", "time_score"} and float(td["stats", "time_generate"][0]) > 0


def test_a_row_with_its_own_system_message_keeps_it(chat_tokenizer):
    rows = [{"prompt": [{"role": "system", "content": "mine."}, {"role": "user", "content": "1+1="}]}]
    assert encode_prompts(rows, chat_tokenizer, system_prompt="default.").texts == ["<system>mine.\n<user>1+1=\n<assistant>"]


def test_chat_prompt_errors_name_the_row_and_column(chat_tokenizer, tokenizer):
    with pytest.raises(DataError, match=r"row 0: column 'prompt' is a list of chat messages, but the tokenizer has "
                                        "no chat template"):
        encode_prompts(CHAT_ROWS, tokenizer)  # the arithmetic tokenizer has none
    with pytest.raises(DataError, match=r"row 2: column 'prompt' is 24 tokens after the chat template, more than "
                                        r"max_prompt_tokens=23; raise max_prompt_tokens"):
        encode_prompts(CHAT_ROWS[:2] + [{"prompt": [{"role": "user", "content": "10+10="}]}], chat_tokenizer,
                       max_tokens=23)
    bad = [({"role": "robot", "content": "x"}, "message 0 is"), ({"role": "user"}, "message 0 is"),
           ({"role": "user", "content": "  "}, "has only empty messages")]
    for message, said in bad:
        with pytest.raises(DataError, match=rf"src: row 1, column 'prompt', {said}"):
            validate_rows([CHAT_ROWS[0], {"prompt": [message]}], "prompt", "src")
    with pytest.raises(DataError, match=r"row 0, column 'prompt', is an empty list"):
        validate_rows([{"prompt": []}], "prompt", "src")


def test_saved_dataset_folders_splits_and_renamed_columns(tmp_path):
    import datasets

    rows = [{"question": [{"role": "user", "content": f"{a}+1="}], "solution": str(a + 1)} for a in range(6)]
    splits = datasets.DatasetDict({"train": datasets.Dataset.from_list(rows[:4]),
                                   "test": datasets.Dataset.from_list(rows[4:])})
    splits.save_to_disk(str(tmp_path / "splits"))
    datasets.Dataset.from_list(rows).save_to_disk(str(tmp_path / "single"))
    cfg = DataConfig(path=str(tmp_path / "splits"), eval_split="test",
                     rename_columns={"question": "prompt", "solution": "answer"})
    train, held_out = build_rows(cfg)
    assert [r["answer"] for r in train] == ["1", "2", "3", "4"] and [r["answer"] for r in held_out] == ["5", "6"]
    assert train[0]["prompt"] == [{"role": "user", "content": "0+1="}]
    assert len(load_rows(tmp_path / "single")) == 6
    (tmp_path / "files").mkdir()  # a folder of data files: datasets' own loader reads it
    (tmp_path / "files" / "part.jsonl").write_text(json.dumps({"prompt": "1+1=", "answer": "2"}) + "\n")
    assert load_rows(tmp_path / "files") == [{"prompt": "1+1=", "answer": "2"}]
    with pytest.raises(DataError, match=r"has splits \['test', 'train'\], not 'validation'; set data.split"):
        load_rows(tmp_path / "splits", split="validation")
    with pytest.raises(DataError, match=r"data.rename_columns names \['query'\], which the rows lack"):
        load_rows(tmp_path / "single", rename={"query": "prompt"})
    with pytest.raises(DataError, match="no such file or folder"):
        load_rows(tmp_path / "missing")
    with pytest.raises(ConfigError, match="data.eval_split='test': the built-in task has no splits"):
        build_rows(DataConfig(eval_split="test"))


def test_eval_path_takes_any_form_of_data_path(tmp_path):
    train = tmp_path / "train.jsonl"
    train.write_text(json.dumps({"q": "1+1=", "answer": "2"}) + "\n")
    import datasets

    datasets.Dataset.from_list([{"q": "2+2=", "answer": "4"}]).save_to_disk(str(tmp_path / "held"))
    _, held_out = build_rows(DataConfig(path=str(train), eval_path=str(tmp_path / "held"),
                                        rename_columns={"q": "prompt"}))
    assert held_out == [{"prompt": "2+2=", "answer": "4"}]


def test_a_hub_id_that_cannot_be_loaded_is_named():
    """As on a machine without the hub (offline mode, set before import, skips ~25 s of retries)."""
    code = ("from grpo_accel.data.files import load_rows\n"
            "load_rows('someone/no-such-dataset', name='main', split='test')\n")
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env={**os.environ, "HF_HUB_OFFLINE": "1"},
                          capture_output=True, text=True, timeout=120)
    assert proc.returncode == 1
    assert ("DataError: data.path='someone/no-such-dataset' (data.name='main', split='test'): datasets could not "
            "load it") in proc.stderr


def test_chat_arithmetic_task_has_a_disjoint_held_out_split():
    train, held_out = build_rows(DataConfig(task="chat_arithmetic", max_operand=99, holdout=200))
    assert len(train) == 3800 and len(held_out) == 200
    key = lambda r: r["prompt"][0]["content"]  # noqa: E731
    assert not {key(r) for r in train} & {key(r) for r in held_out}
    for row in train + held_out:
        a, op, b = re.fullmatch(r"What is (\d+)([+-])(\d+)\? Answer with just the number\.", key(row)).groups()
        assert 10 <= int(a) <= 99 and 10 <= int(b) <= 99
        assert int(row["answer"]) == (int(a) + int(b) if op == "+" else int(a) - int(b)) >= 0
    # issue 74 item 9: the operand range follows the task (it was addition's 4, refused for a setting never set)
    assert [DataConfig(task=t).max_operand for t in ("addition", "chat_arithmetic", "calculator")] == [4, 99, 999]
    assert len(build_rows(DataConfig(task="chat_arithmetic"))[0]) == 4000
    with pytest.raises(ConfigError, match="data.max_operand=4: chat_arithmetic uses operands 10..max_operand"):
        build_rows(DataConfig(task="chat_arithmetic", max_operand=4))
    with pytest.raises(ConfigError, match="data.task='nope': must be one of"):
        DataConfig(task="nope")


def test_smollm2_chat_template_renders_the_task(smollm2):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(smollm2)
    _, held_out = build_rows(DataConfig(task="chat_arithmetic", max_operand=99, holdout=200))
    prompts = encode_prompts(held_out[:2], tokenizer, system_prompt="Be brief.", max_tokens=64)
    assert prompts.texts[0].startswith("<|im_start|>system\nBe brief.<|im_end|>\n<|im_start|>user\nWhat is ")
    assert prompts.texts[0].endswith("<|im_end|>\n<|im_start|>assistant\n")
    assert tokenizer.decode(prompts.ids[0]) == prompts.texts[0]
