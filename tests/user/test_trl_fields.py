"""Recipes published for TRL run as published (issue 63): every field of the installed TRL's dataclasses in one of
three lists, the recipe scripts' own keys, files that mix TRL's names with grpo_accel's, command-line values that
are not YAML, and three published recipes (two of open-r1's, TRL's own docs' GRPO config) trained for 2 steps with
only the edits this machine forces."""
import dataclasses
import json
import logging
import random
from pathlib import Path

import pytest
import yaml

from grpo_accel.config.checks import ConfigError
from grpo_accel.config.loading import load_config, to_dict
from grpo_accel.config.schema import GRPOConfig
from grpo_accel.config.trl.translate import translate
from grpo_accel.config.reference import trl_markdown as markdown
from grpo_accel.config.trl.fields import NO_EFFECT, NOT_TRLS, REFUSED, TRANSLATED, TRL_KEYS
from trainer_utils import train_in_process

ROOT = Path(__file__).resolve().parents[2]
RECIPES = ROOT / "tests" / "fixtures" / "recipes"


def trl_dataclass_fields() -> dict[str, str]:
    """Every field of TRL's GRPOConfig (with TrainingArguments'), trl grpo's script arguments, ModelConfig and
    DatasetMixtureConfig, in the installed trl: field -> its class."""
    import trl
    from trl.scripts.grpo import GRPOScriptArguments
    from trl.scripts.utils import DatasetMixtureConfig

    out = {}
    for cls in (trl.GRPOConfig, trl.ScriptArguments, GRPOScriptArguments, trl.ModelConfig, DatasetMixtureConfig):
        out.update({f.name: cls.__name__ for f in dataclasses.fields(cls) if f.name not in out})
    return out


def test_every_field_of_the_installed_trl_is_in_exactly_one_list():
    fields = trl_dataclass_fields()
    assert len(fields) > 200  # GRPOConfig alone has 191 in TRL 1.16
    missing = sorted(set(fields) - TRL_KEYS)
    assert not missing, f"fields of the installed trl in no list of grpo_accel/config/trl/fields.py: {missing}"
    lists = [set(TRANSLATED), set(NO_EFFECT), set(REFUSED)]
    assert all(not a & b for i, a in enumerate(lists) for b in lists[i + 1:])
    strangers = sorted(TRL_KEYS - set(fields) - set(NOT_TRLS))
    assert not strangers, f"keys in the lists that are neither TRL's nor said where they come from: {strangers}"


def setting_paths(d: dict, prefix: str = ""):
    for key, value in d.items():
        yield prefix + key
        if isinstance(value, dict):
            yield from setting_paths(value, f"{prefix}{key}.")


def test_every_translated_field_names_a_setting_that_exists():
    keys = set(setting_paths(to_dict(GRPOConfig())))
    for name, here in TRANSLATED.items():
        assert here.key is None and here.note or here.key in keys or here.key == "rewards", (name, here.key)


def test_the_docs_tables_are_the_lists():
    page = (ROOT / "docs" / "pages" / "coming-from-trl.md").read_text()
    assert "<!-- generated: grpo_accel.config.reference.trl_markdown() -->" in page
    tables = markdown()
    for name in TRL_KEYS:
        assert f"| `{name}` |" in tables, name
    assert f"### Translated ({len(TRANSLATED)})" in tables and f"### Refused ({len(REFUSED)})" in tables


def write(tmp_path, settings: dict, name="trl.yaml") -> Path:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(settings, sort_keys=False))
    return path


def rows_file(tmp_path, count=8) -> Path:
    """Rows in OpenR1-Math-220k's columns (problem, solution, answer)."""
    path = tmp_path / "math.jsonl"
    path.write_text("".join(json.dumps({"problem": f"What is {a} + {a + 1}?", "solution": f"${2 * a + 1}$",
                                        "answer": str(2 * a + 1)}) + "\n" for a in range(count)))
    return path


BASE = {"reward_funcs": ["accuracy_reward"], "max_steps": 2, "per_device_train_batch_size": 4,
        "num_generations": 2}


