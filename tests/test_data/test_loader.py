"""The streaming loader on real token shards: packing invariants, token-weighted mixing, exact
resume with worker processes, epoch splits across consumers, robustness."""

from __future__ import annotations

import json
import shutil
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from ray_cluster import free_port

from data.layout import parse_image
from data.loader import LoaderConfig, SourceConfig, build_loader
from data.loader.expand import IGNORE
from data.loader.table_load import load_table
from data.text_tokenizer import TextTokenizer
from model.rope import LayoutTracker

SOURCES = ("code", "text", "scenes", "digits", "clips", "docs")


def cfg_for(tokens, weights=None, **kw) -> LoaderConfig:
    weights = weights or {s: 1.0 for s in SOURCES}
    srcs = [SourceConfig(name=s, shards=[str(tokens / s)], weight=w) for s, w in weights.items()]
    return LoaderConfig(
        sources=srcs, **{"seq_len": 512, "num_workers": 0, "shuffle_buffer": 8, **kw}
    )


def take(loader, n):
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    it.close()
    return out


def docs_of(tokens):
    """(source index, sample) -> (ids, mod) read straight from the shards."""
    out = {}
    for si, s in enumerate(SOURCES):
        t = load_table(SourceConfig(name=s, shards=[str(tokens / s)]))
        for i in range(len(t)):
            import io

            offset, size = t.locate_members(i)[5:7]  # of the ids member
            with open(t.shards[t.shard_of(i)], "rb") as f:
                f.seek(offset)
                ids = np.load(io.BytesIO(f.read(size)), allow_pickle=False)
            out[(si, i)] = ids
    return out


def one_row(stream) -> dict[str, np.ndarray]:
    """The next row of a stream of batches of one row: its fields, and its pieces."""
    fields = {key: value.numpy() for key, value in stream.next_batch().to_dict().items()}
    row = {key: value[0] for key, value in fields.items() if value.ndim >= 2}
    row["pieces"] = [piece for piece in fields["pieces"][0].tolist() if piece[0] >= 0]
    return row


def test_rows_keep_blocks_whole_and_labels_true(tiny_tokens, tiny_tokenizers):
    lay = TextTokenizer.load(tiny_tokenizers[0]).layout
    loader = build_loader(cfg_for(tiny_tokens), rank=0, world_size=1, micro_batch=4)
    docs = docs_of(tiny_tokens)
    batches = take(loader, 12)
    boi, eoi = lay.structure_id("<boi>"), lay.structure_id("<eoi>")
    images = 0
    for b in batches:
        for r in range(4):
            ids, lab, doc = (
                b["input_ids"][r].numpy(),
                b["labels"][r].numpy(),
                b["doc_ids"][r].numpy(),
            )
            for start in np.flatnonzero(ids == boi):  # every image block is whole and parses
                end = start + np.flatnonzero(ids[start:] == eoi)[0] + 1
                assert (doc[start:end] == doc[start]).all()
                parse_image(ids[start:end], lay)
                images += 1
            pad = ids == 0  # <|pad|>: never in real data
            assert (lab[pad] == IGNORE).all() and (doc[pad] == doc.max()).all()
    assert images > 10
    # Every label is the true next token of its document: rows from a consumer stream name
    # their pieces' documents, which we read back from the shards directly.
    from data.loader.stream import ConsumerStream

    stream_pieces = 0
    tables = [load_table(SourceConfig(name=s, shards=[str(tiny_tokens / s)])) for s in SOURCES]
    cs = ConsumerStream(
        tables,
        [1.0] * len(SOURCES),
        cfg_for(tiny_tokens),
        consumer=0,
        consumers=1,
        micro_batch=1,
        pad_id=0,
    )
    for _ in range(40):
        row = one_row(cs)
        for pid, (s, sample, a, bnd) in enumerate(row["pieces"]):
            d = docs[(s, sample)]
            sel = row["doc_ids"] == pid
            np.testing.assert_array_equal(row["input_ids"][sel], d[a:bnd])
            want = np.append(d[a + 1 : bnd + 1], [IGNORE] * (1 if bnd == len(d) else 0))
            np.testing.assert_array_equal(row["labels"][sel], want)
            stream_pieces += 1
            if a == 0 and bnd == len(d):  # a whole document: M-RoPE as generation sees it
                want_thw = LayoutTracker.positions(d, lay).numpy()
                np.testing.assert_array_equal(row["position_thw"][sel], want_thw)
    assert stream_pieces > 40


