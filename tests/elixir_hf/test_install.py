"""The release a user installs: ``python -m build`` on a clean copy of the sources makes an sdist and,
from it, a wheel (issue 50); both install outside the repo and run a command there; the wheel's metadata
declares pyproject.toml's version and dependencies. An installed wheel builds and selects the C++ CPU
Adam (issue 25): the C++ sources are package data, and concurrent first uses build once.

Offline: built with the venv's setuptools (``--no-isolation``) and installed with ``--no-deps --no-index
--target``; torch and the rest come from the venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tarfile
import tomllib
import zipfile
from pathlib import Path

import pytest

from elixir_runtime.kernels import cpu_adam

REPO = Path(__file__).resolve().parents[2]
PROJECT = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
VERSION = PROJECT["version"]

# The packaging, not transformers code: the newest transformers only (the elixir-plan it runs from the
# installed copy, commands/test_plan.py runs on both versions)
pytestmark = pytest.mark.once


@pytest.fixture(scope="module")
def dist(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Path]:
    """``python -m build`` of a clean copy of the tree (what a clone has: pyproject.toml, README.md,
    LICENSE, src/): the sdist, and the wheel built from it."""
    pytest.importorskip("setuptools", reason="builds with the venv's setuptools (offline)")
    pytest.importorskip("build", reason="python -m build: the dev extra's build")
    root = tmp_path_factory.mktemp("dist")
    clone = root / "clone"
    clone.mkdir()
    for name in ("pyproject.toml", "README.md", "LICENSE"):
        shutil.copy2(REPO / name, clone)
    shutil.copytree(REPO / "src", clone / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    done = subprocess.run(
        [sys.executable, "-m", "build", "--no-isolation", "--outdir", str(root / "dist"), str(clone)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    (sdist,) = (root / "dist").glob("elixir_hf-*.tar.gz")
    (whl,) = (root / "dist").glob("elixir_hf-*.whl")
    return {"sdist": sdist, "wheel": whl}


@pytest.fixture(scope="module")
def wheel(dist: dict[str, Path]) -> Path:
    return dist["wheel"]


def _install(what: Path, site: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q", "install", "--no-deps", "--no-index"]
        + ["--no-build-isolation", "--target", str(site), str(what)],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-3000:]


def test_the_release_is_named_by_its_version(dist: dict[str, Path]) -> None:
    assert dist["sdist"].name == f"elixir_hf-{VERSION}.tar.gz"
    assert dist["wheel"].name == f"elixir_hf-{VERSION}-py3-none-any.whl"
    with tarfile.open(dist["sdist"]) as tar:
        names = {n.split("/", 1)[1] for n in tar.getnames() if "/" in n}
    assert {"pyproject.toml", "README.md", "LICENSE", "src/elixir_runtime/kernels/csrc/cpu_adam.cpp"} <= names


def test_the_wheel_declares_pyproject_s_dependencies(wheel: Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        (meta,) = [n for n in z.namelist() if n.endswith(".dist-info/METADATA")]
        text = z.read(meta).decode()
    assert f"\nVersion: {VERSION}\n" in text
    requires = [line.removeprefix("Requires-Dist: ") for line in text.splitlines() if line.startswith("Requires-Dist:")]
    core = {_key(r) for r in requires if "extra ==" not in r}
    assert core == {_key(d) for d in PROJECT["dependencies"]}, core


def _key(requirement: str) -> tuple[str, str]:
    from packaging.requirements import Requirement
    from packaging.utils import canonicalize_name

    r = Requirement(requirement)
    return canonicalize_name(r.name), str(r.specifier)


@pytest.mark.parametrize("kind", ["sdist", "wheel"])
def test_the_installed_release_plans_outside_the_repo(dist: dict[str, Path], kind: str, tmp_path: Path) -> None:
    """Installed from the sdist (built again into a wheel) or the wheel, in a folder of its own: the
    package imports from there with its version, and elixir-plan plans a preset (no GPU, no network)."""
    site = tmp_path / "site"
    _install(dist[kind], site)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1", "HF_HUB_OFFLINE": "1"}
    code = "import elixir_hf, sys; print(elixir_hf.__version__, elixir_hf.__file__)"
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, env=env, capture_output=True, text=True)
    version, where = out.stdout.split()
    assert version == VERSION and Path(where).is_relative_to(site), out.stdout + out.stderr
    plan = [sys.executable, "-m", "elixir_hf.commands.plan", "--model", "tiny", "--seq-len", "64", "--gpu", "h100"]
    out = subprocess.run([*plan, "--json"], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-3000:]
    assert json.loads(out.stdout)["plan"]["n_chunks"] > 0


def test_the_wheel_ships_the_kernel_sources_and_the_commands(wheel: Path) -> None:
    names = zipfile.ZipFile(wheel).namelist()
    for source in ("cpu_adam.cpp", "cpu_adam_simd.h"):
        assert f"elixir_runtime/kernels/csrc/{source}" in names
    assert "elixir_runtime/hardware/profiles/h100.json" in names
    (entry_points,) = [n for n in names if n.endswith("entry_points.txt")]
    scripts = zipfile.ZipFile(wheel).read(entry_points).decode()
    for script in (
        "elixir-convert = elixir_hf.commands.convert:main",
        "elixir-env = elixir_hf.commands.env:main",
        "elixir-plan = elixir_hf.commands.plan:main",
        "elixir-run = elixir_hf.commands.run:main",
    ):
        assert script in scripts


def test_an_installed_wheel_selects_the_cpp_kernel(
    wheel: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Two processes start at once on a fresh extensions directory holding a stale cpp_extension
    baton (a build killed earlier): both report ``"cpu_adam": "cpp"`` from the installed copy,
    the library was compiled once, and neither hangs on the baton."""
    site = tmp_path / "site"
    _install(wheel, site)
    ext = tmp_path / "torch_extensions"
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(ext))
    monkeypatch.delenv("ELIXIR_ADAM_KERNEL", raising=False)
    env = {**os.environ, "PYTHONPATH": str(site), "OMP_NUM_THREADS": "1"}
    build_dir = cpu_adam.build_directory("native")  # the installed copy's sources are these bytes
    build_dir.mkdir(parents=True)
    (build_dir / "lock").touch()

    cmd = [sys.executable, "-m", "elixir_hf.commands.env", "--json"]
    procs = [
        subprocess.Popen(cmd, cwd=tmp_path, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        for _ in range(2)
    ]
    try:
        results = [p.communicate(timeout=240) for p in procs]
    finally:
        for p in procs:
            p.kill()
    for p, (out, err) in zip(procs, results):
        assert p.returncode == 0, err
        report = json.loads(out)
        assert report["cpu_adam"] == "cpp", report["cpu_adam_detail"]
        assert report["version"] == VERSION
        assert Path(report["location"]) == site
        assert str(build_dir) in report["cpu_adam_detail"]
        assert {"triton_adam", "gpus", "host_memory_gib"} <= report.keys()
    built = [line.split("\t")[-1] for line in (build_dir / ".ninja_log").read_text().splitlines()[1:]]
    assert sorted(built) == sorted(set(built)) and len(built) == 2, built  # cpu_adam.o and the .so, once each
