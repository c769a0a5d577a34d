"""File names of the data artifacts: one spelling, shared by the prep commands that write them
and the loader, trainer and tools that read them (docs/data.md describes each file).

A shard folder (``earlyfuse-prep ingest`` / ``tokenize``)::

    DIR/SHARD.tar, DIR/SHARD.idx.jsonl   the shards and their indexes
    DIR/manifest.json                    shards, counts, bytes, hashes, the command and versions
    DIR/rejects.jsonl                    every input that did not become a sample, with its reason
    DIR/tokenizers/                      (token folders) a copy of the tokenizers they were made with

A tokenizer folder (``train-text-tokenizer`` plus the visual tokenizer of a vtok run)::

    tokenizer.json, vocab_layout.json, text_tokenizer_training.json, visual_tokenizer/
"""

from __future__ import annotations

MANIFEST_FILE = "manifest.json"
REJECTS_FILE = "rejects.jsonl"
INDEX_SUFFIX = ".idx.jsonl"  # SHARD.tar -> SHARD.idx.jsonl
TOKENIZERS_DIR = "tokenizers"

TOKENIZER_FILE = "tokenizer.json"  # the text BPE (Hugging Face tokenizers)
LAYOUT_FILE = "vocab_layout.json"  # the id space (data/vocab.py), beside the tokenizers
TEXT_TOKENIZER_TRAINING_FILE = "text_tokenizer_training.json"  # what the BPE was trained on
VISUAL_TOKENIZER_DIR = "visual_tokenizer"  # the FSQ autoencoder a vtok run exports
VISUAL_CONFIG_FILE = "config.json"  # inside visual_tokenizer/: its VisualTokenizerConfig
VISUAL_WEIGHTS_FILE = "model.safetensors"  # inside visual_tokenizer/: its weights
