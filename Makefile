# Two commands on a fresh clone: `make demo` and `make test`. Both create (or reuse) the
# virtual environment in .venv and install what they need first.
SHELL := /bin/bash
PYTHON ?= python3
VENV ?= .venv
PY := $(VENV)/bin/python
BIN := $(VENV)/bin
DEMO_DIR ?= runs/demo
STAMP := $(VENV)/.earlyfuse-installed

.PHONY: demo demo-long test test-slow test-gpu gpu-check lint bench venv clean-demo

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

# Style and types are checked first, so CI fails on a lint error or an unformatted file.
lint: $(STAMP)
	$(BIN)/ruff check .
	$(BIN)/ruff format --check .
	$(BIN)/mypy

# One pytest worker per core this process may use (nproc), at most 4 (memory: each runs
# 2-process trainings), a test file on one worker, so its module fixtures are built once.
# TEST_WORKERS=0 runs them in this process.
TEST_WORKERS ?= $(shell n=$$(nproc); echo $$(( n < 4 ? n : 4 )))
test: lint
	$(PY) -m pytest -n $(TEST_WORKERS) --dist loadfile

test-slow: $(STAMP)
	$(PY) -m pytest -m slow

# On a CUDA machine (skipped elsewhere): tests/test_gpu. docs/benchmarks.md, "The GPU check".
test-gpu: $(STAMP)
	$(PY) -m pytest -m gpu tests/test_gpu

# The prepared GPU check, logs in $(OUT): PART=throughput (the default: GPU tests, throughput
# table, the trainer) or PART=long (long rows and BlockMask builds). docs/benchmarks.md.
OUT ?= runs/gpu_check
gpu-check:
	PYTHON=$(if $(wildcard $(PY)),$(PY),python3) tools/gpu_check.sh $(OUT) $(PART)

# The demo, end to end on CPU (README "Quick start"): a small real corpus built offline ->
# raw shards -> text BPE and visual tokenizer -> token shards -> the early-fusion LM.
# Every step is resumable: rerunning `make demo` redoes only what is missing.
# --allow-outside-paths: interleaved/docs.jsonl names the corpus's photos, scenes and clips in
# its sibling folders (../photos/...), which a table may read only when allowed.
DEMO_SOURCES = --allow-outside-paths --source code:$(DEMO_DIR)/$(1)/code \
		--source text:$(DEMO_DIR)/$(1)/text \
		--source images:$(DEMO_DIR)/$(1)/photos \
		--source images:$(DEMO_DIR)/$(1)/scenes/scenes.jsonl \
		--source interleaved:$(DEMO_DIR)/$(1)/scenes/drawings.jsonl \
		--source images:$(DEMO_DIR)/$(1)/digits/digits.csv \
		--source videos:$(DEMO_DIR)/$(1)/clips \
		--source interleaved=interleaved:$(DEMO_DIR)/$(1)/interleaved/docs.jsonl \
		--source wds:$(DEMO_DIR)/$(1)/wds
# --seq-len 512: every image and video block fits the LM's rows (data.seq_len), none dropped.
TOKENIZE = $(BIN)/earlyfuse-prep tokenize --tokenizer $(DEMO_DIR)/tok \
		--visual-tokenizer $(DEMO_DIR)/vtok/visual_tokenizer --image-max-pixels 2304 \
		--video-max-pixels 1024 --video-max-tokens 512 --seq-len 512 --workers 2 --no-progress
DEMO_SCENE = $(DEMO_DIR)/val_corpus/scenes/img/scene_0000.png
GENERATE = $(BIN)/earlyfuse-generate $(DEMO_DIR)/release