def test_mix_is_weighted_by_tokens(tiny_tokens):
    weights = {"code": 0.5, "text": 0.3, "scenes": 0.2}
    loader = build_loader(
        cfg_for(tiny_tokens, weights, seq_len=2048), rank=0, world_size=1, micro_batch=8
    )
    n = 0
    got = defaultdict(int)
    for b in loader:
        for s, c in zip(weights, b["tokens_by_source"].tolist()):
            got[s] += c
        n += int(b["num_real_tokens"])
        if n >= 1_000_000:
            break
    total = sum(got.values())
    for s, w in weights.items():
        assert abs(got[s] / total - w) < 0.02, (s, got[s] / total)
    assert loader.delivered()["packing_efficiency"] >= 0.97


def test_resume_with_workers_is_exact(tiny_tokens):
    cfg = cfg_for(tiny_tokens, num_workers=2)
    ref = take(build_loader(cfg, rank=0, world_size=1, micro_batch=2), 9)
    for k in (3, 6):
        first = build_loader(cfg, rank=0, world_size=1, micro_batch=2)
        take(first, k)
        state = first.state_dict()
        assert len(json.dumps(state)) < 64_000
        again = build_loader(cfg, rank=0, world_size=1, micro_batch=2)
        again.load_state_dict(json.loads(json.dumps(state)))
        rest = take(again, 9 - k)
        for a, b in zip(ref[k:], rest):
            for key in a:
                assert torch.equal(a[key], b[key]), (k, key)


def test_new_weights_on_resume_are_mixed_from_the_resume_not_caught_up(tiny_tokens):
    """A weight raised on resume gives its source its new share from there on; counted over the
    whole run, the source would get every batch until it had caught up."""
    before = {"code": 1.0, "text": 1.0, "scenes": 0.0}
    first = build_loader(cfg_for(tiny_tokens, before), rank=0, world_size=1, micro_batch=8)
    take(first, 20)
    state = json.loads(json.dumps(first.state_dict()))
    after = {"code": 1.0, "text": 1.0, "scenes": 1.0}
    for weights, scenes_share in ((after, (0.25, 0.42)), (before, (0.0, 0.0))):
        again = build_loader(cfg_for(tiny_tokens, weights), rank=0, world_size=1, micro_batch=8)
        again.load_state_dict(state)
        got = sum(b["tokens_by_source"] for b in take(again, 10)).tolist()
        assert scenes_share[0] <= got[2] / sum(got) <= scenes_share[1], (weights, got)


def test_state_refuses_other_data_and_shapes(tiny_tokens):
    a = build_loader(cfg_for(tiny_tokens), rank=0, world_size=1, micro_batch=2)
    take(a, 2)
    st = a.state_dict()
    b = build_loader(cfg_for(tiny_tokens, {"code": 1.0}), rank=0, world_size=1, micro_batch=2)
    with pytest.raises(ValueError, match="fingerprint"):
        b.load_state_dict(st)
    c = build_loader(cfg_for(tiny_tokens, seq_len=256), rank=0, world_size=1, micro_batch=2)
    with pytest.raises(ValueError, match="seq_len"):
        c.load_state_dict(st)


