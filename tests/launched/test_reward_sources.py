"""Rewards that real tasks need: per-reward scaling, time-limited reward code in worker processes, async reward
functions, reward services over real HTTP (launch/reward_server.py) and a reward model built in code."""
import sys
import time

import psutil
import pytest
import torch

import reward_helpers
from grpo_accel.recipe.parts import build_reward
from grpo_accel.config.rollout_schema import RewardConfig
from grpo_accel.rewards.sources import AsyncReward, RemoteReward, RewardFault, TimedReward
from grpo_accel.rewards import RewardSet, answer_match, standardise
from launching import ROOT, launch, reward_server as serve_reward, run_in_group
from trainer_utils import train_in_process


def reward_workers() -> list:
    """This process's spawned multiprocessing children (reward workers), besides multiprocessing's resource
    tracker (one per process, shared by all): not the other tests' servers (SGLang stand-ins) it may hold."""
    return [p for p in psutil.Process().children() if "spawn_main" in " ".join(p.cmdline())
            and "resource_tracker" not in " ".join(p.cmdline())]


# ----------------------------------------------------------------------------------------------- scaling


def test_normalize_group_and_batch_match_values_computed_by_hand():
    a = lambda p, c, **_: [1.0, 3.0, 10.0, 10.0]  # noqa: E731
    b = lambda p, c, **_: [0.0, 1.0, 2.0, 5.0]  # noqa: E731
    td = RewardSet({"a": a, "b": b}, {"a": 1.0, "b": 0.5}, {"a": "group", "b": "batch"})(
        ["p"] * 4, ["c"] * 4, group_size=2)
    # a within groups of 2: [1, 3] -> mean 2, population std 1 -> [-1, 1]; [10, 10] -> [0, 0]
    # b over the batch: mean 2, population std sqrt((4 + 1 + 0 + 9) / 4) = sqrt(3.5)
    s = 3.5 ** 0.5
    expected = torch.tensor([-1 + 0.5 * -2 / s, 1 + 0.5 * -1 / s, 0 + 0.5 * 0 / s, 0 + 0.5 * 3 / s])
    torch.testing.assert_close(td["reward"], expected, atol=1e-5, rtol=0)
    assert td["rewards", "a"].tolist() == [1.0, 3.0, 10.0, 10.0], "each function's own values are kept"
    assert standardise(torch.tensor([2.0, 4.0]), "none").tolist() == [2.0, 4.0]


# ------------------------------------------------------------------------------------- time-limited code


def test_a_call_that_overruns_or_fails_gets_the_fallback_and_its_worker_is_replaced():
    reward = TimedReward("moody", reward_helpers.moody, processes=2, timeout_s=1.0, fallback=-1.0)
    start = time.monotonic()
    values = reward(["p"] * 6, ["ok", "slow", "ok", "raise", "crash", "ok"])
    assert time.monotonic() - start < 30, "the 60 s call was not waited for"
    assert values == [1.0, -1.0, 1.0, -1.0, -1.0, 1.0]
    assert reward.faults == {"timeouts": [0, 1, 0, 0, 0, 0], "errors": [0, 0, 0, 1, 1, 0]}
    assert reward(["p"], ["ok"]) == [1.0], "the replaced workers score again"
    reward.close()
    assert not reward_workers(), "no worker is left behind"
    strict = TimedReward("moody", reward_helpers.moody, processes=1, timeout_s=1.0)
    with pytest.raises(RewardFault, match=r"'moody' took more than 1 s \(timeout_s\) on completion 0 .*set fallback"):
        strict(["p"], ["slow"])
    from_config = build_reward(RewardConfig(name="reward_helpers:moody", processes=1, timeout_s=1.0))
    with pytest.raises(RewardFault, match=r"took more than 1 s \(rewards\[name=reward_helpers:moody\].timeout_s\) on "
                                          r"completion 0 .*set rewards\[name=reward_helpers:moody\].fallback"):
        from_config(["p"], ["slow"])  # built from a config, it names the config's keys
    assert not reward_workers()


def test_a_run_with_a_reward_that_sleeps_past_its_limit_goes_on(tmp_path):
    """Some completions make the function sleep 60 s: those get the fallback, the run goes on, the timeouts
    are counted in train/reward/<name>_timeouts, and no worker process is left behind."""
    from grpo_accel.reporting.event_files import read_scalars

    out = tmp_path / "run"
    train_in_process([f"output_dir={out}", "rollout.prompts_per_batch=4", "rollout.group_size=4",
                      "trainer.total_frames=32", "trainer.progress_bar=false",
                      "rewards=[{name: 'reward_helpers:slow_on_seven', processes: 2, timeout_s: 0.5, fallback: 0.0}]"])
    timeouts = [v for _, v in read_scalars(out / "tensorboard")["train/reward/slow_on_seven_timeouts"]]
    assert len(timeouts) == 2 and sum(timeouts) > 0
    assert not reward_workers()


