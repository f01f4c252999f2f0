#!/bin/bash
# Wheels to carry the fused-kernel baselines to the GPU machine, which has no network (Python 3.12,
# x86-64, torch 2.11+cu130, triton 3.6, transformers 5.17, accelerate 1.15, numpy and packaging
# there): liger-kernel (--liger), bitsandbytes (trainer_lossy's paged_adamw_8bit), torchao
# (torchao_offload's CPUOffloadOptimizer; 0.18 loads its C++ ops with torch >= 2.11 only, and the
# optimizer is pure Python), torch-optimi, trl (`make test-gpu` collects tests/elixir_hf/test_fused_head.py,
# which imports it), and pytest with the plugins and deps the image lacks.
# bitsandbytes' wheel holds a library per CUDA and ROCm version (43 MB): it is rebuilt here with its
# CUDA 13 libraries (libbitsandbytes_cuda13*.so: torch cu130 loads cuda130) and the CPU one only,
# its RECORD trimmed to match, so that the folder stays far below the device call's 64 MiB carry.
#
#   bash benchmarks/make_fused_wheels.sh [DEST]      # DEST defaults to .whl/fused/ (git-ignored)
#
# There, before the benchmark (name .whl in the device call's carry):
#   python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site .whl/fused/*.whl \
#     && export PYTHONPATH=/tmp/site:$PYTHONPATH
# Downloads need a Python with pip: PY, default the repo's .venv.
set -euo pipefail
repo=$(cd "$(dirname "$0")/.." && pwd)
dest=$(realpath -m "${1:-$repo/.whl/fused}")
py=${PY:-$repo/.venv/bin/python}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
mkdir -p "$dest"
rm -f "$dest"/*.whl  # a wheel of an older pin would be installed beside its successor

# Every wheel's Requires-Dist (extras aside) is torch, triton, numpy or packaging (on the image) or
# one of these: pytest's iniconfig, pluggy, pygments and packaging >= 24 (the image's may be older);
# datasets (benchmarks.quality, the recipe's data, trl) with dill and multiprocess: the image has its pyarrow
# (25.0.1), pandas, xxhash, fsspec, huggingface_hub (1.33.0), accelerate and jinja2 (trl's others).
"$py" -m pip download -q --no-deps --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_28_x86_64 --platform manylinux_2_24_x86_64 --platform manylinux_2_17_x86_64 \
  --platform manylinux2014_x86_64 --platform any -d "$work" \
  liger-kernel==0.8.5 bitsandbytes==0.50.2 torchao==0.18.0 torch-optimi==0.3.3 trl==1.16.0 \
  pytest==9.2.0 pytest-timeout==2.4.0 iniconfig==2.3.1 pluggy==1.7.0 pygments==2.21.0 packaging==26.4 \
  datasets==5.2.0 dill==0.4.1 multiprocess==0.70.19

"$py" - "$work"/bitsandbytes-0.50.2-*.whl "$dest" <<'PY'
"""The wheel without the native libraries of other CUDA versions, ROCm and XPU; RECORD to match."""
import re
import sys
import zipfile
from pathlib import Path

src, dest = Path(sys.argv[1]), Path(sys.argv[2])
drop = re.compile(r"bitsandbytes/libbitsandbytes_(?!cpu\.|cuda13)\w+\.so$")
with zipfile.ZipFile(src) as zin, zipfile.ZipFile(dest / src.name, "w", zipfile.ZIP_DEFLATED) as zout:
    libs = [n for n in zin.namelist() if n.endswith(".so")]
    if not any(re.search(r"libbitsandbytes_cuda13\d*\.so$", n) for n in libs):
        sys.exit(f"{src.name} holds no CUDA 13 library ({libs}): pick a bitsandbytes built for CUDA 13")
    for item in zin.infolist():
        if drop.search(item.filename):
            continue
        data = zin.read(item)
        if item.filename.endswith(".dist-info/RECORD"):
            lines = data.decode().splitlines(keepends=True)
            data = "".join(line for line in lines if not drop.search(line.split(",")[0])).encode()
        zout.writestr(item, data, compress_type=zipfile.ZIP_DEFLATED)
    kept = [n for n in zout.namelist() if n.endswith(".so")]
print(f"{src.name}: kept {', '.join(Path(n).name for n in kept)}")
PY
rm "$work"/bitsandbytes-0.50.2-*.whl
mv "$work"/*.whl "$dest"/
ls -la "$dest"
du -sh "$dest"
