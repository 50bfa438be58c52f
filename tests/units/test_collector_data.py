import json

import pytest
import torch

from grpo_accel import batch
from grpo_accel.data.prompts import DataError
from grpo_accel.layout import BatchLayout
from grpo_accel.config.checks import ConfigError
from grpo_accel.data.files import load_rows, validate_rows
from grpo_accel.recipe.parts import build_rewards, build_rows, resolve_reward
from grpo_accel.config.rollout_schema import RewardConfig
from grpo_accel.config.schema import DataConfig
from grpo_accel.rewards import RewardSet, answer_match, format_match
from grpo_accel.rollout.collector import GRPOCollector
from grpo_accel.embedded.engine import EmbeddedEngine

ROWS = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(3) for b in range(3)]


def _collector(tokenizer, model, rows=ROWS, *, prompts_per_batch=4, group_size=3, processes=1, **kw):
    engine = EmbeddedEngine(model, tokenizer, max_new_tokens=3)
    rewards = RewardSet({"answer_match": answer_match, "format_match": format_match})
    layout = BatchLayout(prompts_per_batch, group_size, processes)
    return GRPOCollector(engine, tokenizer, rows, rewards, layout=layout, **{"seed": 0} | kw)


def prompts_of(td, group_size: int = 3) -> list[tuple[int, ...]]:
    """Each group's prompt tokens, in batch order."""
    rows = slice(None, None, group_size)
    return [tuple(ids[mask.bool()].tolist()) for ids, mask in zip(td[batch.PROMPT_IDS][rows], td[batch.PROMPT_MASK][rows])]


def test_collect_builds_a_scored_grouped_rollout(tokenizer, tiny_model):
    torch.manual_seed(0)
    td = _collector(tokenizer, tiny_model).collect()
    assert td.shape == (12,)
    groups = td[batch.PROMPT_IDS].view(4, 3, -1)
    assert (groups == groups[:, :1]).all() and len({tuple(g[0].tolist()) for g in groups}) == 4, "G rows a prompt"
    rewards = td[batch.REWARD].view(4, 3)
    adv = td[batch.ADVANTAGES].view(4, 3)
    torch.testing.assert_close(adv.sum(-1), torch.zeros(4), atol=1e-5, rtol=0)  # centred per group
    ties = rewards.std(-1) == 0
    assert (adv[ties] == 0).all()
    assert set(td[batch.REWARDS].keys()) == {"answer_match", "format_match"}
    torch.testing.assert_close(td[batch.REWARD], td[batch.REWARDS, "answer_match"] + td[batch.REWARDS, "format_match"])
    assert (td[batch.WEIGHT_VERSION] == 0).all()


def test_dataset_fields_reach_reward_functions(tokenizer, tiny_model):
    seen = {}

    def spy(prompts, completions, **fields):
        seen.update(fields, prompts=prompts)
        return [0.0] * len(completions)

    c = _collector(tokenizer, tiny_model)
    c.rewards = RewardSet({"spy": spy})
    c.collect()
    assert set(seen) == {"prompts", "answer", "completion_ids", "finish_reason", "prompt_messages", "trainer_state",
                         "log_extra", "log_metric"}  # TRL's arguments too
    assert seen["prompt_messages"] == [None] * 12  # string prompts have no messages
    assert len(seen["answer"]) == 12 and seen["prompts"][0] == seen["prompts"][2]
    assert [str(eval(p[:-1])) for p in seen["prompts"]] == seen["answer"]
    assert set(seen["finish_reason"]) <= {"stop", "length"}


def test_epochs_visit_every_row_and_state_dict_resumes(tokenizer, tiny_model):
    c = _collector(tokenizer, tiny_model)
    first = [prompts_of(c.collect()) for _ in range(3)]  # 12 prompts: the first 9 are one pass
    assert sorted(sum(first, [])[:9]) == sorted(tuple(ids) for ids in c.prompts.ids), "one pass visits every row once"
    state = c.state_dict()
    upcoming = prompts_of(c.collect())
    other = _collector(tokenizer, tiny_model)
    other.load_state_dict(state)
    assert prompts_of(other.collect()) == upcoming


