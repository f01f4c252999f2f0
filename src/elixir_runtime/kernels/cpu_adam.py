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

import torch

from ..chunk.layout import GroupRange
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
            master.data_ptr(),
            exp_avg.data_ptr(),
            exp_avg_sq.data_ptr(),
            grad.data_ptr(),
            _DTYPE_CODE[grad.dtype],
            None if param_out is None else param_out.data_ptr(),
            _NO_OUT if param_out is None else _DTYPE_CODE[param_out.dtype],
            table,
            len(table),
            (_Group * len(consts))(*[_Group(*c) for c in consts]),
            0,
            n,
            self._threads or torch.get_num_threads(),
        )
        if rc != 0:
            raise RuntimeError(f"elixir_adam_step failed with code {rc}")
