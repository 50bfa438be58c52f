"""Every shell command in README.md and the docs' pages runs as written here, or is named below with the reason it
cannot; the README's reward module trains as shown; the README's picture is ``grpo-accel report``'s.

Commands that train get a temporary ``output_dir``, ``trainer.total_frames=256`` and no progress bar appended;
nothing else is changed, so the README cannot drift from what works. The training commands of the configs in
``launching.README_RUNS_ELSEWHERE`` run as written in the modules it names.
"""
import json
import re

import pytest

from launching import README_RUNS_ELSEWHERE, readme_commands, run_as_written

ELSEWHERE = {  # how a command starts -> why it does not run in this suite, and what covers it instead
    "bash launch/setup.sh && .venv/bin/python -m pytest": "the test suite itself (what .ci/run runs)",
    "rm -rf /tmp/ci && git clone": "the test suite from a fresh clone: what CI runs",
    "MAIN_ADDR=": "needs a second machine; tests/launched/test_distributed.py runs launch/multinode.sh on this one",
    "sbatch ": "needs SLURM; tests/launched/test_distributed.py runs launch/slurm.sbatch with sbatch-less shims",
    "MODEL=": "needs GPUs for SGLang servers; tests/on_sglang/test_sglang_runs.py runs launch/sglang.sh with DRY_RUN",
    ".venv/bin/accelerate launch --config_file accelerate_configs/zero3.yaml launch/train.py model.name_or_path=M":
        "needs SGLang servers on other machines; tests/on_sglang/test_sglang_runs.py runs the same path against stand-ins",
    "VLLM_SERVER_DEV_MODE=1 VLLM_CPU_KVCACHE_SPACE=2 .venv-vllm/bin/python -m vllm":
        "the vLLM measurement's server (SmolLM2, minutes to start and run); tests/on_vllm/ starts the same server "
        "command on the tests' tiny model",
    "VLLM_SERVER_DEV_MODE=1 vllm serve": "a vLLM server for a GPU; tests/on_vllm/ starts the same server (its CPU "
        "build, tests/helpers/vllm_server.py) and trains against it",
    ".venv/bin/accelerate launch --config_file accelerate_configs/zero3.yaml launch/train.py model.name_or_path=MODEL":
        "needs a vLLM server; tests/on_vllm/test_vllm.py runs the same path under zero3.yaml against a real local one",
    "python launch/bench/sglang_standin": "a measurement recipe with placeholders (M, B, L); tests/on_sglang/test_sglang_runs.py runs it",
    "accelerate launch --config_file accelerate_configs/zero3.yaml launch/train.py model.name_or_path=M":
        "the second half of that measurement recipe",
    ".venv/bin/python launch/bench/bench.py": "minutes at 10m parameters; tests/launched/test_bench.py runs the benchmark small",
    ".venv/bin/accelerate launch --config_file accelerate_configs/zero3.yaml launch/bench/bench.py":
        "minutes under ZeRO-3; tests/launched/test_bench.py runs the benchmark under zero3.yaml small",
    "GRPO_ACCEL_THREADS=1 .venv/bin/python launch/bench/bench.py": "2 variants x 3 rounds x 60 steps; tests/launched/test_bench.py "
        "runs --loop small, the launcher row included",
    "PYTHONPATH=. .venv/bin/python launch/bench/trl_parity.py": "needs TRL in an environment of its own (not a "
        "dependency); its grpo_accel half is the README's training command (run here) and bench --loop (run small "
        "in tests/launched/test_bench.py, which also reads step times from event files as it does)",
    "PYTHONPATH=. .venv/bin/python launch/bench/overlap.py": "4 runs of the README's command against stand-ins (minutes "
        "at 135M); tests/launched/test_bench.py runs it small and checks its arithmetic on event files of known times",
    "bash launch/bench/gpu_check.sh": "needs a GPU; tests/launched/test_bench.py checks that it refuses without one",
    "PYTHONPATH=. .venv/bin/python launch/bench/memory.py": "5 launches of 4 processes at 135M (about 12 minutes); "
        "tests/launched/test_bench.py runs it small, tests/launched/test_zero3_load.py holds ZeRO-3 to its goal",
    "PYTHONPATH=. .venv/bin/python launch/bench/convert.py": "a training run and a resume of 4 and of 2 processes at "
        "135M (about 4 minutes); tests/launched/test_bench.py runs it small",
    ".venv/bin/python -m pytest -q tests/": "a test of the suite, which runs it",
    ".venv/bin/grpo-accel models smollm2-135m": "downloads 93 MB; tests/conftest.py's smollm2 fixture "
        "runs the same conversion once per machine",
    ".venv/bin/accelerate launch --config_file accelerate_configs/single_process.yaml launch/train.py "
    "model.name_or_path=Qwen/": "a hub model and a file of the user's; tests/user/test_user_path.py trains SmolLM2 on a "
        "file given this way, and test_the_readmes_reward_module_trains_as_shown below the README's reward module",
    "grpo-accel ": "the installed command: tests/user/test_cli.py builds the wheel, installs it in a fresh venv and runs "
        "train (one process, ZeRO-2 by name), export, configs and report from an empty folder",
    ".venv/bin/accelerate launch --config_file accelerate_configs/single_process.yaml launch/train.py --config "
    "launch/configs/gsm8k.yaml": "needs the hub (Qwen2.5-0.5B-Instruct, openai/gsm8k) and a GPU; "
        "tests/user/test_user_path.py runs the file on SmolLM2 and GSM8K-layout rows at a tiny scale",
    ".venv/bin/accelerate launch --config_file accelerate_configs/single_process.yaml launch/train.py --config "
    "launch/configs/smollm2_arithmetic.yaml": "4 minutes and a model conversion; tests/launched/test_launch.py runs the recipe's path on the real "
        "model at a tiny scale",
    ".venv/bin/accelerate launch --config_file accelerate_configs/single_process.yaml launch/train.py --config "
    "launch/configs/smollm2_calculator.yaml": "about 10 minutes; tests/launched/test_episode_runs.py runs the recipe's path on the "
        "real model at a tiny scale",
}
TRAINS = re.compile(r"accelerate launch --config_file accelerate_configs/\w+\.yaml launch/train\.py( [\w.]+=\S+)*$")
"""A training command, bare or with key=value settings: this module runs it small."""


