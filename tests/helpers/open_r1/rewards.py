"""open-r1's ``accuracy_reward``, ``format_reward`` and ``tag_count_reward`` (src/open_r1/rewards.py @ 1416fa0,
functions of the same names), re-implemented: each reads TRL's conversational completions
(``completion[0]["content"]``), as the originals do, so that a text completion fails as it fails there."""
from __future__ import annotations

import re


def accuracy_reward(completions, solution, **kwargs):
    """1.0 where math_verify finds the completion's answer equal to the row's ``solution``; None where the
    solution does not parse or verification fails (the original skips those rows the same way)."""
    from latex2sympy2_extended import NormalizationConfig
    from math_verify import LatexExtractionConfig, parse, verify

    answer_config = [LatexExtractionConfig(
        normalization_config=NormalizationConfig(nits=False, malformed_operators=False, basic_latex=True,
                                                 equations=True, boxed="all", units=True),
        boxed_match_priority=0, try_extract_without_anchor=False)]
    out = []
    for completion, gold in zip(completions, solution):
        text = completion[0]["content"]
        expected = parse(gold, extraction_mode="first_match")
        if not expected:
            out.append(None)
            continue
        try:
            out.append(float(verify(expected, parse(text, extraction_config=answer_config,
                                                    extraction_mode="first_match"))))
        except Exception:  # noqa: BLE001 - the original returns None where verify raises
            out.append(None)
    return out


FORMAT = re.compile(r"^<think>\n.*?\n</think>\n<answer>\n.*?\n</answer>$", re.DOTALL | re.MULTILINE)


def format_reward(completions, **kwargs):
    """1.0 for a completion that is a think block then an answer block, each tag on its own line."""
    return [1.0 if FORMAT.match(completion[0]["content"]) else 0.0 for completion in completions]


def tag_count_reward(completions, **kwargs):
    """A quarter for each of the four tags that appears exactly once in its place."""
    tags = ("<think>\n", "\n</think>\n", "\n<answer>\n", "\n</answer>")
    return [sum(0.25 for tag in tags if completion[0]["content"].count(tag) == 1) for completion in completions]
