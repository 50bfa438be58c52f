"""Multi-turn episodes: tools, the token sequence of an episode, masking the environment's tokens out of the
loss, grouping, budgets, both engines and a launched run under ZeRO-3."""
import json
import threading

import pytest
import torch

from episode_env import Countdown, chat_tokenizer, short_turn_model
from grpo_accel import batch as K
from grpo_accel.advantages import group_advantages
from grpo_accel.data import render_chat
from grpo_accel.logprobs import sequence_logprobs
from grpo_accel.loss import GRPOLoss
from grpo_accel.rewards import RewardSet, env_reward
from grpo_accel.rollout.collector import GRPOCollector
from grpo_accel.rollout.embedded import EmbeddedEngine
from grpo_accel.rollout.episodes import EpisodeRunner, TurnRenderer
from grpo_accel.tasks.calculator import calculator, calculator_environment
from grpo_accel.tasks.tiny import build_tiny_model
from grpo_accel.tools import TaggedCallParser, ToolCall, ToolRunner, tool_schema

ROWS = [{"prompt": p, "answer": "0"} for p in ("1+1=", "22+2=", "3+33=", "4", "55*5", "6-6=")]


@pytest.fixture(scope="module")
def tok():
    return chat_tokenizer()


def likelier_eos(model, tok, bias=4.0):
    """Make the random model end its turns early, so that episodes take several turns, and write no other
    special token (its turn's text then renders back to the same tokens)."""
    def hook(module, args, out):
        out.logits[..., tok.eos_token_id] += bias
        out.logits[..., [tok.pad_token_id, tok.bos_token_id, tok.unk_token_id]] = -1e4
        return out

    model.register_forward_hook(hook)
    return model


def call(name, **arguments):
    return f"<tool_call>{json.dumps({'name': name, 'arguments': arguments})}</tool_call>"


# ------------------------------------------------------------------------------------------------ tools


def test_a_function_becomes_a_tool_and_every_failure_a_message():
    def add(a: int, b: float = 1.0) -> float:
        """Add two numbers.

        Details the model does not need."""
        return a + b

    def boom(x: str) -> str:
        """Fail."""
        raise RuntimeError("no")

    def slow() -> str:
        """Sleep."""
        threading.Event().wait(5)
        return "late"

    assert tool_schema(add) == {"type": "function", "function": {
        "name": "add", "description": "Add two numbers.", "parameters": {
            "type": "object", "properties": {"a": {"type": "integer"}, "b": {"type": "number"}}, "required": ["a"]}}}
    def undocumented(x: int) -> int:
        return x

    with pytest.raises(ValueError, match="tool 'undocumented' has no docstring"):
        tool_schema(undocumented)
    calls = TaggedCallParser().parse(f"first {call('add', a=2, b=3)} then <tool_call>{{oops</tool_call> "
                                     f"{call('boom', x='1')}{call('nope')}{call('add', c=1)}{call('slow')}")
    assert calls[0] == ToolCall("add", {"a": 2, "b": 3}) and "not valid JSON" in calls[1].error
    runner = ToolRunner([add, boom, slow], timeout_s=0.5)
    answers = runner.run(calls)
    assert answers[0] == ("5", False)
    assert answers[1][1] and answers[1][0].startswith("error: the call is not valid JSON")
    assert answers[2] == ("error: boom raised RuntimeError: no", True)
    assert answers[3] == ("error: there is no tool 'nope'; the tools are ['add', 'boom', 'slow']", True)
    assert answers[4][1] and "add raised TypeError" in answers[4][0] and "'c'" in answers[4][0]
    assert answers[5] == ("error: slow timed out after 0.5 s", True)


def test_calls_run_concurrently():
    """Four calls that each wait for all four at a barrier can only finish if they run at the same time."""
    barrier = threading.Barrier(4, timeout=3)

    def meet() -> str:
        """Wait for the others."""
        barrier.wait()
        return "met"

    runner = ToolRunner([meet], timeout_s=5)
    assert runner.run([ToolCall("meet") for _ in range(4)]) == [("met", False)] * 4


def test_tool_environment_answers_calls_and_ends_on_a_turn_without_one():
    env = calculator_environment(system_prompt="Be exact.")()
    assert env.reset(ROWS[0]) == [{"role": "system", "content": "Be exact."}, {"role": "user", "content": "1+1="}]
    turn = {"role": "assistant", "content": f"Let me see. {call('calculator', expression='347*29')}"}
    step = env.step([*env.reset(ROWS[0]), turn])
    assert step.messages == [{"role": "tool", "content": "10063"}] and not step.done and step.tool_calls == 1
    bad = env.step([{"role": "assistant", "content": call("calculator", expression="2**2**99")}])
    assert bad.tool_errors == 1 and bad.messages[0]["content"].startswith("error: calculator raised ValueError")
    assert env.step([{"role": "assistant", "content": "10063"}]).done
    assert calculator("(2+3)/4") == "1.25" and calculator("-7*3") == "-21"


