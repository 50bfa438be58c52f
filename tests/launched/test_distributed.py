"""ZeRO 0-3 and DDP for real: 2-process ``accelerate launch`` runs on CPU (gloo) against a 1-process run.

Tolerance: keyed sampling makes every process count draw exactly the same completions, so rewards match exactly
while the weights agree to float32 rounding; losses then differ only by the order of float32 summation (all-reduce,
ZeRO buckets): over 10 steps we measured max 1.7e-8 absolute (5e-6 relative) on the loss and 6e-6 relative on the
entropy, identical on every stage. We allow rtol 1e-4 / atol 1e-6, far below any real divergence (a wrong
normaliser is off by a factor of 2)."""
import json
import os
import re
import shlex
import sys

import pytest
import torch

from grpo_accel.distributed.deepspeed_files import DistributedConfigError, read_deepspeed_file, validate_deepspeed_config
from launching import ROOT, TINY_FOLDER, free_port, launch, launch_training, run_in_group
from trainer_utils import train_in_process

BASE = ["trainer.total_frames=512", "trainer.progress_bar=false"]  # 4 batches of 16 prompts x 8
TAGS = ("train/loss", "train/reward_mean", "train/clip_fraction", "train/entropy")
saved = lambda folder: (f"model.name_or_path={folder}", *TINY_FOLDER)  # noqa: E731 - every stage from one
# saved folder (conftest's model_dir, the built-in tiny Llama): ZeRO-3 loads it partitioned (zero.Init), others whole


READY = "process group ready: rank {} of 2"


def run(config, tmp_path, name, *extra):
    """A training run: one process in this process (launch/train.py's main); two processes launched, under the
    configs the README names through the README's own command line. Each launch gets a build folder of its own
    holding the lock a killed DeepSpeed op build leaves: under DeepSpeed it must be removed (it used to hang
    every later launch, with no output), and nothing compiled there (DeepSpeed's shm op took 20-70 s)."""
    out = tmp_path / name
    args = [f"output_dir={out}", *BASE, *extra]
    if config == "single_process.yaml":
        train_in_process(args)
        return out
    build_root, lock = killed_build(tmp_path / f"{name}_torch_extensions")
    env = {"TORCH_EXTENSIONS_DIR": str(build_root)}
    proc = launch_training(config, args, env=env)
    assert READY.format(0) in proc.stderr and READY.format(1) in proc.stderr
    if config.startswith("zero"):  # DeepSpeed
        assert f"removed a stale build lock {lock}" in proc.stderr and not lock.exists()
        assert [p for p in build_root.rglob("*") if p.is_file()] == [] and "built successfully" not in proc.stdout
    if "loss.packing=true" in extra:  # checked once per process for each module whose logprobs are packed
        checked = re.findall(r"padding-free packing checked for (\w+)", proc.stderr)
        assert checked and all(checked.count(module) == 2 for module in checked), checked
    else:  # shared prompts (the default): a group's prompt of ~6 tokens runs once for its 8 completions
        checked = re.findall(r"shared prompts checked for (\w+)", proc.stderr)  # per process, policy and reference
        assert checked and all(checked.count(module) % 2 == 0 for module in checked), checked
    assert_bounded_console(proc)
    return out


def killed_build(build_root):
    """``build_root`` with the lock of a DeepSpeed op build that was killed (taken as torch's builder takes it,
    then closed): its path and the lock's."""
    flavour = "cpu" if torch.version.cuda is None else "cu" + torch.version.cuda.replace(".", "")
    lock = build_root / f"py{sys.version_info.major}{sys.version_info.minor}_{flavour}" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)
    os.close(os.open(lock, os.O_CREAT | os.O_EXCL))
    return build_root, lock


def assert_bounded_console(proc):
    """ZeRO-3 printed torch's deprecation warning ~40 times per batch per process (838 lines in 20 batches) and
    Accelerate five lines per checkpoint. Now: warnings once per process, one line per checkpoint."""
    lines = (proc.stdout + proc.stderr).split("\n")  # progress-bar refreshes end in \r, not \n: one line
    warnings = [line for line in lines if "Warning: " in line]
    assert all(warnings.count(w) <= 2 for w in warnings), warnings
    assert sum("checkpoint" in line and "saved" in line for line in lines) == 1  # at the end of training
    assert not [line for line in lines if "[RANK 0]" in line]  # Accelerate's per-checkpoint INFO lines
    assert len(lines) < 70, "\n".join(lines)


