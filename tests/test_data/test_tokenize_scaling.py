"""Tokenize at scale on one machine: partitions, worker counts and the text-only path all give
the same token folder byte for byte; text-only data never imports torch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from data.cli import main
from data.ingest import ingest
from data.shards.reader import iter_shard, shard_entries
from data.tokenize.docs import encode_text_chunk, has_visual
from data.tokenize.run import tokenize
from data.tokenize.shard_job import CHUNK_DOCS, batched


def folder_bytes(out: Path) -> dict[str, bytes]:
    """Every file of a token folder but the per-shard records (they name their partition and
    command), the manifest without the commands that made it."""
    got = {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".tokenize" not in p.parts
    }
    manifest = json.loads(got["manifest.json"])
    manifest["created_by"].pop("commands")
    got["manifest.json"] = json.dumps(manifest).encode()
    return got


@pytest.fixture(scope="module")
def single(tiny_raw, tiny_tokenizers, tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("single") / "tokens"
    m = tokenize(tiny_raw, out, *tiny_tokenizers)
    assert m["finalized"] and m["totals"]["rejects"] == 0
    return out


def test_partitions_then_merge_give_the_single_runs_bytes(
    tiny_raw, tiny_tokenizers, single, tmp_path
):
    text, visual = tiny_tokenizers
    out = tmp_path / "parts"
    base = ["tokenize", "--in", str(tiny_raw), "--out", str(out), "--tokenizer", str(text)]
    base += ["--visual-tokenizer", str(visual), "--no-progress", "--num-partitions", "3"]
    assert main(base + ["--partition", "0", "--workers", "2"]) == 0
    assert main(base + ["--partition", "2"]) == 0
    assert not (out / "manifest.json").exists()
    assert main(["merge", str(out)]) == 2  # partition 1 is missing: named, nothing written
    assert not (out / "manifest.json").exists()
    assert main(base + ["--partition", "1"]) == 0  # the last one to finish writes the manifest
    assert folder_bytes(out) == folder_bytes(single)
    (out / "manifest.json").unlink()
    assert main(["merge", str(out)]) == 0
    assert folder_bytes(out) == folder_bytes(single)
    commands = json.loads((out / "manifest.json").read_text())["created_by"]["commands"]
    assert sorted(c[c.index("--partition") + 1] for c in commands) == ["0", "1", "2"]


def test_two_workers_give_the_single_runs_bytes(tiny_raw, tiny_tokenizers, single, tmp_path):
    out = tmp_path / "w2"
    tokenize(tiny_raw, out, *tiny_tokenizers, workers=2)
    assert folder_bytes(out) == folder_bytes(single)


def test_text_path_equals_the_full_encoder(tiny_raw, tiny_tokenizers):
    """The torch-free path is the DocEncoder's result, id for id and span for span."""
    from data.text_tokenizer import TextTokenizer
    from data.tokenize.docs import TokenizeOptions
    from data.tokenize.encoder import DocEncoder
    from data.tokenize.visual import load_visual_tokenizer

    text = TextTokenizer.load(tiny_tokenizers[0])
    enc = DocEncoder(
        text,
        load_visual_tokenizer(tiny_tokenizers[1], text.layout),
        TokenizeOptions(),
        __import__("torch").device("cpu"),
    )
    compared = 0
    for tar, idx, _ in shard_entries(tiny_raw, ["code", "text"]):
        for chunk in batched(iter_shard(tar, idx), CHUNK_DOCS):
            assert not has_visual(chunk)
            fast, full = encode_text_chunk(text, chunk), enc.encode_chunk(chunk)
            for a, b in zip(fast, full, strict=True):
                assert a.key == b.key and a.source == b.source and a.spans == b.spans
                assert a.ids.dtype == b.ids.dtype and np.array_equal(a.ids, b.ids)
                assert a.modality.dtype == b.modality.dtype
                assert np.array_equal(a.modality, b.modality)
                compared += 1
    assert compared > 5


def test_text_only_data_never_imports_torch(tiny_corpus, tiny_tokenizers, tmp_path):
    raw = tmp_path / "raw"
    ingest(raw, [f"code:{tiny_corpus / 'code'}", f"text:{tiny_corpus / 'text'}"])
    script = (
        "import sys\n"
        "from data.tokenize.run import tokenize\n"
        f"m = tokenize({str(raw)!r}, {str(tmp_path / 'tok')!r}, "
        f"{str(tiny_tokenizers[0])!r}, {str(tiny_tokenizers[1])!r})\n"
        "assert m['finalized'] and m['totals']['samples'] > 0\n"
        "print('torch imported:', 'torch' in sys.modules)\n"
    )
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, check=True)
    assert "torch imported: False" in out.stdout


def test_the_visual_tokenizer_is_built_once_per_worker(
    tiny_raw, tiny_tokenizers, tmp_path, monkeypatch
):
    """Once for the whole run in a worker (here: this process), never in the parent's checks
    (building it twice, even for text, cost seconds)."""
    import data.tokenize.visual as visual
    from data.tokenize import shard_job

    built = []
    real = visual.load_visual_tokenizer
    monkeypatch.setattr(
        visual, "load_visual_tokenizer", lambda *a, **k: built.append(a[0]) or real(*a, **k)
    )
    monkeypatch.setattr(shard_job, "_CACHE", {})  # a fresh worker
    m = tokenize(tiny_raw, tmp_path / "t", *tiny_tokenizers)
    assert m["totals"]["tokens_by_modality"]["image"] > 0 and len(m["shards"]) > 3
    assert built == [str(tiny_tokenizers[1])]
