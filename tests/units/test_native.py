"""The decode step's C library (grpo_accel/embedded/native.py): its functions against torch's ops, the decode loop
with it against the loop with torch's ops, its build once per machine, and the torch ops where it cannot be built."""
import os
import shutil
import subprocess
import sys

import torch
import torch.nn.functional as F

import pytest

from grpo_accel import batch
from grpo_accel.embedded import native
from grpo_accel.embedded.decode import Decoder, DecodeSettings
from grpo_accel.embedded.lean import LeanForward
from grpo_accel.embedded.native import NativeStep, native_reason

PROMPTS = ["12+34=", "1+2=", "7+7=", "49+49="]  # 4 to 6 tokens: left padding


def _llama(tokenizer):
    from grpo_accel.tasks.tiny import build_tiny_model

    return build_tiny_model(tokenizer, seed=0)


def _qwen2(tokenizer):
    """Grouped-query attention, biases on q/k/v, tied embeddings."""
    from grpo_accel.tasks.tiny import build_tiny_qwen2

    return build_tiny_qwen2(tokenizer, seed=0)


def _mistral(tokenizer):
    from transformers import MistralConfig, MistralForCausalLM

    torch.manual_seed(0)
    return MistralForCausalLM(MistralConfig(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=1, head_dim=16, max_position_embeddings=64, sliding_window=None,
        pad_token_id=tokenizer.pad_token_id, eos_token_id=tokenizer.eos_token_id))