@pytest.mark.parametrize(
    "weights, error",
    [
        ({"code": -0.5, "text": 1.0}, "source code: weight -0.5; give a number >= 0"),
        ({"code": float("nan"), "text": 1.0}, "source code: weight nan"),
        ({"code": float("inf"), "text": 1.0}, "source code: weight inf"),
        ({"code": "0.5x", "text": 1.0}, "source code: weight '0.5x'"),
        ({"code": 0.0, "text": 0}, r"sources \['code', 'text'\]: every weight is 0"),
    ],
)
def test_a_weight_that_is_no_share_of_the_mix_is_refused_naming_the_source(
    tiny_tokens, weights, error
):
    """A negative weight was silently left out of the mix, NaN or inf took all of it, all zeros
    divided by zero, a string failed inside the sum; each is refused naming the source."""
    with pytest.raises(ValueError, match=error):
        build_loader(cfg_for(tiny_tokens, weights), rank=0, world_size=1, micro_batch=1)


@pytest.mark.parametrize(
    ("setting", "error"), [("mode", "data.mode 'foo'"), ("oversize", "data.oversize 'foo'")]
)
def test_a_setting_out_of_its_choices_is_refused_when_the_loader_is_built(
    tiny_tokens, setting, error
):
    """Before any batch: earlyfuse-train turns the loader's start-up ValueErrors into one line,
    exit code 2 (before: data.oversize was checked in each stream, at the first batch, and the run
    stopped with a traceback)."""
    cfg = cfg_for(tiny_tokens, **{setting: "foo"})
    with pytest.raises(ValueError, match=f"{error}: choose "):
        build_loader(cfg, rank=0, world_size=1, micro_batch=1)


def test_two_sources_of_one_name_and_too_few_documents_for_the_consumers_are_refused(tiny_tokens):
    """Names key the mix, its metrics and each source's order: two sources named alike merged
    into one figure. In infinite mode every consumer (rank x worker) reads its own slice of every
    source with a share: a source with fewer documents than consumers failed in a worker at the
    first batch; now at start, naming it. Epoch mode and a source of weight 0 need no slice each."""
    cfg = cfg_for(tiny_tokens, {"code": 1.0})
    cfg.sources.append(SourceConfig(name="code", shards=[str(tiny_tokens / "text")]))
    with pytest.raises(ValueError, match="two sources are named 'code'; give each its own name"):
        build_loader(cfg, rank=0, world_size=1, micro_batch=1)
    few = len(load_table(SourceConfig(name="docs", shards=[str(tiny_tokens / "docs")])))
    cfg = cfg_for(tiny_tokens, {"docs": 1.0, "code": 1.0}, num_workers=2)
    with pytest.raises(ValueError, match=rf"source docs: {few} document\(s\), fewer than the "):
        build_loader(cfg, rank=0, world_size=few, micro_batch=1)
    build_loader(
        cfg_for(tiny_tokens, {"docs": 0.0, "code": 1.0}), rank=0, world_size=few + 1, micro_batch=1
    )
    build_loader(replace(cfg, mode="epoch"), rank=0, world_size=few, micro_batch=1)


def test_epoch_split_over_consumers_has_no_repeats_and_equal_batches(tiny_tokens):
    """2 ranks x 2 workers, computed in one process: every consumer yields the same number of
    batches, no sample appears twice, and all the others are reported as held back."""
    from data.loader.dataset import PackedLoader

    cfg = cfg_for(
        tiny_tokens, {"scenes": 1.0, "digits": 1.0}, mode="epoch", num_workers=2, seq_len=256
    )
    tables = [load_table(s) for s in cfg.sources]
    seen = []
    counts = []
    for rank in range(2):
        ld = PackedLoader(cfg, tables, rank=rank, world_size=2, micro_batch=2, pad_id=0)
        for w in range(2):
            s = ld.make_stream(w)
            n = 0
            while s.next_batch() is not None:
                n += 1
            counts.append(n)
            for c_i, c in enumerate(s.cursors):
                order = s.slice_of(c_i, 0)
                seen += [(c_i, int(x)) for x in order[: c.pos]]
    assert len(set(counts)) == 1 and counts[0] > 0
    assert len(seen) == len(set(seen))  # no sample read twice
    total = sum(len(t) for t in tables)
    assert len(seen) <= total


