"""Multi-turn episodes end to end: on SGLang (the stand-in), launched runs under ZeRO-0 and ZeRO-3, the config's
environment settings, the calculator recipe on the real model, and a stopped and resumed episode run.
(Episodes' tokens, masks, groups and budgets in one process: test_episodes.py.)"""
import json

import pytest
import torch

from episode_env import ROWS, Countdown, chat_tokenizer, short_turn_model
from grpo_accel import batch
from grpo_accel.layout import BatchLayout
from grpo_accel.logprobs import sequence_logprobs
from grpo_accel.loss import GRPOLoss
from grpo_accel.rewards import RewardSet, env_reward
from grpo_accel.rollout.collector import GRPOCollector
from grpo_accel.embedded.engine import EmbeddedEngine
from grpo_accel.rollout.episodes import EpisodeRunner
from grpo_accel.tasks.tiny import build_tiny_model


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


# --------------------------------------------------------------------------------------- both engines


@pytest.fixture(scope="module")
def short_turns(tok, tmp_path_factory):
    """A folder holding the tiny model taught to take short turns, and the chat tokenizer."""
    folder = tmp_path_factory.mktemp("short_turns")
    short_turn_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_episodes_on_sglang_send_each_turn_as_input_ids(tok, short_turns):
    """Against the SGLang stand-in (launch/bench/sglang_standin): each turn is a /generate with the conversation's
    ids; the server's logprobs of the model's tokens equal the trainer's over the finished episode, and seeds
    make episodes reproducible."""
    from transformers import AutoModelForCausalLM

    from grpo_accel.sglang.engine import SGLangEngine
    from sglang_standin.processes import standin_server

    with standin_server(short_turns, "--deterministic") as url:
        engine = SGLangEngine([url], tok, max_new_tokens=6, temperature=0.8)
        runner = EpisodeRunner(engine, tok, Countdown, max_turns=3)
        rows = ROWS[:3]
        td, episodes = runner.run(rows, runner.encode(rows), group_size=2, seeds=[1, 2, 3])
        again, _ = runner.run(rows, runner.encode(rows), group_size=2, seeds=[1, 2, 3])
    assert max(ep.turns for ep in episodes) == 3 and torch.equal(td[batch.COMPLETION_IDS], again[batch.COMPLETION_IDS])
    model = AutoModelForCausalLM.from_pretrained(short_turns)
    with torch.no_grad():
        trainer = sequence_logprobs(model, td[batch.PROMPT_IDS], td[batch.PROMPT_MASK], td[batch.COMPLETION_IDS],
                                    td[batch.COMPLETION_MASK], temperature=0.8)
    torch.testing.assert_close(td[batch.ENGINE_LOGPROBS], trainer * td[batch.MODEL_MASK], atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("config,extra", [
    ("zero0.yaml", ["trainer.async_collection=true", "rollout.embedded_worker=true"]),
    ("zero3.yaml", ["rollout.dynamic_sampling=true", "loss.packing=true"]),
])
def test_launched_runs_train_on_episodes(tmp_path, short_turns, config, extra):
    """accelerate launch with 2 processes: episodes whose turn counts differ between the processes, collected
    asynchronously by the decode worker (ZeRO-0), and under ZeRO-3, where each turn is a collective, with packing
    and dynamic sampling; the episode metrics reach TensorBoard. (ZeRO-1/2 hold whole parameters for generation
    as ZeRO-0 does; their training is test_distributed.py's.) ZeRO-0's run is the README's command, as written."""
    from launching import launch_training
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in ROWS * 2))
    out = tmp_path / "run"
    launch_training(config, [
        f"output_dir={out}", f"model.name_or_path={short_turns}", f"data.path={data}",
        "rollout.environment=tests.helpers.episode_env:Countdown", "rollout.max_turns=3", "rollout.max_new_tokens=6",
        "rollout.prompts_per_batch=4", "rollout.group_size=2", "trainer.total_frames=16", "trainer.progress_bar=false",
        "rewards=[{name: env_reward}]", *extra])
    events = EventAccumulator(str(out / "tensorboard")).Reload()
    tags = events.Tags()["scalars"]
    for tag in ("turns_mean", "tool_calls_mean", "tool_error_rate", "tokens_mean", "model_token_fraction"):
        assert f"train/episode/{tag}" in tags
    turns = [e.value for e in events.Scalars("train/episode/turns_mean")]
    assert len(turns) == 2 and all(1 < t <= 3 for t in turns)
    fraction = [e.value for e in events.Scalars("train/episode/model_token_fraction")]
    assert all(0 < f < 1 for f in fraction)


