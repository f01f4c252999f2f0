"""The C++ CPU Adam kernel (``kernels/csrc/cpu_adam.cpp``, package data), built on first use.

``load_library`` builds the sources shipped in the package with ``torch.utils.cpp_extension.load``
as a plain shared library (``is_python_module=False``: a C ABI, no torch C++ ABI) and loads it with
ctypes, which drops the GIL for the duration of a call. The compiler is ``$CXX`` (default ``c++``),
with OpenMP, ``-O3`` and ``-march=native`` (AVX-512, AVX2 or scalar code is picked by the
compiler's own feature macros), through ninja.

The build is cached under ``$TORCH_EXTENSIONS_DIR`` (default: torch's, ``~/.cache/torch_extensions``)
in ``elixir_cpu_adam/<torch version>-<python>-<isa>-<key>/``, the key hashing the sources, the
compiler, the flags and the CPU's feature flags: a library built with ``-march=native`` is reused
only on the same kind of CPU, with the same torch. It is built once per machine: every process
takes a file lock on the build directory first (``filelock``, released if its holder dies), so
concurrent ranks wait for one build and then load it. Anything that stops the build raises
:class:`CpuAdamUnavailable` saying why and what fixes it.

Both states of ``adam_state.py`` run here: ``elixir_adam_step`` for exact fp32 moments,
``elixir_adam8_step`` for 8-bit ones ([Note: 8-bit kernel] in cpu_adam.cpp: the same fp32 update per
element, codes and scales bitwise ``quant8.quantize``'s of the new moments, on every ISA and thread
count).

[Note: one lookup per code]
``quant8``'s rule takes two dependent lookups per value: ``c = bucket[key]``, then ``mid[c]`` for the
comparison. A bucket (the fp32 values sharing the top 16 bits ``key``) holds at most one midpoint,
so within it ``x > mid[c]`` is a comparison of the low 16 bits: for ``x >= 0``, ``low(x) > low(mid)``;
for ``x < 0`` the order of magnitudes reverses, ``~low(x) > ~low(mid)`` (16 bits). :func:`key_table`
stores ``c << 16 | threshold`` per key, the threshold ``low(mid[c])`` (or its complement for a
negative key) where the bucket holds ``mid[c]``, else 0xFFFF (never above), so one lookup and
integer operations give the code. Exact for every ``x`` in [-1, 1] and NaN, all a kernel divides
out (``|value| <= scale``); ``test_key_table_gives_quant8s_codes`` checks it against the rule.

[Note: 8-bit rate] Measured on a shared 2-core AMD EPYC (Zen 4) VM, 2^26 elements, bf16 grad and
param copy, best of interleaved rounds: fp32 ~1.0-1.3 G elements/s at 1 or 2 threads (memory bound:
28 bytes per element), 8-bit ~0.36 per core and ~0.45 at 2 threads under the machine's load (16 bytes
per element, but compute bound). Its time is the four table lookups per element (two dequantized by
in-register permutes on AVX-512, gathers on AVX2; two codes by gathers of :func:`key_table`): Zen 4
gathers about one lane per cycle, scalar loads no faster. It gains on fp32 only where more cores
share the memory bandwidth than fp32 needs (the hardware profile measures both rates).
"""

from __future__ import annotations

import ctypes
import hashlib
import os
import platform
import re
import shutil
import subprocess
import sys
from collections.abc import Sequence
from functools import cache
from pathlib import Path

import numpy as np
import torch

from ..adam_state import AdamTensors
from ..chunk.layout import GroupRange
from . import quant8
from .adam_consts import CONST_NAMES, step_constants
from .kernel import AdamHyper, bounded_put, check_arenas, segment_extent

__all__ = ["CpuAdamKernel", "CpuAdamUnavailable", "load_library", "library_path", "build_directory", "CSRC"]

