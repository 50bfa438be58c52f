import functools
import math

import pytest

from grpo_accel.rewards import RewardError, RewardSet, answer_match, format_match


def test_answer_match_compares_last_number_numerically():
    got = answer_match(["p"] * 5, ["7", " 7.0", "the answer is 12 then 7", "8", ""], answer=["7", "7", "7", "7", "7"])
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_format_match_needs_full_match_and_a_stop():
    got = format_match(["p"] * 4, ["12", "1+2", "12", " -3 "], finish_reason=["stop", "stop", "length", "stop"])
    assert got == [1.0, 0.0, 0.0, 1.0]
    assert format_match(["p"], ["ab"], pattern="[a-z]+") == [1.0]


def test_reward_set_weights_and_per_function_values():
    rs = RewardSet({"answer": answer_match, "format": format_match}, {"format": 0.5})
    td = rs(["1+1="] * 3, ["2", "3", "x"], answer=["2", "2", "2"], finish_reason=["stop"] * 3)
    assert td["rewards", "answer"].tolist() == [1.0, 0.0, 0.0]
    assert td["rewards", "format"].tolist() == [1.0, 1.0, 0.0]
    assert td["reward"].tolist() == [1.5, 0.5, 0.0]
    assert rs.names == ["answer", "format"]


def test_reward_function_errors_name_the_function():
    def boom(prompts, completions, **kw):
        raise KeyError("answer")

    with pytest.raises(RewardError, match="'boom' raised KeyError"):
        RewardSet({"boom": boom})(["p"], ["c"])
    with pytest.raises(RewardError, match="'short' returned 1 values for 2 completions"):
        RewardSet({"short": lambda p, c, **k: [1.0]})(["p", "p"], ["a", "b"])
    with pytest.raises(RewardError, match=r"'nan' returned nan for completion 1 \(prompt 'q'"):
        RewardSet({"nan": lambda p, c, **k: [0.0, math.nan]})(["p", "q"], ["a", "b"])
    with pytest.raises(RewardError, match="'text' returned 'good'"):
        RewardSet({"text": lambda p, c, **k: ["good"]})(["p"], ["a"])


def test_reward_set_rejects_empty_and_unknown_weights():
    with pytest.raises(ValueError, match="no reward function"):
        RewardSet({})
    with pytest.raises(ValueError, match=r"\['typo'\]"):
        RewardSet({"a": answer_match}, {"typo": 1.0})


def test_partial_with_kwargs_is_a_reward_function():
    rs = RewardSet({"f": functools.partial(format_match, pattern="[0-9]{2}")})
    assert rs(["p", "p"], ["12", "1"])["reward"].tolist() == [1.0, 0.0]
