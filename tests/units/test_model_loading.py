"""A named model as a GPU user meets it (issue 56): defaults that follow the hardware (TRL's bf16 and gradient
checkpointing on a CUDA device, float32 and off on a CPU), tested with the device decision injected; and the
loading settings people set (attn_implementation, trust_remote_code, revision, dtype auto) reaching
``from_pretrained``, each bad value one line naming its key."""
import json
import logging
import shutil

import pytest
import torch
import yaml

from grpo_accel.config import defaults
from grpo_accel.config.checks import ConfigError
from grpo_accel.config.defaults import Hardware
from grpo_accel.config.loading import load_config
from launching import TINY_FOLDER
from trainer_utils import train_in_process

H100, T4, CPU = Hardware(cuda=True, bf16=True), Hardware(cuda=True, bf16=False), Hardware(cuda=False, bf16=False)


def on(monkeypatch, hardware: Hardware) -> None:
    """The device decision, injected: what :func:`defaults.detect_hardware` would say on that machine."""
    monkeypatch.setattr(defaults, "detect_hardware", lambda: hardware)


@pytest.mark.parametrize("hardware, named, precision, checkpointing", [
    (H100, True, "bf16", True), (T4, True, "fp16", True), (CPU, True, "no", False),
    (H100, False, "no", False), (CPU, False, "no", False),  # the built-in toy keeps float32 everywhere
])
def test_unset_precision_and_checkpointing_follow_the_hardware(monkeypatch, hardware, named, precision, checkpointing):
    on(monkeypatch, hardware)
    cfg = load_config(None, ["model.name_or_path=Org/some-model"] if named else [])
    assert (cfg.trainer.mixed_precision, cfg.model.gradient_checkpointing) == (precision, checkpointing)
    assert cfg.followed_defaults.values["trainer.mixed_precision"] == precision
    kept = load_config(None, ["model.name_or_path=Org/some-model", "trainer.mixed_precision='no'",
                              "model.gradient_checkpointing=false"])
    assert (kept.trainer.mixed_precision, kept.model.gradient_checkpointing) == ("no", False)  # a set value wins
    assert "trainer.mixed_precision" not in kept.followed_defaults.values


def test_a_named_model_on_a_cuda_device_trains_in_bf16_with_checkpointing_and_says_why(monkeypatch, tmp_path,
                                                                                       model_dir, caplog):
    """The CUDA column run for real on this CPU (bf16 autocast and checkpointing both run on a CPU): config.yaml
    records the resolved values, one start line names each setting that followed and why."""
    on(monkeypatch, H100)
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        assert train_in_process([f"output_dir={out}", f"model.name_or_path={model_dir}", *TINY_FOLDER,
                                 "trainer.total_frames=256", "trainer.progress_bar=false"]) == 0
    saved = yaml.safe_load((out / "config.yaml").read_text())
    assert saved["trainer"]["mixed_precision"] == "bf16" and saved["model"]["gradient_checkpointing"] is True
    line = next(r.getMessage() for r in caplog.records if r.getMessage().startswith("unset settings that follow"))
    assert line == ("unset settings that follow the model (a model named by model.name_or_path on a CUDA device: "
                    "TRL's defaults): rollout.max_prompt_tokens=512, trainer.mixed_precision=bf16, "
                    "model.gradient_checkpointing=true; set any of them to choose otherwise")
    summary = json.loads((out / "summary.json").read_text())
    assert summary["iterations"] == 2


# ------------------------------------------------------------------------------------------ loading settings

def test_the_loading_settings_reach_from_pretrained(monkeypatch, model_dir):
    from transformers import AutoModelForCausalLM

    from grpo_accel.recipe.parts import build_tokenizer_and_model

    seen = []
    real = AutoModelForCausalLM.from_pretrained.__func__

    def spy(cls, name, **kwargs):
        seen.append(kwargs)
        return real(cls, name, **kwargs)

    monkeypatch.setattr(AutoModelForCausalLM, "from_pretrained", classmethod(spy))
    cfg = load_config(None, [f"model.name_or_path={model_dir}", "model.attn_implementation=eager",
                             "model.trust_remote_code=true", "model.revision=main", "model.dtype=bfloat16"]).model
    _, model = build_tokenizer_and_model(cfg)
    assert seen == [{"dtype": torch.bfloat16, "trust_remote_code": True, "revision": "main",
                     "attn_implementation": "eager"}]
    assert model.config._attn_implementation == "eager" and model.dtype == torch.bfloat16