def curves(out):
    from grpo_accel.reporting.event_files import read_scalars

    scalars = read_scalars(out / "tensorboard")
    return {tag: [v for _, v in scalars[tag]] for tag in TAGS}, json.loads((out / "summary.json").read_text())


def assert_same_run(got, expected):
    for tag in TAGS:
        assert len(got[tag]) == 4
        assert got[tag] == pytest.approx(expected[tag], rel=1e-4, abs=1e-6), tag


# The 1-process references sample with transformers' generate, the 2-process runs with grpo_accel's decode loop
# (the default): equal rewards on every stage mean the loop draws generate's tokens under DDP and ZeRO 1-3 too.
PREVIOUS_ENGINE = "rollout.decoder=generate"


@pytest.fixture(scope="module")
def single(tmp_path_factory, model_dir):
    return curves(run("single_process.yaml", tmp_path_factory.mktemp("one"), "run", *saved(model_dir), PREVIOUS_ENGINE))[0]


@pytest.mark.parametrize("config, stage, dist_type, extra", [
    ("ddp.yaml", 0, "MULTI_CPU", ()), ("zero1.yaml", 1, "DEEPSPEED", ()),
    # two micro-batches of 32 accumulated per process = one of 64 = one process
    ("zero2.yaml", 2, "DEEPSPEED", ("trainer.micro_batch_completions=32", "trainer.gradient_accumulation_steps=2")),
    ("zero3.yaml", 3, "DEEPSPEED", ()),  # with zero3_gather_full and packing: the LoRA test below
])
def test_two_processes_match_one_process(single, model_dir, tmp_path, config, stage, dist_type, extra):
    got, summary = curves(run(config, tmp_path, "run", *saved(model_dir), "trainer.micro_batch_completions=64", *extra))
    assert summary["num_processes"] == 2 and summary["distributed_type"] == dist_type
    assert summary["zero_stage"] == stage
    assert summary["param_fraction_on_rank0"] == (0.5 if stage == 3 else 1.0)  # ZeRO-3 really shards
    assert_same_run(got, single)


@pytest.fixture(scope="module")
def single_tied(tmp_path_factory):
    """The tiny Qwen2, whose input embedding and LM head share one weight, and its 1-process curves."""
    from grpo_accel.tasks.tiny import build_char_tokenizer, build_tiny_qwen2

    folder = tmp_path_factory.mktemp("tied_model")
    tokenizer = build_char_tokenizer()
    build_tiny_qwen2(tokenizer, seed=0).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    model = (f"model.name_or_path={folder}", *TINY_FOLDER)
    return model, curves(run("single_process.yaml", tmp_path_factory.mktemp("single_tied"), "run", *model))[0]


@pytest.mark.parametrize("config, extra", [
    ("ddp.yaml", ()), ("zero2.yaml", ("trainer.micro_batch_completions=32", "trainer.gradient_accumulation_steps=2")),
])
def test_a_tied_embedding_trains_alike_on_two_processes(single_tied, tmp_path, config, extra):
    """The tied weight's gradient is made whole in the embedding's backward (logprobs.tied_embedding_rows):
    DDP's and DeepSpeed's gradient hooks see it once, whole, and average it as they average the rest."""
    model, expected = single_tied
    got, summary = curves(run(config, tmp_path, "run", *model, "trainer.micro_batch_completions=64", *extra))
    assert summary["num_processes"] == 2
    assert_same_run(got, expected)


LORA = ("model.lora.r=4", "model.lora.alpha=8", "loss.kl_coef=0.05")  # the reference: the adapter switched off


@pytest.fixture(scope="module")
def single_lora(tmp_path_factory, model_dir):
    out = run("single_process.yaml", tmp_path_factory.mktemp("lora"), "run", *saved(model_dir), *LORA, PREVIOUS_ENGINE)
    return (*curves(out), out)