def test_a_refused_field_is_one_line_with_its_reason_and_its_off_value_is_no_effect(tmp_path, caplog):
    with pytest.raises(ConfigError) as error:
        load_config(write(tmp_path, {**BASE, "load_in_4bit": True, "fsdp": "full_shard", "neftune_noise_alpha": 5}))
    lines = str(error.value).splitlines()
    assert len(lines) == 4 and lines[1].startswith("  load_in_4bit=True: quantised training is not supported here")
    assert lines[2].startswith("  fsdp='full_shard': FSDP is not an engine here")
    with caplog.at_level(logging.INFO):
        load_config(write(tmp_path, {**BASE, "load_in_4bit": False, "use_liger_kernel": True, "sync_ref_model": False}))
    said = next(r.getMessage() for r in caplog.records if "holds TRL's settings" in r.getMessage())
    inert = said.splitlines()[-1]
    assert inert.startswith("  no effect here: ") and "use_liger_kernel" in inert
    assert "load_in_4bit (False asks for nothing)" in inert and "sync_ref_model (False asks for nothing)" in inert


def test_fields_with_real_behaviour_here(tmp_path):
    data = rows_file(tmp_path)
    settings = {**BASE, "dataset_name": str(data), "max_steps": -1, "num_train_epochs": 1,
                "gradient_checkpointing": True, "gradient_checkpointing_kwargs": {"use_reentrant": False},
                "logging_first_step": True, "log_level": "passive", "save_strategy": "epoch", "eval_strategy": "steps",
                "eval_steps": 2, "dataset_test_split": "held", "log_completions": True, "num_completions_to_print": 3,
                "report_to": "none", "disable_tqdm": True, "lr_scheduler_type": "cosine_with_min_lr",
                "lr_scheduler_kwargs": {"min_lr_rate": 0.1}, "adam_epsilon": 1e-6, "beta": 0.04,
                "chat_template": "{{ messages[0]['content'] }}", "system_prompt": "Think first.",
                "dataset_prompt_column": "problem"}
    got, lines = translate(settings, 1, rows=lambda _: 8)
    assert got["model.gradient_checkpointing"] is True and got["trainer.log_first"] is True
    assert got["trainer.log_level"] == "info" and got["trainer.report_to"] == [] and got["trainer.progress_bar"] is False
    # one epoch: 8 rows x 2 completions = 16 frames, 2 generations of 8 (4 per device x 2 accumulation... here 1)
    assert got["trainer.total_frames"] == 16 and got["checkpoint.interval_frames"] == 16
    assert got["eval.every_iterations"] == 2 and got["data.eval_split"] == "held"  # 1 optimizer step per batch
    assert got["trainer.log_samples"] == 3 and got["optim.scheduler"] == "cosine" and got["optim.min_lr_ratio"] == 0.1
    assert got["optim.eps"] == 1e-6 and got["loss.kl_importance_weighted"] is True  # TRL's use_bias_correction_kl
    assert got["data.system_prompt"] == "Think first." and got["data.prompt_field"] == "problem"
    assert got["model.chat_template"].startswith("{{")
    assert "gradient_checkpointing_kwargs (checkpointing here is non-reentrant: the same gradients)" in lines[-1]
    quiet, _ = translate(BASE, 1, rows=lambda _: 0)
    assert quiet["trainer.log_samples"] == 0  # log_completions: TRL's default false
    with pytest.raises(ConfigError, match=r"gradient_checkpointing_kwargs: \['preserve_rng_state'\]"):
        translate({**BASE, "gradient_checkpointing_kwargs": {"preserve_rng_state": True}}, 1, rows=lambda _: 0)
    with pytest.raises(ConfigError, match="without reward_funcs or reward_model_name_or_path"):
        load_config(write(tmp_path, {"max_steps": 2}))
    lora, _ = translate({**BASE, "lora_r": 8}, 1, rows=lambda _: 0)
    assert "model.lora.r" not in lora  # lora_* without use_peft: TRL trains the whole model too
    assert translate({**BASE, "use_peft": True, "lora_r": 8}, 1, rows=lambda _: 0)[0]["model.lora.r"] == 8