def test_robustness(tiny_tokens, tmp_path):
    bad = tmp_path / "tokens"
    shutil.copytree(tiny_tokens, bad)
    t = load_table(SourceConfig(name="code", shards=[str(bad / "code")]))
    # Corrupt one sample's ids member: it is skipped and counted, the stream goes on.
    tar = t.shards[t.shard_of(0)]
    data = bytearray(Path(tar).read_bytes())
    off = t.locate_members(0)[5]  # of the ids member
    data[off : off + 8] = b"garbage!"
    Path(tar).write_bytes(bytes(data))
    loader = build_loader(
        cfg_for(bad, {"code": 1.0}, mode="epoch"), rank=0, world_size=1, micro_batch=1
    )
    list(loader)
    assert loader.delivered()["errors"] == 1
    with pytest.raises(ValueError, match="does not exist"):
        build_loader(
            LoaderConfig(sources=[SourceConfig(name="x", shards=[str(bad / "nope.tar")])]),
            rank=0,
            world_size=1,
            micro_batch=1,
        )


def test_a_relative_shard_path_not_found_names_the_folder_it_was_taken_from(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    missing = SourceConfig(name="x", shards=["runs/demo/tokens/code"])
    with pytest.raises(ValueError) as refused:
        load_table(missing)
    assert str(refused.value) == (
        f"source x: shard runs/demo/tokens/code does not exist (relative to {tmp_path})"
    )


def test_preview_prints_and_renders_rows(tiny_tokens, tmp_path):
    from data.loader.preview import preview

    out = preview(
        tiny_tokens,
        sources=["scenes", "clips"],
        seq_len=256,
        n_rows=2,
        png=tmp_path / "rows.png",
        colour=False,
    )
    assert "row 0:" in out and "row 1:" in out and "[image" in out and "packing efficiency" in out
    from PIL import Image

    with (
        Image.open(tmp_path / "rows.png") as rows_png,
        Image.open(tmp_path / "rows_images.png") as images,
    ):
        assert rows_png.size[0] > 100 and images.size[0] > 0
    # Clips are drawn too (only images were): a clip as its first and last frames side by side
    preview(tiny_tokens, sources=["clips"], seq_len=256, n_rows=1, png=tmp_path / "clips.png")
    with Image.open(tmp_path / "clips_images.png") as clips:
        assert clips.size[0] >= 2 * clips.size[1]


def test_preview_shows_control_characters_as_pictures(tiny_tokenizers):
    """A log's colour codes in a corpus were printed as they are: ESC reached the terminal."""
    from data.loader.preview import describe
    from data.text_tokenizer import TextTokenizer
    from data.vocab import Modality

    tok = TextTokenizer.load(tiny_tokenizers[0])
    ids = np.asarray(tok.encode("\x1b[31mred\x07\tcode\n\x9b2J\u202e"))
    row = {
        "input_ids": ids,
        "modality": np.full(len(ids), Modality.TEXT),
        "doc_ids": np.zeros(len(ids)),
    }
    shown = describe(row, tok, colour=False)
    assert "\u241b[31mred\u2407\tcode\n\\x9b2J\\u202e" in shown and "\x1b" not in shown


def test_preview_leaves_the_held_out_split_out_unless_named(tmp_path):
    """A token folder of ingest --val-fraction holds val/NAME sources: preview without --source
    drew them as training data with equal weights, as no run would."""
    from data.loader.preview import sources_of
    from data.shards.storage import Folder

    names = ["code", "text", "val/code", "val/text"]
    (tmp_path / "manifest.json").write_text(json.dumps({"sources": [{"name": n} for n in names]}))
    folder = Folder(tmp_path)
    assert [s["name"] for s in sources_of(folder, None)] == ["code", "text"]
    assert [s["name"] for s in sources_of(folder, ["val/code"])] == ["val/code"]


def test_token_before_a_dropped_block_predicts_nothing(tiny_tokens, tiny_tokenizers):
    """An image longer than the row is dropped; the token before it must not be trained to
    predict the dropped block's ``<boi>`` (the next input token is the text after the image)."""
    from data.loader.stream import ConsumerStream

    lay = TextTokenizer.load(tiny_tokenizers[0]).layout
    boi = lay.structure_id("<boi>")
    docs = docs_of(tiny_tokens)
    cfg = cfg_for(tiny_tokens, {"scenes": 1.0}, seq_len=48)  # 8x8 images need 76 tokens
    tables = [load_table(SourceConfig(name="scenes", shards=[str(tiny_tokens / "scenes")]))]
    cs = ConsumerStream(tables, [1.0], cfg, consumer=0, consumers=1, micro_batch=1, pad_id=0)
    cut = 0
    for _ in range(10):
        row = one_row(cs)
        assert not (row["labels"] == boi).any()
        for pid, (_src, sample, _start, bnd) in enumerate(row["pieces"]):
            d = docs[(SOURCES.index("scenes"), sample)]
            if bnd < len(d) and d[bnd] == boi:
                assert row["labels"][row["doc_ids"] == pid][-1] == IGNORE
                cut += 1
    assert cut > 0 and cs.state_dict()["stats"]["dropped_blocks"] > 0


def test_two_ranks_under_torchrun_with_uneven_shards(tiny_tokens, tmp_path):
    """torchrun, 2 ranks x 2 workers, epoch mode, sources of uneven shard counts: both ranks yield
    the same number of batches (an all-reduce per batch would hang otherwise), no document is
    delivered twice, and every document is delivered or counted as held back."""
    import os
    import subprocess
    import sys

    script = Path(__file__).with_name("torchrun_loader.py")
    root = Path(__file__).resolve().parents[2]
    shard_counts = {
        s: len(list((tiny_tokens / s).glob("*.tar"))) for s in ("scenes", "digits", "text")
    }
    assert len(set(shard_counts.values())) > 1, shard_counts  # uneven
    cmd = [
        sys.executable,
        "-m",
        "torch.distributed.run",
        "--nproc_per_node",
        "2",
        "--master_port",
        str(free_port()),
        str(script),
        str(tmp_path),
        str(tiny_tokens),
    ]
    p = subprocess.run(
        cmd,
        cwd=root,
        capture_output=True,
        text=True,
        timeout=300,
        env={**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(root)},
    )
    assert p.returncode == 0, p.stderr[-3000:]
    ranks = [json.loads((tmp_path / f"rank_{r}.json").read_text()) for r in range(2)]
    assert ranks[0]["batches"] == ranks[1]["batches"] > 0
    whole = defaultdict(list)  # (source, sample) -> pieces seen
    for r in ranks:
        for s, sample, a, b in r["pieces"]:
            whole[(s, sample)].append((a, b))
    for spans in whole.values():  # a document's pieces never overlap
        spans.sort()
        assert all(x[1] <= y[0] for x, y in zip(spans, spans[1:])), spans
    docs = docs_of(tiny_tokens)
    names = ("scenes", "digits", "text")
    total = sum(len(load_table(SourceConfig(name=s, shards=[str(tiny_tokens / s)]))) for s in names)
    full = sum(
        1
        for (s, sample), spans in whole.items()
        if sum(b - a for a, b in spans) == len(docs[(SOURCES.index(names[s]), sample)])
    )
    held = sum(r["delivered"]["held_back"] for r in ranks)
    assert full + held == total and full > 0, (full, held, total, len(whole))


def test_read_npy_matches_np_load_and_refuses_what_np_load_refuses():
    import io

    from data.shards.npy import read_npy

    for a in (
        np.arange(7, dtype=np.int32),
        np.array([], dtype=np.int32),
        np.arange(300, dtype=np.uint8),
        np.arange(5, dtype=np.int64),
        np.zeros((2, 3), np.int32),
        np.arange(4, dtype=">i4"),
    ):
        buf = io.BytesIO()
        np.save(buf, a)
        got = read_npy(buf.getvalue())
        assert got.dtype == a.dtype and got.shape == a.shape and (got == a).all()
    buf = io.BytesIO()
    np.save(buf, np.arange(10, dtype=np.int32))
    with pytest.raises(ValueError):
        read_npy(buf.getvalue()[:-8])  # cut short
    buf = io.BytesIO()
    np.save(buf, np.array([{"a": 1}], dtype=object), allow_pickle=True)
    with pytest.raises(ValueError):
        read_npy(buf.getvalue())  # a pickled object array is never loaded


def test_preview_draws_rows_with_a_runs_weights_and_counts_drops(
    tiny_tokens, tmp_path, capsys, monkeypatch
):
    from data.cli import main
    from data.loader import preview

    cfg = tmp_path / "mine.yaml"
    cfg.write_text(
        "sources:\n"
        f"  - {{name: code, shards: [{tiny_tokens / 'code'}], weight: 0.8}}\n"
        f"  - {{name: clips, shards: [{tiny_tokens / 'clips'}], weight: 0.2}}\n"
        "seq_len: 256\nseed: 3\n"
    )
    assert main(["preview", "--config", str(cfg), "--rows", "4"]) == 0
    out = capsys.readouterr().out
    assert "row 3: " in out and "row 4: " not in out and "/256 real tokens" in out
    # measured over more rows than it shows: 4 rows of a corpus of long clips packed 99.9 %,
    # 200 rows 90 %, as its training did
    assert "packing efficiency over 256 rows: " in out
    assert "tokens by source over 256 rows (weight): code " in out and "(80%)" in out
    monkeypatch.setattr(preview, "MEASURED_ROWS", 2)  # more rows shown than it measures
    assert main(["preview", "--config", str(cfg), "--rows", "4"]) == 0
    assert "packing efficiency over 4 rows: " in capsys.readouterr().out
    assert "dropped visual blocks: none" in out
    # Rows shorter than the clips' video blocks: shown, with every dropped block counted.
    assert main(["preview", str(tiny_tokens), "--config", str(cfg), "--seq-len", "96"]) == 0
    out = capsys.readouterr().out
    assert "DROPPED visual blocks longer than seq_len 96: clips: " in out and " video" in out
    bad = tmp_path / "bad.yaml"
    bad.write_text("defaults: [demo]\nseq_len: 256\n")  # its sources only in the defaults
    assert main(["preview", "--config", str(bad)]) == 2
    capsys.readouterr()
    # YAML's own message spans four lines: said in one, the file's name as it is on disk.
    spaced = tmp_path / "my  bad\tdata.yaml"
    spaced.write_text("sources: [\n")
    assert main(["preview", str(tiny_tokens), "--config", str(spaced)]) == 2
    err = capsys.readouterr().err
    assert err.startswith(f"earlyfuse-prep preview: error: {spaced}: cannot read it as YAML (")
    assert err.count("\n") == 1 and "found '<stream end>' in " in err, err
    # A data config of one's own as docs/own_data.md writes it: a defaults list, its own sources.
    own = tmp_path / "own.yaml"
    own.write_text("defaults:\n  - demo\n" + cfg.read_text())
    assert main(["preview", "--config", str(own), "--rows", "1"]) == 0
    assert "row 0: " in capsys.readouterr().out


def test_every_field_of_a_data_config_reaches_the_loaders_of_preview_and_the_mix_bench(
    tiny_tokens, tiny_raw, tmp_path, monkeypatch
):
    """One builder (LoaderConfig.from_dict) for both: max_pending, allow_block_drops and the rest
    of a data config reach the loader, the tool's own settings on top; a key that is no field
    is refused naming the file. Raw sources with data.tokenizers preview without a TOKEN_DIR."""
    import data.loader.preview as preview_module
    import tools.bench.bench_loader as bench_module

    mine = tmp_path / "mine.yaml"
    mine.write_text(
        "sources:\n"
        f"  - {{name: code, shards: [{tiny_tokens / 'code'}]}}\n"
        f"  - {{name: clips, shards: [{tiny_tokens / 'clips'}]}}\n"
        "seq_len: 96\nmax_pending: 7\nallow_block_drops: true\nshuffle_buffer: 16\n"
    )
    built = []
    for module in (preview_module, bench_module):
        real = module.build_loader
        monkeypatch.setattr(  # the real loader, its config kept to be read
            module,
            "build_loader",
            lambda cfg, real=real, **kw: built.append(cfg) or real(cfg, **kw),
        )
    preview_module.preview(None, config=mine, n_rows=1)
    # The clips' video blocks are longer than a row of 96: refused at start without the flag.
    bench_module.from_loader(mine, steps=2, micro_batch=1, mix_chunk=0, whole=False)
    got = [
        (cfg.max_pending, cfg.allow_block_drops, cfg.shuffle_buffer, cfg.seq_len) for cfg in built
    ]
    assert got == [(7, True, 16, 96)] * 2
    raw = tmp_path / "raw.yaml"
    raw.write_text(
        f"sources: [{{name: text, shards: [{tiny_raw / 'text'}]}}]\nseq_len: 64\n"
        f"tokenizers: {tiny_tokens / 'tokenizers'}\n"
    )
    assert "row 0: 64/64 real tokens; text 64" in preview_module.preview(None, config=raw, n_rows=1)
    mine.write_text(mine.read_text() + "max_pendng: 3\n")
    said = rf"{mine}: not a data config: unknown key 'max_pendng' \(did you mean max_pending\?\)"
    with pytest.raises(ValueError, match=said):
        bench_module.from_loader(mine, steps=2, micro_batch=1, mix_chunk=0, whole=False)
    with pytest.raises(ValueError, match=said):  # as earlyfuse-prep preview --config says it
        preview_module.config_of(mine)


def test_each_step_carries_the_mix_not_one_long_document(tiny_tokens):
    """code (long stdlib modules) at 10 %: handed out whole, one module fills step after step;
    handed out a row-sized chunk at a time, no step is given over to it, and the mix holds."""
    from tools.bench.bench_loader import figures

    weights = {"code": 0.1, "scenes": 0.5, "text": 0.4}

    def steps(mix_chunk):
        ld = build_loader(
            cfg_for(tiny_tokens, weights, seq_len=256, mix_chunk=mix_chunk),
            rank=0,
            world_size=1,
            micro_batch=2,
        )
        got = [
            dict(zip(weights, map(float, b["tokens_by_source"].tolist()))) for b in take(ld, 150)
        ]
        # what the loader says it delivered is what the rows held (not what it read ahead)
        assert ld.delivered()["tokens_by_source"] == {n: sum(g[n] for g in got) for n in weights}
        return figures(got, weights), ld.delivered()

    whole, _ = steps(10**9)
    chunked, delivered = steps(0)
    assert whole["dominated_steps"] >= 5  # the failure this guards against is real here
    # A scene that does not fit what is left of a row waits for the next (documents holding a
    # picture are never split): now and then another source's chunk fills a step instead
    assert chunked["dominated_share"] < 0.02 and chunked["mean_kl"] < whole["mean_kl"] / 2
    total = sum(delivered["tokens_by_source"].values())
    for name, w in weights.items():
        assert abs(delivered["tokens_by_source"][name] / total - w) < 0.03


def test_one_doc_rows_flag_says_whether_every_row_holds_one_document(tiny_tokens):
    """The batch tells the model, on the CPU, when causal attention is exact (every row's real
    tokens are one document): the model then never reads its doc ids back from the GPU."""
    seen = set()
    for seq_len in (32, 512):
        cfg = cfg_for(tiny_tokens, {"code": 1.0, "text": 1.0}, seq_len=seq_len)
        for batch in take(build_loader(cfg, rank=0, world_size=1, micro_batch=2), 6):
            doc, real = batch["doc_ids"], batch["labels"] != -100
            one_doc = all(len(set(doc[row][doc[row] >= 0].tolist())) <= 1 for row in range(2))
            assert bool(batch["one_doc_rows"]) == one_doc, (seq_len, doc)
            assert real.any()
            seen.add(one_doc)
    assert seen == {True, False}
