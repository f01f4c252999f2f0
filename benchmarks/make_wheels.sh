#!/bin/bash
# Wheels to carry DeepSpeed to the GPU machine, which has no network: DeepSpeed 0.19.8 built here
# from its source distribution with no ops compiled (its CPU Adam JIT-builds there in ~40 s, with
# the image's nvcc and ninja), plus the pure-Python deps the GPU image lacks.
#
#   bash benchmarks/make_wheels.sh [DEST]      # DEST defaults to .whl/ (git-ignored)
#
# There, before the benchmark (name .whl in the device call's carry):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/*.whl \
#     && export PYTHONPATH=/tmp/site:$PYTHONPATH
# The build needs a Python with torch (DeepSpeed's setup.py imports it): PY, default the repo's .venv.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dest=$(realpath -m "${1:-$repo/.whl}")
py=${PY:-$repo/.venv/bin/python}
build=$(mktemp -d)
trap 'rm -rf "$build"' EXIT
mkdir -p "$dest"

DS_BUILD_OPS=0 "$py" -m pip wheel -q --no-deps --no-build-isolation --no-binary deepspeed -w "$build" deepspeed==0.19.8
cp "$build"/deepspeed-0.19.8-*.whl "$dest"/

# The GPU image (Python 3.12, x86-64) has torch, numpy, packaging, psutil, py-cpuinfo, tqdm,
# einops, msgpack, ninja and nvidia-ml-py; these are the rest of DeepSpeed's requirements.
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_17_x86_64 --platform manylinux2014_x86_64 \
  -d "$dest" hjson==3.1.0 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2
ls -la "$dest"