def test_async_reward_functions_are_awaited_together_and_time_limited():
    reward_helpers.BARRIER.clear()
    td = RewardSet({"a": reward_helpers.first_half, "b": reward_helpers.second_half})(["p"] * 2, ["c"] * 2)
    assert td["reward"].tolist() == [0.75, 0.75], "each waited for the other: they ran at once"
    late = AsyncReward("late", reward_helpers.never_done, timeout_s=0.2, fallback=0.0)
    td = RewardSet({"late": late})(["p"] * 2, ["c"] * 2)
    assert td["reward"].tolist() == [0.0, 0.0] and td["reward_faults", "late_timeouts"].tolist() == [1.0, 1.0]
    with pytest.raises(RewardFault, match="'late' took more than 0.2 s"):
        RewardSet({"late": AsyncReward("late", reward_helpers.never_done, timeout_s=0.2)})(["p"], ["c"])


# ------------------------------------------------------------------------------------------ reward services


@pytest.fixture
def reward_server():
    with serve_reward() as served:
        yield served


def test_a_reward_service_scores_as_the_function_does_and_a_stopped_one_is_named(reward_server, tmp_path):
    url, proc = reward_server
    prompts, completions, answers = ["1+2=", "1+2=", "3+4=", "3+4="], ["3", "4", "7", "x7"], ["3", "3", "7", "7"]
    remote = RemoteReward("remote", f"{url}/score", batch_size=3)
    assert remote(prompts, completions, answer=answers) == answer_match(prompts, completions, answer=answers)
    out = tmp_path / "run"  # a run scored by the service (launch/train.py in this process)
    train_in_process([f"output_dir={out}", "trainer.total_frames=256", "trainer.progress_bar=false",
                      f"rewards=[{{name: remote, url: '{url}/score', batch_size: 64}}]"])
    proc.kill()
    proc.wait()
    with pytest.raises(RewardFault, match=rf"reward service 'remote' at url='{url}/score': "
                                          r".*cannot reach the server.*set fallback"):
        RemoteReward("remote", f"{url}/score", retries=0)(prompts, completions, answer=answers)
    with pytest.raises(RewardFault, match=rf"reward service 'remote' at rewards\[name=remote\].url='{url}/score': "
                                          r".*cannot reach the server.*set rewards\[name=remote\].fallback"):
        build_reward(RewardConfig(name="remote", url=f"{url}/score", retries=0))(prompts, completions, answer=answers)
    lenient = RemoteReward("remote", f"{url}/score", retries=0, fallback=0.5)
    assert lenient(prompts, completions, answer=answers) == [0.5] * 4 and lenient.faults["errors"] == [1] * 4


# ------------------------------------------------------------------------------------------- reward models


