"""Datasets as people have them (issue 57 item 3): a .json file holding one array, a .csv file, and prompts longer
than rollout.max_prompt_tokens refused (the default), dropped (verl's filter) or cut to their last tokens."""
import json
import logging
import sys

import pytest

from grpo_accel.data.prompts import DataError
from grpo_accel.config.checks import ConfigError
from grpo_accel.data.files import load_rows
from grpo_accel.config.loading import load_config
from grpo_accel.reporting.event_files import read_scalars
from trainer_utils import train_in_process

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]


def test_a_json_array_and_a_csv_file_read_as_their_rows(tmp_path):
    array = tmp_path / "rows.json"
    array.write_text(json.dumps(ROWS, indent=2))
    lines = tmp_path / "lines.json"
    lines.write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    table = tmp_path / "rows.csv"
    table.write_text("prompt,answer\n" + "".join(f"{r['prompt']},{r['answer']}\n" for r in ROWS))
    assert load_rows(array) == load_rows(lines) == ROWS
    assert [{k: str(v) for k, v in row.items()} for row in load_rows(table)] == ROWS  # numbers read as numbers
    bad = tmp_path / "bad.json"
    bad.write_text('[{"prompt": "1+1="}, "2"]')
    with pytest.raises(DataError, match="holds a JSON array whose items are not all objects"):
        load_rows(bad)


def test_a_csv_file_is_read_without_datasets_as_datasets_reads_it_and_checked(tmp_path, monkeypatch):
    """Issue 74 item 3: a CSV needed the `datasets` extra (a traceback without it), and a malformed one was never
    checked. Read with the standard library: the rows datasets reads (numbers as numbers, empty cells None)."""
    import datasets

    table = tmp_path / "rows.csv"
    table.write_text('prompt,answer,score,note\n"1,2+3=",5,0.5,\n2+2=,4,1,"said ""four"""\n')
    expected = list(datasets.Dataset.from_csv(str(table)))
    monkeypatch.setitem(sys.modules, "datasets", None)  # as installed without the data extra
    assert load_rows(table) == expected == [{"prompt": "1,2+3=", "answer": 5, "score": 0.5, "note": None},
                                            {"prompt": "2+2=", "answer": 4, "score": 1.0, "note": 'said "four"'}]
    for text, said in [("", "holds no header"), ("prompt,answer\n", "holds a header and no rows"),
                       ("prompt,answer\n1+1=,2,3\n", "line 2 has 3 cells, the header 2; quote cells"),
                       ("prompt,prompt\n1+1=,2\n", "has an empty or repeated column name"),
                       ('prompt,answer\n"1+1=,2\n', "line 2 is not CSV")]:
        table.write_text(text)
        with pytest.raises(DataError, match=rf"data.path='{table}'.* {said}"):
            load_rows(table)
    datasets_only = tmp_path / "rows.parquet"
    datasets_only.write_bytes(b"PAR1")
    with pytest.raises(DataError, match=r"needs the `datasets` package .*pip install 'grpo_accel\[data\]', or give a "
                                        r"\.jsonl or \.csv file"):
        load_rows(datasets_only)


@pytest.fixture
def long_and_short(tmp_path):
    """Nine rows, three of them with prompts of 12 characters (tokens, for the built-in tokenizer) or more."""
    rows = [dict(r) for r in ROWS]
    for row in rows[:3]:
        row["prompt"] = "0+" * 5 + row["prompt"]
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def run(tmp_path, data, policy, name):
    out = tmp_path / name
    train_in_process([f"output_dir={out}", f"data.path={data}", "rollout.max_prompt_tokens=8",
                      f"data.overlong_prompts={policy}", "rollout.prompts_per_batch=4", "rollout.group_size=4",
                      "trainer.total_frames=32", "trainer.progress_bar=false"])
    return out


def test_overlong_prompts_are_refused_dropped_or_cut(tmp_path, long_and_short, caplog):
    with pytest.raises(DataError, match=r"dataset row 0: column 'prompt' is 14 tokens, more than "
                                        r"rollout.max_prompt_tokens=8"):
        run(tmp_path, long_and_short, "error", "error")
    with caplog.at_level(logging.WARNING):
        dropped = run(tmp_path, long_and_short, "drop", "drop")
        cut = run(tmp_path, long_and_short, "truncate_left", "cut")
    assert ("data.overlong_prompts=drop: dropped 3 of 9 rows whose prompts are longer than rollout.max_prompt_tokens=8 "
            "tokens (row 0: 14 tokens)") in caplog.text
    assert "data.overlong_prompts=truncate_left: kept the last tokens of 3 of 9 rows" in caplog.text
    for out in (dropped, cut):
        assert len(read_scalars(out / "tensorboard")["train/reward_mean"]) == 2
    with pytest.raises(ConfigError, match=r"data.overlong_prompts='cut': must be one of \['error', 'drop', "
                                          r"'truncate_left'\]"):
        load_config(None, ["data.overlong_prompts=cut"])


def test_dropping_every_row_says_so(tmp_path):
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps({"prompt": "1+" * 9 + "1=", "answer": "10"}) + "\n" for _ in range(4)))
    with pytest.raises(DataError, match="data.overlong_prompts=drop dropped every row: all 4 prompts are longer than "
                                        "rollout.max_prompt_tokens=8; raise it"):
        run(tmp_path, path, "drop", "none")