def test_use_vllm_becomes_vllm_servers(tmp_path):
    server, lines = translate({**BASE, "use_vllm": True, "vllm_mode": "server", "vllm_server_host": "0.0.0.0",
                               "vllm_server_port": 30001, "vllm_group_port": 51216}, 1, rows=lambda _: 0)
    assert server["rollout.backend"] == "vllm" and server["rollout.urls"] == ["http://127.0.0.1:30001"]
    assert server["weight_sync.method"] == "disk"
    assert (server["loss.tis_mode"], server["loss.tis_cap"]) == ("sequence_mask", 3.0)  # TRL's defaults
    assert any("VLLM_SERVER_DEV_MODE=1 vllm serve MODEL --port 30001 --logprobs-mode processed_logprobs" in line
               and "trl vllm-serve" in line for line in lines)
    assert "vllm_group_port (the weights reach vLLM from disk here)" in lines[-1]
    assert "vllm_server_port" not in lines[-1] and "vllm_server_host" not in lines[-1], "they made the URL"
    colocated, lines = translate({**BASE, "use_vllm": True, "vllm_gpu_memory_utilization": 0.5}, 1,
                                 rows=lambda _: 0)
    assert colocated["rollout.colocate"] is True and colocated["rollout.urls"] == ["http://127.0.0.1:8000"]
    assert any("--gpu-memory-utilization 0.5 --enable-sleep-mode" in line for line in lines)
    off, lines = translate({**BASE, "use_vllm": False, "vllm_mode": "server", "vllm_device": "cuda:7"}, 1,
                           rows=lambda _: 0)
    assert "rollout.backend" not in off and "vllm_mode (use_vllm is off)" in lines[-1]
    assert lines[-1].count("vllm_device") == 1, "an old key of TRL's named once (issue 74, item 11)"
    cfg = load_config(write(tmp_path, {**BASE, "use_vllm": True, "vllm_mode": "server",
                                       "vllm_server_base_url": "http://10.0.0.2:8000",
                                       "vllm_importance_sampling_mode": "token_truncate"}))
    assert cfg.rollout.urls == ["http://10.0.0.2:8000"] and cfg.loss.tis_mode == "token_truncate"


def test_trl_vllm_serve_starts_the_server_this_client_needs():
    """TRL 1.16's ``trl vllm-serve`` runs vLLM's own server (TRL's vllm_serve.py: ``build_command`` and ``main``):
    with processed logprobs and, in its environment, the dev mode whose routes the weight push uses."""
    import inspect

    from trl.scripts import vllm_serve

    command = vllm_serve.build_command(vllm_serve.ScriptArguments(model="M", port=8001))
    assert command[command.index("serve") :][:2] == ["serve", "M"] and "--port" in command
    assert command[command.index("--logprobs-mode") + 1] == "processed_logprobs"
    assert 'env["VLLM_SERVER_DEV_MODE"] = "1"' in inspect.getsource(vllm_serve.main)


def test_a_file_mixes_trls_names_with_grpo_accels_and_a_setting_given_twice_is_one_line(tmp_path):
    cfg = load_config(write(tmp_path, {**BASE, "data.system_prompt": "Be brief: <think>\n...\n</think>",
                                       "rollout": {"max_new_tokens": 16}, "optim": {"lr": 1e-5}}))
    assert cfg.data.system_prompt.startswith("Be brief") and cfg.rollout.max_new_tokens == 16
    assert cfg.optim.lr == 1e-5 and cfg.rollout.group_size == 2  # TRL's learning_rate default gave way to ours
    with pytest.raises(ConfigError, match="rollout.group_size: given as rollout.group_size and by TRL's "
                                          "num_generations; keep one"):
        load_config(write(tmp_path, {**BASE, "rollout.group_size": 4}))
    with pytest.raises(ConfigError, match="optim='sgd': the optimizer here is AdamW"):
        load_config(write(tmp_path, {**BASE, "optim": "sgd"}))  # TRL's optim (a string), not the section


def test_command_line_values_that_are_not_yaml_are_the_text_they_are():
    think = "Respond in the format: <think>\n...\n</think>\n<answer>\n...\n</answer>"
    for text in (think, "Answer: 42", "{% if x %}", "[unclosed", "- a list?", "yes", "@at", "a: b: c"):
        assert load_config(None, [f"data.system_prompt={text}"]).data.system_prompt == text
    assert load_config(None, ["trainer.total_frames=256"]).trainer.total_frames == 256  # YAML where it reads
    alphabet = list("abz019 :=,.-_[]{}<>!&*#?|%@`'\"\n\t\\") + ["trainer.", "rollout.group_size", "data.", "null"]
    rng = random.Random(0)
    for _ in range(400):  # no input gives anything but a config or a ConfigError
        item = "".join(rng.choice(alphabet) for _ in range(rng.randint(0, 14)))
        try:
            load_config(None, [item])
        except ConfigError:
            pass


def test_a_saved_config_without_a_newer_setting_resumes_as_its_default():
    from grpo_accel.config.resume import resume_conflicts

    current = to_dict(load_config(None, []))
    saved = to_dict(load_config(None, []))
    del saved["loss"]["tis_mode"], saved["model"]["chat_template"]
    assert resume_conflicts(saved, current) == []


