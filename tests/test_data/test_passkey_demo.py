"""Passkey documents (data/demo_corpus/passkey.py) for the long-context demo stage: the same seed
writes the same bytes, the needle sits at its depth and the question closes the document, the
control has no needle, the documents go through ingest as text, and the teacher-forced scorer
(tools/evaluate/passkey_demo.py) counts digits right and wrong on logits made from the truth."""

from __future__ import annotations

import json

import pytest
import torch

from data.demo_corpus.passkey import (
    ANSWER_PREFIX,
    INTRO,
    needle,
    passkey_text,
    write_passkey_docs,
)
from data.ingest import ingest
from data.text_tokenizer import TextTokenizer
from tools.evaluate.passkey_demo import format_table, passkey_table, score_document


def test_documents_are_deterministic_and_hide_the_key_at_its_depth(tmp_path):
    path = write_passkey_docs(tmp_path / "a", 20, 3000, seed=3, min_chars=500)
    again = write_passkey_docs(tmp_path / "b", 20, 3000, seed=3, min_chars=500)
    assert path.read_bytes() == again.read_bytes()
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    assert len(rows) == 20 and len({row["passkey"] for row in rows}) > 15
    for row in rows:
        text, key = row["text"], row["passkey"]
        assert len(key) == 5 and key.isdigit()
        assert 400 <= len(text) <= 3000 + 50
        assert text.endswith(f"{ANSWER_PREFIX} {key}.") and text.count(needle(key)) == 1
        filler = len(text) - len(INTRO) - len(needle(key)) - len(f"{ANSWER_PREFIX} {key}.")
        where = (text.index(needle(key)) - len(INTRO)) / filler
        assert abs(where - row["depth"]) < 0.1  # the needle goes between filler sentences
    control = passkey_text(2000, 0.5, "12345", hidden=False)
    assert "12345" not in control[: control.rindex(ANSWER_PREFIX)]
    with pytest.raises(ValueError, match="depth"):
        passkey_text(100, 1.5, "12345")


def test_passkey_documents_ingest_as_text(tmp_path):
    path = write_passkey_docs(tmp_path / "corpus", 5, 800, seed=0)
    summary = ingest(tmp_path / "raw", [f"passkey=text:{path}"])
    assert summary["finalized"] and summary["manifest"]["totals"]["samples"] == 5


def oracle(flip: bool):
    """Logits that put all weight on the true next token (or on another one when ``flip``)."""

    def model(inputs):
        target = torch.roll(inputs, -1, dims=1)
        if flip:
            target = (target + 1) % 4096
        return torch.nn.functional.one_hot(target, 4096).float()

    return model


def test_the_scorer_counts_the_answer_digits(tiny_tokenizers):
    tokenizer = TextTokenizer.load(tiny_tokenizers[0])
    text = passkey_text(600, 0.25, "48213")
    right = score_document(oracle(False), tokenizer, text)
    assert right.digits == 5 and right.right == 5 and right.exact == 1
    wrong = score_document(oracle(True), tokenizer, text)
    assert wrong.digits == 5 and wrong.right == 0 and wrong.exact == 0
    table = passkey_table(oracle(False), tokenizer, [64, 128], per_cell=2)
    assert all(score.accuracy == 1.0 for score in table["cells"].values())
    printed = format_table(table, "oracle")
    assert "control" in printed and "100.0%" in printed
