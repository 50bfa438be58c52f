"""The element-wise work of a float32 CPU decode step in C: one call for each stretch between two products.

Between its matrix products, a decode step of the lean forward (:mod:`grpo_accel.embedded.lean`) issues a few
dozen small torch ops a layer. Each product streams megabytes of weights through the cache, so each op after it
runs with its code and data evicted: an RMSNorm after a product took 42 us against 12 us in a loop of its own,
the written-out attention 77 against 32 us (SmolLM2's decode sizes, 2 threads), and SmolLM2's decode call
(8 rows x 32 tokens) spent ~0.5 s of its 1.6 s outside the products against 0.22 s with the products made free.
``decode_step.c`` does each stretch in one call on the calling thread: the residual add and the next RMSNorm,
the rotary embedding, the cache write and one query's attention, SiLU times up. Its results agree with the torch
ops' to float32 rounding (sums in another order, exp by a polynomial within 2 ulp); float64 models, GPUs, ZeRO-3
and prefills keep the torch ops.

The library is compiled once per machine with the machine's C compiler (``cc -O3 -march=native``, about a
second) into ``~/.cache/grpo_accel/kernels`` (under ``$XDG_CACHE_HOME`` where set), named by a hash of the
source, the flags and the CPU's feature flags (a home directory shared by different machines gets one library
each) and by a hash of its own content, written under a temporary name and renamed into place. A cached file
whose content no longer matches its name (cut short, overwritten, emptied) is rebuilt, with a warning naming it. Without a compiler (or off Linux) the decode step
keeps the torch ops: :func:`native_reason` says why.
"""
from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import subprocess
import tempfile
from pathlib import Path

from torch import Tensor

log = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("decode_step.c")
FLAGS = ("-O3", "-march=native", "-fno-math-errno", "-fopenmp-simd", "-fPIC", "-shared")
_POINTER, _INT, _FLOAT = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
_SIGNATURES = {
    "add_rms_norm": ([_POINTER, _POINTER, _POINTER, _FLOAT, _POINTER, _INT, _INT], None),
    "silu_mul": ([_POINTER, _POINTER, _INT, _INT], None),
    "attention": ([_POINTER] * 6 + [_INT, _POINTER] + [_INT] * 6 + [_FLOAT], ctypes.c_int),
}


def kernel_dir() -> Path:
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "grpo_accel" / "kernels"


@functools.cache
def _built() -> tuple[ctypes.CDLL | None, str | None]:
    """(the library, None) or (None, why not): compiled at the first call on this machine, loaded once a process."""
    if platform.system() != "Linux":
        return None, f"{platform.system()} (the decode step's C library is built on Linux only)"
    cpu_flags = next((line for line in Path("/proc/cpuinfo").read_text().splitlines() if line.startswith("flags")), "")
    compiler = os.environ.get("CC", "cc")
    key = hashlib.sha256(b"\0".join([SOURCE.read_bytes(), " ".join((compiler, *FLAGS)).encode(), cpu_flags.encode()]))
    stem = f"decode_step-{key.hexdigest()[:16]}"
    path = next(iter(sorted(kernel_dir().glob(f"{stem}-*.so"))), None)
    if path is not None and not _intact(path):  # cut short, overwritten, emptied: it would not load or would crash
        log.warning("decode step: the cached library %s is damaged (its content does not match its name); "
                    "rebuilding it", path)
        path.unlink(missing_ok=True)
        path = None
    if path is None:
        path, failed = _build(compiler, stem)
        if failed:
            return None, failed
    try:
        library = ctypes.CDLL(str(path))
        for name, (arguments, result) in _SIGNATURES.items():
            function = getattr(library, name)
            function.argtypes, function.restype = arguments, result
    except (OSError, AttributeError) as exc:
        return None, f"{path} could not be loaded ({exc})"
    log.debug("decode step: %s", path)
    return library, None


def native_library() -> Path | None:
    """The loaded library's file, or None."""
    library = _built()[0]
    return None if library is None else Path(library._name)