# ------------------------------------------------------------------------------------------------ config


def test_environment_settings_build_or_name_the_fix():
    from grpo_accel.config.checks import ConfigError
    from grpo_accel.recipe.parts import build_environment, build_rows
    from grpo_accel.config.rollout_schema import RolloutConfig
    from grpo_accel.config.schema import DataConfig

    data = DataConfig(task="calculator", max_operand=20, holdout=4, system_prompt="Calculate.")
    assert build_environment(RolloutConfig(), data) is None
    make = build_environment(RolloutConfig(environment="calculator", tool_timeout_s=0.25), data)
    env = make()
    assert env.runner.timeout_s == 0.25 and env.reset(build_rows(data)[1][0])[0] == {"role": "system",
                                                                                      "content": "Calculate."}
    assert build_environment(RolloutConfig(environment="tests.helpers.episode_env:Countdown"), data).__name__ == "Countdown"
    for name, message in [("nope", r"rollout.environment='nope': not a built-in \['calculator'\]; for your own "
                                   r"factory write 'package.module:factory'"),
                          ("tests.helpers.episode_env:Missing", "cannot import it"),
                          ("tests.helpers.episode_env:CHARS", "is a str, not a callable")]:
        with pytest.raises(ConfigError, match=message):
            build_environment(RolloutConfig(environment=name), data)
    for key, value in [("max_turns", 0), ("max_episode_tokens", 0), ("tool_timeout_s", 0)]:
        with pytest.raises(ConfigError, match=f"rollout.{key}={value}"):
            RolloutConfig(**{key: value})
    assert RolloutConfig(environment="calculator", max_turns=3, max_new_tokens=40).max_completion_tokens == 120
    assert RolloutConfig(environment="calculator", max_turns=3, max_new_tokens=40,
                         max_episode_tokens=100).max_completion_tokens == 100
    train, held_out = build_rows(data)
    assert len(held_out) == 4 and all(r["prompt"][-1]["content"].startswith("What is ") for r in train)
    assert not {r["prompt"][-1]["content"] for r in train} & {r["prompt"][-1]["content"] for r in held_out}


def test_reward_functions_that_need_episode_fields_need_an_environment(tok):
    engine = EmbeddedEngine(build_tiny_model(tok, seed=0), tok, max_new_tokens=2)
    with pytest.raises(ValueError, match=r"reward 'env_reward' needs \['env_rewards'\], which only multi-turn episodes "
                                         "provide; set environment, or drop that reward."):
        GRPOCollector(engine, tok, ROWS, RewardSet({"env_reward": env_reward}), layout=BatchLayout(2, 2))
    for setting, message in [({"max_turns": 0}, "max_turns=0: an episode needs at least one model turn"),
                             ({"max_episode_tokens": 0}, "max_episode_tokens=0: use null")]:
        with pytest.raises(ValueError, match=message):
            GRPOCollector(engine, tok, ROWS, RewardSet({"env_reward": env_reward}), layout=BatchLayout(2, 2),
                          environment=Countdown, **setting)


def test_the_calculator_recipe_runs_on_the_real_model(tmp_path, smollm2):
    """launch/configs/smollm2_calculator.yaml's path at a tiny scale, in this process: SmolLM2 from its folder,
    the calculator task and tool environment, evaluation of held-out episodes before and after, episode metrics
    and the engine/trainer logprob gap over episodes (prefix-shared later turns included)."""
    from grpo_accel.reporting.event_files import read_scalars
    from launching import ROOT
    from trainer_utils import train_in_process

    out = tmp_path / "run"
    train_in_process([
        "--config", str(ROOT / "launch" / "configs" / "smollm2_calculator.yaml"), f"output_dir={out}",
        f"model.name_or_path={smollm2}", "data.holdout=2", "rollout.prompts_per_batch=2", "rollout.group_size=2",
        "rollout.max_new_tokens=40", "rollout.max_turns=2", "trainer.total_frames=4", "eval.every_iterations=1",
        "eval.k=1", "trainer.progress_bar=false", "trainer.seed=1"])  # the config's 40 tokens: 30 cut calls short;
    # seed 1's four sampled episodes hold tool calls (seeds 0 and 2-7 happen to hold none at 30 tokens)
    scalars = read_scalars(out / "tensorboard")
    assert [step for step, _ in scalars["eval/episode/tool_calls_mean"]] == [0, 1]
    assert all(1 < v <= 2 for _, v in scalars["train/episode/turns_mean"])  # a tool call, then a later turn
    assert max(v for _, v in scalars["train/engine_logprob_abs_diff"]) < 1e-3


