"""``python -m elixir_hf.commands.env`` (``elixir-env``): what elixir-hf finds on this machine, for bug reports.

    python -m elixir_hf.commands.env          # a table
    python -m elixir_hf.commands.env --json   # one JSON object

It reports the package and library versions, the CPU Adam kernel offloaded chunks get (``cpp``, or
``torch`` and why: the C++ kernel is built here if it is not built yet, as on the first training
step), whether the fused GPU Adam (Triton) is ready, the GPUs, the host's RAM and cores, and the
hardware profile ``--elixir auto`` would plan with. It measures nothing and imports no
transformers code (versions come from the installed metadata).

The JSON object's keys: ``version``, ``location`` (the directory the packages were imported from), ``python``, ``platform``, ``torch``, ``cuda``, ``transformers``,
``accelerate``, ``triton`` (versions, ``null`` where not installed), ``cpu_adam`` (``"cpp"`` or
``"torch"``) and ``cpu_adam_detail`` (the build, or why not and the fix), ``triton_adam``
(``"triton"`` or ``"torch"``) and ``triton_adam_detail``, ``gpus`` (a list of ``{"name",
"memory_gib", "capability"}``), ``host_memory_gib``, ``cpu_cores`` (those this process may run on)
and ``hardware_profile`` (where ``auto``'s profile comes from).
"""

from __future__ import annotations

import argparse
import json
import logging
from collections.abc import Sequence

from ... import __version__

__all__ = ["main"]

# Only the standard library at import: --help and --version answer before torch loads (seconds);
# report.py, which reads the machine with torch and the engine, after the command line parsed.


class _NoCudaRuntime(logging.Filter):
    """Drops torch's "No CUDA runtime is found, using CUDA_HOME=..." (a CUDA wheel on a machine without a
    GPU, when the C++ Adam's build imports cpp_extension): the report's GPUs line says it in its place."""

    def filter(self, record: logging.LogRecord) -> bool:
        return not record.getMessage().startswith("No CUDA runtime is found")


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="elixir-env", description=__doc__.split("\n\n")[0])
    ap.add_argument("--version", action="version", version=f"%(prog)s {__version__}")
    ap.add_argument("--json", action="store_true", help="print one JSON object")
    args = ap.parse_args(argv)
    quiet, torch_log = _NoCudaRuntime(), logging.getLogger("torch.utils.cpp_extension")
    torch_log.addFilter(quiet)
    from .report import environment, report_text

    try:
        env = environment()
    finally:
        torch_log.removeFilter(quiet)
    print(json.dumps(env, indent=2) if args.json else report_text(env))
    return 0
