import copy
import sys
from pathlib import Path

import pytest
import yaml

from grpo_accel.recipe.build import batch_layout
from grpo_accel.config.checks import ConfigError
from grpo_accel.config.loading import load_config, to_dict
from grpo_accel.config.schema import GRPOConfig

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("path", sorted((ROOT / "launch" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_shipped_experiment_config_loads_and_lays_out(path):
    cfg, t = load_config(path), load_config(path).trainer
    layout, micro_batch = batch_layout(cfg, 1)
    describe = layout.describe(micro_batch, t.gradient_accumulation_steps, t.num_epochs, t.optim_steps_per_batch)
    assert "completions per collected batch" in describe


@pytest.mark.parametrize("path", sorted((ROOT / "launch" / "configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_experiment_config_starts_with_its_command(path):
    assert path.read_text().startswith("# accelerate launch --config_file accelerate_configs/")


def test_config_is_a_hydra_structured_config():
    from omegaconf import OmegaConf

    base = OmegaConf.structured(GRPOConfig)
    merged = OmegaConf.merge(base, OmegaConf.load(ROOT / "launch" / "configs" / "dapo.yaml"),
                             OmegaConf.from_dotlist(["trainer.total_frames=256"]))
    cfg = OmegaConf.to_object(merged)
    assert isinstance(cfg, GRPOConfig) and cfg.rollout.dynamic_sampling and cfg.trainer.total_frames == 256
    assert to_dict(cfg) == to_dict(load_config(ROOT / "launch" / "configs" / "dapo.yaml", ["trainer.total_frames=256"]))


def test_default_yaml_spells_out_the_defaults():
    assert to_dict(load_config(ROOT / "launch" / "configs" / "default.yaml")) == to_dict(GRPOConfig())


@pytest.mark.parametrize("path", sorted((ROOT / "accelerate_configs").glob("*.yaml")), ids=lambda p: p.name)
def test_every_accelerate_config_is_yaml_with_its_launch_command(path):
    text = path.read_text()
    assert text.startswith("# accelerate launch --config_file accelerate_configs/" + path.name)
    assert isinstance(yaml.safe_load(text), dict)


def test_overrides_are_typed_and_nested():
    cfg = load_config(None, ["trainer.total_frames=64", "optim.lr=1e-3", "loss.tis_cap=2", "optim.clip_norm=null",
                             "rewards=[{name: answer_match}]", "output_dir=/tmp/x"])
    assert cfg.trainer.total_frames == 64 and cfg.optim.lr == 1e-3 and cfg.loss.tis_cap == 2.0
    assert cfg.optim.clip_norm is None and [r.name for r in cfg.rewards] == ["answer_match"]
    assert cfg.output_dir == "/tmp/x"


@pytest.mark.parametrize(
    "override, message",
    [("rollout.group_size=1", "rollout.group_size=1: GRPO compares"),
     ("rollout.sizes=3", "rollout.sizes: unknown key; valid keys under rollout"),
     ("loss.aggregation=mean", "loss.aggregation='mean': must be one of"),
     ("trainer.mixed_precision=fp8", "trainer.mixed_precision='fp8': must be one of"),
     ("trainer.max_staleness=-1", "trainer.max_staleness=-1"),
     ("eval.k=0", "eval.k=0"),
     ("checkpoint.best_mode=up", "checkpoint.best_mode='up'"),
     ("trainer.total_frames=many", "trainer.total_frames='many': must be an integer"),
     ("trainer.progress_bar=3", "must be true or false"),
     ("rollout.temperature=0", "rollout.temperature=0.0: must be > 0"),
     ("rollout.top_p=1.5", "rollout.top_p=1.5"),
     ("rollout.colocate=true", "rollout.colocate=True: colocation shares the trainer's GPUs"),
     ("weight_sync.pause_mode=in_place", "weight_sync.pause_mode='in_place': must be one of"),
     ("rollout.request_size=0", "rollout.request_size=0"),
     ("model.num_heads=3", "model.num_heads=3: must divide model.hidden_size=64"),
     ("rewards=[]", "list at least one reward"),
     ("rewards=[{name: a}, {name: a}]", "may appear once"),
     ("rewards=[{nme: a}]", "rewards[0].nme: unknown key"),
     ("loss.kl_coef=-1", "loss.kl_coef=-1.0"),
     ("data.holdout=25", "data.holdout=25"),
     ("trainer=5", "trainer=5: must be a mapping"),
     ("novalue", "is not key=value")],
)
def test_bad_values_name_key_value_and_fix(override, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, [override])
    assert message in str(err.value)


def test_batch_layout_must_divide():
    cfg = load_config(None, ["rollout.prompts_per_batch=6"])
    with pytest.raises(ConfigError, match="rollout.prompts_per_batch=6: must be a positive multiple of the 4 processes"):
        batch_layout(cfg, 4)
    with pytest.raises(ConfigError, match=r"micro_batch_completions=128: 1 micro-batches per epoch \(64 completions / "
                                          r"128\) is not a multiple of trainer.gradient_accumulation_steps=2; .*one of "
                                          r"\[1, 2, 4, 8, 16, 32\], or auto"):
        batch_layout(load_config(None, ["trainer.gradient_accumulation_steps=2", "rollout.prompts_per_batch=8",
                                        "trainer.micro_batch_completions=128"]), 1)
    layout, micro = batch_layout(load_config(None, ["trainer.micro_batch_completions=32",
                                                    "trainer.gradient_accumulation_steps=2"]), 2)
    assert (layout.completions_per_process, layout.micro_batches(micro), layout.optimizer_steps(micro, 2)) == (64, 2, 1)
    # the last micro-batch may be short: 64 completions in micro-batches of 24 are 24, 24, 16, one step of 3
    layout, micro = batch_layout(load_config(None, ["rollout.prompts_per_batch=8", "trainer.micro_batch_completions=24",
                                                    "trainer.gradient_accumulation_steps=3"]), 1)
    assert (layout.micro_batches(micro), layout.optimizer_steps(micro, 3)) == (3, 1)
    with pytest.raises(ConfigError, match="trainer.optim_steps_per_batch=3: must be a multiple of trainer.gradient_accumulation_steps=2"):
        batch_layout(load_config(None, ["trainer.optim_steps_per_batch=3", "trainer.gradient_accumulation_steps=2"]), 1)


@pytest.mark.parametrize("processes, accumulation, micro", [(1, 1, 128), (2, 1, 64), (4, 2, 16), (8, 1, 16)])
def test_auto_micro_batches_fit_any_process_count_that_divides_the_prompts(processes, accumulation, micro):
    cfg = load_config(None, [f"trainer.gradient_accumulation_steps={accumulation}"])
    layout, micro_batch = batch_layout(cfg, processes)
    assert cfg.trainer.micro_batch_completions == "auto" and micro_batch == micro
    assert f"micro-batches of {micro}" in layout.describe(micro_batch, accumulation)
    with pytest.raises(ConfigError, match=r"gradient_accumulation_steps=3: .* use one of \[1, 2, 4, 8, 16, 32, 64\]"):
        batch_layout(load_config(None, ["trainer.gradient_accumulation_steps=3"]), 2)
    with pytest.raises(ConfigError, match="micro_batch_completions='soon': must be an integer or 'auto'"):
        load_config(None, ["trainer.micro_batch_completions=soon"])


def test_missing_and_broken_files(tmp_path):
    with pytest.raises(ConfigError, match="does not exist"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "bad.yaml"
    bad.write_text("model: [unclosed")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_renamed_keys_name_their_new_name_and_old_checkpoints_still_match():
    from grpo_accel.config.resume import resume_conflicts

    for old, new in [("rollout.prompts_per_step", "rollout.prompts_per_batch"),
                     ("weight_sync.verify_names", "weight_sync.verify_tensors"),
                     ("weight_sync.layout", "weight_sync.load_format")]:
        with pytest.raises(ConfigError, match=f"{old}: renamed {new} \\(the same setting\\); write {new} instead"):
            load_config(None, [f"{old}=2"])
    current = to_dict(load_config(None, []))
    saved = copy.deepcopy(current)
    saved["rollout"]["prompts_per_step"] = saved["rollout"].pop("prompts_per_batch")  # written by the earlier release
    assert resume_conflicts(saved, current) == []
    saved["rollout"]["prompts_per_step"] = 4
    assert resume_conflicts(saved, current) == ["rollout.prompts_per_batch: 4 -> 16"]


def test_a_named_models_checkpoint_resumes_whether_or_not_it_recorded_the_built_in_sizes():
    """Checkpoints saved before the built-in model's sizes were left out of a named model's record still hold
    them (64, 2, ...); the sizes do nothing to that model, so neither record nor resume compares them."""
    from grpo_accel.config.resume import changed_settings, resume_conflicts
    from grpo_accel.config.secrets import record

    cfg = load_config(None, ["model.name_or_path=some/model"])
    current = record(cfg)
    assert "hidden_size" not in current["model"] and current["model"]["name_or_path"] == "some/model"
    saved = to_dict(cfg)  # as the earlier release recorded it
    assert saved["model"]["hidden_size"] == 64
    assert resume_conflicts(saved, current) == [] and changed_settings(saved, current) == []
    built_in = record(load_config(None, []))  # the built-in model: its sizes are recorded and compared
    assert resume_conflicts(built_in, record(load_config(None, ["model.num_layers=3"]))) == [
        "model.num_layers: 2 -> 3"]


def test_the_layout_line_names_a_short_last_micro_batch_and_the_steps_it_shrinks(tmp_path):
    """Issue 49 item 8: 32 completions per process in micro-batches of 7 were "5 micro-batches of 7", and under
    2 processes (16 each) "14 completions per optimizer step". Run as a user runs it, and the 2-process line."""
    from grpo_accel.layout import BatchLayout
    from launching import run_in_group

    proc = run_in_group([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={tmp_path / 'run'}",
                         "rollout.prompts_per_batch=4", "trainer.micro_batch_completions=7", "trainer.total_frames=32",
                         "trainer.progress_bar=false"], cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    (line,) = [l.split(": ", 1)[1] for l in proc.stderr.splitlines() if "grpo_accel.recipe.build: batch layout" in l]
    assert line == ("batch layout: 4 prompts x 8 = 32 completions per collected batch; 32 per process in 5 "
                    "micro-batches: 4 of 7 and 1 of 4; 1 micro-batches per optimizer step = 7, 7, 7, 7 and 4 "
                    "completions in its optimizer steps over 1 processes -> 5 optimizer steps per collected batch")
    assert "16 per process in 3 micro-batches: 2 of 7 and 1 of 2; 1 micro-batches per optimizer step = 14, 14 and 4 " \
           "completions in its optimizer steps over 2 processes" in BatchLayout(4, 8, 2).describe(7, 1)
    assert "5 micro-batches per optimizer step = 32 completions per optimizer step" in BatchLayout(4, 8).describe(7, 5)


def test_settings_reach_their_components_by_name(tmp_path):
    """House 5: a component's settings are passed by name (recipe.build.by_name), so a setting is one schema line.
    Settings off their defaults in four sections arrive in the trainer, the loss, the collector and the engine."""
    from dataclasses import dataclass

    from grpo_accel.recipe.build import build_trainer, by_name, close_parts
    from trainer_utils import reset_accelerate_state

    @dataclass
    class A:
        x: int = 1
        y: int = 2

    @dataclass
    class B:
        y: int = 3
        z: int = 4

    def target(x, y, *, w=0):
        return x, y, w

    assert by_name(target, A()) == {"x": 1, "y": 2} and by_name(target, A(), B(), skip=("y",)) == {"x": 1}
    with pytest.raises(TypeError, match="y: given by two config sections"):
        by_name(target, A(), B())
    cfg = load_config(None, [f"output_dir={tmp_path}", "trainer.progress_bar=false", "trainer.log_interval=3",
                             "trainer.max_staleness=4", "loss.tis_min=0.25", "loss.kl_estimator=k2",
                             "rollout.max_extra_rounds=7", "rollout.top_k=5", "optim.clip_norm=0.5"])
    trainer = build_trainer(cfg)
    try:
        assert (trainer.reporter.settings.log_interval, trainer.max_staleness) == (3, 4)
        assert trainer.stepper.clip_norm == 0.5
        assert (trainer.unwrapped_loss.tis_min, trainer.unwrapped_loss.kl_estimator) == (0.25, "k2")
        assert (trainer.collector.max_extra_rounds, trainer.collector.engine.settings.top_k) == (7, 5)
    finally:
        close_parts(trainer)
        reset_accelerate_state()
