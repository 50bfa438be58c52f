"""push_to_hub (issue 63 item 2): after each checkpoint the exported model goes to a Hub repository in the
background, over real HTTP to a stand-in that answers huggingface_hub's upload calls (tests/helpers/hub_standin.py);
an upload that fails is one line, and the run goes on with its checkpoints."""
import logging

import pytest
import torch
import yaml
from safetensors.torch import load

from hub_standin import USER, HubStandIn
from trainer_utils import train_in_process

TOKEN = "hf_standin_write_token"
RUN = ["trainer.total_frames=256", "checkpoint.interval_frames=128", "trainer.progress_bar=false",
       "hub.push=true", "hub.token=${HUB_TEST_TOKEN}"]


@pytest.fixture
def hub(monkeypatch):
    monkeypatch.setenv("HUB_TEST_TOKEN", TOKEN)
    import huggingface_hub.constants

    # HF_HUB_DISABLE_XET=1, as read at import: the stand-in speaks LFS, not Xet's storage
    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_DISABLE_XET", True)
    with HubStandIn(TOKEN) as server:
        yield server


def test_every_checkpoint_is_pushed_as_a_model_and_the_newest_checkpoint_beside_it(tmp_path, hub, caplog):
    from grpo_accel.run.export import export_checkpoint

    out = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        assert train_in_process([f"output_dir={out}", *RUN, f"hub.endpoint={hub.url}", "hub.model_id=grpo-tiny",
                                 "hub.strategy=checkpoint", "hub.always_push=true", "hub.private=true"]) == 0
    repo = hub.repos[f"{USER}/grpo-tiny"]  # a name alone: under the token's user, as the Hub does
    assert repo["private"] and len(repo["commits"]) == 4  # 2 checkpoints x (the model, last-checkpoint/)
    assert repo["commits"][-1] == "grpo_accel: step_00000002"
    files = repo["files"]
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= set(files)
    assert any(name.startswith("last-checkpoint/") for name in files)
    export_checkpoint(sorted((out / "checkpoints").glob("step_*"))[-1], tmp_path / "exported")
    pushed, local = load(files["model.safetensors"]), load((tmp_path / "exported" / "model.safetensors").read_bytes())
    assert pushed.keys() == local.keys() and all(torch.equal(pushed[k], local[k]) for k in local)  # the final model
    assert TOKEN not in (out / "config.yaml").read_text()  # a secret: the run records its reference
    assert yaml.safe_load((out / "config.yaml").read_text())["hub"]["token"] == "${HUB_TEST_TOKEN}"
    assert not list(out.glob("hub-*")), "the snapshots are removed after their push"
    assert sum("pushed to trainer-user/grpo-tiny" in r.getMessage() for r in caplog.records) == 2


def test_an_upload_that_fails_is_one_line_and_the_run_goes_on(tmp_path, hub, caplog):
    out = tmp_path / "run"
    with caplog.at_level(logging.INFO):
        assert train_in_process([f"output_dir={out}", *RUN, f"hub.endpoint={hub.url}",
                                 "hub.model_id=team/grpo-unwritable", "hub.strategy=end"]) == 0
    failed = [r.getMessage() for r in caplog.records if "hub: pushing" in r.getMessage()]
    assert len(failed) == 1 and "\n" not in failed[0]  # strategy end: one push, after training
    assert failed[0].startswith("hub: pushing step_00000002 to team/grpo-unwritable failed (HfHubHTTPError: ")
    assert failed[0].endswith(f"training goes on, the checkpoint is kept in {out / 'checkpoints'}")
    assert hub.repos["team/grpo-unwritable"]["commits"] == []
    assert sorted(p.name for p in (out / "checkpoints").glob("step_*")) == ["step_00000001", "step_00000002"]


def test_trls_hub_keys_become_the_hub_settings(tmp_path):
    from grpo_accel.config.trl.translate import translate

    got, lines = translate({"reward_funcs": ["accuracy_reward"], "max_steps": 2, "push_to_hub": True,
                            "hub_model_id": "me/model", "hub_strategy": "every_save", "hub_private_repo": True,
                            "hub_token": "hf_secret_value"}, 1, rows=lambda _: 0)
    assert (got["hub.push"], got["hub.model_id"], got["hub.strategy"], got["hub.private"]) == (
        True, "me/model", "every_save", True)
    assert not any("hf_secret_value" in line for line in lines)  # the token is a secret in the start-up lines too


def test_a_repository_named_without_push_is_said(tmp_path, caplog):
    """Issue 74 item 10: hub.model_id without hub.push uploads nothing; a line says so instead of silence."""
    with caplog.at_level(logging.WARNING):
        assert train_in_process([f"output_dir={tmp_path / 'run'}", "trainer.total_frames=128",
                                 "trainer.progress_bar=false", "hub.model_id=team/forgotten"]) == 0
    assert "hub.model_id=team/forgotten has no effect: hub.push is false (set hub.push=true to upload there)" \
        in caplog.text