def test_an_open_r1_reward_without_open_r1_installed_is_one_line(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "open_r1" else real(name, *a))
    with pytest.raises(ConfigError, match="'accuracy' is open-r1's reward .*open_r1 is not installed here"):
        translate({**BASE, "reward_funcs": ["accuracy"]}, 1, rows=lambda _: 0)
    with pytest.raises(ConfigError, match="'code' is open-r1's, built by its script"):
        translate({**BASE, "reward_funcs": ["code"]}, 1, rows=lambda _: 0)


def test_a_chat_reward_on_text_prompts_is_one_line_naming_the_fix(tmp_path, smollm2):
    data = rows_file(tmp_path)
    config = write(tmp_path, {**BASE, "model_name_or_path": str(smollm2), "dataset_name": str(data),
                              "dataset_prompt_column": "problem", "reward_funcs": ["accuracy"],
                              "max_completion_length": 4, "bf16": False, "report_to": "none"})
    with pytest.raises(Exception) as error:
        train_in_process(["--config", str(config), f"output_dir={tmp_path / 'run'}", "trainer.progress_bar=false"])
    message = str(error.value)
    assert "\n" not in message and message.startswith("reward function 'accuracy_reward' reads chat messages")
    assert "give data.system_prompt" in message and "@grpo_accel.rewards.text_reward" in message


MACHINE_FORCED = {"use_vllm": False, "attn_implementation": "sdpa", "bf16": False,
                  "max_steps": 2, "per_device_train_batch_size": 4, "gradient_accumulation_steps": 1,
                  "num_generations": 2, "max_completion_length": 8, "max_prompt_length": 256}
"""What this machine forces on a published recipe: no vLLM (nor its GPUs), SDPA for flash-attention 2, float32
on CPU cores, and a run of 2 optimizer steps that fits them. Its push_to_hub goes to the Hub stand-in."""


@pytest.mark.parametrize("recipe", ["open-r1_qwen2.5-1.5b_grpo.yaml", "open-r1_r1-distill-qwen-1.5b_grpo.yaml"])
def test_a_published_recipe_trains_with_only_the_edits_this_machine_forces(tmp_path, smollm2, recipe, monkeypatch,
                                                                           caplog):
    from grpo_accel.reporting.event_files import read_scalars
    from hub_standin import USER, HubStandIn
    from tracker_stores import tracker_env

    for key, value in tracker_env(tmp_path).items():
        monkeypatch.setenv(key, value)  # W&B offline, its files under tmp_path
    monkeypatch.delenv("HF_HUB_OFFLINE")
    monkeypatch.setenv("HF_TOKEN", "hf_standin")  # the token TRL users export
    import huggingface_hub.constants

    # HF_HUB_DISABLE_XET=1, as read at import: the stand-in speaks LFS, not Xet's storage
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    published = yaml.safe_load((RECIPES / recipe).read_text())
    settings = {**published, **MACHINE_FORCED, "model_name_or_path": str(smollm2),
                "dataset_name": str(rows_file(tmp_path)), "output_dir": str(tmp_path / "run"),
                "report_to": ["wandb", "tensorboard"]}  # tensorboard beside the recipe's wandb: read back here
    config = write(tmp_path, settings)
    with HubStandIn("hf_standin") as hub, caplog.at_level(logging.INFO):
        assert train_in_process(["--config", str(config), "trainer.progress_bar=false",
                                 f"hub.endpoint={hub.url}"]) == 0
    pushed = hub.repos[f"{USER}/{published['hub_model_id']}"]  # hub_strategy every_save: the one checkpoint
    assert pushed["commits"] == ["grpo_accel: step_00000002"] and "model.safetensors" in pushed["files"]
    said = next(r.getMessage() for r in caplog.records if "holds TRL's settings" in r.getMessage())
    assert "system_prompt=" in said and "dataset_prompt_column='problem' -> data.prompt_field=problem" in said
    summary = json.loads((tmp_path / "run" / "summary.json").read_text())
    assert summary["iterations"] == 2  # 2 optimizer steps: one per collected batch
    scalars = read_scalars(tmp_path / "run" / "tensorboard")
    for name in ("accuracy_reward", "format_reward", "tag_count_reward"):
        assert len(scalars[f"train/reward/{name}_mean"]) >= 1, name  # logged under the function's name
    assert [step for step, _ in scalars["train/reward_mean"]][0] == 1  # logging_first_step, logging_steps 1
    assert any((tmp_path / "run" / "wandb").glob("offline-run-*/run-*.wandb")), "W&B wrote no offline run"