@pytest.mark.parametrize("config, stage, extra", [
    ("zero2.yaml", 2, ()),
    # with generation from fully gathered weights and padding-free training (each = the padded 1-process run)
    ("zero3.yaml", 3, ("rollout.zero3_gather_full=true", "loss.packing=true")),
])
def test_lora_under_zero_matches_one_process(single_lora, model_dir, tmp_path, config, stage, extra):
    from grpo_accel.checkpoint import Checkpoint
    from grpo_accel.run.export import load_policy

    expected, one, one_out = single_lora
    out = run(config, tmp_path, "run", *saved(model_dir), "trainer.micro_batch_completions=64", *LORA, *extra)
    got, summary = curves(out)
    assert summary["zero_stage"] == stage and summary["trainable_parameters"] == one["trainable_parameters"]
    assert 8 * one["trainable_parameters"] < one["optimizer_state_bytes_rank0"] < 8.1 * one["trainable_parameters"]
    assert summary["optimizer_state_bytes_rank0"] < 0.55 * one["optimizer_state_bytes_rank0"]  # ZeRO splits Adam
    assert_same_run(got, expected)
    # the checkpoints hold the adapter only, sharded or not, and both give the same merged model
    final = [load_policy(Checkpoint(o / "checkpoints").complete()[-1]).merge_and_unload() for o in (out, one_out)]
    for (name, a), b in zip(final[0].state_dict().items(), final[1].state_dict().values()):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-5, msg=name)


def test_zero3_with_reference_offload_and_checkpointing_matches_one_process(tmp_path, model_dir):
    kl = [*saved(model_dir), "loss.kl_coef=0.1"]  # the reference: a second partitioned load of the folder
    expected, _ = curves(run("single_process.yaml", tmp_path, "single", *kl))
    got, summary = curves(run("zero3_offload.yaml", tmp_path, "z3", *kl, "trainer.micro_batch_completions=64",
                              "model.gradient_checkpointing=true"))
    assert summary["zero_stage"] == 3 and summary["param_fraction_on_rank0"] == 0.5
    assert_same_run(got, expected)


def test_bf16_under_zero3_learns_with_finite_loss(tmp_path):
    out = tmp_path / "bf16"
    launch("zero3.yaml", [f"output_dir={out}", "trainer.total_frames=3072", "trainer.progress_bar=false",
                          "trainer.micro_batch_completions=64", "trainer.mixed_precision=bf16", "optim.lr=3e-3"])
    from grpo_accel.reporting.event_files import read_scalars

    scalars = read_scalars(out / "tensorboard")
    losses = [v for _, v in scalars["train/loss"]]
    assert len(losses) == 24 and all(abs(v) < 1e3 for v in losses)
    summary = json.loads((out / "summary.json").read_text())
    assert summary["reward_last_mean"] > summary["reward_first_mean"] + 0.1, summary  # here: 0.08 -> 0.26


def test_slurm_script_runs_two_machines_of_one_process(single, model_dir, tmp_path):
    """launch/slurm.sbatch under stand-ins for srun/scontrol that start its two tasks the way SLURM would, on two
    "machines" of one process each: two network namespaces with addresses of their own (tests/helpers/netns.py), so the
    run crosses a network; each runs launch/multinode.sh -> accelerate launch. It gives the 1-process curves."""
    from netns import two_hosts

    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    with two_hosts() as hosts:
        _slurm_run(hosts, bin_dir, tmp_path, single, saved(model_dir))


def _slurm_run(hosts, bin_dir, tmp_path, single, model):
    node = [shlex.join(hosts.prefix(i, hostname=True)) for i in (0, 1)]  # c10d finds rank 0 by host name
    (bin_dir / "scontrol").write_text(f"#!/usr/bin/env bash\necho {hosts.addresses[0]}\necho {hosts.addresses[1]}\n")
    (bin_dir / "srun").write_text(
        "#!/usr/bin/env bash\n"  # drop srun's own options, run the command once per node (namespace) in parallel
        "while [[ $1 == --* ]]; do shift; done\n"
        f"SLURM_NODEID=0 {node[0]} \"$@\" & a=$!\nSLURM_NODEID=1 {node[1]} \"$@\" & b=$!\n"
        "wait $a; ra=$?; wait $b; rb=$?; exit $(( ra | rb ))\n"
    )
    for shim in bin_dir.iterdir():
        shim.chmod(0o755)
    env = {**os.environ, "PATH": f"{bin_dir}:{os.environ['PATH']}", "SLURM_JOB_NODELIST": "node[0-1]",
           "SLURM_NNODES": "2", "PROCS_PER_MACHINE": "1", "MAIN_PORT": str(free_port()), "PYTHON": sys.executable,
           "SLURM_SUBMIT_DIR": str(ROOT), "DS_ACCELERATOR": "cpu"}
    out = tmp_path / "run"
    proc = run_in_group(["bash", str(ROOT / "launch" / "slurm.sbatch"), f"output_dir={out}", *BASE, *model,
                         "trainer.micro_batch_completions=64"], env=env, timeout=300)
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-8000:]
    assert READY.format(0) in proc.stderr and READY.format(1) in proc.stderr
    got, summary = curves(out)
    assert summary["num_processes"] == 2
    assert_same_run(got, single)