def runnable() -> list[str]:
    return [c for c in readme_commands() if not c.startswith(tuple(ELSEWHERE))]


def run_here() -> list[str]:
    """The runnable commands no other module runs as written (launch_as_in_readme), nor
    another command here as its last part (``bash launch/setup.sh && X`` runs X)."""
    elsewhere = [f"--config_file accelerate_configs/{c} launch/train.py" for c in README_RUNS_ELSEWHERE]
    here = [c for c in runnable() if not (c.startswith(".venv/bin/accelerate") and c.endswith(tuple(elsewhere)))]
    return [c for c in here if not any(other.endswith(f" && {c}") for other in here)]


def test_every_readme_command_runs_here_or_is_accounted_for():
    commands = readme_commands()
    assert len(commands) >= 15
    unaccounted = [c for c in runnable() if not TRAINS.search(c)]
    assert not unaccounted, f"README commands neither run by this test nor named in ELSEWHERE: {unaccounted}"
    unused = [start for start in ELSEWHERE if not any(c.startswith(start) for c in commands)]
    assert not unused, f"ELSEWHERE names commands the README no longer has: {unused}"


@pytest.mark.parametrize("command", run_here())
def test_readme_training_command_runs_as_written(command, tmp_path):
    out = tmp_path / "run"
    run_as_written(command, [f"output_dir={out}", "trainer.total_frames=256", "trainer.progress_bar=false"], timeout=600)
    summary = json.loads((out / "summary.json").read_text())
    from grpo_accel.runtime.resources import available_cores

    # the cores split over the processes, not accelerate launch's OMP_NUM_THREADS=1 (one core for one process)
    assert summary["torch_threads"] == max(1, available_cores() // summary["num_processes"]), summary


def test_the_readmes_reward_module_trains_as_shown(tmp_path, model_dir):
    """The README's reward module, written as shown into the folder a run starts from, and its command with the
    built-in model's folder for the hub model (and a short run): it imports, scores and trains."""
    from launching import ROOT, run_in_group

    readme = (ROOT / "README.md").read_text()
    module = re.search(r"```python\n(# my_reward\.py.*?)```", readme, re.S).group(1)
    (tmp_path / "my_reward.py").write_text(module)
    command = next(c for c in readme_commands() if "my_reward:" in c)
    rows = [{"prompt": f"{a}+{b}=", "answer": str(a + b)} for a in range(5) for b in range(5)]
    (tmp_path / "rows.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    args = command.split(" launch/train.py ", 1)[1].replace("Qwen/Qwen2.5-0.5B-Instruct", str(model_dir))
    proc = run_in_group(["bash", "-c", f"{ROOT}/.venv/bin/python {ROOT}/launch/train.py {args} output_dir=run "
                         "trainer.total_frames=256 trainer.progress_bar=false rollout.max_new_tokens=4 optim.lr=3e-4"],
                        cwd=tmp_path, timeout=300)
    assert proc.returncode == 0, proc.stderr[-4000:]
    from grpo_accel.reporting.event_files import read_scalars

    rewards = read_scalars(tmp_path / "run" / "tensorboard")["train/reward/right_and_brief_mean"]
    assert len(rewards) == 2 and all(-1 <= v <= 1 for _, v in rewards)


def test_the_readmes_picture_is_the_reports():
    """The figure the README shows is a PNG that ``grpo-accel report`` wrote (matplotlib's signature in it);
    test_cli.py checks what report draws."""
    from launching import ROOT

    picture = re.search(r"!\[[^]]*\]\((docs/pages/assets/[^)]+\.png)\)", (ROOT / "README.md").read_text()).group(1)
    data = (ROOT / picture).read_bytes()
    assert data.startswith(b"\x89PNG") and b"Matplotlib" in data
