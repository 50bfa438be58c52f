"""A user's mistakes end in one line that names the setting, function or environment and the fix; nothing trains
on garbage; every model stops where its generation config says (issue 26's cases, each failing before)."""
import subprocess
import sys

import pytest
import torch

from grpo_accel import batch
from grpo_accel.rewards import RewardError, RewardSet
from launching import ROOT, TINY_FOLDER, run_in_group

# ---------------------------------------------------------------------------------------- the console


def test_without_a_terminal_a_traceback_starts_with_its_own_cause():
    """Under nohup, SLURM or CI there is no /dev/tty: the run's own error must not read as raised while
    handling that one (the block used to run inside the ``except OSError`` that found no terminal)."""
    code = "from grpo_accel.runtime.signals import terminal_foreground\nwith terminal_foreground():\n    raise ValueError('x')"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, start_new_session=True, stdin=subprocess.DEVNULL,
                          capture_output=True, text=True, timeout=60)
    assert proc.stderr.count("Traceback") == 1 and proc.stderr.strip().endswith("ValueError: x"), proc.stderr
    assert "/dev/tty" not in proc.stderr and "During handling" not in proc.stderr


# ------------------------------------------------------------------------------------------- rewards


def _raises(prompts, completions, **_):
    return [1.0 / (c != "3") for c in completions]  # ZeroDivisionError on the completion "3"


@pytest.mark.parametrize("fn, message", [
    (_raises, r"reward function 'f' raised ZeroDivisionError: float division by zero on completion 1 "
              r"\(prompt 'b', completion '3'\); fix the function or make it return 0.0"),
    (lambda p, c, **_: [0.0, float("nan")], r"'f' returned nan for completion 1 \(prompt 'b', completion '3'\)"),
    (lambda p, c, **_: [0.0], r"'f' returned 1 values for 2 completions"),
    (lambda p, c, **_: ["good", "bad"], r"'f' returned 'good' for completion 0"),
    (lambda p, c, **_: ["1.0", "0.0"], r"'f' returned '1.0' for completion 0 .*strings are refused"),
    (lambda p, c, **_: None, r"'f' returned None \(NoneType\) for 2 completions; it must return a list with one "
                             r"float \(or None\) per completion"),
    (lambda p, c, **_: 1.0, r"'f' returned 1.0 \(float\) for 2 completions"),
])
def test_a_reward_functions_mistake_names_it_and_the_row(fn, message):
    with pytest.raises(RewardError, match=message):
        RewardSet({"f": fn})(["a", "b"], ["1", "3"])


def test_bools_count_as_0_and_1():
    assert RewardSet({"f": lambda p, c, **_: [True, False]})(["a", "b"], ["1", "3"])["reward"].tolist() == [1.0, 0.0]