def test_use_vllm_true_with_sglang_one_setting_away(tmp_path, model_dir, fresh_server, caplog):
    """A TRL file with use_vllm: true in server mode and rollout.backend: sglang samples from the SGLang stand-in at
    vllm_server_host and port, with TRL's importance-sampling correction, and pushes its weights there after each
    batch (tests/on_vllm runs the same file's kind against a real vLLM)."""
    from sglang_standin.processes import server_state

    url = fresh_server()
    host, port = url.removeprefix("http://").split(":")
    data = tmp_path / "rows.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"{a}+{b}=", "answer": str(a + b)}) + "\n"
                            for a in range(3) for b in range(3)))
    config = write(tmp_path, {
        "model_name_or_path": str(model_dir), "dataset_name": str(data), "output_dir": str(tmp_path / "run"),
        "reward_funcs": ["grpo_accel.rewards.answer_match"], "use_vllm": True, "vllm_mode": "server",
        "vllm_server_host": host, "vllm_server_port": int(port), "max_steps": 2, "per_device_train_batch_size": 8,
        "num_generations": 4, "max_completion_length": 4, "learning_rate": 3e-4, "bf16": False,
        "report_to": ["tensorboard"],
        # grpo_accel's own settings in the same file
        "weight_sync": {"dtype": "float32", "disk_path": str(tmp_path / "weights")}})
    with caplog.at_level(logging.INFO):  # SGLang in vLLM's place: the one setting, on the command line
        assert train_in_process(["--config", str(config), "trainer.progress_bar=false", "rollout.backend=sglang"]) == 0
    said = next(r.getMessage() for r in caplog.records if "holds TRL's settings" in r.getMessage())
    assert f"-> rollout.urls=['http://{host}:{port}']" in said and "-> loss.tis_mode=sequence_mask" in said
    saved = yaml.safe_load((tmp_path / "run" / "config.yaml").read_text())
    assert saved["rollout"]["backend"] == "sglang" and saved["loss"]["tis_cap"] == 3.0
    assert server_state(url)["weight_version"] == "2"  # both batches' weights pushed to the server


def test_trls_own_docs_grpo_config_trains_as_published(tmp_path, smollm2, caplog):
    """TRL's CLI docs' GRPO config file (tests/fixtures/recipes/README.md): its Qwen2.5-0.5B and Polaris dataset
    for SmolLM2 and rows in Polaris' conversational layout, a short run; its nproc_per_node is the launch's."""
    from grpo_accel.reporting.event_files import read_scalars

    data = tmp_path / "polaris.jsonl"
    data.write_text("".join(json.dumps({"prompt": [{"role": "user", "content": f"What is {a} + {a}?"}],
                                        "solution": f"${2 * a}$"}) + "\n" for a in range(8)))
    published = yaml.safe_load((RECIPES / "trl-docs_clis_grpo.yaml").read_text())
    config = write(tmp_path, {**published, "model_name_or_path": str(smollm2), "dataset_name": str(data),
                              "output_dir": str(tmp_path / "run"), "bf16": False, "max_steps": 2,
                              "per_device_train_batch_size": 4, "num_generations": 2, "max_completion_length": 8})
    with caplog.at_level(logging.INFO):
        assert train_in_process(["--config", str(config), "trainer.progress_bar=false"]) == 0
    said = next(r.getMessage() for r in caplog.records if "holds TRL's settings" in r.getMessage())
    assert "no effect here: nproc_per_node" in said
    # TRL's logging_steps 10 and logging_first_step false: one log in a 2-step run, at its end
    assert [s for s, _ in read_scalars(tmp_path / "run" / "tensorboard")["train/reward/accuracy_reward_mean"]] == [2]


def test_log_first_and_log_level(tmp_path):
    """trainer.log_first (the default) logs the first batch whatever log_interval says (TRL's logging_first_step);
    trainer.log_level=warning leaves grpo_accel's info lines off the console."""
    import subprocess
    import sys

    from grpo_accel.reporting.event_files import read_scalars

    for first, steps in ((True, [1, 2]), (False, [2])):
        out = tmp_path / f"first-{first}"
        assert train_in_process([f"output_dir={out}", "trainer.total_frames=256", "trainer.log_interval=100000",
                                 f"trainer.log_first={str(first).lower()}", "trainer.progress_bar=false"]) == 0
        assert [step for step, _ in read_scalars(out / "tensorboard")["train/reward_mean"]] == steps
    run = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={tmp_path / 'quiet'}",
                          "trainer.total_frames=128", "trainer.progress_bar=false", "trainer.log_level=warning"],
                         capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert run.returncode == 0 and "done: 128 frames" not in run.stderr and "summary:" not in run.stderr
