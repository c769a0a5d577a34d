"""Passkey documents (data/passkey.py): the needle at its depth, the question and the answer at
the end, and a JSONL file that ingest reads as ordinary text documents."""

from __future__ import annotations

import json

import numpy as np
import pytest
import webdataset as wds

from data.cli import main as prep_main
from data.ingest import ingest
from data.passkey import (
    NEEDLE,
    QUESTION,
    passkey_documents,
    passkey_text,
    random_key,
    write_passkey_documents,
)


def test_the_needle_sits_at_its_depth_and_the_answer_ends_the_document():
    key = "48213"
    needle = NEEDLE.format(key=key)
    for depth, before in ((0.0, 0), (0.5, 5), (1.0, 10)):
        text = passkey_text(key, depth=depth, sentences=10)
        head, tail = text.split(needle)
        assert head.count(".") == before  # filler sentences before the needle
        assert tail.endswith(f"{QUESTION} {key}.") and tail.count(".") == 10 - before + 1
    with pytest.raises(ValueError, match="depth 1.5"):
        passkey_text(key, depth=1.5, sentences=10)


def test_keys_have_their_digits_and_documents_repeat_by_seed():
    rng = np.random.default_rng(0)
    keys = [random_key(rng, 6) for _ in range(50)]
    assert all(len(key) == 6 and key.isdigit() and key[0] != "0" for key in keys)
    first = list(passkey_documents(20, seed=3, digits=(5, 7)))
    assert first == list(passkey_documents(20, seed=3, digits=(5, 7)))
    assert first != list(passkey_documents(20, seed=4, digits=(5, 7)))
    for doc in first:
        assert 5 <= len(doc["key"]) <= 7 and 0 <= doc["depth"] <= 1
        assert doc["text"].endswith(f"{QUESTION} {doc['key']}.")
        assert NEEDLE.format(key=doc["key"]) in doc["text"]


def test_written_documents_ingest_as_text(tmp_path):
    path = tmp_path / "passkey" / "passkey.jsonl"
    assert write_passkey_documents(path, 6, seed=1, min_sentences=5, max_sentences=30) == 6
    rows = [json.loads(line) for line in path.read_text().splitlines()]
    summary = ingest(tmp_path / "raw", [f"text:{path}"])
    assert summary["finalized"] and summary["manifest"]["totals"]["rejects"] == 0
    shards = sorted(str(p) for p in (tmp_path / "raw").rglob("*.tar"))
    docs = [json.loads(x["json"]) for x in wds.WebDataset(shards, shardshuffle=False)]
    assert sorted(d["segments"][0]["text"] for d in docs) == sorted(row["text"] for row in rows)
    assert sorted(d["meta"]["key"] for d in docs) == sorted(row["key"] for row in rows)


def test_the_prep_command_writes_the_documents(tmp_path, capsys):
    """`earlyfuse-prep passkey` (make demo-long's writer): the same documents as
    write_passkey_documents with the same options, and bad lengths refused by name."""
    out = tmp_path / "cli" / "passkey.jsonl"
    argv = ["passkey", "--out", str(out), "--count", "5", "--sentences", "8,40", "--digits", "4"]
    assert prep_main([*argv, "--seed", "2"]) == 0
    assert "5 passkey documents" in capsys.readouterr().out
    again = tmp_path / "api.jsonl"
    write_passkey_documents(again, 5, seed=2, min_sentences=8, max_sentences=40, digits=(4, 4))
    assert out.read_bytes() == again.read_bytes()
    assert all(len(json.loads(line)["key"]) == 4 for line in out.read_text().splitlines())
    assert prep_main(["passkey", "--out", str(out), "--count", "2", "--sentences", "40,8"]) == 2
    assert "sentences 40..8" in capsys.readouterr().err
    assert prep_main(["passkey", "--out", str(out), "--count", "2", "--digits", "five"]) == 2
    assert "--digits 'five'" in capsys.readouterr().err
