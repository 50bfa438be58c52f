"""A ``trl grpo`` config file runs as it is (issue 57 item 2): TRL's names read, TRL's batch arithmetic reproduced
(checked against TRL's own GRPOConfig for the same numbers), steps converted to frames, what has no counterpart
refused in one line each."""
import json
import logging

import pytest
import yaml

from grpo_accel.recipe.build import batch_layout
from grpo_accel.config.checks import ConfigError
from grpo_accel.config.loading import load_config
from grpo_accel.config.trl.translate import TrlLayout, translate
from trainer_utils import main_in_process


def trl_config(monkeypatch, tmp_path, processes: int, **settings):
    """TRL's own GRPOConfig for ``settings`` over ``processes`` (its world size made so)."""
    from transformers import TrainingArguments
    from trl import GRPOConfig

    monkeypatch.setattr(TrainingArguments, "world_size", property(lambda self: processes))
    return GRPOConfig(output_dir=str(tmp_path), bf16=False, report_to="none", **settings)


@pytest.mark.parametrize("processes, settings", [
    (1, {}),  # TRL's defaults: 8 per device, accumulation 1, 8 generations
    (1, {"per_device_train_batch_size": 4, "gradient_accumulation_steps": 4, "num_generations": 8}),
    (2, {"per_device_train_batch_size": 8, "gradient_accumulation_steps": 2, "num_generations": 4,
         "num_iterations": 2}),
    (2, {"per_device_train_batch_size": 4, "generation_batch_size": 64, "num_generations": 16,
         "gradient_accumulation_steps": 2}),
    (4, {"per_device_train_batch_size": 2, "steps_per_generation": 4, "num_generations": 4}),
])
def test_trls_batch_arithmetic_is_reproduced(monkeypatch, tmp_path, processes, settings):
    theirs = trl_config(monkeypatch, tmp_path, processes, **settings)
    ours = TrlLayout(settings, processes)
    assert (ours.generation, ours.steps_per_generation) == (theirs.generation_batch_size, theirs.steps_per_generation)
    steps = theirs.steps_per_generation * theirs.num_iterations // theirs.gradient_accumulation_steps
    settings_here, _ = translate({**settings, "max_steps": 3 * steps}, processes, rows=lambda _: 0)
    cfg = load_config(None, [f"{key}={json.dumps(v)}" for key, v in settings_here.items() if key != "rewards"])
    layout, micro_batch = batch_layout(cfg, processes)
    assert layout.completions == theirs.generation_batch_size and layout.group_size == theirs.num_generations
    per_batch = layout.optimizer_steps(micro_batch, cfg.trainer.gradient_accumulation_steps, cfg.trainer.num_epochs,
                                       cfg.trainer.optim_steps_per_batch)
    assert per_batch == steps  # one collected batch here is one TRL generation, with its optimizer steps
    assert cfg.trainer.total_frames == 3 * theirs.generation_batch_size  # max_steps=3 generations' steps


def test_num_train_epochs_counts_the_rows_of_the_file_the_config_names(tmp_path, caplog):
    """No max_steps (TRL's default): the run is num_train_epochs passes over dataset_name's rows, in whole
    generations: 2 epochs x 9 rows x 4 completions = 72 frames, 5 generations of 16 (one optimizer step each)."""
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(3) for b in range(3)))
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump({"dataset_name": str(data), "num_train_epochs": 2, "num_generations": 4,
                                    "reward_funcs": ["accuracy_reward"],
                                    "per_device_train_batch_size": 8, "gradient_accumulation_steps": 2}))
    with caplog.at_level(logging.INFO):
        cfg = load_config(path)
    assert cfg.data.path == str(data) and cfg.trainer.total_frames == 5 * 16
    said = next(r.getMessage() for r in caplog.records if "holds TRL's settings" in r.getMessage())
    assert "num_train_epochs=2 x 9 rows x num_generations=4 -> trainer.total_frames=80" in said
    path.write_text(yaml.safe_dump({"num_train_epochs": 2}))  # no dataset to count: one line saying so
    with pytest.raises(ConfigError, match="num_train_epochs: a TRL config needs dataset_name"):
        load_config(path)


def test_a_trl_config_that_trl_would_refuse_is_refused_as_trl_would(tmp_path):
    with pytest.raises(ConfigError, match=r"generation_batch_size=20: TRL needs it divisible by per_device_train_"
                                          r"batch_size x processes = 8"):
        translate({"generation_batch_size": 20}, 1, rows=lambda _: 0)
    with pytest.raises(ConfigError, match="divisible by num_generations=3"):
        translate({"num_generations": 3}, 1, rows=lambda _: 0)


def test_a_file_of_grpo_accels_own_keys_is_never_read_as_trls():
    from grpo_accel.config.trl.translate import is_trl_config

    assert not is_trl_config({"output_dir": "runs/x"}) and not is_trl_config({"optim": {"lr": 1e-6}, "output_dir": 1})
    assert is_trl_config({"output_dir": "runs/x", "learning_rate": 1e-6})
    assert is_trl_config({"optim": "adamw_torch"})  # TRL's optim is a string; grpo_accel's a section


def test_a_key_of_neither_is_answered_in_the_files_own_terms(tmp_path):
    """Issue 74 item 4: a typo in a TRL file was offered grpo_accel's top-level keys; a script's own key for its
    data gets how a TRL file names data. Every such key at once; grpo_accel's own keys beside TRL's still pass."""
    config = tmp_path / "trl.yaml"
    config.write_text("num_generatons: 8\nlearning_rate: 1.0e-6\nreward_funcs: [accuracy_reward]\n"
                      "dataset_train_path: rows.jsonl\ntrainer.total_frames: 64\noptim: {clip_norm: 1.0}\n")
    with pytest.raises(ConfigError) as err:
        load_config(config)
    assert str(err.value).splitlines() == [
        f"{config} holds TRL's settings and 2 key(s) that are neither TRL's nor grpo_accel's:",
        "  num_generatons: unknown key; did you mean num_generations?",
        "  dataset_train_path: unknown key; did you mean dataset_train_split? A TRL file names its data by "
        "dataset_name (a local file or folder, or a Hub id), with dataset_config and dataset_train_split."]