# ------------------------------------------------------------------------------------ configurations


def test_shipped_accelerate_and_deepspeed_files_agree():
    import yaml

    ds_files = sorted((ROOT / "ds_configs").glob("*.json"))
    assert {p.stem for p in ds_files} == {"zero0", "zero1", "zero2", "zero3", "zero3_offload"}
    for path in ds_files:
        cfg = read_deepspeed_file(path)
        for key in ("train_micro_batch_size_per_gpu", "gradient_accumulation_steps", "gradient_clipping"):
            assert cfg[key] == "auto", (path.name, key)  # the trainer fills them: one place to set them
        assert "optimizer" not in cfg
    used = set()
    for path in sorted((ROOT / "accelerate_configs").glob("*.yaml")):
        cfg = yaml.safe_load(path.read_text())
        if cfg["distributed_type"] != "DEEPSPEED":
            assert cfg["distributed_type"] in ("NO", "MULTI_GPU"), path.name
            continue
        ds_path = ROOT / cfg["deepspeed_config"]["deepspeed_config_file"]
        used.add(ds_path.name)
        stage = read_deepspeed_file(ds_path)["zero_optimization"]["stage"]
        if path.stem.startswith("zero"):
            assert path.stem.startswith(f"zero{stage}") and ds_path.stem == path.stem, path.name
        assert "mixed_precision" not in cfg, "bf16 goes in the JSON (an accelerate YAML value conflicts)"
    assert used >= {p.name for p in ds_files}


@pytest.mark.parametrize("zero, message", [
    ({"stage": 5}, "zero_optimization.stage=5; ZeRO stages are 0, 1, 2 or 3"),
    ({"stage": 2, "offload_param": {"device": "cpu"}}, "offload_param needs ZeRO stage 3 but stage=2"),
    ({"stage": 0, "offload_optimizer": {"device": "cpu"}}, "offload_optimizer needs ZeRO stage 1-3"),
    ({"stage": 3, "offload_optimizer": {"device": "cpu"}}, "zero_force_ds_cpu_optimizer"),
])
def test_bad_deepspeed_settings(zero, message):
    with pytest.raises(DistributedConfigError, match=message.replace("(", r"\(")):
        validate_deepspeed_config({"zero_optimization": zero}, "x.json")


@pytest.mark.parametrize("content, message", [
    (None, "does not exist"),
    ("{not json", "is not valid JSON"),
    ('{"zero_optimization": {"stage": 2, "offload_param": {"device": "cpu"}}}', "offload_param needs ZeRO stage 3"),
    # misspelt keys, checked against DeepSpeed's own config models (issue 26 item 3)
    ('{"zero_optimization": {"stgae": 2}}', "zero_optimization.stgae is not a DeepSpeed setting; did you mean "
                                            "zero_optimization.stage?"),
    ('{"zero_optimisation": {"stage": 2}}', "zero_optimisation is not a DeepSpeed setting; did you mean "
                                            "zero_optimization?"),
    ('{"zero_optimization": {"stage": 2, "reduce_bucket_sise": 5}}', "did you mean zero_optimization.reduce_bucket_size"),
    ('{"zero_optimization": {"stage": 3, "offload_param": {"devcie": "cpu"}}}',
     "zero_optimization.offload_param.devcie is not a DeepSpeed setting; did you mean zero_optimization.offload_param.device"),
])
def test_bad_deepspeed_files_are_named(tmp_path, content, message):
    ds = tmp_path / "ds.json"
    if content is not None:
        ds.write_text(content)
    with pytest.raises(DistributedConfigError, match=message) as err:
        read_deepspeed_file(str(ds))
    assert str(ds) in str(err.value)