def test_a_reward_error_is_one_line_and_exit_2_also_when_collected_in_the_background(tmp_path):
    """Run as a user runs it (launch/train.py, a reward module in the folder the run starts from), with
    asynchronous collection: the background thread's error reaches the user as it was raised."""
    (tmp_path / "myrewards.py").write_text("def boom(prompts, completions, **kw):\n"
                                           "    return [1 / 0 for _ in completions]\n")
    proc = run_in_group([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={tmp_path}/run",
                         "rewards=[{name: 'myrewards:boom'}]", "trainer.async_collection=true",
                         "trainer.progress_bar=false"], cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    last = proc.stderr.splitlines()[-1]
    assert last.startswith("error: reward function 'boom' raised ZeroDivisionError: division by zero on "
                           "completion 0 (prompt '"), last


# ------------------------------------------------------------------------------------------ environments


class _Says:
    """An environment whose step answers ``answer`` (or raises it)."""

    tools = ()

    def __init__(self, answer):
        self.answer = answer

    def reset(self, row):
        return [{"role": "user", "content": row["prompt"]}]

    def step(self, messages):
        if isinstance(self.answer, Exception):
            raise self.answer
        return self.answer


@pytest.mark.parametrize("answer, message", [
    ("Step([{'rol': 'user', 'text': 3}])", r"_Says.step\(\) after model turn 1 of the episode of row \{'prompt': '1\+1='"
                                           r"\} returned message 0 \{'rol': 'user', 'text': 3\}; Step.messages is a list"),
    ({"messages": []}, r"returned \{'messages': \[\]\}, a dict; return grpo_accel.rollout.episodes.Step"),
    (KeyError("state"), r"_Says.step\(\) .* raised KeyError: 'state'; fix the environment"),
    ("Step([], rewards={'r': float('nan')})", r"returned rewards \{'r': nan\}; Step.rewards maps names to finite"),
])
def test_an_environment_that_answers_garbage_stops_the_episode_naming_it(answer, message, tokenizer):
    from episode_env import chat_tokenizer
    from grpo_accel.embedded.engine import EmbeddedEngine
    from grpo_accel.rollout.episodes import EpisodeError, EpisodeRunner, Step
    from grpo_accel.tasks.tiny import build_tiny_model

    tok = chat_tokenizer()
    model = build_tiny_model(tok, seed=0)
    model.get_output_embeddings().register_forward_hook(  # every turn ends at once: the environment answers
        lambda module, args, out: out.index_fill(-1, torch.tensor([tok.eos_token_id]), 1e4))
    answer = eval(answer, {"Step": Step}) if isinstance(answer, str) else answer  # noqa: S307 - the test's own
    runner = EpisodeRunner(EmbeddedEngine(model, tok, max_new_tokens=3), tok, lambda: _Says(answer), max_turns=3)
    rows = [{"prompt": "1+1="}]
    with pytest.raises(EpisodeError, match=message):
        runner.run(rows, runner.encode(rows), group_size=2, seeds=[0])


# --------------------------------------------------------------------------------------------- run folder


def test_an_output_dir_that_cannot_be_written_is_one_line_before_any_work(tmp_path):
    from grpo_accel.run.folder import RunFolderBusy
    from trainer_utils import main_in_process

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    readonly = tmp_path / "readonly"  # a read-only file system (root ignores mode bits, not a read-only mount)
    readonly.mkdir()
    subprocess.run(["mount", "-t", "tmpfs", "-o", "ro,size=1m", "tmpfs", str(readonly)], check=True)
    try:
        for folder in (blocker, blocker / "run", readonly, readonly / "run"):
            with pytest.raises(RunFolderBusy, match=rf"output_dir='{folder}': cannot (make that folder|write there) "
                                                    r"\((Read-only file system|Not a directory|File exists).*\); "
                                                    r"choose a folder you can write"):
                main_in_process("train", [f"output_dir={folder}"])
    finally:
        subprocess.run(["umount", str(readonly)], check=True)


# ----------------------------------------------------------------------------------------------- stop ids


@pytest.fixture(scope="module")
def two_stop_model(tmp_path_factory, tokenizer):
    """The tiny Llama whose generation config lists a second stop id ("=", as a chat model lists its end-of-turn
    id beside the EOS), made likely to be drawn; saved as a model folder."""
    from grpo_accel.tasks.tiny import build_tiny_model

    model = build_tiny_model(tokenizer, seed=0)
    stop = tokenizer.convert_tokens_to_ids("=")
    with torch.no_grad():
        model.lm_head.weight[stop] += 0.5 * model.lm_head.weight.norm(dim=1).mean()
    model.generation_config.eos_token_id = [tokenizer.eos_token_id, stop]
    folder = tmp_path_factory.mktemp("two_stops")
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder, stop


def _assert_stops_at_either(td, stops):
    n_stopped = 0
    for ids, mask, reason in zip(td[batch.COMPLETION_IDS], td[batch.COMPLETION_MASK], td[batch.FINISH_REASON]):
        kept = ids[mask.bool()].tolist()
        inside = [i for i, t in enumerate(kept) if t in stops]
        assert inside in ([], [len(kept) - 1]), f"a stop id inside the completion: {kept}"
        assert (int(reason) == batch.FINISH_STOP) == bool(inside)
        n_stopped += kept[-1] == stops[1] if kept else 0
    assert n_stopped > 0, "some completions end on the second stop id"


@pytest.mark.parametrize("decoder", ["fast", "generate"])
def test_the_embedded_engine_stops_on_every_id_the_generation_config_lists(two_stop_model, tokenizer, decoder):
    from transformers import AutoModelForCausalLM

    from grpo_accel.embedded.engine import EmbeddedEngine

    folder, stop = two_stop_model
    engine = EmbeddedEngine(AutoModelForCausalLM.from_pretrained(folder), tokenizer, max_new_tokens=12, decoder=decoder)
    td = engine.generate([tokenizer("1+2")["input_ids"], tokenizer("3+4")["input_ids"]], 8, seeds=[0, 1])
    _assert_stops_at_either(td, (tokenizer.eos_token_id, stop))


def test_sglang_requests_name_the_models_stop_ids(two_stop_model, tokenizer, servers, tmp_path):
    """launch/train.py's engine sends the generation config's ids as ``stop_token_ids``; the stand-in stops as
    SGLang does (the matched id last in ``output_ids``)."""
    from transformers import AutoModelForCausalLM

    from grpo_accel.sglang.engine import SGLangEngine
    from sglang_standin.processes import server_state

    folder, stop = two_stop_model
    url = servers.get(folder, "--deterministic")
    model = AutoModelForCausalLM.from_pretrained(folder)
    engine = SGLangEngine([url], tokenizer, max_new_tokens=12,
                          stop_token_ids=batch.stop_token_ids(tokenizer, model.generation_config))
    td = engine.generate([tokenizer("1+2")["input_ids"], tokenizer("3+4")["input_ids"]], 8, seeds=[0, 1])
    _assert_stops_at_either(td, (tokenizer.eos_token_id, stop))
    sent = next(body for path, body in server_state(url)["requests"] if path == "/generate")
    assert sent["sampling_params"][0]["stop_token_ids"] == [stop]


def test_with_pad_equal_to_eos_the_stop_trains_once_and_padding_never(tokenizer):
    import copy

    from grpo_accel.embedded.engine import EmbeddedEngine
    from grpo_accel.tasks.tiny import build_tiny_model

    tok = copy.deepcopy(tokenizer)
    tok.pad_token = tok.eos_token
    model = build_tiny_model(tok, seed=0)
    with torch.no_grad():
        model.lm_head.weight[tok.eos_token_id] += 0.4 * model.lm_head.weight.norm(dim=1).mean()
    td = EmbeddedEngine(model, tok, max_new_tokens=10).generate([tok("1+2")["input_ids"]], 8, seeds=[3])
    for ids, mask in zip(td[batch.COMPLETION_IDS], td[batch.COMPLETION_MASK]):
        eos_in_mask = int(((ids == tok.eos_token_id) & mask.bool()).sum())
        assert eos_in_mask == int(ids[mask.bool()][-1] == tok.eos_token_id) <= 1
    assert (td[batch.FINISH_REASON] == batch.FINISH_STOP).any() and (td[batch.COMPLETION_MASK].sum(1) < 10).any()


def test_under_accelerate_launch_q_our_line_is_the_last_and_the_exit_code_is_accelerates():
    """One process under ``accelerate launch``: Accelerate re-raises a failed script as its own CalledProcessError
    traceback (exit 1); with its ``-q`` it exits 1 quietly and our line stays the last (as the README says)."""
    from launching import launch

    proc = launch("single_process.yaml", ["rollout.max_prompt_tokens=2", "trainer.progress_bar=false",
                                          "output_dir=/tmp/grpo_accel_never_written"],
                  launcher_args=["-q"], expect_ok=False, timeout=120)
    assert proc.returncode == 1 and "CalledProcessError" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1].startswith("error: dataset row 0: column 'prompt' is 4 tokens")