def test_processes_take_disjoint_slices_of_the_same_global_batch(tokenizer, tiny_model):
    ranks = [_collector(tokenizer, tiny_model, rank=r, processes=2) for r in range(2)]
    tds = [c.collect() for c in ranks]
    assert [td.shape[0] for td in tds] == [6, 6]
    whole = prompts_of(_collector(tokenizer, tiny_model).collect())  # one process's global batch of 4 prompts
    assert prompts_of(tds[0]) == whole[:2] and prompts_of(tds[1]) == whole[2:]
    with pytest.raises(ValueError, match="multiple of the 3 processes"):
        _collector(tokenizer, tiny_model, processes=3)


def test_group_size_below_two_is_rejected(tokenizer, tiny_model):
    with pytest.raises(ValueError, match=r"group_size=1: GRPO compares.*at least 2"):
        _collector(tokenizer, tiny_model, group_size=1)


def test_too_long_prompt_names_its_row(tokenizer, tiny_model):
    rows = ROWS[:2] + [{"prompt": "1" * 50 + "=", "answer": "1"}]
    with pytest.raises(DataError, match=r"dataset row 2: column 'prompt' is 51 tokens.*max_prompt_tokens=10"):
        _collector(tokenizer, tiny_model, rows=rows, prompts_per_batch=3, max_prompt_tokens=10)  # before any batch


def test_rows_without_a_column_a_reward_needs_are_named_before_any_batch(tokenizer, tiny_model):
    with pytest.raises(DataError, match=r"reward 'answer_match' needs column\(s\) \['answer'\].*row 0 has \['prompt'\]"):
        _collector(tokenizer, tiny_model, rows=[{"prompt": "1+1="}, {"prompt": "2+2="}], prompts_per_batch=2)
    with pytest.raises(DataError, match=r"row 1 lacks column\(s\) \['answer'\] that row 0 has"):
        _collector(tokenizer, tiny_model, rows=[ROWS[0], {"prompt": "2+2="}], prompts_per_batch=2)


def test_prompts_the_tokenizer_cannot_read_are_named(tokenizer, tiny_model, caplog):
    rows = [ROWS[0], {"prompt": "é+1=", "answer": "1"}, {"prompt": "1+ü=", "answer": "1"}]
    with caplog.at_level("WARNING", logger="grpo_accel.rollout.collector"):
        _collector(tokenizer, tiny_model, rows=rows, prompts_per_batch=1)
    assert "2 of 3 prompts hold text the tokenizer maps to its unknown token '<unk>' (first: row 1" in caplog.text

    class Silent:  # a tokenizer that encodes text to nothing (what an empty tokenizer file gives)
        def __call__(self, text):
            return {"input_ids": [] if text == "2+2=" else tokenizer(text)["input_ids"]}

        def __getattr__(self, name):
            return getattr(tokenizer, name)

    with pytest.raises(DataError, match="dataset row 1: column 'prompt' encodes to no tokens"):
        _collector(Silent(), tiny_model, rows=[ROWS[0], {"prompt": "2+2=", "answer": "4"}], prompts_per_batch=2)


def test_required_columns_are_the_arguments_without_defaults():
    from functools import partial

    def needs_two(prompts, completions, answer, unit, scale=1.0, **fields):
        return [0.0] * len(completions)

    rewards = RewardSet({"a": answer_match, "f": format_match, "two": needs_two, "bound": partial(needs_two, unit="m"),
                         "ids": lambda prompts, completions, completion_ids: [0.0] * len(completions)})
    assert rewards.required_columns() == {"a": ["answer"], "two": ["answer", "unit"], "bound": ["answer"]}


def test_reserved_dataset_field_is_rejected(tokenizer, tiny_model):
    with pytest.raises(ValueError, match="finish_reason"):
        _collector(tokenizer, tiny_model, rows=[{"prompt": "1=", "finish_reason": "x"}])


