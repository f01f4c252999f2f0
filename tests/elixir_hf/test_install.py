"""A wheel built from a clean copy of the sources and installed outside the repo builds and selects
the C++ CPU Adam (issue 25): the C++ sources are package data, and concurrent first uses build once.

Offline: the wheel is built with the venv's setuptools (``--no-build-isolation --no-index``) and
installed with ``--no-deps --target``; torch and the rest come from the venv.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest

from elixir_runtime.kernels import cpu_adam

REPO = Path(__file__).resolve().parents[2]
VERSION = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["version"]


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The wheel of a clean copy of the tree (pyproject.toml and src/ only: what a clone has)."""
    pytest.importorskip("setuptools", reason="builds the wheel with the venv's setuptools (offline)")
    root = tmp_path_factory.mktemp("wheel")
    clone = root / "clone"
    clone.mkdir()
    shutil.copy2(REPO / "pyproject.toml", clone)
    shutil.copytree(REPO / "src", clone / "src", ignore=shutil.ignore_patterns("__pycache__", "*.egg-info"))
    pip = [sys.executable, "-m", "pip", "--disable-pip-version-check", "-q"]
    subprocess.run(
        [*pip, "wheel", "--no-deps", "--no-build-isolation", "--no-index", "-w", str(root / "dist"), str(clone)],
        check=True,
        capture_output=True,
        timeout=300,
    )
    (whl,) = (root / "dist").glob("elixir_hf-*.whl")
    return whl


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
    subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "-q",
            "install",
            "--no-deps",
            "--no-index",
            "--target",
            str(site),
            str(wheel),
        ],
        check=True,
        capture_output=True,
        timeout=300,
    )
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