# --------------------------------------------------------------------------------- the episode's tokens


def test_turns_are_appended_never_re_rendered_with_the_real_smollm2_template(smollm2):
    """With SmolLM2's template, the incremental token sequence equals the tokens of the whole conversation
    rendered at the end: re-rendering changes no earlier token. The tools reach the model as a system message
    (the template has no tools argument)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(smollm2)
    schemas = [tool_schema(calculator)]
    messages = [{"role": "user", "content": "What is 347*29?"}]
    ids = tok(render_chat(tok, messages, schemas), add_special_tokens=False)["input_ids"]
    renderer = TurnRenderer(tok, schemas)
    for text, answer in [(call("calculator", expression="347*29"), "10063"), ("It is 10063.", None)]:
        ids += tok(text, add_special_tokens=False)["input_ids"] + [tok.eos_token_id]  # the model's turn
        messages.append({"role": "assistant", "content": text})
        if answer is not None:
            messages.append({"role": "tool", "content": answer})
            ids += renderer.between(messages[-1:])
    whole = tok(render_chat(tok, messages, schemas, add_generation_prompt=False), add_special_tokens=False)["input_ids"]
    assert ids == whole[: len(ids)] and tok.decode(whole[len(ids):]) == "\n"  # the template's newline after the end
    assert "You can call these tools:\n" + json.dumps(schemas[0]["function"]) in tok.decode(ids)


def test_a_template_that_rewrites_earlier_turns_leaves_the_episode_as_the_model_saw_it(tok):
    """Qwen3-style templates drop the reasoning of earlier assistant turns: re-rendering the conversation
    would change tokens the model already saw. The renderer only ever renders the new messages, so the episode
    keeps what the model read."""
    import copy

    rewriting = copy.deepcopy(tok)
    rewriting.chat_template = (
        "{% for m in messages %}{% set c = m['content'] %}{% if m['role'] == 'assistant' and not loop.last %}"
        "{% set c = c.split('</think>')[-1] %}{% endif %}<{{ m['role'] }}>{{ c }}<eos>\n{% endfor %}"
        "{% if add_generation_prompt %}<assistant>{% endif %}")
    between = TurnRenderer(rewriting).between([{"role": "tool", "content": "42"}])
    assert rewriting.decode(between) == "\n<tool>42<eos>\n<assistant>"
    conversation = [{"role": "user", "content": "q"}, {"role": "assistant", "content": "<think>hm</think>a"},
                    {"role": "tool", "content": "42"}]
    assert "hm" not in render_chat(rewriting, conversation)  # what re-rendering would have changed


def test_episodes_interleave_turns_and_train_on_exactly_what_the_model_saw(tok):
    """Each later turn is generated from the prompt and the episode's tokens so far; the engine's logprobs of
    the model's tokens equal the trainer's forward over the finished episode (so every turn's context is the
    prefix trained on), the environment's tokens are masked, and the text is the chat template's rendering of
    the conversation."""
    model = likelier_eos(build_tiny_model(tok, seed=0), tok)
    engine = EmbeddedEngine(model, tok, max_new_tokens=5, temperature=0.9)
    contexts = []  # every later turn's whole context, as the engine was asked to continue it
    continue_rows = engine.continue_rows

    def spy(prompt_ids, rows, suffixes, keys):
        contexts.extend(prompt_ids[r] + s for r, s in zip(rows, suffixes))
        return continue_rows(prompt_ids, rows, suffixes, keys)

    engine.continue_rows = spy
    runner = EpisodeRunner(engine, tok, Countdown, max_turns=3)
    prompts = runner.encode(ROWS[:3])
    td, episodes = runner.run(ROWS[:3], prompts, group_size=2, seeds=[1, 2, 3])
    assert td.shape == (6,) and contexts
    model_mask, mask = td[K.MODEL_MASK], td[K.COMPLETION_MASK]
    assert (model_mask <= mask).all() and ((model_mask == 0) & (mask == 1)).any()
    with torch.no_grad():
        trainer = sequence_logprobs(model, td[K.PROMPT_IDS], td[K.PROMPT_MASK], td[K.COMPLETION_IDS], mask,
                                    temperature=0.9)
    torch.testing.assert_close(td[K.ENGINE_LOGPROBS], trainer * model_mask, atol=1e-5, rtol=1e-5)
    for i, ep in enumerate(episodes):
        prompt = td[K.PROMPT_IDS][i][td[K.PROMPT_MASK][i].bool()].tolist()
        sequence = prompt + ep.tokens
        starts = [j for j in range(1, len(ep.model)) if ep.model[j] and not ep.model[j - 1]]
        assert len(starts) == ep.turns - 1 == sum(m["role"] == "tool" for m in ep.messages)
        assert all(sequence[: len(prompt) + j] in contexts for j in starts)  # turn k was generated from this prefix
        if td[K.FINISH_REASON][i] == K.FINISH_STOP:
            assert tok.decode(sequence) + "\n" == render_chat(tok, ep.messages, add_generation_prompt=False)
    assert [ep.turns for ep in episodes] == [min(3, 1 + len(r["prompt"]) % 3) for r in ROWS[:3] for _ in "ab"] or \
        any(td[K.FINISH_REASON] == K.FINISH_LENGTH)  # a turn cut by max_new_tokens ends its episode early


def test_later_turns_prefill_each_prompt_once_and_draw_what_whole_contexts_would(tok):
    """The embedded engine's ``continue_rows`` (a prompt prefilled once for its episodes, then each episode's own
    tokens) draws the same tokens, with the same logprobs, as generating from each whole context."""
    import types

    model = short_turn_model(tok)
    engine = EmbeddedEngine(model, tok, max_new_tokens=6, temperature=0.8)
    runner = EpisodeRunner(engine, tok, Countdown, max_turns=3)
    prompts = runner.encode(ROWS)
    td, episodes = runner.run(ROWS, prompts, group_size=3, seeds=list(range(6)))
    assert max(ep.turns for ep in episodes) == 3
    runner.engine = types.SimpleNamespace(generate=engine.generate, pad_id=engine.pad_id)  # whole contexts only
    again, _ = runner.run(ROWS, prompts, group_size=3, seeds=list(range(6)))
    assert torch.equal(td[K.COMPLETION_IDS], again[K.COMPLETION_IDS])
    torch.testing.assert_close(td[K.ENGINE_LOGPROBS], again[K.ENGINE_LOGPROBS], atol=1e-5, rtol=1e-5)
    greedy, _ = runner.run(ROWS, prompts, group_size=1, greedy=True)
    runner.engine = engine
    assert torch.equal(runner.run(ROWS, prompts, group_size=1, greedy=True)[0][K.COMPLETION_IDS],
                       greedy[K.COMPLETION_IDS])


def test_budgets_cut_episodes_and_the_cut_answer_is_not_shown(tok):
    model = likelier_eos(build_tiny_model(tok, seed=0), tok, bias=8.0)
    engine = EmbeddedEngine(model, tok, max_new_tokens=4)
    rows = [{"prompt": "22+22", "answer": "0"}]  # Countdown wants 3 turns
    runner = EpisodeRunner(engine, tok, Countdown, max_turns=2)
    td, episodes = runner.run(rows, runner.encode(rows), group_size=2, seeds=[5])
    assert all(ep.turns == 2 for ep in episodes) and (td[K.FINISH_REASON] == K.FINISH_LENGTH).all()
    assert all(ep.model[-1] == 1 and ep.messages[-1]["role"] == "assistant" for ep in episodes)
    runner = EpisodeRunner(engine, tok, Countdown, max_turns=3, max_episode_tokens=12)
    td, episodes = runner.run(rows, runner.encode(rows), group_size=4, seeds=[5])
    assert (td[K.COMPLETION_MASK].sum(1) <= 12).all() and (td[K.FINISH_REASON] == K.FINISH_LENGTH).all()


# ---------------------------------------------------------------------------------- loss and grouping


def episode_rollout(tok, **collector_kwargs):
    model = likelier_eos(build_tiny_model(tok, seed=0), tok)
    engine = EmbeddedEngine(model, tok, max_new_tokens=5)
    rewards = RewardSet({"env_reward": env_reward, "spy": lambda p, c, conversation, **f: [len(x) for x in conversation]})
    collector = GRPOCollector(engine, tok, ROWS, rewards, prompts_per_batch=3, group_size=2, environment=Countdown,
                              max_turns=3, **collector_kwargs)
    return model, collector, collector.collect()


def test_environment_tokens_reach_no_gradient_and_no_token_count(tok):
    """Changing the stored logprobs (pi_old, reference, engine) of the environment's tokens changes neither the
    loss, nor any gradient, nor a diagnostic; changing one model token's does (the test can fail)."""
    model, _, td = episode_rollout(tok)
    reference = build_tiny_model(tok, seed=1)
    loss = GRPOLoss(model, reference, kl_coef=0.1, tis_cap=2.0, clip_epsilon=0.05)
    with torch.no_grad():
        td[K.OLD_LOGPROBS] = loss.logprobs(model, td)  # ratio 1: every token inside the clip
        td[K.REF_LOGPROBS] = loss.logprobs(reference, td)
    env_tokens = (td[K.MODEL_MASK] == 0) & (td[K.COMPLETION_MASK] == 1)
    assert env_tokens.any()

    def run(rollout):
        model.zero_grad()
        out = loss(rollout)
        (out["loss_objective"] + out["loss_kl"]).backward()
        return out, [p.grad.clone() for p in model.parameters()]

    base, grads = run(td)
    changed = td.clone()
    for key in (K.OLD_LOGPROBS, K.REF_LOGPROBS, K.ENGINE_LOGPROBS):
        changed[key] = torch.where(env_tokens, torch.randn(env_tokens.shape) - 3, td[key])
    out, changed_grads = run(changed)
    assert all(torch.equal(a, b) for a, b in zip(grads, changed_grads))
    assert all(torch.equal(base[k], out[k]) for k in base.keys())
    assert int(loss.units(td)) == int(td[K.MODEL_MASK].sum())  # token_mean counts the model's tokens only
    control = td.clone()
    control[K.REF_LOGPROBS][tuple((td[K.MODEL_MASK] == 1).nonzero()[0].tolist())] += 0.5  # one model token's
    _, control_grads = run(control)
    assert not all(torch.equal(a, b) for a, b in zip(grads, control_grads))


