"""A stand-in for open-r1's package (huggingface/open-r1, Apache-2.0), which is no PyPI package: the three reward
functions its GRPO demo recipes name (``reward_funcs: [accuracy, format, tag_count]``), re-implemented from
src/open_r1/rewards.py at commit 1416fa0 so that those recipes run here as published."""