def test_export_errors_are_one_line(tmp_path):
    proc = subprocess.run([sys.executable, "-m", "grpo_accel.cli", "export", str(tmp_path), str(tmp_path / "out")],
                          cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: {tmp_path} is neither a complete checkpoint (no COMPLETE marker) nor a run folder holding one "
        "(output_dir/checkpoints/step_*); give a run's output_dir or one of its checkpoints.")


def test_paths_are_kept_resolved_so_a_resume_compares_the_files(tmp_path, monkeypatch):
    """data.path given relatively and absolutely is one file (a resume accepts it); the same relative text from
    another folder is another (it stays as written, and differs)."""
    from grpo_accel.config.loading import load_config, to_dict
    from grpo_accel.config.resume import resume_conflicts

    (tmp_path / "rows.jsonl").write_text('{"prompt": "1+1=", "answer": "2"}\n')
    monkeypatch.chdir(tmp_path)
    relative = to_dict(load_config(None, ["data.path=rows.jsonl"]))
    absolute = to_dict(load_config(None, [f"data.path={tmp_path / 'rows.jsonl'}"]))
    assert relative["data"]["path"] == str(tmp_path / "rows.jsonl") and not resume_conflicts(relative, absolute)
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path / "elsewhere")
    assert resume_conflicts(relative, to_dict(load_config(None, ["data.path=rows.jsonl"]))) == [
        f"data.path: {str(tmp_path / 'rows.jsonl')!r} -> 'rows.jsonl'"]