def digit_preferring_reward_model(tokenizer, folder, steps: int = 60):
    """A tiny Llama sequence classifier taught (a few seconds of Adam) to score prompt + completion higher the
    more of the completion is digits: the reward model of the tests, saved with its tokenizer."""
    import random

    from transformers import LlamaConfig, LlamaForSequenceClassification

    torch.manual_seed(0)
    rng = random.Random(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, max_position_embeddings=64, num_labels=1,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForSequenceClassification(config)
    optimizer = torch.optim.Adam(model.parameters(), lr=1e-2)
    chars = "0123456789+-*="
    for _ in range(steps):
        completions = ["".join(rng.choice(chars) for _ in range(rng.randint(1, 4))) for _ in range(32)]
        texts = [f"{rng.randint(0, 4)}+{rng.randint(0, 4)}={c}" for c in completions]
        target = torch.tensor([sum(ch.isdigit() for ch in c) / len(c) for c in completions])
        batch = tokenizer(texts, return_tensors="pt", padding=True)
        loss = torch.nn.functional.mse_loss(model(**batch).logits[:, 0], target)
        optimizer.zero_grad()
        loss.backward()
        optimizer.step()
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def test_a_reward_model_built_in_code_trains_the_tiny_policy(tokenizer, tmp_path):
    from grpo_accel.rewards.sources import RewardModel

    folder = digit_preferring_reward_model(tokenizer, tmp_path / "rm")
    rm = RewardModel("reward_model", str(folder), batch_size=4)
    digits, symbols = rm(["1+2="] * 2, ["33", "+="])
    assert digits > symbols + 0.3, "it prefers digits"
    # batch_size 64 = one process's share under 2 processes: both runs score the same rows together
    args = ["trainer.total_frames=1536", "trainer.progress_bar=false", "optim.lr=3e-3",
            f"rewards=[{{name: reward_model, path: '{folder}', batch_size: 64}}]"]  # one optimizer step a batch
    train_in_process([f"output_dir={tmp_path / 'single'}", *args])
    launch("zero3.yaml", [f"output_dir={tmp_path / 'zero3'}", *args])
    import json

    from grpo_accel.reporting.event_files import read_scalars

    summary = json.loads((tmp_path / "single" / "summary.json").read_text())
    assert summary["reward_last_mean"] > summary["reward_first_mean"] + 0.05, summary
    for tag in ("train/reward_mean", "train/loss"):
        single, zero3 = ([v for _, v in read_scalars(tmp_path / run / "tensorboard")[tag]] for run in ("single", "zero3"))
        assert len(single) == 12 and zero3 == pytest.approx(single, rel=1e-4, abs=1e-6), tag


def test_a_reward_service_stopped_mid_run_scores_its_fallback_and_the_run_goes_on(reward_server, tmp_path):
    """The service is killed once it has answered its first batch: the later batches get the fallback, counted
    in train/reward/remote_errors, and the run finishes."""
    import threading

    from grpo_accel.reporting.event_files import read_scalars

    url, proc = reward_server

    def stop_after_the_first_answer():
        for line in proc.stderr:  # aiohttp's access log: one line per answered request
            if b"POST /score" in line:
                proc.kill()
                return

    threading.Thread(target=stop_after_the_first_answer, daemon=True).start()
    out = tmp_path / "run"
    train_in_process([f"output_dir={out}", "trainer.total_frames=512", "trainer.progress_bar=false",
                      f"rewards=[{{name: remote, url: '{url}/score', batch_size: 128, retries: 0, fallback: 0.0}}]"])
    errors = [v for _, v in read_scalars(out / "tensorboard")["train/reward/remote_errors"]]
    assert len(errors) == 4 and errors[0] == 0 and errors[-1] == 128, errors


def test_math_answer_is_time_limited_in_a_background_thread_too():
    """SIGALRM works only in a main thread: there math-verify keeps its own limits; in another thread (async
    collection) the check runs in a worker process limited to 5 s, with the same verdicts."""
    import threading

    from grpo_accel.rewards import builtin as rewards

    def in_thread(found, gold):
        out = []
        thread = threading.Thread(target=lambda: out.append(rewards.same_answer(found, gold)))
        thread.start()
        thread.join(60)
        return out[0]

    assert rewards.same_answer("0.5", "\\frac{1}{2}") and in_thread("0.5", "\\frac{1}{2}")
    assert not rewards.same_answer("x^2+2", "x^2+1") and not in_thread("x^2+2", "x^2+1")
    assert reward_workers(), "the off-thread check ran in a worker process"
    rewards._OFF_THREAD_VERIFY.close()
    assert not reward_workers()


def test_a_service_that_takes_the_request_and_never_answers_is_named_so_in_the_time_set(tmp_path):
    """Issue 49 item 7, run as a user runs it: a service that accepts the connection and never answers was
    reported as unreachable. The line says it took the request and did not answer within rewards[].timeout_s, over
    1 + retries attempts, and the run spends about that long on it."""
    import socket
    import threading
    import time

    listener = socket.create_server(("127.0.0.1", 0))
    held = []
    threading.Thread(target=lambda: [held.append(listener.accept()) for _ in range(100)], daemon=True).start()
    url = f"http://127.0.0.1:{listener.getsockname()[1]}/score"
    start = time.monotonic()
    proc = run_in_group([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={tmp_path / 'run'}",
                         "trainer.progress_bar=false", f"rewards=[{{name: remote, url: '{url}', timeout_s: 2, retries: 1}}]"],
                        cwd=tmp_path, timeout=300)
    took = time.monotonic() - start
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: reward service 'remote' at rewards[name=remote].url='{url}': POST {url}: the server took the request "
        "but did not answer within 2 s (2 attempts); check the service, raise rewards[name=remote].timeout_s, or set "
        "rewards[name=remote].fallback.")
    waits = [line for line in proc.stderr.splitlines() if "no answer within 2 s; retry 1/1" in line]
    assert len(waits) == 1 and 4 <= took < 4 + 60, took  # two waits of 2 s, plus the run's start
    listener.close()