def test_episode_training_stopped_and_resumed_equals_a_straight_run(tok, tmp_path):
    """Episodes keep the run's promise: stop after 2 batches, resume to 4, and every logged scalar and weight is
    bitwise the straight 4-batch run's (the episodes' draws are keyed by group and turn, environments hold no
    state between batches)."""
    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.trainer import GRPOTrainer
    from grpo_accel.embedded.sender import EmbeddedWeightSync
    from trainer_utils import reset_accelerate_state, without_wall_times

    taught = short_turn_model(tok).state_dict()
    rewards = RewardSet({"env_reward": env_reward, "short": lambda p, completions, **f: [-len(c) for c in completions]})

    def run(out, batches, resume=None):
        reset_accelerate_state()
        model = build_tiny_model(tok, seed=0)
        model.load_state_dict(taught)
        engine = EmbeddedEngine(model, tok, max_new_tokens=6)
        collector = GRPOCollector(engine, tok, ROWS, rewards, layout=BatchLayout(2, 2),
                                  environment=Countdown, max_turns=3)
        trainer = GRPOTrainer(collector=collector, total_frames=4 * batches, loss_module=GRPOLoss(model),
                              optimizer=torch.optim.AdamW(model.parameters(), lr=1e-3),
                              weight_sync_sender=EmbeddedWeightSync(engine), empty_replay_buffer_on_weight_update=True,
                              seed=0, checkpoint=Checkpoint(out, resume=resume))
        trainer.train()
        return trainer, model

    straight, straight_model = run(tmp_path / "a", 4)
    first, _ = run(tmp_path / "b", 2)
    resumed, resumed_model = run(tmp_path / "b", 4, resume="auto")
    assert resumed.iterations == 4 and any(h["train/episode/turns_mean"] > 1 for h in straight.history)
    assert without_wall_times(first.history + resumed.history) == without_wall_times(straight.history)
    assert all(torch.equal(a, b) for a, b in zip(resumed_model.parameters(), straight_model.parameters()))
    reset_accelerate_state()


def test_an_environment_whose_reset_writes_garbage_is_named_not_a_dataset_column(short_turns, tmp_path):
    """Issue 49 item 10, run as a user runs it: reset()'s malformed first messages were reported as "dataset row
    0: column 'prompt': ...", a column the user never wrote; the line names the environment's reset()."""
    import json
    import subprocess
    import sys

    from launching import ROOT, run_in_group

    (tmp_path / "bad_env.py").write_text(
        "class BadReset:\n    tools = ()\n\n    def reset(self, row):\n        return [{'rol': 'user', 'text': row['prompt']}]\n\n"
        "    def step(self, messages):\n        raise AssertionError('never reached')\n")
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
    proc = run_in_group([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={tmp_path / 'run'}",
                         f"model.name_or_path={short_turns}", "data.path=rows.jsonl", "rollout.environment=bad_env:BadReset",
                         "rewards=[{name: env_reward}]", "rollout.prompts_per_batch=2", "rollout.group_size=2",
                         "trainer.total_frames=4", "trainer.progress_bar=false", "rollout.max_new_tokens=4",
                         "optim.lr=3e-4"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1] == (
        "error: BadReset.reset() for dataset row 0 returned messages that are not a conversation: message 0 is "
        "{'rol': 'user', 'text': '1+1='}; each message is {'role': one of ['system', 'user', 'assistant', 'tool'], "
        "'content': a string}.")