def test_a_bad_reward_module_is_refused_before_any_process_group(tmp_path):
    import torch.distributed as dist

    from grpo_accel.config.checks import ConfigError
    from trainer_utils import main_in_process

    with pytest.raises(ConfigError, match=r"rewards name='nomodule:f': cannot import it"):
        main_in_process("train", [f"output_dir={tmp_path}/run", "rewards=[{name: 'nomodule:f'}]"])
    assert not dist.is_initialized()


def test_a_reward_module_with_a_syntax_error_is_one_line_naming_file_and_line(tmp_path, monkeypatch):
    from grpo_accel.config.checks import ConfigError
    from trainer_utils import main_in_process

    (tmp_path / "broken_rewards.py").write_text("def f(prompts, completions, **kw):\n    return [1.0 for c in]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ConfigError) as err:
        main_in_process("train", [f"output_dir={tmp_path}/run", "rewards=[{name: 'broken_rewards:f'}]"])
    assert str(err.value).startswith(f"rewards name='broken_rewards:f': {tmp_path / 'broken_rewards.py'}, line 2: "
                                     "SyntaxError: invalid syntax; fix the module."), err.value
    assert "\n" not in str(err.value)


def test_a_reward_model_must_be_a_classifier_with_its_head(tmp_path, tokenizer):
    """A causal LM given as a reward model trained on the scores of a random head (exit 0); a missing path was a
    90-line traceback. Both are refused at start in one line naming the path; a classifier saved without its head
    too."""
    from transformers import LlamaConfig, LlamaForSequenceClassification

    from grpo_accel.config.checks import ConfigError
    from grpo_accel.recipe.parts import build_reward
    from grpo_accel.config.rollout_schema import RewardConfig
    from grpo_accel.tasks.tiny import build_tiny_model

    causal = tmp_path / "causal"
    build_tiny_model(tokenizer, seed=0).save_pretrained(causal)
    tokenizer.save_pretrained(causal)
    headless = tmp_path / "headless"
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                         num_attention_heads=4, num_key_value_heads=4, num_labels=1, pad_token_id=tokenizer.pad_token_id)
    classifier = LlamaForSequenceClassification(config)
    classifier.save_pretrained(headless, state_dict={k: v for k, v in classifier.state_dict().items() if "score" not in k})
    tokenizer.save_pretrained(headless)
    for path, message in [
        (causal, f"rewards[name=reward_model].path='{causal}' is a LlamaForCausalLM model, not a sequence classifier: "
                 "a reward model must be a *ForSequenceClassification model with a trained score head"),
        (tmp_path / "nowhere", f"rewards[name=reward_model].path='{tmp_path / 'nowhere'}' is not a model folder (no "
                               "such path)"),
        (headless, f"rewards[name=reward_model].path='{headless}': the folder does not hold all of the model's "
                   "weights (missing ['score.weight']), so its head would be random"),
    ]:
        with pytest.raises(ConfigError) as err:
            build_reward(RewardConfig(name="reward_model", path=str(path)))
        assert str(err.value).startswith(message) and "\n" not in str(err.value), err.value


def test_without_a_terminal_progress_is_a_line_now_and_then(tmp_path, monkeypatch, caplog):
    """In a log file a tqdm bar redrew twice per batch (890 redraws in a short run); there it is one log line
    every reporter.PROGRESS_LINE_S seconds (0 here: one per batch), and no bar."""
    import logging

    from grpo_accel.reporting import reporter
    from trainer_utils import train_in_process

    monkeypatch.setattr(reporter, "PROGRESS_LINE_S", 0.0)
    caplog.set_level(logging.INFO, "grpo_accel.reporting.reporter")
    train_in_process([f"output_dir={tmp_path}/run", "trainer.total_frames=384", "trainer.progress_bar=true"])
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("progress: ")]
    assert len(lines) == 3 and lines[-1].startswith("progress: 384 of 384 frames (100%), reward ")


