"""The C++ CPU Adam kernel (``csrc/cpu_adam.cpp``), built on first use and loaded with ctypes.

The library is compiled with the system C++ compiler for the CPU it runs on (``-march=native``:
AVX-512, AVX2 or scalar code is picked by the compiler's own feature macros) and cached under
``~/.cache/elixir/cpu_adam/`` (or ``$ELIXIR_CACHE_DIR``), keyed by the source, the flags and the
CPU's feature flags, so a GPU host without network builds it once, offline. Only raw pointers cross
the boundary: no torch C++ ABI, and ctypes drops the GIL for the duration of the call.
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
from functools import cache
from pathlib import Path
from typing import Sequence

import torch

from .adam_consts import CONST_NAMES, step_constants
from ..chunk.layout import GroupRange
from .kernel import AdamHyper, bounded_put, check_arenas, segment_extent

__all__ = ["CpuAdamKernel", "CpuAdamUnavailable", "load_library"]

_CSRC = Path(__file__).resolve().parents[3] / "csrc"
_SOURCES = ("cpu_adam.cpp", "cpu_adam_simd.h")
_ISA_FLAGS = {
    "native": ["-march=native"],
    "avx512": ["-march=x86-64-v4", "-mtune=native"],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
    "scalar": ["-march=x86-64", "-mtune=native"],
}
_BASE_FLAGS = ["-O3", "-std=c++17", "-fPIC", "-shared", "-fopenmp"]
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NO_OUT = 3


class CpuAdamUnavailable(RuntimeError):
    """The C++ kernel could not be built or loaded (no compiler, no sources, compile error)."""


class _Seg(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_int64), ("length", ctypes.c_int64), ("group", ctypes.c_int64)]


class _Group(ctypes.Structure):
    _fields_ = [(name, ctypes.c_double) for name in CONST_NAMES]


def _cpu_flags() -> str:
    """The CPU's feature flags: a library built with -march=native is only valid where they match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _cache_dir() -> Path:
    root = os.environ.get("ELIXIR_CACHE_DIR") or Path.home() / ".cache" / "elixir"
    return Path(root) / "cpu_adam"


def _build(cxx: str, flags: list[str], target: Path) -> None:
    """Compile into a temp file and rename it into place, so concurrent builders never race."""
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    cmd = [cxx, *_BASE_FLAGS, *flags, str(_CSRC / "cpu_adam.cpp"), "-o", tmp]
    try:
        res = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
        if res.returncode != 0:
            raise CpuAdamUnavailable(f"`{' '.join(cmd)}` failed:\n{res.stderr[-4000:]}")
        os.replace(tmp, target)
    finally:
        if os.path.exists(tmp):
            os.unlink(tmp)


@cache
def load_library(isa: str = "native") -> ctypes.CDLL:
    """Build (once per source/flags/CPU) and load the kernel library; raises CpuAdamUnavailable."""
    if isa not in _ISA_FLAGS:
        raise ValueError(f"isa must be one of {sorted(_ISA_FLAGS)}, got {isa!r}")
    if not all((_CSRC / f).is_file() for f in _SOURCES):
        raise CpuAdamUnavailable(f"C++ sources not found under {_CSRC}")
    cxx = os.environ.get("CXX", "c++")
    flags = _ISA_FLAGS[isa]
    key = hashlib.sha256()
    for f in _SOURCES:
        key.update((_CSRC / f).read_bytes())
    key.update(repr((cxx, _BASE_FLAGS, flags, platform.machine(), _cpu_flags())).encode())
    target = _cache_dir() / key.hexdigest()[:24] / "libelixir_cpu_adam.so"
    if not target.is_file():
        if shutil.which(cxx) is None:
            raise CpuAdamUnavailable(f"no C++ compiler ({cxx!r} not on PATH; set CXX)")
        _build(cxx, flags, target)
    try:
        lib = ctypes.CDLL(str(target))
    except OSError as err:
        raise CpuAdamUnavailable(f"could not load {target}: {err}") from err
    lib.elixir_adam_isa.restype = ctypes.c_char_p
    lib.elixir_adam_step.restype = ctypes.c_int
    lib.elixir_adam_step.argtypes = [
        *[ctypes.c_void_p] * 4, ctypes.c_int, ctypes.c_void_p, ctypes.c_int,
        ctypes.POINTER(_Seg), ctypes.c_int64, ctypes.POINTER(_Group), ctypes.c_int64, ctypes.c_int64, ctypes.c_int,
    ]
    return lib


class CpuAdamKernel:
    """AdamKernel for CPU arenas: one OpenMP-parallel C++ call per step covers every segment.

    ``isa`` pins the instruction set ("avx512", "avx2", "scalar") instead of the machine's best
    ("native"), which lets the tests check every code path on one machine. ``threads`` defaults
    to ``torch.get_num_threads()`` at each call.
    """

    def __init__(self, isa: str = "native", threads: int | None = None) -> None:
        self._lib = load_library(isa)
        self.isa: str = self._lib.elixir_adam_isa().decode()
        self._threads = threads
        self._tables: dict[tuple[GroupRange, ...], tuple[ctypes.Array, int, int]] = {}

    def _table(self, segments: Sequence[GroupRange]) -> tuple[ctypes.Array, int, int]:
        """The C segment table, the arena end and the group count it needs; cached per segments."""
        key = tuple(segments)
        hit = self._tables.get(key)
        if hit is None:
            end, groups = segment_extent(key)
            table = (_Seg * len(key))(*[(s.offset, s.length, s.group) for s in key])
            hit = bounded_put(self._tables, key, (table, end, groups))
        return hit

    def step(
        self,
        master: torch.Tensor,
        exp_avg: torch.Tensor,
        exp_avg_sq: torch.Tensor,
        grad: torch.Tensor,
        param_out: torch.Tensor | None,
        segments: Sequence[GroupRange],
        hypers: Sequence[AdamHyper],
        step: int,
        div_scale: float,
    ) -> None:
        """Update all segments in one call (see ``AdamKernel``)."""
        if master.device.type != "cpu":
            raise ValueError(f"the CPU kernel needs CPU arenas, got {master.device}")
        n = master.numel()
        consts = step_constants(hypers, step, div_scale)
        table, end, groups = self._table(segments)
        check_arenas(master, exp_avg, exp_avg_sq, grad, param_out, end, groups, len(hypers))
        rc = self._lib.elixir_adam_step(
            master.data_ptr(), exp_avg.data_ptr(), exp_avg_sq.data_ptr(), grad.data_ptr(), _DTYPE_CODE[grad.dtype],
            None if param_out is None else param_out.data_ptr(),
            _NO_OUT if param_out is None else _DTYPE_CODE[param_out.dtype],
            table, len(table), (_Group * len(consts))(*consts), 0, n,
            self._threads or torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"elixir_adam_step failed with code {rc}")
