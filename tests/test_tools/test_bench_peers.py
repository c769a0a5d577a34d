"""The peer benchmark's corpus builder and its command line (the benchmark itself is no test).

The script is loaded from its file: benchmarks are not part of the installed distribution."""

from __future__ import annotations

import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "tools" / "bench" / "bench_peers.py"


@pytest.fixture(scope="module")
def bench():
    spec = importlib.util.spec_from_file_location("bench_peers", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def make_material(root: Path) -> Path:
    """Real-looking files: source code (.py) and prose (.rst, .txt), one of them not UTF-8."""
    pkg = root / "pkg"
    pkg.mkdir(parents=True)
    for number in range(12):
        body = "".join(
            f"def func_{number}_{line}(value):\n    return value + {line}\n" for line in range(40)
        )
        (pkg / f"mod{number:02d}.py").write_text(body)
    for number in range(6):
        (pkg / f"notes{number}.rst").write_text(
            f"Section {number}\n==========\n\n" + "Prose. " * 300
        )
    (pkg / "latin1.txt").write_bytes("caf\xe9 ".encode("latin-1") * 100)
    (pkg / "ignored.so").write_bytes(b"\x7fELF")
    return root


def test_corpus_is_token_shards_of_text_and_code_every_peer_reads_alike(bench, tmp_path):
    material = make_material(tmp_path / "material")
    corpus = tmp_path / "corpus"
    args = ["--corpus", str(corpus), "--docs", "12", "--doc-tokens", "512"]
    built = bench.main([*args, "--material", str(material), "--corpus-only"])
    assert built["documents"] == 12
    assert set(built["sources"]) == {"text", "code"}
    assert built["sources"]["text"]["documents"] == 3  # --text-share 0.25
    assert built["tokenizer"].startswith("byte-level")
    docs = bench.read_documents(corpus / "tokens")
    assert len(docs) == 12
    assert sum(len(ids) for ids, _ in docs) == built["tokens"]
    for ids, mod in docs:
        assert 256 <= len(ids) <= 768 + 1  # half to one and a half times --doc-tokens
        assert ids[-1] == bench.EOS_ID
        assert ids.min() >= 0 and ids.max() < bench.ByteTokenizer.text_size
        assert len(set(mod.tolist())) == 1
    manifest = json.loads((corpus / "tokens" / "manifest.json").read_text())
    assert manifest["totals"]["tokens"] == built["tokens"]
    # The packer every peer gets hands out each real token once, in order
    packer = bench.MinimalPacker(seq_len=256, rows=2)
    batches = list(packer.batches(docs))
    assert sum(int(batch["num_real_tokens"]) for batch in batches) == built["tokens"]
    flat = np.concatenate([batch["input_ids"].numpy().ravel() for batch in batches])
    assert np.array_equal(flat[: built["tokens"]], np.concatenate([ids for ids, _ in docs]))
    # Built once: the same settings reuse it, others are refused with the folder named
    assert bench.main([*args, "--material", str(material), "--corpus-only"]) == built
    with pytest.raises(SystemExit, match=str(corpus / "corpus.json")):
        bench.main([*args, "--material", str(material), "--corpus-only", "--docs", "10"])


def test_help_names_the_corpus_and_the_peers():
    out = subprocess.run(
        [sys.executable, str(SCRIPT), "--help"], capture_output=True, text=True, check=True
    ).stdout
    assert "--corpus" in out and "litdata-tokens" in out and "energon" in out


def test_visual_corpus_adds_the_token_folders_blocks_and_every_packer_keeps_them_whole(
    bench, tmp_path, tiny_tokens
):
    from data.vocab import VocabLayout

    material = make_material(tmp_path / "material")
    corpus = tmp_path / "corpus"
    args = ["--corpus", str(corpus), "--docs", "12", "--doc-tokens", "512"]
    built = bench.main(
        [*args, "--material", str(material), "--visual", str(tiny_tokens), "--corpus-only"]
    )
    given = json.loads((tiny_tokens / "manifest.json").read_text())
    visual = {
        src["name"] for src in given["sources"] if src["tokens"]["image"] or src["tokens"]["video"]
    }
    assert visual and set(built["sources"]) == {"text", "code"} | visual
    # Text and code keep the byte-level ids, inside the folder's text range: one vocabulary
    assert built["tokenizer"].startswith("byte-level")
    manifest = json.loads((corpus / "tokens" / "manifest.json").read_text())
    assert manifest["tokenizers"] == given["tokenizers"]
    visual_docs = sum(built["sources"][name]["documents"] for name in visual)
    assert built["visual_share"]["documents"] == round(visual_docs / built["documents"], 4)
    docs = bench.read_documents(corpus / "tokens")
    assert len(docs) == built["documents"]
    everything = np.concatenate([ids for ids, _ in docs])
    assert everything.min() > 0  # no padding id in a document: the rows' padding is told apart
    layout = VocabLayout.load(corpus / "tokens" / "tokenizers" / "vocab_layout.json")
    openers = [layout.structure_id("<boi>"), layout.structure_id("<bov>")]

    def check_rows(ids, mod):
        """Every token once, in order, and no row starts inside a visual block (a block cut by
        a row's end would go on at the start of the next row)."""
        assert np.array_equal(ids[ids != 0], everything)
        starts = ids.reshape(-1, 256)[:, 0], mod.reshape(-1, 256)[:, 0]
        inside = (starts[1] >= bench.IMAGE) & ~np.isin(starts[0], openers)
        assert not inside.any()

    # The peers' packer (blocks of the tiny folder are at most 240 tokens: they fit 256)
    batches = list(bench.MinimalPacker(seq_len=256, rows=2).batches(docs))
    assert sum(int(batch["num_real_tokens"]) for batch in batches) == built["tokens"]
    # Some block would have straddled a row's end: padding before the last batch
    assert any(int(batch["num_real_tokens"]) < 2 * 256 for batch in batches[:-1])
    check_rows(
        *(
            np.concatenate([batch[key].numpy().ravel() for batch in batches])
            for key in ("input_ids", "modality")
        )
    )
    # LitData TokensLoader's stream, cut at fixed offsets: padded where a row must start
    stream = np.concatenate(list(bench.row_aligned(docs, 256)))
    stream = np.concatenate([stream, np.full(-len(stream) % 256, bench.PAD_MOD, np.int32)])
    mod = stream & ((1 << bench.MOD_BITS) - 1)
    check_rows(np.where(mod == bench.PAD_MOD, 0, stream >> bench.MOD_BITS), mod)


def test_earlyfuse_measured_on_the_peers_transport_delivers_the_same_epoch(bench, tmp_path):
    """``earlyfuse-queue``: the loader in the peers' DataLoader wrapper, its batches through
    torch's worker queue; the same epoch as through its own worker and ring."""
    material = make_material(tmp_path / "material")
    corpus = tmp_path / "corpus"
    args = ["--corpus", str(corpus), "--docs", "12", "--doc-tokens", "512"]
    built = bench.main([*args, "--material", str(material), "--corpus-only"])
    figures = {}
    for name in ("earlyfuse", "earlyfuse-queue"):
        result = tmp_path / f"{name}.json"
        settings = ["--seq-len", "256", "--rows", "2", "--workers", "1"]
        bench.main([*args, *settings, "--measure", name, "--result", str(result)])
        figures[name] = json.loads(result.read_text())
    assert 0 < figures["earlyfuse"]["tokens"] == figures["earlyfuse-queue"]["tokens"]
    assert figures["earlyfuse"]["tokens"] <= built["tokens"]
    assert figures["earlyfuse"]["batches"] == figures["earlyfuse-queue"]["batches"]
    # with two harness workers, each reads its half of the epoch, as two ranks would
    result = tmp_path / "two.json"
    settings = ["--seq-len", "256", "--rows", "2", "--workers", "2"]
    bench.main([*args, *settings, "--measure", "earlyfuse-queue", "--result", str(result)])
    assert 0 < json.loads(result.read_text())["tokens"] <= built["tokens"]
