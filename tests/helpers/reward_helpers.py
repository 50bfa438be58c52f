"""Reward functions for the tests of time-limited, async and served rewards (importable by worker processes)."""
import asyncio
import os
import time


def moody(prompts, completions, **fields):
    """1.0, except: "slow" sleeps far past any limit, "raise" raises, "crash" kills its process."""
    out = []
    for c in completions:
        if "slow" in c:
            time.sleep(60)
        if "raise" in c:
            raise ValueError("cannot score this")
        if "crash" in c:
            os._exit(3)
        out.append(1.0)
    return out


def slow_on_seven(prompts, completions, **fields):
    """The share of digits in the completion; a completion holding a 7 takes far longer than any limit."""
    if any("7" in c for c in completions):
        time.sleep(60)
    return [sum(ch.isdigit() for ch in c) / max(len(c), 1) for c in completions]


BARRIER = {}


async def first_half(prompts, completions, **fields):
    """Finishes only once second_half has started: they must be awaited together."""
    BARRIER.setdefault("a", asyncio.Event()).set()
    await asyncio.wait_for(BARRIER.setdefault("b", asyncio.Event()).wait(), 5)
    return [0.5] * len(completions)


async def second_half(prompts, completions, **fields):
    BARRIER.setdefault("b", asyncio.Event()).set()
    await asyncio.wait_for(BARRIER.setdefault("a", asyncio.Event()).wait(), 5)
    return [0.25] * len(completions)


async def never_done(prompts, completions, **fields):
    await asyncio.sleep(60)
    return [1.0] * len(completions)