def test_the_g_episodes_of_a_prompt_are_its_group_and_rewards_see_the_episode(tok):
    _, collector, td = episode_rollout(tok)
    torch.testing.assert_close(td[K.ADVANTAGES], group_advantages(td[K.REWARD], 2))
    assert (td[K.GROUP_ID].view(3, 2) == td[K.GROUP_ID].view(3, 2)[:, :1]).all()
    answered = td[K.EPISODE]["tool_calls"].float() * 0.1  # Countdown's per-turn term, summed
    torch.testing.assert_close(td[K.REWARDS, "env_reward"], answered)
    assert (td[K.REWARDS, "spy"] == 2 * td[K.EPISODE]["turns"]).all()  # user + turns + answers
    assert collector.prompts.texts[0] == "<user>1+1=<eos>\n<assistant>"


def test_dynamic_sampling_and_packing_work_on_episodes(tok):
    model, collector, td = episode_rollout(tok, dynamic_sampling=True, max_extra_rounds=2)
    assert td.shape == (6,) and K.MODEL_MASK in td.keys() and "dropped_group_fraction" in td["stats"].keys()
    loss = GRPOLoss(model, packing=True)
    padded = GRPOLoss(model)
    torch.testing.assert_close(loss(td)["loss_objective"], padded(td)["loss_objective"], atol=1e-5, rtol=1e-4)