def test_validate_rows_errors():
    with pytest.raises(ValueError, match="dataset is empty"):
        validate_rows([], "prompt", "data.path='x.jsonl'")
    with pytest.raises(ValueError, match=r"row 1 has no prompt field 'prompt' \(its fields: \['question'\]\)"):
        validate_rows([{"prompt": "a"}, {"question": "b"}], "prompt", "src")
    with pytest.raises(ValueError, match="row 0 column 'prompt' is ''"):
        validate_rows([{"prompt": ""}], "prompt", "src")


def test_load_rows_jsonl_and_parquet(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text("\n".join(json.dumps(r) for r in ROWS) + "\n")
    assert load_rows(path) == ROWS
    import datasets

    datasets.Dataset.from_list(ROWS).to_parquet(str(tmp_path / "d.parquet"))
    assert load_rows(tmp_path / "d.parquet") == ROWS
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"prompt": "a"}\nnot json\n')
    with pytest.raises(ValueError, match="line 2 is not JSON"):
        load_rows(bad)
    with pytest.raises(DataError, match="no such file"):
        load_rows(tmp_path / "missing.jsonl")
    with pytest.raises(ValueError, match="unknown file type '.txt'"):
        (tmp_path / "d.txt").write_text("x")
        load_rows(tmp_path / "d.txt")
    with pytest.raises(DataError, match=r"d.csv.* holds a header and no rows; a .csv file needs a header line"):
        (tmp_path / "d.csv").write_text("x")
        load_rows(tmp_path / "d.csv")


def test_build_rows_and_rewards_from_config(tmp_path):
    train, held = build_rows(DataConfig(max_operand=3, holdout=4))
    assert len(train) == 12 and len(held) == 4
    assert not {r["prompt"] for r in train} & {r["prompt"] for r in held}
    path = tmp_path / "q.jsonl"
    path.write_text(json.dumps({"question": "1+1=", "answer": "2"}) + "\n")
    with pytest.raises(ValueError, match="set data.prompt_field"):
        build_rows(DataConfig(path=str(path)))
    assert build_rows(DataConfig(path=str(path), prompt_field="question"))[0][0]["answer"] == "2"
    rs = build_rewards([RewardConfig("format_match", 0.5, {"pattern": "[0-9]"}), RewardConfig("grpo_accel.rewards:answer_match")])
    td = rs(["p"], ["12"], answer=["12"], finish_reason=["stop"])
    assert td["reward"].tolist() == [1.0]  # format fails one-digit pattern (0), answer matches (1)
    with pytest.raises(ConfigError, match="not a built-in"):
        resolve_reward("nope")
    with pytest.raises(ConfigError, match="cannot import"):
        resolve_reward("grpo_accel.rewards:nope")


def test_prompts_a_tokenizer_drops_characters_of_are_named(tokenizer, tiny_model, caplog):
    """Issue 49 item 5: a tokenizer that drops what it cannot encode (no unknown token in sight) trained
    "２+２=" as "+=" without a word; a round trip, decode(encode(text)), names it."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    core = Tokenizer(models.BPE(tokenizer.get_vocab(), [], unk_token=None))  # BPE without an unknown token drops
    core.pre_tokenizer, core.decoder = pre_tokenizers.Split("", behavior="isolated"), decoders.Fuse()
    dropping = PreTrainedTokenizerFast(tokenizer_object=core, pad_token="<pad>", bos_token="<bos>",
                                       eos_token="<eos>", unk_token="<unk>", padding_side="left")
    rows = [ROWS[0], {"prompt": "２+２=", "answer": "4"}]
    with caplog.at_level("WARNING", logger="grpo_accel.rollout.collector"):
        _collector(dropping, tiny_model, rows=rows, prompts_per_batch=1)
    assert ("1 of 2 prompts do not read back as written: the tokenizer drops text it cannot encode (first: row 1, "
            "'２+２=' reads back as '+='); the model trains on what it reads: use the model's own tokenizer, or "
            "normalise the text (e.g. unicodedata NFKC)") in caplog.text
    caplog.clear()
    with caplog.at_level("WARNING", logger="grpo_accel.rollout.collector"):
        _collector(tokenizer, tiny_model, rows=[ROWS[0]], prompts_per_batch=1)
    assert "read back" not in caplog.text