CSRC = Path(__file__).resolve().parent / "csrc"
"""The kernel's C++ sources, shipped as package data (pyproject.toml ``[tool.setuptools.package-data]``)."""
_SOURCES = ("cpu_adam.cpp", "cpu_adam_simd.h")
_ISA_FLAGS = {
    "native": ["-march=native"],
    "avx512": ["-march=x86-64-v4", "-mtune=native"],
    "avx2": ["-march=x86-64-v3", "-mtune=native"],
    "scalar": ["-march=x86-64", "-mtune=native"],
}
_CFLAGS = ["-O3", "-fopenmp"]
_LDFLAGS = ["-fopenmp"]
_DTYPE_CODE = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2}
_NO_OUT = 3
_COMPILER_FIX = (
    "install g++ with OpenMP (Debian/Ubuntu: apt-get install g++; RHEL: dnf install gcc-c++) or set CXX to one"
)


class CpuAdamUnavailable(RuntimeError):
    """The C++ kernel could not be built or loaded; the message says why and what fixes it."""


class _Seg(ctypes.Structure):
    _fields_ = [("offset", ctypes.c_int64), ("length", ctypes.c_int64), ("group", ctypes.c_int64)]


class _Group(ctypes.Structure):
    _fields_ = [(name, ctypes.c_double) for name in CONST_NAMES]


class _Map(ctypes.Structure):
    """One moment's map (``Map`` in cpu_adam.cpp): ``quant8``'s codebook and :func:`key_table`."""

    _fields_ = [("code", ctypes.c_void_p), ("key", ctypes.c_void_p)]


@cache
def key_table(kind: str) -> torch.Tensor:
    """Per top-16-bit pattern ``key`` of an fp32 ``x``: ``code << 16 | threshold`` (uint32 as int32),
    from which the kernel gets ``quant8``'s code of ``x`` in one lookup ([Note: one lookup per code])."""
    t = quant8.tables(kind)
    keys = np.arange(1 << 16, dtype=np.uint32)
    code = t.bucket.numpy().astype(np.uint32)
    mid = t.mid.numpy().view(np.uint32)[code]
    low = mid & 0xFFFF
    threshold = np.where((mid >> 16) != keys, 0xFFFF, np.where(keys & 0x8000, 0xFFFF - low, low))
    return torch.from_numpy((code << 16 | threshold).view(np.int32))


def _maps() -> ctypes.Array[_Map]:
    """The two moments' maps (the tensors are cached for the process: the pointers stay valid)."""
    return (_Map * 2)(
        *[_Map(quant8.tables(kind).code.data_ptr(), key_table(kind).data_ptr()) for kind in quant8.MOMENT_KINDS]
    )


def _cpu_flags() -> str:
    """The CPU's feature flags: a library built with -march=native is only valid where they match."""
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _check_isa(isa: str) -> None:
    if isa not in _ISA_FLAGS:
        raise ValueError(f"isa must be one of {sorted(_ISA_FLAGS)}, got {isa!r}")


def build_directory(isa: str = "native") -> Path:
    """Where the library of ``isa`` is built and cached (see the module docstring); a pure function
    of the environment, the sources and this machine: nothing is created."""
    from torch.utils.cpp_extension import get_cxx_compiler, get_default_build_root

    _check_isa(isa)
    key = hashlib.sha256()
    for f in _SOURCES:
        path = CSRC / f
        key.update(path.read_bytes() if path.is_file() else b"")
    key.update(repr((get_cxx_compiler(), _CFLAGS, _ISA_FLAGS[isa], platform.machine(), _cpu_flags())).encode())
    root = os.environ.get("TORCH_EXTENSIONS_DIR") or get_default_build_root()
    py = f"py{sys.version_info.major}{sys.version_info.minor}"
    return Path(root) / "elixir_cpu_adam" / f"{torch.__version__}-{py}-{isa}-{key.hexdigest()[:16]}"