def _intact(path: Path) -> bool:
    """Whether the library's content is what its name says: ``<stem>-<its SHA-256, 16 digits>.so``."""
    return hashlib.sha256(path.read_bytes()).hexdigest()[:16] == path.stem.rsplit("-", 1)[-1]


def _build(compiler: str, stem: str) -> tuple[Path | None, str | None]:
    """(the library compiled as ``<stem>-<its digest>.so`` in the kernel folder, None), or (None, why not). Built
    beside its name and renamed in, so a reader never sees half a file."""
    folder = kernel_dir()
    try:
        folder.mkdir(parents=True, exist_ok=True)
        scratch_dir = tempfile.TemporaryDirectory(dir=folder)
    except OSError as exc:
        return None, f"could not build in {folder} ({exc}): set XDG_CACHE_HOME to a writable folder"
    try:
        with scratch_dir as scratch:
            built = Path(scratch) / f"{stem}.so"
            subprocess.run([compiler, *FLAGS, "-o", str(built), str(SOURCE)], check=True, capture_output=True,
                           text=True, timeout=300)
            path = folder / f"{stem}-{hashlib.sha256(built.read_bytes()).hexdigest()[:16]}.so"
            os.replace(built, path)
    except FileNotFoundError:
        return None, f"no C compiler ({compiler} not found): install one (e.g. apt install gcc) or name it in CC"
    except subprocess.CalledProcessError as exc:
        lines = exc.stderr.strip().splitlines()
        return None, (f"{compiler} failed on {SOURCE.name}: {lines[-1] if lines else exc}; name another compiler "
                      "in CC")
    except (OSError, subprocess.TimeoutExpired) as exc:
        return None, f"could not build in {folder} ({exc}): set XDG_CACHE_HOME to a writable folder"
    return path, None


def native_reason() -> str | None:
    """Why decode steps keep the torch ops on this machine, or None when they call the C library."""
    return _built()[1]


class NativeStep:
    """The C library's functions on tensors: float32, contiguous rows (checked by the caller, the lean forward)."""

    def __init__(self) -> None:
        library, reason = _built()
        if library is None:
            raise RuntimeError(f"the decode step's C library is unavailable: {reason}")
        self.library = library

    def add_rms_norm(self, hidden: Tensor, delta: Tensor | None, weight: Tensor, eps: float, out: Tensor) -> None:
        """``hidden += delta`` (in place, when given); ``out = rms_norm(hidden) * weight``. [R, H] each."""
        rows, width = hidden.shape
        self.library.add_rms_norm(hidden.data_ptr(), None if delta is None else delta.data_ptr(), weight.data_ptr(),
                                  eps, out.data_ptr(), rows, width)

    def silu_mul(self, gate_up: Tensor, out: Tensor) -> None:
        """``out = silu(gate) * up`` for ``gate_up`` [R, 2I] (gate first), ``out`` [R, I]."""
        rows, width = out.shape
        self.library.silu_mul(gate_up.data_ptr(), out.data_ptr(), rows, width)

    def attention(self, qkv: Tensor, cos: Tensor, sin: Tensor, keys: Tensor, values: Tensor, mask: Tensor,
                  out: Tensor, heads: int, kv_heads: int, length: int, scaling: float) -> None:
        """One query per row: q and k of ``qkv`` [R, (heads + 2 kv_heads) D] rotated by ``cos``/``sin`` [R, D]
        (sin signed), k and v written at ``length`` of ``keys``/``values`` [R, kv_heads, capacity, D], the query
        attending to positions 0..length under the additive ``mask`` [R, >= length + 1] (rows may be strided),
        the result in ``out`` [R, heads D]."""
        rows, _, capacity, dim = keys.shape
        status = self.library.attention(qkv.data_ptr(), cos.data_ptr(), sin.data_ptr(), keys.data_ptr(),
                                        values.data_ptr(), mask.data_ptr(), mask.stride(0), out.data_ptr(), rows,
                                        heads, kv_heads, dim, capacity, length, scaling)
        if status != 0:
            raise MemoryError(f"decode step attention: no memory for {length + 1 + dim} floats of scratch")