def test_single_turn_rollouts_are_unchanged(tok, tokenizer):
    """Without an environment a rollout has no episode keys, and the loss's mask is the completion mask."""
    engine = EmbeddedEngine(build_tiny_model(tokenizer, seed=0), tokenizer, max_new_tokens=3)
    from grpo_accel.rewards import answer_match
    from grpo_accel.tasks.addition import addition_rows

    collector = GRPOCollector(engine, tokenizer, addition_rows(4)[0], RewardSet({"a": answer_match}),
                              prompts_per_batch=2, group_size=2)
    td = collector.collect()
    assert K.MODEL_MASK not in td.keys() and K.EPISODE not in td.keys() and collector.episodes is None
    assert torch.equal(K.loss_mask(td), td[K.COMPLETION_MASK])


# --------------------------------------------------------------------------------------- both engines


@pytest.fixture(scope="module")
def short_turns(tok, tmp_path_factory):
    """A folder holding the tiny model taught to take short turns, and the chat tokenizer."""
    folder = tmp_path_factory.mktemp("short_turns")
    short_turn_model(tok).save_pretrained(folder)
    tok.save_pretrained(folder)
    return folder


def test_episodes_on_sglang_send_each_turn_as_input_ids(tok, short_turns):
    """Against the SGLang stand-in (tests/sglang_standin.py): each turn is a /generate with the conversation's
    ids; the server's logprobs of the model's tokens equal the trainer's over the finished episode, and seeds
    make episodes reproducible."""
    from transformers import AutoModelForCausalLM

    from grpo_accel.sglang.engine import SGLangEngine
    from standin import standin_server

    with standin_server(short_turns, "--deterministic") as url:
        engine = SGLangEngine([url], tok, max_new_tokens=6, temperature=0.8)
        runner = EpisodeRunner(engine, tok, Countdown, max_turns=3)
        rows = ROWS[:3]
        td, episodes = runner.run(rows, runner.encode(rows), group_size=2, seeds=[1, 2, 3])
        again, _ = runner.run(rows, runner.encode(rows), group_size=2, seeds=[1, 2, 3])
    assert max(ep.turns for ep in episodes) == 3 and torch.equal(td[K.COMPLETION_IDS], again[K.COMPLETION_IDS])
    model = AutoModelForCausalLM.from_pretrained(short_turns)
    with torch.no_grad():
        trainer = sequence_logprobs(model, td[K.PROMPT_IDS], td[K.PROMPT_MASK], td[K.COMPLETION_IDS],
                                    td[K.COMPLETION_MASK], temperature=0.8)
    torch.testing.assert_close(td[K.ENGINE_LOGPROBS], trainer * td[K.MODEL_MASK], atol=1e-5, rtol=1e-5)


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
        "rollout.environment=tests.episode_env:Countdown", "rollout.max_turns=3", "rollout.max_new_tokens=6",
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
    from grpo_accel.recipe.build import build_environment, build_rows
    from grpo_accel.recipe.checks import ConfigError
    from grpo_accel.recipe.rollout_schema import RolloutConfig
    from grpo_accel.recipe.schema import DataConfig

    data = DataConfig(task="calculator", max_operand=20, holdout=4, system_prompt="Calculate.")
    assert build_environment(RolloutConfig(), data) is None
    make = build_environment(RolloutConfig(environment="calculator", tool_timeout_s=0.25), data)
    env = make()
    assert env.runner.timeout_s == 0.25 and env.reset(build_rows(data)[1][0])[0] == {"role": "system",
                                                                                      "content": "Calculate."}
    assert build_environment(RolloutConfig(environment="tests.episode_env:Countdown"), data).__name__ == "Countdown"
    for name, message in [("nope", r"rollout.environment='nope': not a built-in \['calculator'\]; for your own "
                                   r"factory write 'package.module:factory'"),
                          ("tests.episode_env:Missing", "cannot import it"),
                          ("tests.episode_env:CHARS", "is a str, not a callable")]:
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
                                         "provide; set rollout.environment, or drop that reward."):
        GRPOCollector(engine, tok, ROWS, RewardSet({"env_reward": env_reward}), prompts_per_batch=2, group_size=2)
    for setting, message in [({"max_turns": 0}, "max_turns=0: an episode needs at least one model turn"),
                             ({"max_episode_tokens": 0}, "max_episode_tokens=0: use null")]:
        with pytest.raises(ValueError, match=message):
            GRPOCollector(engine, tok, ROWS, RewardSet({"env_reward": env_reward}), prompts_per_batch=2, group_size=2,
                          environment=Countdown, **setting)


