# Two commands on a fresh clone: `make demo` and `make test`. Both create (or reuse) the
# virtual environment in .venv and install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
DEMO_DIR ?= runs/demo
STAMP := $(VENV)/.earlyfuse-installed

.PHONY: demo test test-slow bench venv clean-demo

venv: $(STAMP)

# torch goes in first so that nothing pulls a multi-GB CUDA build on a CPU-only machine:
# without an NVIDIA driver we ask for the CPU build torch==2.13.0 explicitly.
$(STAMP): pyproject.toml
	@test -x $(PY) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install -q --upgrade pip
	@if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then \
		$(PY) -m pip install -q torch; \
	else \
		$(PY) -m pip install -q torch==2.13.0; \
	fi
	$(PY) -m pip install -q -e '.[demo,test]'
	@touch $@

test: $(STAMP)
	$(PY) -m pytest

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# The demo: a small real corpus built offline -> raw shards -> stats and verification.
demo: $(STAMP)
	$(BIN)/earlyfuse-prep demo-corpus --out $(DEMO_DIR)/corpus
	$(BIN)/earlyfuse-prep ingest --out $(DEMO_DIR)/raw --workers 2 --shard-size 4MB \
		--source code:$(DEMO_DIR)/corpus/code \
		--source text:$(DEMO_DIR)/corpus/text \
		--source images:$(DEMO_DIR)/corpus/photos \
		--source images:$(DEMO_DIR)/corpus/scenes/scenes.jsonl \
		--source images:$(DEMO_DIR)/corpus/digits/digits.csv \
		--source videos:$(DEMO_DIR)/corpus/clips \
		--source interleaved=interleaved:$(DEMO_DIR)/corpus/interleaved/docs.jsonl \
		--source wds:$(DEMO_DIR)/corpus/wds
	$(BIN)/earlyfuse-prep verify $(DEMO_DIR)/raw
	$(BIN)/earlyfuse-prep stats $(DEMO_DIR)/raw

bench: $(STAMP)
	$(PY) tools/bench/bench_ingest.py

clean-demo:
	rm -rf $(DEMO_DIR)