def test_what_has_no_counterpart_is_refused_one_line_each(tmp_path):
    path = tmp_path / "trl.yaml"
    path.write_text(yaml.safe_dump({"model_name_or_path": "Qwen/Qwen2.5-0.5B-Instruct", "sync_ref_model": True,
                                    "load_in_4bit": True, "learning_rate": 1e-6, "min_p": 0.1}))
    with pytest.raises(ConfigError) as err:
        load_config(path)
    head, *lines = str(err.value).splitlines()  # in the file's order (safe_dump sorted it)
    assert head == "a TRL config with settings that cannot be honoured here:" and len(lines) == 3
    assert lines[0] == ("  load_in_4bit=True: quantised training is not supported here; drop it")
    assert lines[1].startswith("  min_p=0.1: min-p sampling is not available here")
    assert lines[2] == "  sync_ref_model=True: the KL reference stays the initial model; drop it"


TRL_YAML = """\
# as written for: trl grpo --config trl_grpo.yaml
model_name_or_path: {model}
dataset_name: {data}
reward_funcs: [get_soft_overlong_punishment, yaml_rewards.reward_len]
reward_weights: [0.5, 1.0]
output_dir: {out}
learning_rate: 3.0e-4
lr_scheduler_type: cosine
per_device_train_batch_size: 8
gradient_accumulation_steps: 2
num_generations: 4
max_completion_length: 4
max_steps: 4
logging_steps: 1
save_steps: 2
beta: 0.04
epsilon: 0.2
loss_type: grpo
bf16: false
gradient_checkpointing: false
use_vllm: false
report_to: none
"""


def test_a_prompt_over_the_files_max_prompt_length_names_that_key_and_the_choices(tmp_path):
    """Issue 74 item 5: the line named rollout.max_prompt_tokens, a key the TRL file never wrote, and only "raise it
    or drop/shorten that prompt"; now the file's key first, and data.overlong_prompts' choices."""
    from grpo_accel.data.prompts import DataError

    config = tmp_path / "trl.yaml"
    config.write_text("max_prompt_length: 2\nmax_steps: 1\nrewards: [{name: answer_match}]\n")
    with pytest.raises(DataError) as err:
        main_in_process("train", ["--config", str(config), f"output_dir={tmp_path / 'run'}"])
    assert str(err.value).endswith(
        "is 4 tokens, more than max_prompt_length (rollout.max_prompt_tokens)=2; raise max_prompt_length "
        "(rollout.max_prompt_tokens), shorten or drop that prompt, or set data.overlong_prompts=drop (such rows "
        "leave the data) or truncate_left (each keeps its last 2 tokens, what older TRL did with max_prompt_length).")
    assert load_config(config, ["rollout.max_prompt_tokens=3"]).trl_sources.get("rollout.max_prompt_tokens") is None


def test_a_trl_grpo_file_trains_with_trls_layout(tmp_path, monkeypatch, model_dir, caplog):
    """TRL counts 4 optimizer steps of 8 completions x 2 accumulated per device: a generation of 16 completions
    (4 prompts x 4) each step. The same here: 4 batches of 16, one optimizer step each, checkpoints every 2."""
    (tmp_path / "yaml_rewards.py").write_text("def reward_len(completions, **kwargs):\n"
                                            "    return [-abs(4 - len(c)) / 4 for c in completions]\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(3) for b in range(3)))
    out = tmp_path / "run"
    config = tmp_path / "trl_grpo.yaml"
    config.write_text(TRL_YAML.format(model=model_dir, data=data, out=out))
    with caplog.at_level(logging.INFO):
        assert main_in_process("train", ["--config", str(config), "trainer.progress_bar=false"]) == 0
    said = next(r.getMessage() for r in caplog.records if "holds TRL's settings" in r.getMessage())
    assert "max_steps=4 optimizer steps (1 per generation of 16 completions) -> trainer.total_frames=64" in said
    assert ("reward_funcs, reward_weights -> rewards=[{'name': 'overlong_penalty', 'kwargs': {'max_tokens': 1280, "
            "'cache_tokens': 256}, 'weight': 0.5}, {'name': 'yaml_rewards:reward_len', 'weight': 1.0}]") in said
    saved = yaml.safe_load((out / "config.yaml").read_text())  # the resolved grpo_accel config
    assert (saved["rollout"]["prompts_per_batch"], saved["rollout"]["group_size"]) == (4, 4)
    assert (saved["trainer"]["total_frames"], saved["trainer"]["micro_batch_completions"],
            saved["trainer"]["gradient_accumulation_steps"]) == (64, 8, 2)
    assert (saved["optim"]["scheduler"], saved["loss"]["aggregation"], saved["loss"]["kl_coef"]) == (
        "cosine", "seq_mean_token_mean", 0.04)
    assert saved["loss"]["clip_eps_high"] == 0.2 and saved["optim"]["betas"] == [0.9, 0.999]
    assert saved["trainer"]["seed"] == 42 and saved["trainer"]["report_to"] == []
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 4
    steps = sorted(p.name for p in (out / "checkpoints").iterdir())
    assert steps[-1] == "step_00000004" and "step_00000002" in steps  # save_steps=2: every 32 frames
