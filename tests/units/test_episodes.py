"""Multi-turn episodes in one process: tools, the token sequence of an episode, masking the environment's tokens
out of the loss, grouping and budgets. (SGLang, launched runs, the config and resume: test_episode_runs.py.)"""
import json
import threading

import pytest
import torch

from episode_env import ROWS, Countdown, chat_tokenizer, short_turn_model
from grpo_accel import batch
from grpo_accel.advantages import group_advantages
from grpo_accel.data.prompts import render_chat
from grpo_accel.layout import BatchLayout
from grpo_accel.logprobs import sequence_logprobs
from grpo_accel.loss import GRPOLoss
from grpo_accel.rewards import RewardSet, env_reward
from grpo_accel.rollout.collector import GRPOCollector
from grpo_accel.embedded.engine import EmbeddedEngine
from grpo_accel.rollout.episodes import EpisodeRunner, TurnRenderer
from grpo_accel.tasks.calculator import calculator, calculator_environment
from grpo_accel.tasks.tiny import build_tiny_model
from grpo_accel.rollout.tools import TaggedCallParser, ToolCall, ToolRunner, tool_schema

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
    model_mask, mask = td[batch.MODEL_MASK], td[batch.COMPLETION_MASK]
    assert (model_mask <= mask).all() and ((model_mask == 0) & (mask == 1)).any()
    with torch.no_grad():
        trainer = sequence_logprobs(model, td[batch.PROMPT_IDS], td[batch.PROMPT_MASK], td[batch.COMPLETION_IDS], mask,
                                    temperature=0.9)
    torch.testing.assert_close(td[batch.ENGINE_LOGPROBS], trainer * model_mask, atol=1e-5, rtol=1e-5)
    for i, ep in enumerate(episodes):
        prompt = td[batch.PROMPT_IDS][i][td[batch.PROMPT_MASK][i].bool()].tolist()
        sequence = prompt + ep.tokens
        starts = [j for j in range(1, len(ep.model)) if ep.model[j] and not ep.model[j - 1]]
        assert len(starts) == ep.turns - 1 == sum(m["role"] == "tool" for m in ep.messages)
        assert all(sequence[: len(prompt) + j] in contexts for j in starts)  # turn k was generated from this prefix
        if td[batch.FINISH_REASON][i] == batch.FINISH_STOP:
            assert tok.decode(sequence) + "\n" == render_chat(tok, ep.messages, add_generation_prompt=False)
    assert [ep.turns for ep in episodes] == [min(3, 1 + len(r["prompt"]) % 3) for r in ROWS[:3] for _ in "ab"] or \
        any(td[batch.FINISH_REASON] == batch.FINISH_LENGTH)  # a turn cut by max_new_tokens ends its episode early


def test_later_turns_prefill_each_prompt_once_and_draw_what_whole_contexts_would(tok):
    """The embedded engine's ``continue_rows`` (a prompt prefilled once for its episodes, then each episode's own
    tokens) draws the same tokens, with the same logprobs, as generating from each whole context."""
    from grpo_accel.contracts import RolloutEngine

    model = short_turn_model(tok)
    engine = EmbeddedEngine(model, tok, max_new_tokens=6, temperature=0.8)
    runner = EpisodeRunner(engine, tok, Countdown, max_turns=3)
    prompts = runner.encode(ROWS)
    td, episodes = runner.run(ROWS, prompts, group_size=3, seeds=list(range(6)))
    assert max(ep.turns for ep in episodes) == 3

    class WholeContexts(RolloutEngine):  # the contract's continue_rows: each whole context through generate
        pad_id, max_new_tokens = engine.pad_id, engine.max_new_tokens

        def generate(self, *args, **kwargs):
            return engine.generate(*args, **kwargs)

    runner.engine = WholeContexts()
    again, _ = runner.run(ROWS, prompts, group_size=3, seeds=list(range(6)))
    assert torch.equal(td[batch.COMPLETION_IDS], again[batch.COMPLETION_IDS])
    torch.testing.assert_close(td[batch.ENGINE_LOGPROBS], again[batch.ENGINE_LOGPROBS], atol=1e-5, rtol=1e-5)
    greedy, _ = runner.run(ROWS, prompts, group_size=1, greedy=True)
    runner.engine = engine
    assert torch.equal(runner.run(ROWS, prompts, group_size=1, greedy=True)[0][batch.COMPLETION_IDS],
                       greedy[batch.COMPLETION_IDS])
    # one turn as a rollout: its prompts are the whole contexts, as the contract's default builds them
    suffixes = [ep.tokens for ep in episodes[:5]]
    turn = engine.continue_rows(prompts.ids[:2], [0, 0, 1, 1, 1], suffixes, keys=[3, 4, 5, 6, 7])
    whole = WholeContexts().continue_rows(prompts.ids[:2], [0, 0, 1, 1, 1], suffixes, keys=[3, 4, 5, 6, 7])
    for key in (batch.PROMPT_IDS, batch.PROMPT_MASK, batch.COMPLETION_IDS):
        assert torch.equal(turn[key], whole[key]), key


