"""Suite-wide setup: force offline Hub access, skip ``gpu`` tests without CUDA, and mark the tests
that run transformers code (``make test`` runs only those again on transformers 5.17)."""

from __future__ import annotations

import functools
import os
import shutil
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

# `make test` on a GPU machine runs as on a CPU-only one: the suite, its ranks and the processes it
# launches see no GPU (a test's result must not depend on the machine, and a rank forked from a
# forkserver that touched CUDA cannot use it). `ELIXIR_TEST_DEVICE=cuda` (`make test-gpu`) shows them.
if os.environ.get("ELIXIR_TEST_DEVICE", "cpu") == "cpu":
    os.environ["CUDA_VISIBLE_DEVICES"] = ""

import torch  # noqa: E402 - after the GPUs are hidden (torch reads CUDA_VISIBLE_DEVICES once)

from elixir_runtime.progress import set_progress_factory
from helpers import dist as dist_harness
from helpers.device import ON_CUDA
from helpers.lifetime import die_with_parent
from helpers.transformers_use import uses_transformers

# An xdist worker dies with the pytest that started it (an interrupted `make test` leaves none running on).
if os.environ.get("PYTEST_XDIST_WORKER"):
    die_with_parent()

# What every rank of a multi-rank test imports, done once by the forkserver the ranks fork from (the
# modeling files load lazily otherwise); here, not in helpers/dist.py, so that an engine-only test of
# the harness does not count as running transformers code (helpers/transformers_use.py).
dist_harness.PRELOAD += [
    "elixir_runtime",
    "helpers.models",
    "elixir_hf",
    *(f"transformers.models.{m}.modeling_{m}" for m in ("gpt2", "opt", "llama")),
]

# What the processes the suite launches leave in the temporary folder (torchrun's `torchelastic_*` log
# folders, which it keeps) goes into one of this process's, removed at its exit.
_TMP = tempfile.TemporaryDirectory(prefix="elixir-tests-", ignore_cleanup_errors=True)
os.environ["TMPDIR"] = _TMP.name

# Tests must never reach the Hub; set before transformers is imported by tests.
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
# Every chunk state transition is checked against its table (runtime/state.py), in spawned ranks too.
os.environ.setdefault("ELIXIR_DEBUG_STATES", "1")


@pytest.fixture(autouse=True)
def _compiled_code_compiles() -> None:
    """An engine's first forward runs compiled code eagerly until its backward; a test that ends
    between the two leaves the process eager (the engine's next forward would end it)."""
    torch.compiler.set_stance("default")


@pytest.fixture(autouse=True)
def _no_progress_bars_left_behind() -> Iterator[None]:
    """A test that builds an Accelerator or Trainer installs the bars' factory for the process
    (``elixir_runtime.progress``); the next test in the same worker starts without it, whichever
    test ran before (the suite's order is xdist's)."""
    previous = set_progress_factory(None)
    try:
        yield
    finally:
        set_progress_factory(previous)


@pytest.fixture(scope="session")
def machine_profile() -> Path:
    """This machine's hardware profile file (``~/.cache/elixir``'s, measured if missing, as by any test that
    plans with it): a test that keeps Elixir's caches in a folder of its own copies it there
    (``hardware_in``), so that its planner does not measure this machine again (13 s on 2 cores)."""
    from elixir_runtime.hardware.load import cache_path, load_hardware

    load_hardware(ranks=())  # what a job's planner measures: the rest, per rank count, the job adds
    return cache_path()


@pytest.fixture()
def hardware_in(machine_profile: Path) -> Callable[[Path], None]:
    """``hardware_in(folder)``: this machine's profile put in ``folder``, an ``ELIXIR_CACHE_DIR``."""

    def put(folder: Path) -> None:
        folder.mkdir(parents=True, exist_ok=True)
        shutil.copy2(machine_profile, folder / machine_profile.name)

    return put


def pytest_report_header(config: pytest.Config) -> str:
    import transformers

    return f"elixir: torch {torch.__version__}, transformers {transformers.__version__}"


_LAUNCHES = ("run_distributed(", "run_ranks(", "run_script(", "subprocess.")
RUN_ONCE = tuple(Path(__file__).parent / name for name in ("elixir_runtime", "reliability", "benchmarks"))
"""Tests of this repository's own code, marked ``once``: the engine (transformers' tiny GPT-2, OPT and
Llama only its subjects), the fault handling of ranks, checkpoints and signals, the benchmark harness.
The transformers code they run, the HF layer's tests run too; ``make test`` runs them on the newest only."""

CUDA_SUITES = tuple(
    Path(__file__).parent / "elixir_runtime" / name
    for name in ("test_parity.py", "test_mixed_precision.py", "test_checkpoint.py", "runtime")
)
"""The engine's suites, marked ``cuda_suite``: they compute on ``helpers.device.local_device()``, so
with ``ELIXIR_TEST_DEVICE=cuda`` (``make test-gpu``) on CUDA, multi-rank ones over NCCL. The other
tests compute on the CPU by design (``make test``, which hides the GPUs); there they skip, saying so."""


@functools.cache
def _launches_processes(path: Path) -> bool:
    source = path.read_text()
    return any(s in source for s in _LAUNCHES)


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark ``transformers`` the tests of modules that reach transformers code (``helpers/transformers_use.py``
    gives the rule), ``once`` and ``cuda_suite`` by folder; honour the ``gpu`` marker: skip rather than fail
    on CPU-only machines; with ``ELIXIR_TEST_DEVICE=cuda`` skip the CPU's tests, saying so. Modules that
    launch processes (the slow ones) run first, each in its own order: under ``make test``'s xdist the
    workers then end on short modules together instead of one waiting for the other's last long one."""
    items.sort(key=lambda item: not _launches_processes(Path(item.path)))  # stable
    for item in items:
        if uses_transformers(Path(item.path)):
            item.add_marker(pytest.mark.transformers)
        if any(folder in Path(item.path).parents for folder in RUN_ONCE):
            item.add_marker(pytest.mark.once)
        if any(suite == Path(item.path) or suite in Path(item.path).parents for suite in CUDA_SUITES):
            item.add_marker(pytest.mark.cuda_suite)
    if ON_CUDA:
        cpu_test = pytest.mark.skip(reason="computes on the CPU by design: `make test` runs it (GPUs hidden)")
        for item in items:
            if "cuda_suite" not in item.keywords and "gpu" not in item.keywords:
                item.add_marker(cpu_test)
    if torch.cuda.is_available():
        return
    skip_gpu = pytest.mark.skip(reason="needs CUDA: make test-gpu (ELIXIR_TEST_DEVICE=cuda) runs it")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip_gpu)
