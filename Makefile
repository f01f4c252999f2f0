# Project tasks. The venv is rebuilt only when pyproject.toml changes.
PYTHON ?= python3
VENV := .venv
VPY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
# torch 2.13.0 is the CPU wheel on local disk; installing it first keeps pip
# from resolving `torch>=2.11` to a multi-GB CUDA build.
TORCH_PIN := torch==2.13.0
OFFLINE_ENV := HF_HUB_OFFLINE=1 TRANSFORMERS_OFFLINE=1 OMP_NUM_THREADS=1

.PHONY: venv test train clean-venv

venv: $(STAMP)

$(VENV): $(STAMP)

$(STAMP): pyproject.toml
	test -x $(VPY) || $(PYTHON) -m venv $(VENV)
	$(VPY) -m pip install --upgrade pip
	$(VPY) -m pip install '$(TORCH_PIN)'
	$(VPY) -m pip install -e '.[dev]'
	touch $(STAMP)

test: $(STAMP)
	$(OFFLINE_ENV) $(VPY) -m pytest -q

train: $(STAMP)
	$(VPY) recipes/gpt2/train.py --elixir auto

clean-venv:
	rm -rf $(VENV)