def test_budgets_cut_episodes_and_the_cut_answer_is_not_shown(tok):
    model = likelier_eos(build_tiny_model(tok, seed=0), tok, bias=8.0)
    engine = EmbeddedEngine(model, tok, max_new_tokens=4)
    rows = [{"prompt": "22+22", "answer": "0"}]  # Countdown wants 3 turns
    runner = EpisodeRunner(engine, tok, Countdown, max_turns=2)
    td, episodes = runner.run(rows, runner.encode(rows), group_size=2, seeds=[5])
    assert all(ep.turns == 2 for ep in episodes) and (td[batch.FINISH_REASON] == batch.FINISH_LENGTH).all()
    assert all(ep.model[-1] == 1 and ep.messages[-1]["role"] == "assistant" for ep in episodes)
    runner = EpisodeRunner(engine, tok, Countdown, max_turns=3, max_episode_tokens=12)
    td, episodes = runner.run(rows, runner.encode(rows), group_size=4, seeds=[5])
    assert (td[batch.COMPLETION_MASK].sum(1) <= 12).all() and (td[batch.FINISH_REASON] == batch.FINISH_LENGTH).all()


# ---------------------------------------------------------------------------------- loss and grouping


def episode_rollout(tok, **collector_kwargs):
    model = likelier_eos(build_tiny_model(tok, seed=0), tok)
    engine = EmbeddedEngine(model, tok, max_new_tokens=5)
    rewards = RewardSet({"env_reward": env_reward, "spy": lambda p, c, conversation, **f: [len(x) for x in conversation]})
    collector = GRPOCollector(engine, tok, ROWS, rewards, layout=BatchLayout(3, 2), environment=Countdown,
                              max_turns=3, **collector_kwargs)
    return model, collector, collector.collect()


def test_environment_tokens_reach_no_gradient_and_no_token_count(tok):
    """Changing the stored logprobs (pi_old, reference, engine) of the environment's tokens changes neither the
    loss, nor any gradient, nor a diagnostic; changing one model token's does (the test can fail)."""
    model, _, td = episode_rollout(tok)
    reference = build_tiny_model(tok, seed=1)
    loss = GRPOLoss(model, reference, kl_coef=0.1, tis_cap=2.0, clip_epsilon=0.05)
    with torch.no_grad():
        td[batch.OLD_LOGPROBS] = loss.logprobs(model, td)  # ratio 1: every token inside the clip
        td[batch.REF_LOGPROBS] = loss.logprobs(reference, td)
    env_tokens = (td[batch.MODEL_MASK] == 0) & (td[batch.COMPLETION_MASK] == 1)
    assert env_tokens.any()

    def run(rollout):
        model.zero_grad()
        out = loss(rollout)
        (out["loss_objective"] + out["loss_kl"]).backward()
        return out, [p.grad.clone() for p in model.parameters()]

    base, grads = run(td)
    changed = td.clone()
    for key in (batch.OLD_LOGPROBS, batch.REF_LOGPROBS, batch.ENGINE_LOGPROBS):
        changed[key] = torch.where(env_tokens, torch.randn(env_tokens.shape) - 3, td[key])
    out, changed_grads = run(changed)
    assert all(torch.equal(a, b) for a, b in zip(grads, changed_grads))
    assert all(torch.equal(base[k], out[k]) for k in base.keys())
    assert int(loss.units(td)) == int(td[batch.MODEL_MASK].sum())  # token_mean counts the model's tokens only
    control = td.clone()
    control[batch.REF_LOGPROBS][tuple((td[batch.MODEL_MASK] == 1).nonzero()[0].tolist())] += 0.5  # one model token's
    _, control_grads = run(control)
    assert not all(torch.equal(a, b) for a, b in zip(grads, control_grads))


def test_the_g_episodes_of_a_prompt_are_its_group_and_rewards_see_the_episode(tok):
    _, collector, td = episode_rollout(tok)
    torch.testing.assert_close(td[batch.ADVANTAGES], group_advantages(td[batch.REWARD], 2))
    prompts = td[batch.PROMPT_IDS].view(3, 2, -1)
    assert (prompts == prompts[:, :1]).all(), "a prompt's G episodes are contiguous"
    answered = td[batch.EPISODE]["tool_calls"].float() * 0.1  # Countdown's per-turn term, summed
    torch.testing.assert_close(td[batch.REWARDS, "env_reward"], answered)
    assert (td[batch.REWARDS, "spy"] == 2 * td[batch.EPISODE]["turns"]).all()  # user + turns + answers
    assert collector.prompts.texts[0] == "<user>1+1=<eos>\n<assistant>"


def test_dynamic_sampling_and_packing_work_on_episodes(tok):
    model, collector, td = episode_rollout(tok, dynamic_sampling=True, max_extra_rounds=2)
    assert td.shape == (6,) and batch.MODEL_MASK in td.keys() and "dropped_group_fraction" in td["stats"].keys()
    loss = GRPOLoss(model, packing=True)
    padded = GRPOLoss(model)
    torch.testing.assert_close(loss(td)["loss_objective"], padded(td)["loss_objective"], atol=1e-5, rtol=1e-4)


def test_single_turn_rollouts_are_unchanged(tok, tokenizer):
    """Without an environment a rollout has no episode keys, and the loss's mask is the completion mask."""
    engine = EmbeddedEngine(build_tiny_model(tokenizer, seed=0), tokenizer, max_new_tokens=3)
    from grpo_accel.rewards import answer_match
    from grpo_accel.tasks.addition import addition_rows

    collector = GRPOCollector(engine, tokenizer, addition_rows(4)[0], RewardSet({"a": answer_match}),
                              layout=BatchLayout(2, 2))
    td = collector.collect()
    assert batch.MODEL_MASK not in td.keys() and batch.EPISODE not in td.keys() and collector.episodes is None
    assert torch.equal(batch.loss_mask(td), td[batch.COMPLETION_MASK])