@pytest.fixture
def fresh_build(monkeypatch, tmp_path):
    """A process that has not loaded the library yet, with a kernel folder of its own."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    native._built.cache_clear()
    yield tmp_path / "grpo_accel" / "kernels"
    native._built.cache_clear()  # later tests load the machine's library again


def test_the_c_functions_compute_what_torch_computes():
    """Against float64 torch: the residual add exactly, the RMSNorm, SiLU times up over [-120, 120] (exp's range
    reduction, its clamps) and one query's attention with grouped heads, a rotary embedding and masked keys, to
    float32 rounding; the cache gets the rotated key and the value at its position and nothing else."""
    step, g = NativeStep(), torch.Generator().manual_seed(0)
    hidden, delta, weight = (torch.randn(5, 96, generator=g) * 3, torch.randn(5, 96, generator=g),
                             torch.randn(96, generator=g))
    added, normed = hidden.clone(), torch.empty(5, 96)
    step.add_rms_norm(added, delta, weight, 1e-6, normed)
    assert torch.equal(added, hidden + delta)
    torch.testing.assert_close(normed.double(), torch.rms_norm((hidden + delta).double(), (96,), weight.double(), 1e-6),
                               rtol=1e-6, atol=1e-6)
    step.add_rms_norm(hidden, None, weight, 1e-6, normed)  # no delta: the norm alone
    torch.testing.assert_close(normed.double(), torch.rms_norm(hidden.double(), (96,), weight.double(), 1e-6),
                               rtol=1e-6, atol=1e-6)

    gate, up = torch.linspace(-120, 120, 4001), torch.randn(4001, generator=g)
    out = torch.empty(1, 4001)
    step.silu_mul(torch.cat([gate, up])[None], out)
    torch.testing.assert_close(out[0].double(), F.silu(gate.double()) * up.double(), rtol=2e-6, atol=1e-30)

    rows, heads, kv_heads, dim, capacity, length = 3, 6, 2, 16, 10, 6
    qkv = torch.randn(rows, (heads + 2 * kv_heads) * dim, generator=g)
    cos, sin = torch.randn(rows, dim, generator=g), torch.randn(rows, dim, generator=g)
    keys, values = torch.randn(rows, kv_heads, capacity, dim, generator=g), torch.randn(rows, kv_heads, capacity, dim, generator=g)
    mask = torch.zeros(rows, 1, 1, capacity + 2)
    mask[1, ..., :2] = torch.finfo(torch.float32).min  # row 1 sees neither of its first two positions
    before_keys, before_values, out = keys.clone(), values.clone(), torch.empty(rows, heads * dim)
    step.attention(qkv, cos, sin, keys, values, mask[..., : length + 1], out, heads, kv_heads, length, 0.25)

    def rotate(x):  # [rows, n, dim]
        return x * cos[:, None].double() + x.roll(dim // 2, -1) * sin[:, None].double()

    q, k, v = qkv.double().split([heads * dim, kv_heads * dim, kv_heads * dim], -1)
    k, v = rotate(k.view(rows, kv_heads, dim)), v.view(rows, kv_heads, dim)
    torch.testing.assert_close(keys[:, :, length].double(), k, rtol=1e-6, atol=1e-6)
    assert torch.equal(values[:, :, length].double(), v)
    for cache, before in ((keys, before_keys), (values, before_values)):
        assert torch.equal(cache[:, :, :length], before[:, :, :length]) and torch.equal(cache[:, :, length + 1:], before[:, :, length + 1:])
    full_k = keys.double()[:, :, : length + 1].repeat_interleave(heads // kv_heads, 1)  # [rows, heads, S, dim]
    full_v = values.double()[:, :, : length + 1].repeat_interleave(heads // kv_heads, 1)
    scores = torch.einsum("rhd,rhsd->rhs", rotate(q.view(rows, heads, dim)), full_k) * 0.25 + mask[:, 0, :, : length + 1].double()
    expected = torch.einsum("rhs,rhsd->rhd", scores.softmax(-1), full_v).reshape(rows, -1)
    torch.testing.assert_close(out.double(), expected, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("build, eos", [(_llama, 0.3), (_qwen2, 1.0), (_mistral, 0.3)],
                         ids=["llama", "qwen2-gqa-bias", "mistral-one-kv-head"])
def test_the_decode_loop_draws_the_same_tokens_with_the_c_step(tokenizer, build, eos, monkeypatch):
    """Float32, EOS made likely so that rows finish at different steps and leave the batch: the loop with the C
    step draws the tokens the loop with torch's ops draws, with its logprobs to float32 rounding; the C step ran
    for every decode step (not for the prefill)."""
    model = build(tokenizer)
    with torch.no_grad():
        head = model.get_output_embeddings()
        head.weight[tokenizer.eos_token_id] += eos * head.weight.norm(dim=1).mean()
    ids = batch.pad_sequences([tokenizer(p)["input_ids"] for p in PROMPTS], tokenizer.pad_token_id, "left")
    keys = torch.tensor([s * 4 + j for s in [5, 6, 7, 8] for j in range(4)])
    settings = DecodeSettings(24, (tokenizer.eos_token_id,), tokenizer.pad_token_id)
    decoder = Decoder(model)
    assert decoder.lean and decoder.lean_forward.native is not None and decoder.lean_forward.native_reason is None
    steps = []
    attention = NativeStep.attention
    monkeypatch.setattr(NativeStep, "attention", lambda self, *a, **k: steps.append(a[0].shape[0]) or attention(self, *a, **k))
    tokens, logprobs = decoder(ids, (ids != tokenizer.pad_token_id).long(), 4, keys, settings)
    lengths = (tokens != tokenizer.pad_token_id).sum(1)
    assert lengths.min() < 12 and lengths.max() == 24, "rows must finish at different steps"
    assert len(steps) == 2 * (tokens.shape[1] - 1) and steps[-1] < steps[0]  # 2 layers a step; fewer rows at the end
    decoder.lean_forward.native = None
    expected_tokens, expected_logprobs = decoder(ids, (ids != tokenizer.pad_token_id).long(), 4, keys, settings)
    assert torch.equal(tokens, expected_tokens)
    torch.testing.assert_close(logprobs, expected_logprobs, atol=2e-5, rtol=0)


def test_the_library_is_built_once_per_machine_and_named_by_its_source_and_cpu(fresh_build):
    assert native_reason() is None
    (library,) = fresh_build.glob("decode_step-*.so")
    built = library.stat().st_mtime_ns
    native._built.cache_clear()  # another process on this machine: loads, does not build
    assert native_reason() is None and library.stat().st_mtime_ns == built
    assert [p.name for p in fresh_build.iterdir()] == [library.name]  # no build folder left behind


@pytest.mark.parametrize("compiler, reason", [("/nonexistent/cc", "no C compiler (/nonexistent/cc not found"),
                                              ("false", "false failed on decode_step.c")])
def test_without_a_compiler_decode_steps_keep_the_torch_ops(tokenizer, fresh_build, monkeypatch, compiler, reason):
    monkeypatch.setenv("CC", compiler)
    assert native_reason().startswith(reason)
    model = _llama(tokenizer)
    lean = LeanForward(model)
    assert lean.native is None and lean.native_reason.startswith(reason)
    ids = torch.tensor([tokenizer("1+2=")["input_ids"]])
    tokens, _ = Decoder(model)(ids, torch.ones_like(ids), 2, torch.tensor([1, 2]),
                               DecodeSettings(6, (tokenizer.eos_token_id,), tokenizer.pad_token_id))
    assert tokens.shape[0] == 2
    assert not list(fresh_build.glob("*.so"))


def test_float64_models_keep_the_torch_ops(tokenizer):
    lean = LeanForward(_llama(tokenizer).double())
    assert lean.native is None and lean.native_reason == "torch.float64 on cpu (the C step is float32 on CPU)"


def train_as_user(output_dir, cache, **env) -> list[str]:
    """launch/train.py as a user runs it (one batch), ``cache`` its XDG_CACHE_HOME: the lines it wrote to stderr."""
    from launching import ROOT

    run = subprocess.run([sys.executable, str(ROOT / "launch" / "train.py"), f"output_dir={output_dir}",
                          "trainer.total_frames=128", "trainer.progress_bar=false"], capture_output=True, text=True,
                         env={**os.environ, "XDG_CACHE_HOME": str(cache), **env}, timeout=300)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stderr.splitlines()


def damage_lines(lines: list[str]) -> list[str]:
    return [line for line in lines if "decode step:" in line]


def decode_path(lines: list[str]) -> str:
    """The one line a run says about its decode path."""
    said = [line.split("grpo_accel.embedded.engine: ", 1)[1] for line in lines
            if "grpo_accel.embedded.engine: decode: " in line]
    assert len(said) == 1, lines[-30:]
    return said[0]


@pytest.fixture(scope="module")
def first_run(tmp_path_factory):
    """A run on an empty cache, which builds the C step: (its cache folder, its stderr lines)."""
    root = tmp_path_factory.mktemp("first_run")
    return root / "cache", train_as_user(root / "run", root / "cache")


def test_a_corrupt_cached_library_is_rebuilt_with_one_line(tmp_path, first_run):
    """Issue 49: a cached library cut short, overwritten with garbage or emptied stopped every run at its first
    batch (an OSError traceback, or a crash for a file cut short). Run as a user runs it: the run rebuilds it,
    says so in one line naming the file, and trains; the next run loads the rebuilt library silently. Each damage
    fails the one check a run makes before it loads the library (content against name); the run meets one."""
    built, lines = first_run
    assert damage_lines(lines) == []  # the first build says nothing of damage
    cache = shutil.copytree(built, tmp_path / "cache")
    (library,) = (cache / "grpo_accel" / "kernels").glob("decode_step-*.so")
    whole = library.read_bytes()
    for garbage in (b"not a library" * 100, b""):  # garbage and emptied: the check the cut one meets below
        library.write_bytes(garbage)
        assert not native._intact(library)
    library.write_bytes(whole[: len(whole) // 2])  # cut short: loaded, it crashed the run
    said = damage_lines(train_as_user(tmp_path / "cut", cache))
    assert len(said) == 1 and said[0].endswith(f"decode step: the cached library {library} is damaged (its "
                                               "content does not match its name); rebuilding it"), said
    (rebuilt,) = (cache / "grpo_accel" / "kernels").glob("decode_step-*.so")
    assert native._intact(rebuilt)
    assert damage_lines(train_as_user(tmp_path / "after", cache)) == []


def test_a_corrupt_library_that_cannot_be_rebuilt_keeps_the_torch_ops(fresh_build, monkeypatch, tokenizer, caplog):
    assert native_reason() is None
    (library,) = fresh_build.glob("decode_step-*.so")
    library.unlink()  # this process has the library mapped: emptying that file in place would crash it (SIGBUS)
    library.write_bytes(b"")
    native._built.cache_clear()
    monkeypatch.setattr(native, "_build", lambda compiler, stem: (None, f"{compiler} failed on decode_step.c: gone"))
    assert native_reason().endswith("failed on decode_step.c: gone")  # the rebuild's failure, as a build's
    assert f"the cached library {library} is damaged" in caplog.text and not library.exists()
    assert LeanForward(_llama(tokenizer)).native is None


def test_a_run_says_at_start_which_decode_path_it_takes_and_why_not_the_fast_one(tmp_path, first_run):
    """Issue 49: without a compiler, or with a cache folder that cannot be written, the decode step kept the torch
    ops silently (the reason went to log.debug). Run as a user runs it: one line names the path, and on the
    slower one why and how to get the C step."""
    cache, lines = first_run
    kernels = cache / "grpo_accel" / "kernels"
    assert decode_path(lines) == f"decode: the lean decode loop with its C step ({next(kernels.glob('decode_step-*.so'))})"
    no_cc = decode_path(train_as_user(tmp_path / "no_cc", tmp_path / "no_cc_cache", CC="/nonexistent"))
    assert no_cc == ("decode: the lean decode loop on torch ops, without its C step: no C compiler (/nonexistent not "
                     "found): install one (e.g. apt install gcc) or name it in CC")
    line = decode_path(train_as_user(tmp_path / "unwritable", "/proc/nope"))
    assert line.startswith("decode: the lean decode loop on torch ops, without its C step: could not build in "
                           "/proc/nope/grpo_accel/kernels (") and line.endswith("set XDG_CACHE_HOME to a writable folder")
