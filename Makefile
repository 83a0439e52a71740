# Everything runs inside .venv, which `setup` creates from pyproject.toml. Every target that
# needs Python depends on the install stamp, so a first `make test` on a fresh clone sets up
# everything, and a second `make setup` on a ready venv does nothing (the stamp is newer than
# pyproject.toml).

PYTHON ?= python3
VENV := .venv
BIN := $(VENV)/bin
STAMP := $(VENV)/.installed
# XLA runs on the host CPU unless told otherwise (on a TPU VM: PJRT_DEVICE=TPU make ...).
PJRT_DEVICE ?= CPU
export PJRT_DEVICE

.PHONY: help setup test tiny-model bench-prepare clean

help:
	@echo "make setup       create .venv with the pinned stack (torch 2.9.0 + torch_xla 2.9.0) and test tools"
	@echo "make test        run the test suite on CPU (PJRT_DEVICE=CPU); sets up .venv first if needed"
	@echo "make tiny-model  write the tiny demo base model + tokenizer to outputs/demo/base"
	@echo "make bench-prepare  measure dataset.prepare throughput and peak memory (a few minutes)"
	@echo "make clean       remove outputs/ and caches (keeps .venv)"

setup: $(STAMP)

$(STAMP): pyproject.toml
	$(PYTHON) -m venv $(VENV)
	$(BIN)/python -m pip install --quiet --upgrade pip
	$(BIN)/python -m pip install --quiet -e '.[test]'
	touch $@

test: $(STAMP)
	PJRT_DEVICE=CPU $(BIN)/python -m pytest

tiny-model: $(STAMP)
	$(BIN)/python -m finetuning_pipeline.tiny_model --out outputs/demo/base

bench-prepare: $(STAMP)
	$(BIN)/python -m benchmarks.prepare_throughput

clean:
	rm -rf outputs .pytest_cache
	find . -name __pycache__ -not -path './$(VENV)/*' -prune -exec rm -rf {} +