def test_a_bad_deepspeed_file_stops_the_run_before_any_process_group(tmp_path, monkeypatch):
    """launch/train.py in this process, with the environment accelerate launch gives it for a DeepSpeed config
    (ACCELERATE_USE_DEEPSPEED, ACCELERATE_DEEPSPEED_CONFIG_FILE): the file is refused before the Accelerator
    exists. (Every launched DeepSpeed run here reads its file the same way.)"""
    import torch.distributed as dist

    ds = tmp_path / "ds.json"
    ds.write_text('{"zero_optimization": {"stage": 4}}')
    monkeypatch.setenv("ACCELERATE_USE_DEEPSPEED", "true")
    monkeypatch.setenv("ACCELERATE_DEEPSPEED_CONFIG_FILE", str(ds))
    with pytest.raises(DistributedConfigError, match="zero_optimization.stage=4") as err:
        train_in_process([f"output_dir={tmp_path}/run"])
    assert str(ds) in str(err.value) and not dist.is_initialized()


@pytest.mark.parametrize("env, threads", [
    ({}, lambda cores: cores),
    ({"OMP_NUM_THREADS": "3"}, lambda cores: 3),  # the user's choice
    ({"OMP_NUM_THREADS": "1", "ACCELERATE_DYNAMO_BACKEND": "NO"}, lambda cores: cores),  # accelerate launch's default
    ({"OMP_NUM_THREADS": "1", "ACCELERATE_DYNAMO_BACKEND": "NO", "LOCAL_WORLD_SIZE": "2"}, lambda cores: max(1, cores // 2)),
    ({"OMP_NUM_THREADS": "1", "ACCELERATE_DYNAMO_BACKEND": "NO", "GRPO_ACCEL_THREADS": "1"}, lambda cores: 1),
])
def test_torch_threads_per_process(monkeypatch, env, threads):
    import torch

    from grpo_accel.runtime.resources import available_cores, configure_threads

    for key in ("OMP_NUM_THREADS", "ACCELERATE_DYNAMO_BACKEND", "LOCAL_WORLD_SIZE", "ACCELERATE_NUM_PROCESSES",
                "GRPO_ACCEL_THREADS"):
        monkeypatch.delenv(key, raising=False)
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    before = torch.get_num_threads()
    try:
        assert configure_threads() == torch.get_num_threads() == threads(available_cores())
    finally:
        torch.set_num_threads(before)


def test_a_build_lock_nobody_holds_is_removed_and_a_held_one_is_reported(tmp_path, caplog):
    """torch's JIT builder holds its lock file open while it builds (torch/utils/file_baton.py) and others wait
    on the file silently, forever; a builder killed mid-build left the file, and every later launch hung."""
    import subprocess
    import time

    from grpo_accel.runtime.build_locks import clear_stale_build_locks

    lock = tmp_path / "py311_cpu" / "deepspeed_shm_comm" / "lock"
    lock.parent.mkdir(parents=True)

    def builder(seconds: float) -> subprocess.Popen:  # takes the lock as FileBaton.try_acquire does
        code = (f"import os, time; fd = os.open({str(lock)!r}, os.O_CREAT | os.O_EXCL); print(flush=True); "
                f"time.sleep({seconds}); os.close(fd); os.remove({str(lock)!r})")
        proc = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
        proc.stdout.readline()
        return proc

    live = builder(2.0)
    start = time.monotonic()
    with caplog.at_level("WARNING", logger="grpo_accel.runtime"):
        assert clear_stale_build_locks(tmp_path, report_every_s=0.5) == []  # waited for the build, removed nothing
    assert live.wait() == 0 and time.monotonic() - start > 1.0
    assert f"to finish building deepspeed_shm_comm (lock {lock})" in caplog.text and str(live.pid) in caplog.text

    killed = builder(300)
    killed.kill()
    killed.wait()
    assert lock.exists()
    assert clear_stale_build_locks(tmp_path) == [lock] and not lock.exists()
    assert "removed a stale build lock" in caplog.text
