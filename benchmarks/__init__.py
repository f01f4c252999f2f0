"""Micro-benchmarks for the runtime's kernels (run from the repo root: ``python -m benchmarks.NAME``)."""
