import functools
import math

import pytest

from grpo_accel.rewards import RewardError, RewardSet, answer_match, final_answer, format_match, math_answer, same_answer


def test_answer_match_compares_last_number_numerically():
    got = answer_match(["p"] * 5, ["7", " 7.0", "the answer is 12 then 7", "8", ""], answer=["7", "7", "7", "7", "7"])
    assert got == [1.0, 1.0, 1.0, 0.0, 0.0]


def test_format_match_needs_full_match_and_a_stop():
    got = format_match(["p"] * 4, ["12", "1+2", "12", " -3 "], finish_reason=["stop", "stop", "length", "stop"])
    assert got == [1.0, 0.0, 0.0, 1.0]
    assert format_match(["p"], ["ab"], pattern="[a-z]+") == [1.0]


@pytest.mark.parametrize("text, stated, strict", [
    ("so \\boxed{4\\frac{1}{2}} and 9", "4\\frac{1}{2}", "4\\frac{1}{2}"),  # boxed first, braces balanced
    ("The answer is 42.\n#### 43", "43", "43"),
    ("17 + 25 = 42, so the answer is 42 apples.", "42 apples", "42 apples"),
    ("Answer: x^2", "x^2", "x^2"),
    ("27 + 82 = 198", "198", "198"),
    ("I think 5, or maybe 7", "7", None),
    ("\\boxed{12", "12", None),  # an unclosed box states nothing
    ("no digits", None, None),
])
def test_final_answer_is_found_the_way_people_write_it(text, stated, strict):
    assert final_answer(text) == stated
    assert final_answer(text, last_number=False) == strict


def test_answers_compare_as_numbers_or_with_math_verify():
    assert same_answer("85 apples", "85") and same_answer("1,234", "1234") and not same_answer("86", "85")
    assert same_answer("1/2", "\\frac{1}{2}") and same_answer("0.5", "\\frac{1}{2}")  # math-verify: symbolic
    assert same_answer("x^2 + 1", "1 + x^2") and not same_answer("x^2", "x^3")
    assert not same_answer("\\frac{1}{2}", "0.5")  # a numeric reference wants the number, not an expression


# issue 50's strings: math-verify evaluated the expressions to 85, and a policy learnt "The answer is 47+38".
REAL_ANSWERS = ["85", "85.", "= 85", "The answer is 85", "\\boxed{85}", "85.0", "47 + 38 = 85", "#### 85",
                "85 apples", "The answer is: 85."]
GAMES = ["The answer is 47+38", "= 47+38", "The answer is 85+0",
         # and our own: the prompt echoed, the operands, several numbers, the answer inside a longer expression
         "What is 47+38? Answer with just the number.", "47 38", "85 or 86", "\\boxed{170/2}", "= 85 + 0",
         "The answer is 47+38=85+0", "The answer is 84 + 1", "The answer is 85, 86", "answer: 42.5+42.5",
         "The answer is 85 = 47+38"]


def test_math_answer_pays_for_stated_numbers_and_never_for_expressions():
    assert math_answer(["p"] * len(REAL_ANSWERS), REAL_ANSWERS, answer=["85"] * len(REAL_ANSWERS)) == [1.0] * len(
        REAL_ANSWERS)
    assert math_answer(["p"] * len(GAMES), GAMES, answer=["85"] * len(GAMES)) == [0.0] * len(GAMES)
    assert math_answer(["p"] * 3, ["1,085", "The answer is $1,085.", "-3"], answer=["1085", "1,085", "-3"]) == [1.0] * 3
    # answer_match reads the last number: 38, 38, 0, 38, 38, 86, 2, 0, 0, 1, 86, 5, 38
    assert answer_match(["p"] * len(GAMES), GAMES, answer=["85"] * len(GAMES)) == [0.0] * len(GAMES)


def test_math_answer_reward_and_its_strict_mode():
    completions = ["The answer is 85.", "27 + 82 = 198", "so 40 then 85", "#### 85"]
    assert math_answer(["p"] * 4, completions, answer=["85"] * 4) == [1.0, 0.0, 1.0, 1.0]
    assert math_answer(["p"] * 4, completions, answer=["85"] * 4, strict=True) == [1.0, 0.0, 0.0, 1.0]


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


def test_a_bad_normalize_reads_as_the_config_check_does():
    """One rule for the choice (rules.check_choice), in the API's words as in the config's (issue 35: the two
    checks said it differently)."""
    with pytest.raises(ValueError, match=r"^RewardSet: normalize\['a'\]='grp': must be one of \['none', 'group', "
                                         r"'batch'\]\.$"):
        RewardSet({"a": lambda p, c, **k: [0.0] * len(c)}, normalize={"a": "grp"})