def test_the_calculator_recipe_runs_on_the_real_model(tmp_path, smollm2):
    """launch/configs/smollm2_calculator.yaml's path at a tiny scale, in this process: SmolLM2 from its folder,
    the calculator task and tool environment, evaluation of held-out episodes before and after, episode metrics
    and the engine/trainer logprob gap over episodes (prefix-shared later turns included)."""
    from grpo_accel.reporting.tracking import read_scalars
    from launching import ROOT
    from trainer_utils import train_in_process

    out = tmp_path / "run"
    train_in_process([
        "--config", str(ROOT / "launch" / "configs" / "smollm2_calculator.yaml"), f"output_dir={out}",
        f"model.name_or_path={smollm2}", "data.holdout=2", "rollout.prompts_per_batch=2", "rollout.group_size=2",
        "rollout.max_new_tokens=30", "rollout.max_turns=2", "trainer.total_frames=4", "eval.every_iterations=1",
        "eval.k=1", "trainer.progress_bar=false"])
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
    from grpo_accel.weight_sync.embedded import EmbeddedWeightSync
    from trainer_utils import reset_accelerate_state, without_wall_times

    taught = short_turn_model(tok).state_dict()
    rewards = RewardSet({"env_reward": env_reward, "short": lambda p, completions, **f: [-len(c) for c in completions]})

    def run(out, batches, resume=None):
        reset_accelerate_state()
        model = build_tiny_model(tok, seed=0)
        model.load_state_dict(taught)
        engine = EmbeddedEngine(model, tok, max_new_tokens=6)
        collector = GRPOCollector(engine, tok, ROWS, rewards, prompts_per_batch=2, group_size=2,
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
