"""API keys never reach what a run writes (issue 60): the run folder (config.yaml, checkpoints' metadata, the lock),
TensorBoard's event files and the W&B and MLflow stores hold "***" or the ``${NAME}`` a key was read from; a key
can come from the environment; a resume neither needs the key written anywhere nor refuses a changed one."""
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest
import yaml

from grpo_accel.config.checks import ConfigError
from grpo_accel.config.loading import load_config
from grpo_accel.config.secrets import is_secret, record, redact, redact_text
from launching import ROOT, free_port, launch, reward_server as serve_reward

KEYS = {"rollout.api_key": "SECRET123", "weight_sync.admin_api_key": "ADMIN456", "reward": "RKEY789"}


def test_which_settings_hold_secrets():
    assert all(is_secret(p) for p in ("rollout.api_key", "weight_sync.admin_api_key", "rewards[2].api_key",
                                      "trainer.tracker_kwargs.wandb.api_key", "rewards[0].kwargs.hf_token",
                                      "trainer.tracker_kwargs.mlflow.password"))
    assert not any(is_secret(p) for p in ("rollout.urls[0]", "rewards[0].url", "rewards[0].kwargs.max_tokens",
                                          "trainer.tracker_kwargs.wandb.entity", "trainer.run_name"))


def test_a_secret_written_as_a_reference_is_read_from_the_environment_and_recorded_as_written(monkeypatch):
    monkeypatch.setenv("SGLANG_KEY", "SECRET123")
    cfg = load_config(None, ["rollout.api_key=${SGLANG_KEY}", "weight_sync.admin_api_key=ADMIN456",
                             "rewards=[{name: remote, url: 'http://h:1/score', api_key: '${SGLANG_KEY}'}]",
                             "trainer.report_to=[tensorboard, wandb]",
                             "trainer.tracker_kwargs={wandb: {entity: team, api_key: WKEY}}"])
    assert cfg.rollout.api_key == cfg.rewards[0].api_key == "SECRET123"  # what the run uses
    written = record(cfg)
    assert written["rollout"]["api_key"] == written["rewards"][0]["api_key"] == "${SGLANG_KEY}"
    assert written["weight_sync"]["admin_api_key"] == "***"
    assert written["trainer"]["tracker_kwargs"] == {"wandb": {"entity": "team", "api_key": "***"}}
    assert redact({"rollout": {"api_key": "old-literal"}}) == {"rollout": {"api_key": "***"}}  # an older checkpoint's
    monkeypatch.delenv("SGLANG_KEY")
    with pytest.raises(ConfigError, match=r"^rollout.api_key=\$\{SGLANG_KEY\}: the environment has no variable "
                                          r"SGLANG_KEY; export SGLANG_KEY=\.\.\."):
        load_config(None, ["rollout.api_key=${SGLANG_KEY}"])
    # a text setting's value is the text given on the command line (YAML would read these digits as a number)
    assert load_config(None, ["rollout.api_key=123456"]).rollout.api_key == "123456"


def test_a_command_line_keeps_no_key():
    line = ("train.py rollout.api_key=SECRET123 weight_sync.admin_api_key='ADMIN456' rollout.urls=[http://h:1] "
            "rewards=[{name: remote, url: 'http://h:2/score', api_key: RKEY789}] --api-key=K9 "
            "rollout.api_key=${SGLANG_KEY}")
    assert redact_text(line) == (
        "train.py rollout.api_key=*** weight_sync.admin_api_key=*** rollout.urls=[http://h:1] "
        "rewards=[{name: remote, url: 'http://h:2/score', api_key: ***}] --api-key=*** rollout.api_key=${SGLANG_KEY}")


@pytest.fixture
def keyed_reward_server():
    """A reward service (grpo-accel reward-server) that answers only requests carrying its key."""
    with serve_reward("--api-key", KEYS["reward"]) as (url, _):
        yield url + "/score"


