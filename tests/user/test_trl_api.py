"""A TRL GRPO script runs by changing its import (issue 74 item 14): ``grpo_accel.trl``'s GRPOConfig and GRPOTrainer
take TRL's arguments, read them as a TRL config file is read, train as the command does, resume and save the model
where TRL does; what cannot be taken is one line."""
import json
import subprocess
import sys

import pytest

from grpo_accel.config.checks import ConfigError

SCRIPT = '''from datasets import load_dataset
from trl import GRPOConfig, GRPOTrainer

dataset = load_dataset("json", data_files="prompts.jsonl", split="train")  # this machine: no Hub


def reward_len(completions, **kwargs):
    """Completions of 3 characters score best."""
    return [-abs(3 - len(completion)) for completion in completions]


training_args = GRPOConfig(output_dir="grpo-run", max_steps=STEPS, per_device_train_batch_size=8,
                           num_generations=4, max_completion_length=4, logging_steps=1, save_steps=1,
                           report_to="none", learning_rate=3e-4)
trainer = GRPOTrainer(model="MODEL", reward_funcs=reward_len, args=training_args, train_dataset=dataset)
trainer.train(RESUME)
trainer.save_model()
'''


def test_a_trl_script_runs_by_changing_its_import_resumes_and_saves_its_model(tmp_path, model_dir):
    """TRL's documented shape (GRPOConfig, GRPOTrainer(model=..., reward_funcs=..., args=..., train_dataset=...),
    train(), save_model()) with this machine's edits (a local model and data file, two steps); the one edit that
    makes it grpo_accel's is the import line."""
    (tmp_path / "prompts.jsonl").write_text("".join(json.dumps({"prompt": f"{a}+{b}="}) + "\n"
                                                    for a in range(4) for b in range(4)))
    run = tmp_path / "grpo-run"

    def script(steps: int, resume: str) -> subprocess.CompletedProcess:
        text = SCRIPT.replace("STEPS", str(steps)).replace("MODEL", str(model_dir)).replace("RESUME", resume)
        assert text.count("from trl import") == 1
        (tmp_path / "train_grpo.py").write_text(text.replace("from trl import", "from grpo_accel.trl import"))
        return subprocess.run([sys.executable, "train_grpo.py"], cwd=tmp_path, capture_output=True, text=True,
                              timeout=300)

    proc = script(2, "")
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "GRPOConfig holds TRL's settings; read as" in proc.stderr
    assert "max_steps=2 optimizer steps (1 per generation of 8 completions) -> trainer.total_frames=16" in proc.stderr
    assert [p.name for p in sorted((run / "checkpoints").iterdir())] == ["step_00000001", "step_00000002"]
    assert json.loads((run / "summary.json").read_text())["final_iteration"] == 2
    assert {"config.json", "model.safetensors", "tokenizer_config.json"} <= {p.name for p in run.iterdir()}
    assert (run / "train_dataset.jsonl").read_text() == (tmp_path / "prompts.jsonl").read_text()
    proc = script(3, "resume_from_checkpoint=True")  # TRL's way to go on
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads((run / "summary.json").read_text())["final_iteration"] == 3
    from transformers import AutoModelForCausalLM

    assert AutoModelForCausalLM.from_pretrained(run).num_parameters() > 0


def test_what_the_trl_api_cannot_take_is_one_line(model_dir):
    import grpo_accel
    from grpo_accel.trl import GRPOConfig, GRPOTrainer

    with pytest.raises(TypeError, match=r"GRPOConfig: learnin_rate \(did you mean learning_rate\?\): not TRL's"):
        GRPOConfig(learnin_rate=1e-6)
    assert GRPOConfig(num_generations=4).num_generations == 4 and GRPOConfig().learning_rate == 1e-6  # TRL's
    with pytest.raises(TypeError, match=r"reward_funcs: <function .*<lambda> at 0x\w+> has no import path"):
        GRPOTrainer(model=str(model_dir), reward_funcs=lambda completions, **kw: [0.0] * len(completions))
    with pytest.raises(TypeError, match=r"model=Linear: give its folder or Hub id"):
        import torch

        GRPOTrainer(model=torch.nn.Linear(2, 2), reward_funcs="accuracy_reward")
    with pytest.raises(TypeError, match=r"callbacks is not taken here: register a function with trainer.register_op"):
        GRPOTrainer(model=str(model_dir), reward_funcs="accuracy_reward", callbacks=[object()])
    with pytest.raises(ConfigError, match="reward_funcs: 'nope' is neither one of TRL's"):
        GRPOTrainer(model=str(model_dir), reward_funcs="nope", args=GRPOConfig(max_steps=1))
    assert {"GRPOTrainer", "GRPOConfig", "load_config", "build_trainer", "__version__"} <= set(dir(grpo_accel))
    assert grpo_accel.load_config is __import__("grpo_accel.config.loading").config.loading.load_config
