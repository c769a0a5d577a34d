"""Fixtures for the training tests."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

from tools.monitor_eval.data import colour_square


@pytest.fixture(scope="session")
def colour_tokens(tiny_tokenizers, tmp_path_factory) -> Path:
    """Token shards of captioned solid-colour squares ("a red square."): the caption is a function
    of the image, so a model that reads its images learns a clear cross-modal dependence."""
    from data.ingest import ingest
    from data.tokenize.encoder import TokenizeOptions
    from data.tokenize.run import tokenize

    root = tmp_path_factory.mktemp("colours")
    folder = root / "corpus"
    folder.mkdir()
    rng = np.random.default_rng(0)
    rows = []
    for i in range(160):
        image, name = colour_square(i, rng)
        image.save(folder / f"c{i:03d}.png")
        rows.append({"image": f"c{i:03d}.png", "caption": f"a {name} square."})
    (folder / "captions.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    raw = root / "raw"
    assert ingest(raw, [f"images:{folder / 'captions.jsonl'}"], shard_max_samples=64)["finalized"]
    out = root / "tokens"
    text, visual = tiny_tokenizers
    tokenize(raw, out, text, visual, opts=TokenizeOptions(image_max_pixels=16 * 16))
    return out


@pytest.fixture(scope="session")
def one_document_tokens(tiny_tokenizers, tmp_path_factory) -> Path:
    """A token folder holding one text document: a held-out set smaller than the ranks of a
    2-process run."""
    from data.ingest import ingest
    from data.tokenize.run import tokenize

    root = tmp_path_factory.mktemp("one_document")
    (root / "notes").mkdir()
    (root / "notes" / "only.txt").write_text("one held-out note, read by every rank.\n" * 20)
    assert ingest(root / "raw", [f"text:{root / 'notes'}"])["finalized"]
    tokenize(root / "raw", root / "tokens", *tiny_tokenizers)
    return root / "tokens" / "notes"