def holding(root, secret: str) -> list[str]:
    """Every file under ``root`` whose bytes hold ``secret``."""
    return [str(p) for p in root.rglob("*") if p.is_file() and secret.encode() in p.read_bytes()]


def test_a_run_with_three_keys_writes_none_of_them_and_resumes_with_them_from_the_environment(tmp_path,
                                                                                              keyed_reward_server):
    from tracker_stores import tracker_env

    out = tmp_path / "run"
    common = [f"output_dir={out}", "trainer.report_to=[tensorboard, wandb, mlflow]", "trainer.progress_bar=false",
              "rollout.prompts_per_batch=4", "rollout.group_size=4", "checkpoint.interval_frames=16"]
    env = tracker_env(tmp_path)
    literal = [f"rollout.api_key={KEYS['rollout.api_key']}", f"weight_sync.admin_api_key={KEYS['weight_sync.admin_api_key']}",
               f"rewards=[{{name: remote, url: '{keyed_reward_server}', api_key: {KEYS['reward']}}}]"]
    launch("single_process.yaml", [*common, *literal, "trainer.total_frames=32"], env=env, cwd=tmp_path)
    from_env = ["rollout.api_key=${SGLANG_KEY}", "weight_sync.admin_api_key=${SGLANG_ADMIN_KEY}",
                f"rewards=[{{name: remote, url: '{keyed_reward_server}', api_key: '${{REWARD_KEY}}'}}]"]
    keys = {"SGLANG_KEY": "SECRET999", "SGLANG_ADMIN_KEY": KEYS["weight_sync.admin_api_key"],  # a changed key: taken
            "REWARD_KEY": KEYS["reward"]}
    resumed = launch("single_process.yaml", [*common, *from_env, "trainer.total_frames=48", "checkpoint.resume=auto"],
                     env={**env, **keys}, cwd=tmp_path)
    assert "resumed from" in resumed.stderr
    written = yaml.safe_load((out / "config.yaml").read_text())
    assert written["rollout"]["api_key"] == "${SGLANG_KEY}" and written["rewards"][0]["api_key"] == "${REWARD_KEY}"
    assert (out / "wandb").is_dir() and (tmp_path / "mlflow.db").is_file() and (out / "tensorboard").is_dir()
    scores = [line for line in resumed.stderr.splitlines() if "reward" in line and "->" in line]
    assert scores, resumed.stderr[-2000:]  # the service scored every batch: the key reached it
    for secret in [*KEYS.values(), "SECRET999"]:
        assert holding(tmp_path, secret) == [], secret  # run folder, event files, W&B and MLflow stores
        assert secret not in resumed.stdout + resumed.stderr


def test_the_reward_server_refuses_a_wrong_key_and_says_when_it_serves_beyond_this_machine_without_one(
        keyed_reward_server):
    import json

    body = json.dumps({"prompts": ["1+2="], "completions": ["3"], "fields": {"answer": ["3"]}}).encode()
    for key, status in ((KEYS["reward"] + "x", 401), (KEYS["reward"][:-1], 401), (KEYS["reward"], 200)):
        request = urllib.request.Request(keyed_reward_server, body, {"Authorization": f"Bearer {key}"})
        try:
            assert urllib.request.urlopen(request, timeout=10).status == status
        except urllib.error.HTTPError as err:
            assert err.code == status
    port = free_port()
    proc = subprocess.Popen([sys.executable, str(ROOT / "launch" / "reward_server.py"), "--reward", "answer_match",
                             "--host", "0.0.0.0", "--port", str(port)], stderr=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 60
    try:
        while proc.poll() is None and time.monotonic() < deadline:
            try:
                urllib.request.urlopen(f"http://127.0.0.1:{port}/health", timeout=2).read()
                break
            except OSError:
                time.sleep(0.2)
    finally:
        proc.kill()
        _, err = proc.communicate(timeout=30)
    assert ("--host 0.0.0.0 serves beyond this machine without --api-key: anyone who reaches port "
            f"{port} can ask for scores; start it with --api-key KEY (the trainer's rewards[].api_key)") in err, err