def _name(directory: Path) -> str:
    """The library's name, unique per build directory: cpp_extension versions a name whose build
    inputs change within a process (``name_v1``...), which a name of its own never does."""
    isa, key = directory.name.rsplit("-", 2)[1:]
    return f"elixir_cpu_adam_{isa}_{key}"


_NO_OPENMP = re.compile(r"omp\.h|cannot find -l[gi]?omp|library not found for -l[gi]?omp|unsupported option '-fopenmp'")
"""What a compiler without OpenMP says (its header, its runtime library, or the flag itself). Not a
bare ``-fopenmp``: every command line ninja echoes has one."""


def _why_build_failed(output: str) -> str:
    """The likely cause of a failed build, from the compiler's output."""
    return "the compiler has no OpenMP" if _NO_OPENMP.search(output) else "the compiler failed"


def _build(isa: str, directory: Path) -> Path:
    """Build (or find up to date) the library in ``directory``; returns its path. Call under the lock."""
    from torch.utils.cpp_extension import get_cxx_compiler, is_ninja_available, load

    missing = [f for f in _SOURCES if not (CSRC / f).is_file()]
    if missing:
        raise CpuAdamUnavailable(
            f"the C++ sources {missing} are missing from {CSRC}. Fix: reinstall elixir-hf from a wheel or "
            f"clone that ships elixir_runtime/kernels/csrc/ (pip install --force-reinstall elixir-hf)"
        )
    cxx = get_cxx_compiler()
    if shutil.which(cxx) is None:
        raise CpuAdamUnavailable(f"no C++ compiler: {cxx!r} is not on PATH. Fix: {_COMPILER_FIX}")
    if not is_ninja_available():
        raise CpuAdamUnavailable(
            "ninja is not on PATH (torch.utils.cpp_extension builds with it). Fix: pip install ninja"
        )
    stale = directory / "lock"  # cpp_extension's own baton: under our lock, only a dead build leaves one
    stale.unlink(missing_ok=True)
    name = _name(directory)
    try:
        load(  # returns nothing documented for a plain library: it is built as <name>.so in the directory
            name=name,
            sources=[str(CSRC / "cpu_adam.cpp")],
            extra_cflags=[*_CFLAGS, *_ISA_FLAGS[isa]],  # lists of our own: load() appends to them
            extra_ldflags=list(_LDFLAGS),
            build_directory=str(directory),
            is_python_module=False,
        )
    except (RuntimeError, OSError, subprocess.SubprocessError) as err:
        output = getattr(err, "output", None) or b""  # torch's own compiler check: a CalledProcessError
        text = f"{err}\n{output.decode(errors='replace') if isinstance(output, bytes) else output}".strip()
        raise CpuAdamUnavailable(
            f"building the C++ CPU Adam with {cxx!r} in {directory} failed ({_why_build_failed(text)}). "
            f"Fix: {_COMPILER_FIX}. The compiler said:\n{text[-4000:]}"
        ) from err
    return directory / f"{name}.so"


_LOADED: dict[str, Path] = {}
"""The file each ISA's library was loaded from in this process."""


def load_library(isa: str = "native") -> ctypes.CDLL:
    """The kernel library of ``isa``, built once per machine, sources, flags and torch, loaded once
    per process; raises :class:`CpuAdamUnavailable`. Concurrent processes wait on a file lock for
    one build."""
    _check_isa(isa)
    return _load(isa)


