#!/bin/bash
# Wheels to carry DeepSpeed to the GPU machine, which has no network: DeepSpeed 0.19.8 built here
# from its source distribution with no ops compiled (its CPU Adam JIT-builds there in ~40 s, with
# the image's nvcc and ninja), plus the pure-Python deps the GPU image lacks, plus fallbacks of
# those it has (py-cpuinfo, msgpack, einops, ninja), and check.sh.
#
#   bash benchmarks/make_wheels.sh [DEST]      # DEST defaults to .whl/ds/ (git-ignored)
#
# There, before the benchmark (name .whl in the device call's carry):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/ds/*.whl \
#     && export PYTHONPATH=/tmp/site:$PYTHONPATH && bash .whl/ds/check.sh
# check.sh (python -m benchmarks.ds_check) imports DeepSpeed and JIT-builds its CPU Adam, ~1 min.
# The build needs a Python with torch (DeepSpeed's setup.py imports it): PY, default the repo's .venv.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dest=$(realpath -m "${1:-$repo/.whl/ds}")
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
  -d "$dest" hjson==3.1.0 pydantic==2.12.5 pydantic-core==2.41.5 annotated-types==0.7.0 typing-inspection==0.4.2 \
  py-cpuinfo==9.0.0 msgpack==1.2.4 einops==0.8.1 ninja==1.13.2
# ninja lands in /tmp/site/bin there: check.sh puts it on PATH when the image has none.
cat > "$dest/check.sh" <<'SH'
#!/bin/bash
# DeepSpeed usable on this machine? Run from the repo root after installing .whl/ds/*.whl into /tmp/site.
export PYTHONPATH=/tmp/site:src:.${PYTHONPATH:+:$PYTHONPATH}
command -v ninja >/dev/null || export PATH=/tmp/site/bin:$PATH
echo "python $(python3 -V 2>&1), ninja $(ninja --version 2>&1), $(c++ --version 2>&1 | head -1), nvcc: $(command -v nvcc || echo none)"
timeout 600 python3 -m benchmarks.ds_check
SH
chmod +x "$dest/check.sh"
ls -la "$dest"
