"""How memory is kept and bounded: glibc's allocator (freed memory kept for the next step, handed back under ZeRO-3)
and ZeRO-3's live parameters (what DeepSpeed keeps gathered beyond a process's shard)."""
import subprocess
import sys

from launching import ROOT

from grpo_accel.distributed.deepspeed_files import read_deepspeed_file


FAULTS_OF_A_STEP = """
import ctypes, resource, sys, torch
from grpo_accel.runtime.resources import configure_allocator
kept = {"default": lambda: None, "zero3": lambda: configure_allocator(zero3=True),
        "not zero3": lambda: configure_allocator(zero3=False)}[sys.argv[1]]()
def step():  # two 64 MiB tensors allocated, touched and freed, as a training step's activations are
    a = torch.ones(2**24)
    return float((a * 2)[-1])
for _ in range(4):  # the heap settles in a few steps
    step()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(10):
    step()
faults = resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
sbrk = ctypes.CDLL("libc.so.6").sbrk
sbrk.restype = ctypes.c_void_p
for _ in range(20):
    step()
settled = sbrk(0)  # the heap's end
for _ in range(100):
    step()
print(kept, faults, sbrk(0) - settled)
"""


def test_freed_memory_is_reused_without_page_faults():
    """glibc serves a 64 MiB block with fresh mmap pages, faulted in 4 KiB at a time, every time it is allocated
    (16,384 faults each); after keep_freed_memory a step reuses the blocks the previous one freed (most steps
    fault nothing; now and then one block still lands on new pages), and the heap stops growing: aligned blocks
    of one size do not always fit the hole a freed one leaves, so it grows for some steps (to ~4x the live 128
    MiB here), then serves every step from what it has."""
    def run(mode: str) -> tuple[str, int, int]:
        out = subprocess.run([sys.executable, "-c", FAULTS_OF_A_STEP, mode], capture_output=True, text=True,
                             check=True, cwd=ROOT).stdout.split()
        return out[0], int(out[1]), int(out[2])

    # the trainer's choice: kept (keep_freed_memory), unless ZeRO-3 (whose gathered weights would stay), where
    # blocks are handed back
    (_, default, _), (kept, reused, growth) = run("default"), run("not zero3")
    assert kept == "True" and default > 10 * 30_000 and reused < default / 4, (default, kept, reused)
    assert growth == 0, f"the heap grew by {growth} bytes over 100 settled steps"
    zero3, returned, growth = run("zero3")
    assert zero3 == "False" and returned > 10 * 30_000 and growth == 0, (returned, growth)


def test_zero3_live_parameters_follow_the_model():
    """The shipped ZeRO-3 files leave the live parameters and the reuse distance at "auto": 30 x hidden^2 elements
    (DeepSpeed's 1e9 kept a model below a billion parameters gathered whole through every step); a number written
    in the file stays."""
    from grpo_accel.distributed import configure_deepspeed

    for name in ("zero3.json", "zero3_offload.json"):
        zero = read_deepspeed_file(ROOT / "ds_configs" / name)["zero_optimization"]
        assert zero["stage3_max_live_parameters"] == zero["stage3_max_reuse_distance"] == "auto", name

    def filled(zero: dict, hidden: int | None) -> dict:
        return configure_deepspeed({"zero_optimization": zero}, micro_batch=2, accumulation=1, num_processes=2,
                                   clip_norm=1.0, hidden_size=hidden)["zero_optimization"]

    auto = {"stage3_max_live_parameters": "auto", "stage3_max_reuse_distance": "auto"}
    assert filled(dict(auto), 576) == {key: 30 * 576 * 576 for key in auto}  # SmolLM2: 9,953,280
    assert filled(dict(auto), 8192) == {key: 10**9 for key in auto}  # at most DeepSpeed's own
    assert filled(dict(auto), None) == {key: 10**9 for key in auto}  # no hidden size: DeepSpeed's own
    assert filled({"stage3_max_live_parameters": 5, "stage3_max_reuse_distance": 7}, 576) == {
        "stage3_max_live_parameters": 5, "stage3_max_reuse_distance": 7}