@pytest.mark.parametrize("saved_as, loads_as", [(torch.bfloat16, torch.bfloat16), (torch.float16, torch.float32),
                                                (torch.float32, torch.float32)])
def test_dtype_auto_is_the_checkpoints_own_unless_it_cannot_train(tmp_path, tiny_model, tokenizer, saved_as, loads_as):
    from grpo_accel.recipe.parts import build_tokenizer_and_model

    tiny_model.to(saved_as).save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    _, model = build_tokenizer_and_model(load_config(None, [f"model.name_or_path={tmp_path}", "model.dtype=auto"]).model)
    assert {p.dtype for p in model.parameters()} == {loads_as}


@pytest.mark.parametrize("setting, message", [
    ("model.attn_implementation=flash", "model.attn_implementation='flash': use one of ['sdpa', 'eager', "),
    ("model.dtype=float16", "model.dtype='float16': must be one of ['float32', 'bfloat16', 'auto']"),
    ("trainer.mixed_precision=fp8", "trainer.mixed_precision='fp8': must be one of ['no', 'bf16', 'fp16']"),
])
def test_a_bad_loading_setting_is_one_line_naming_it(setting, message):
    with pytest.raises(ConfigError) as err:
        load_config(None, ["model.name_or_path=Org/some-model", setting])
    assert str(err.value).startswith(message)


def test_an_attention_kernel_that_is_not_installed_is_one_line(model_dir):
    """flash-attn needs its package and a GPU: on this machine transformers refuses it; the run says which key."""
    from grpo_accel.recipe.parts import build_tokenizer_and_model

    cfg = load_config(None, [f"model.name_or_path={model_dir}", "model.attn_implementation=flash_attention_2"]).model
    with pytest.raises(ConfigError) as err:
        build_tokenizer_and_model(cfg)
    assert str(err.value).startswith("model.attn_implementation='flash_attention_2': model.name_or_path=")
    assert "install what it needs, or use sdpa" in str(err.value)


@pytest.fixture
def remote_code_model(tmp_path, tiny_model, tokenizer):
    """A model folder that ships its own modelling code (auto_map): a Llama subclass of model type mine_llama."""
    folder = tmp_path / "mine"
    tiny_model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    config = json.loads((folder / "config.json").read_text())
    config.update(model_type="mine_llama", architectures=["MineForCausalLM"],
                  auto_map={"AutoConfig": "configuration_mine.MineConfig",
                            "AutoModelForCausalLM": "modeling_mine.MineForCausalLM"})
    (folder / "config.json").write_text(json.dumps(config))
    (folder / "configuration_mine.py").write_text(
        "from transformers import LlamaConfig\n\n\nclass MineConfig(LlamaConfig):\n    model_type = 'mine_llama'\n")
    (folder / "modeling_mine.py").write_text(
        "from transformers import LlamaForCausalLM\n\nfrom .configuration_mine import MineConfig\n\n\n"
        "class MineForCausalLM(LlamaForCausalLM):\n    config_class = MineConfig\n")
    return folder


def test_a_model_with_its_own_code_runs_only_when_trusted(tmp_path, remote_code_model):
    run = [f"model.name_or_path={remote_code_model}", *TINY_FOLDER, "trainer.total_frames=128",
           "trainer.progress_bar=false"]
    with pytest.raises(ConfigError) as err:
        train_in_process([f"output_dir={tmp_path / 'untrusted'}", *run])
    assert str(err.value).startswith("model.trust_remote_code=False: model.name_or_path=")
    assert "set model.trust_remote_code=true if you trust it" in str(err.value)
    assert train_in_process([f"output_dir={tmp_path / 'trusted'}", *run, "model.trust_remote_code=true"]) == 0
    shutil.rmtree(tmp_path / "trusted")