@cache
def _load(isa: str) -> ctypes.CDLL:
    from filelock import FileLock

    directory = build_directory(isa)
    directory.mkdir(parents=True, exist_ok=True)
    with FileLock(str(directory / "elixir-build.lock")):
        path = _build(isa, directory)
    try:
        lib = ctypes.CDLL(str(path))
    except OSError as err:
        raise CpuAdamUnavailable(f"could not load {path}: {err}. Fix: delete {directory} to rebuild it") from err
    lib.elixir_adam_isa.restype = ctypes.c_char_p
    lib.elixir_adam_step.restype = ctypes.c_int
    lib.elixir_adam_step.argtypes = [
        *[ctypes.c_void_p] * 4,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.POINTER(_Seg),
        ctypes.c_int64,
        ctypes.POINTER(_Group),
        ctypes.c_int64,
        ctypes.c_int64,
        ctypes.c_int,
    ]
    lib.elixir_adam8_step.restype = ctypes.c_int
    lib.elixir_adam8_step.argtypes = [
        *[ctypes.c_void_p] * 6,
        ctypes.c_int,
        ctypes.c_void_p,
        ctypes.c_int,
        ctypes.POINTER(_Seg),
        ctypes.c_int64,
        ctypes.POINTER(_Group),
        ctypes.POINTER(_Map),
        ctypes.c_int,
    ]
    _LOADED[isa] = path
    return lib


def library_path(isa: str = "native") -> Path | None:
    """The file ``isa``'s library was loaded from in this process (``None`` before ``load_library``)."""
    return _LOADED.get(isa)


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
        self._tables: dict[tuple[GroupRange, ...], tuple[ctypes.Array[_Seg], int, int]] = {}
        self._maps: ctypes.Array[_Map] | None = None

    def _table(self, segments: Sequence[GroupRange]) -> tuple[ctypes.Array[_Seg], int, int]:
        """The C segment table, the arena end and the group count it needs; cached per segments."""
        key = tuple(segments)
        hit = self._tables.get(key)
        if hit is None:
            end, groups = segment_extent(key)
            table = (_Seg * len(key))(*[_Seg(s.offset, s.length, s.group) for s in key])
            hit = bounded_put(self._tables, key, (table, end, groups))
        return hit

    def step(
        self,
        state: AdamTensors,
        grad: torch.Tensor,
        param_out: torch.Tensor | None,
        segments: Sequence[GroupRange],
        hypers: Sequence[AdamHyper],
        step: int,
        div_scale: float,
    ) -> None:
        """Update all segments in one call (see ``AdamKernel``): exact fp32 moments, or 8-bit ones
        ([Note: 8-bit kernel] in cpu_adam.cpp)."""
        master = state.master
        if master.device.type != "cpu":
            raise ValueError(f"the CPU kernel needs CPU arenas, got {master.device}")
        consts = step_constants(hypers, step, div_scale)
        table, end, groups = self._table(segments)
        check_arenas(state, grad, param_out, segments, end, groups, len(hypers))
        out = None if param_out is None else param_out.data_ptr()
        out_dtype = _NO_OUT if param_out is None else _DTYPE_CODE[param_out.dtype]
        group_table = (_Group * len(consts))(*[_Group(*c) for c in consts])
        threads = self._threads or torch.get_num_threads()
        if state.spec.quantized:
            if self._maps is None:
                self._maps = _maps()
            rc = self._lib.elixir_adam8_step(
                master.data_ptr(),
                state["exp_avg"].data_ptr(),
                state["exp_avg_sq"].data_ptr(),
                state["exp_avg.absmax"].data_ptr(),
                state["exp_avg_sq.absmax"].data_ptr(),
                grad.data_ptr(),
                _DTYPE_CODE[grad.dtype],
                out,
                out_dtype,
                table,
                len(table),
                group_table,
                self._maps,
                threads,
            )
            name = "elixir_adam8_step"
        else:
            rc = self._lib.elixir_adam_step(
                master.data_ptr(),
                state["exp_avg"].data_ptr(),
                state["exp_avg_sq"].data_ptr(),
                grad.data_ptr(),
                _DTYPE_CODE[grad.dtype],
                out,
                out_dtype,
                table,
                len(table),
                group_table,
                0,
                master.numel(),
                threads,
            )
            name = "elixir_adam_step"
        if rc != 0:
            raise RuntimeError(f"{name} failed with code {rc}")
