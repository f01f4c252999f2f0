# Project tasks. The venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch 2.13.0 is the CPU wheel on local disk; installing it first keeps pip
# from resolving `torch>=2.11` to a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
# The triton the GPU Adam's CPU tests (TRITON_INTERPRET=1) ran on; the dev extra takes a range, as a CUDA torch pins its own.
TRITON_PIN := triton==3.6.0; sys_platform == "linux" and platform_machine == "x86_64"
OFFLINE_ENV := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1
# pip compiles no module (--no-compile: 14k files of torch, transformers and the rest, half of the venv's
# minute and a half); each is compiled on its first import and the bytecode written beside it, which a shell's
# PYTHONDONTWRITEBYTECODE would forbid: then every process of `make test` (over a hundred) would compile
# again what it imports, the package's own modules included.
PIP_INSTALL := -m pip install --no-compile
unexport PYTHONDONTWRITEBYTECODE

.PHONY: venv lint test test-perf test-gpu train smoke clean-venv

venv: $(STAMP)

$(VENV): $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) $(PIP_INSTALL) --upgrade pip
	$(VPY) $(PIP_INSTALL) '$(TORCH_PIN)' '$(TRITON_PIN)'
	$(VPY) $(PIP_INSTALL) -e '.[dev]'
	touch $(STAMP)

# transformers 5.17 (the GPU image's) as well as the newest: both are supported and each has
# broken code the other ran. An overlay on the venv (PYTHONPATH), so torch and the rest are shared.
# The second pass runs the tests marked `transformers` only (tests/conftest.py marks those that reach
# transformers code; tests/helpers/transformers_use.py gives the rule): the others run the same code twice.
# Nor does it run the tests of this repository's own code (`once`: tests/elixir_runtime, tests/reliability,
# tests/benchmarks), whose transformers code (tiny GPT-2/OPT/Llama, the Trainer) the HF layer's tests run
# on 5.17 too: they run once, in the first pass. Nor the HF layer's tests marked `once` one by one: those whose
# subject runs in processes they launch (elixir-run's scripts, the recipe, the README's quickstarts, a
# subprocess's imports), each a few seconds of imports, whose transformers code in-process tests run on 5.17.
COMPAT := $(VENV)/compat-transformers-5.17
COMPAT_PINS := transformers==5.17.0 huggingface_hub==1.33.0 httpx==0.28.1 httpcore==1.0.9 certifi==2026.7.22

$(COMPAT)/.installed: $(STAMP)
	rm -rf $(COMPAT)
	$(VPY) $(PIP_INSTALL) -q --no-deps --target $(COMPAT) $(COMPAT_PINS)
	touch $@

# Both passes on every core (pytest-xdist), a module per worker at a time (its fixtures built once), in the
# order tests/conftest.py gives (the modules that launch processes first), not xdist's (most tests first,
# which left the long few-test modules to the end and one worker waiting on them). A worker more than cores
# made the first pass slower on 2 cores (11.5 minutes against 9.7).
XDIST := -n auto --dist loadfile --no-loadscope-reorder

# The lint gate, before every test run and in CI: ruff's lint and format check ([tool.ruff]; `ruff format` and
# `ruff check --fix` repair most of it), the type check ([tool.mypy]: its files, strict where it says), and
# spelling ([tool.codespell]), then the lines of Python per package (a size report, not a gate).
# .pre-commit-config.yaml runs the same on each commit.
LINTED := src tests benchmarks recipes
SPELLED := $(LINTED) docs README.md CHANGELOG.md

lint: $(STAMP)
	$(VPY) -m ruff check $(LINTED)
	$(VPY) -m ruff format --check $(LINTED)
	$(VPY) -m mypy
	$(VENV)/bin/codespell $(SPELLED)
	@echo "lines of Python per package:"; for d in src/elixir_runtime src/elixir_hf tests benchmarks recipes; do \
		printf '  %-20s %7d\n' $$d $$(find $$d -name '*.py' -print0 | xargs -0 cat | wc -l); done

# Wall-clock budgets (`perf`) are not asserted by `make test`: on a loaded machine they fail without a bug.
test: $(STAMP) $(COMPAT)/.installed lint
	$(OFFLINE_ENV) $(VPY) -m pytest -q $(XDIST) -m "not perf"
	$(OFFLINE_ENV) PYTHONPATH=$(COMPAT) $(VPY) -m pytest -q $(XDIST) -m "transformers and not once and not perf"

# On a GPU machine `make test` runs as on a CPU-only one (tests/conftest.py hides the GPUs); this runs the
# engine's suites (`cuda_suite`: parity, mixed precision, checkpoints and tests/elixir_runtime/runtime:
# chunk states, phases, gathers and prefetch, hooks, resident parameters, the update lanes and their
# rate; tests/conftest.py's CUDA_SUITES) on CUDA, multi-rank ones over NCCL, a GPU per rank, then the
# tests marked `gpu`. GPU_PYTHON: an interpreter that has the package's dependencies and pytest where no
# venv can be built (an offline GPU image).
GPU_PYTHON ?= $(VPY)

test-gpu:
	$(OFFLINE_ENV) ELIXIR_TEST_DEVICE=cuda $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m "cuda_suite and not perf"
	$(OFFLINE_ENV) ELIXIR_TEST_DEVICE=cuda $(GPU_PYTHON) -m pytest -q -p no:cacheprovider -m "gpu and not perf"

test-perf: $(STAMP)
	$(OFFLINE_ENV) $(VPY) -m pytest -q -m perf

train: $(STAMP)
	$(VPY) recipes/gpt2/train.py --elixir auto

# A newcomer's check, under 2 minutes on a CPU: the packages import, the GPT-2 recipe trains its tiny
# model for a few steps offline (a falling loss, a model saved), and elixir-plan plans it for an H100.
SMOKE_OUT := runs/smoke
smoke: $(STAMP)
	$(OFFLINE_ENV) $(VPY) -c "import elixir_hf, elixir_runtime; print('elixir-hf', elixir_hf.__version__, 'imports')"
	$(OFFLINE_ENV) HF_DATASETS_OFFLINE=1 $(VPY) recipes/gpt2/train.py --elixir auto --output_dir $(SMOKE_OUT) \
		--max_steps 8 --logging_steps 4 --eval_steps 8 --max_eval_samples 16 --corpus_mb 0.5 --disable_tqdm true
	$(OFFLINE_ENV) $(VPY) -m elixir_hf.commands.plan --model tiny --seq-len 256 --batch-size 8 --gpu h100

clean-venv:
	rm -rf $(VENV)
