"""Fixtures shared by every test folder: a tiny real corpus, its raw shards, its tokenizers."""
from __future__ import annotations

from pathlib import Path

import pytest

from data.demo_corpus import build
from data.ingest import ingest


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """The demo corpus at 5 % scale (seconds to build): code, prose, scenes, digits, clips."""
    root = tmp_path_factory.mktemp("corpus") / "corpus"
    build(root, scale=0.05, progress=False)
    return root


@pytest.fixture(scope="session")
def tiny_raw(tiny_corpus, tmp_path_factory) -> Path:
    """Raw shards of the tiny corpus (no photos: they are large and slow to decode)."""
    out = tmp_path_factory.mktemp("raw") / "raw"
    c = tiny_corpus
    s = ingest(out, [f"code:{c / 'code'}", f"text:{c / 'text'}", f"images:{c / 'scenes' / 'scenes.jsonl'}",
                     f"images:{c / 'digits' / 'digits.csv'}", f"videos:{c / 'clips'}",
                     f"interleaved:{c / 'interleaved' / 'docs.jsonl'}"], shard_max_samples=16)
    assert s["finalized"]
    return out