def test_an_unreachable_sglang_server_is_one_line(tmp_path):
    from launching import free_port

    url = f"http://127.0.0.1:{free_port()}"
    proc = run_in_group([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={tmp_path}/run",
                         "rollout.backend=sglang", f"rollout.urls=[{url}]", "rollout.health_timeout_s=1"],
                        cwd=ROOT, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.strip().splitlines()[-1].startswith(f"error: SGLang server {url} did not answer /server_info within 1 s")


def test_the_shipped_deepspeed_files_are_found_from_any_folder(tmp_path, monkeypatch):
    """accelerate_configs/*.yaml name ds_configs/... relative to the checkout, while a reward module must sit in
    the folder the run starts from: the DeepSpeed file is found from there too (and handed to Accelerate so)."""
    import os

    from grpo_accel.distributed.deepspeed_files import preflight

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", "ds_configs/zero3.json")
    assert preflight()["zero_optimization"]["stage"] == 3
    assert os.environ["ACCELERATE_DEEPSPEED_CONFIG_FILE"] == str(ROOT / "ds_configs" / "zero3.json")


def test_checkpoints_of_a_tied_embedding_model_say_nothing_of_the_tie(tmp_path, tokenizer):
    """Accelerate's "Removed shared tensor {'policy.lm_head.weight'} while saving" came with every checkpoint of
    a tied-embedding model (the tie is expected; the weight comes back tied)."""
    from grpo_accel.tasks.tiny import build_tiny_qwen2
    from launching import launch

    model = build_tiny_qwen2(tokenizer, seed=0)
    model.save_pretrained(tmp_path / "tied")
    tokenizer.save_pretrained(tmp_path / "tied")
    proc = launch("single_process.yaml", [f"output_dir={tmp_path}/run", f"model.name_or_path={tmp_path / 'tied'}",
                                          "trainer.total_frames=256", "checkpoint.interval_frames=128",
                                          "trainer.progress_bar=false", *TINY_FOLDER], timeout=120)
    assert proc.stderr.count("checkpoint ") >= 2 and "Removed shared tensor" not in proc.stderr


def test_a_resume_on_changed_data_is_refused(tmp_path):
    """The same data.path with other rows in it is other data: the resume names it (the folder untouched)."""
    import json

    from grpo_accel.config.checks import ConfigError
    from trainer_utils import train_in_process

    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(4) for b in range(4)))
    run = [f"output_dir={tmp_path}/run", f"data.path={data}", "trainer.progress_bar=false"]
    train_in_process([*run, "trainer.total_frames=128"])
    train_in_process([*run, "trainer.total_frames=256", "checkpoint.resume=auto"])  # the same data: resumes
    data.write_text(data.read_text() + json.dumps({"prompt": "4+4=", "answer": "8"}) + "\n")
    with pytest.raises(ConfigError, match=rf"trained on other data: data.path={data} changed since"):
        train_in_process([*run, "trainer.total_frames=384", "checkpoint.resume=auto"])


def test_a_prompt_that_fills_the_context_says_so_and_names_max_prompt_tokens():
    """It said "Lower rollout.max_new_tokens to 0 or less": no budget can help such a prompt."""
    from grpo_accel.data.prompts import DataError
    from grpo_accel.rollout.collector import check_context

    names = {"max_new_tokens": "rollout.max_new_tokens", "max_prompt_tokens": "rollout.max_prompt_tokens"}
    with pytest.raises(DataError, match=r"^dataset row 1: its prompt is 9 tokens, as long as or longer than the 8 "
                                        r"tokens a sequence may hold .*; set rollout.max_prompt_tokens \(now None\) "
                                        r"below 8 so that such rows are refused when loaded") as err:
        check_context([[1] * 3, [1] * 9], 8, 4, None, names)
    assert "max_new_tokens" not in str(err.value)
    with pytest.raises(DataError, match=r"^rollout.max_new_tokens=6: .* Lower rollout.max_new_tokens to 5 or less"):
        check_context([[1] * 3], 8, 6, None, names)