demo: $(STAMP)
	$(BIN)/earlyfuse-prep demo-corpus --out $(DEMO_DIR)/corpus --split train --no-progress
	$(BIN)/earlyfuse-prep demo-corpus --out $(DEMO_DIR)/val_corpus --split heldout --seed 1 \
		--scale 0.1 --scenes 150 --no-progress
	$(BIN)/earlyfuse-prep ingest --out $(DEMO_DIR)/raw --workers 2 --shard-size 4MB --no-progress \
		$(call DEMO_SOURCES,corpus)
	@# A held-out document that repeats a training document (a few simple scenes come out
	@# pixel-identical) is left out, listed in val_raw/rejects.jsonl as duplicate-of-excluded.
	$(BIN)/earlyfuse-prep ingest --out $(DEMO_DIR)/val_raw --workers 2 --no-progress \
		--exclude-content-of $(DEMO_DIR)/raw $(call DEMO_SOURCES,val_corpus)
	$(BIN)/earlyfuse-prep verify $(DEMO_DIR)/raw
	$(BIN)/earlyfuse-prep stats $(DEMO_DIR)/raw
	$(BIN)/earlyfuse-prep train-text-tokenizer --in $(DEMO_DIR)/raw --out $(DEMO_DIR)/tok \
		--vocab-size 4096 --max-grid 32 --fsq-levels 8,6,5 --no-progress
	$(BIN)/earlyfuse-train experiment=vtok_demo run_dir=$(DEMO_DIR)/vtok vtok_data.tokenizer=$(DEMO_DIR)/tok \
		'vtok_data.raw=[$(DEMO_DIR)/raw]' train.progress=false
	$(TOKENIZE) --in $(DEMO_DIR)/raw --out $(DEMO_DIR)/tokens
	$(TOKENIZE) --in $(DEMO_DIR)/val_raw --out $(DEMO_DIR)/val_tokens
	$(BIN)/earlyfuse-train experiment=demo run_dir=$(DEMO_DIR)/lm train.progress=false
	$(BIN)/earlyfuse-report $(DEMO_DIR)/vtok
	@# What the model learned, to look at: a release, then text and code continued (sampled at
	@# 0.7, seed 0: greedy decoding of a model this small loops), a caption of a held-out scene
	@# (greedy) and a drawn image (sampled, seed 0) saved as PNG.
	$(BIN)/earlyfuse-convert release $(DEMO_DIR)/lm $(DEMO_DIR)/release --force
	@echo "== text: 'The Python'" && $(GENERATE) --prompt "The Python" --max-new-tokens 48 --temperature 0.7 --seed 0
	@echo "== code: 'import os'" && $(GENERATE) --code --prompt "import os" --max-new-tokens 48 --temperature 0.7 --seed 0
	@echo "== caption of $(DEMO_SCENE)" && $(GENERATE) --image $(DEMO_SCENE) --caption --max-new-tokens 32
	@echo "== drawing 'a red circle in the top left, on a plain dark grey background'" && $(GENERATE) \
		--draw "a red circle in the top left, on a plain dark grey background" --size 8x8 \
		--out $(DEMO_DIR)/drawn.png --temperature 0.7 --guidance 2 --seed 0
	@# Held-out evaluation (docs/evaluation.md): per-modality CE against the unigram baseline,
	@# the dependence gap both ways, drawings and captions of held-out scenes read from pixels
	@# (the scenes of the held-out shards: one that is also a training picture was left out by
	@# ingest; drawn with classifier-free guidance 2, as Parti and Chameleon sample images).
	@# The LM's report (last) draws it and prints its table at the very end.
	$(BIN)/earlyfuse-eval $(DEMO_DIR)/release --data $(DEMO_DIR)/val_tokens \
		--train-data $(DEMO_DIR)/tokens --scenes $(DEMO_DIR)/val_raw \
		--max-pairs 60 --max-scenes 40 --draw-guidance 2 --no-table --no-progress \
		--out $(DEMO_DIR)/lm/heldout_eval.json
	$(BIN)/earlyfuse-report $(DEMO_DIR)/lm

# The long-context demo stage (docs/long_context.md, "The CPU demo stage"), after `make demo`
# (run first when its release is missing): the demo model continued at rows of 4,096 tokens on
# passkey documents (earlyfuse-prep passkey: a 5-digit number hidden in 40-600 filler sentences,
# ~300-3,900 tokens, asked for at the end) beside the demo's own data, then earlyfuse-eval's
# passkey table (--needle) of the demo model (before) and of the stage (after), printed last.
LONG_DIR = $(DEMO_DIR)/long
# The held-out text only (--data .../text): the frame-copy table needs held-out videos and is
# left out; --seq-len 512: both releases' held-out text CE on the demo's rows, comparable.
NEEDLE_EVAL = $(BIN)/earlyfuse-eval --data $(DEMO_DIR)/val_tokens/text --seq-len 512 \
		--batch-rows 2 --max-pairs 0 --needle --needle-lengths 512,1024,2048,4096 \
		--needle-trials 8 --needle-digits 5 --no-progress
$(DEMO_DIR)/release/model.safetensors:
	$(MAKE) demo

demo-long: $(STAMP) $(DEMO_DIR)/release/model.safetensors
	$(BIN)/earlyfuse-prep passkey --out $(LONG_DIR)/corpus/passkey.jsonl --count 1500 \
		--sentences 40,600 --digits 5 --seed 0
	$(BIN)/earlyfuse-prep ingest --out $(LONG_DIR)/raw --workers 2 --no-progress \
		--source passkey=text:$(LONG_DIR)/corpus/passkey.jsonl
	$(TOKENIZE) --in $(LONG_DIR)/raw --out $(LONG_DIR)/tokens
	$(BIN)/earlyfuse-train experiment=demo_long run_dir=$(LONG_DIR)/lm \
		train.init_from=$(DEMO_DIR)/release train.progress=false
	$(BIN)/earlyfuse-convert release $(LONG_DIR)/lm $(LONG_DIR)/release --force
	@echo "== before the stage: the demo model (rows of 512)"
	$(NEEDLE_EVAL) $(DEMO_DIR)/release --out $(LONG_DIR)/needle_before.json
	@echo "== after the stage (rows of 4,096)"
	$(NEEDLE_EVAL) $(LONG_DIR)/release --out $(LONG_DIR)/needle_after.json

bench: $(STAMP)
	$(PY) tools/bench/bench_ingest.py

clean-demo:
	rm -rf $(DEMO_DIR)
