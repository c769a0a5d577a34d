"""The loader's O(1) start: binary shard indexes, manifest-only tables, lazy
epoch orders, and batches handed over from a worker through shared slots."""

from __future__ import annotations

import json
import re
import shutil

import numpy as np
import pytest
import torch
from test_data.test_loader import cfg_for, take

from data.loader import build_loader
from data.loader.config import SourceConfig
from data.loader.order import ConsumerSlice, EpochOrder
from data.loader.table import TokenTable
from data.loader.table_load import load_table
from data.shards import token_index
from data.shards.index import read_index


@pytest.fixture()
def tokens(tiny_tokens, tmp_path):
    out = tmp_path / "tokens"
    shutil.copytree(tiny_tokens, out)
    return out


def same(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_the_binary_index_holds_what_the_jsonl_index_says(tiny_tokens):
    tars = sorted(tiny_tokens.rglob("shard-*.tar"))
    assert tars
    for tar in tars:
        lines = read_index(tar.with_name(tar.name[:-4] + ".idx.jsonl"))
        idx = token_index.TokenIndex.open(token_index.index_path_for(tar))
        assert len(idx) == len(lines)
        for i, e in enumerate(lines):
            r = idx.records[i]
            assert idx.key(i) == e["key"]
            assert r["ids"].tolist() == e["members"]["ids.npy"]
            assert r["mod"].tolist() == e["members"]["mod.npy"]
            assert r["json"].tolist() == e["members"]["json"]
            assert int(r["tokens"]) == e["tokens"]
            assert idx.blocks_of(i).tolist() == e["blocks"]
            assert bytes(r["sha256"]).hex() == e["sha256"]
    # np.load reads the file as four arrays in turn, the first the JSON header: no pickle.
    with open(token_index.index_path_for(tars[0]), "rb") as f:
        header = json.loads(np.load(f).tobytes())
        assert len(np.load(f)) == header["samples"]
    assert header["format"] == "earlyfuse-token-index"


def test_a_start_reads_no_index_and_columns_match_the_jsonl(tiny_tokens, monkeypatch):
    from data.loader import store

    real = store.read_bytes

    def no_jsonl(url):
        assert not url.endswith(".idx.jsonl"), f"{url} read at start"
        return real(url)

    monkeypatch.setattr(token_index, "build", None)  # nothing is built either
    monkeypatch.setattr(store, "read_bytes", no_jsonl)
    ld = build_loader(cfg_for(tiny_tokens), rank=0, world_size=1, micro_batch=2)
    take(ld, 2)  # the samples read through the binary indexes beside the shards
    monkeypatch.undo()
    t = load_table(SourceConfig(name="scenes", shards=[str(tiny_tokens / "scenes")]))
    assert isinstance(t, TokenTable) and len(t) > 0
    lines = [e for tar in t.shards for e in read_index(tar[:-4] + ".idx.jsonl")]
    samples = range(len(t))
    assert [t.key_of(i) for i in samples] == [e["key"] for e in lines]
    assert [t.tokens_of(i) for i in samples] == [e["tokens"] for e in lines]
    assert [t.blocks_of(i) for i in samples] == [e["blocks"] for e in lines]
    ids_at = [list(t.locate_members(i)[5:7]) for i in samples]
    assert ids_at == [e["members"]["ids.npy"] for e in lines]
    # Pickled to a worker without its memory maps.
    import pickle

    again = pickle.loads(pickle.dumps(t))
    assert again._indexes == {} and again.key_of(3) == t.key_of(3)


def test_a_shard_without_its_binary_index_is_refused_naming_the_file(tokens):
    """Tokenize writes a binary index beside every shard and its block summary into the
    manifest; a folder without them is refused at start, naming the file and the remedy."""
    from data.shards.verify import verify

    gone = next((tokens / "code").glob("*" + token_index.SUFFIX))
    gone.unlink()
    with pytest.raises(
        ValueError, match=rf"{re.escape(str(gone))} does not exist; .*tokenize the raw shards"
    ):
        build_loader(cfg_for(tokens), rank=0, world_size=1, micro_batch=2)
    assert any(p.startswith(f"{gone}: missing") for p in verify(tokens)["problems"])
    m = json.loads((tokens / "manifest.json").read_text())
    m["shards"][0].pop("blocks")
    (tokens / "manifest.json").write_text(json.dumps(m))
    src = m["shards"][0]["source"]
    with pytest.raises(ValueError, match=r"manifest.json lists .* without blocks; .*tokenize"):
        load_table(SourceConfig(name=src, shards=[str(tokens / src)]))
    m["shards"] = m["shards"][1:]  # a shard its manifest does not list
    (tokens / "manifest.json").write_text(json.dumps(m))
    with pytest.raises(ValueError, match=r"is not listed in .*manifest.json"):
        load_table(SourceConfig(name=src, shards=[str(tokens / src)]))


def test_a_shard_gone_from_a_folder_or_glob_source_is_refused_naming_it(tokens, tiny_raw):
    """A folder or a glob reads what is there; a shard its manifest lists there but deleted after
    the folder was written would leave the mix unsaid. Refused at start, naming the shard (token
    and raw folders alike); shards named one by one are what the source is."""
    gone = sorted((tokens / "scenes").glob("*.tar"))[0]
    gone.unlink()
    for pattern in (tokens / "scenes", tokens / "scenes" / "shard-*.tar", tokens):
        with pytest.raises(ValueError, match=f"source s: {re.escape(str(gone))} is missing, and"):
            load_table(SourceConfig(name="s", shards=[str(pattern)]))
    kept = sorted((tokens / "scenes").glob("*.tar"))
    assert len(load_table(SourceConfig(name="s", shards=list(map(str, kept)))).shards) == 1
    raw = shutil.copytree(tiny_raw / "scenes", tokens.parent / "raw" / "scenes")
    shutil.copy(tiny_raw / "manifest.json", raw.parent)
    sorted(raw.glob("*.tar"))[-1].unlink()
    with pytest.raises(ValueError, match=r"source s: .*\.tar is missing, and .*manifest.json"):
        load_table(SourceConfig(name="s", shards=[str(raw)]))


def test_a_stale_binary_index_is_never_used(tokens, tmp_path):
    """A binary index made from another JSONL index than the manifest records is refused: each
    sample read through it is skipped with the error naming it (as any unreadable sample), and
    nothing is built in its place."""
    cfg = cfg_for(tokens, {"code": 1.0}, cache_dir=str(tmp_path / "cache"))
    a = next((tokens / "code").glob("*" + token_index.SUFFIX))
    b = next((tokens / "text").glob("*" + token_index.SUFFIX))
    shutil.copyfile(b, a)  # another shard's index under this shard's name
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=2)
    stale = rf"{re.escape(str(a))}: made from another JSONL index .*tokenize the raw shards"
    with pytest.raises(RuntimeError, match=rf"unreadable samples in a row.*{stale}"):
        take(loader, 1)
    assert not (tmp_path / "cache" / "index").exists()
    from data.shards.verify import verify

    assert any("not the binary index of" in p for p in verify(tokens)["problems"])


def test_epoch_order_is_a_lazy_permutation_split_over_consumers():
    counts = np.asarray([7, 0, 30, 13, 1])
    order = EpochOrder(counts, seed=3, epoch=2, source="s", buffer=8, shuffle_shards=True)
    full = order.full()
    assert sorted(full.tolist()) == list(range(counts.sum()))
    for c in range(3):
        sl = ConsumerSlice(order, c, 3)
        assert [sl[k] for k in range(len(sl))] == full[c::3].tolist()
        assert sl[1:4].tolist() == full[c::3][1:4].tolist()
    again = EpochOrder(counts, seed=3, epoch=2, source="s", buffer=8, shuffle_shards=True)
    assert again.window_samples(2).tolist() == full[16:24].tolist()  # no earlier window needed
    other = EpochOrder(counts, seed=3, epoch=3, source="s", buffer=8, shuffle_shards=True)
    assert other.full().tolist() != full.tolist()


def test_a_loader_state_of_an_older_earlyfuse_is_refused(tiny_tokens):
    """A state without a field this earlyfuse writes (the epoch order it indexes, its documents'
    chunk ends, the batch limit) is refused with what it lacks, before any batch."""
    from data.loader.redistribute import redistribute

    cfg = cfg_for(tiny_tokens)
    first = build_loader(cfg, rank=0, world_size=1, micro_batch=2)
    take(first, 3)
    good = json.loads(json.dumps(first.state_dict()))
    worker = good["worker_states"]["0"]
    assert worker["order"] == 2 and (worker["pending"] or worker["open"])

    def refused(change, match: str) -> None:
        state = json.loads(json.dumps(good))
        change(state, state["worker_states"]["0"])
        loader = build_loader(cfg, rank=0, world_size=1, micro_batch=2)
        for load in (loader.load_state_dict, lambda st: redistribute([st], loader)):
            with pytest.raises(ValueError, match=match):
                load(state)

    older = "saved by an older earlyfuse"
    refused(lambda st, ws: ws.pop("order"), rf"worker 0: no 'order'; .*{older}")
    refused(lambda st, ws: ws.update(order=1), rf"epoch order 1, .*{older}")
    refused(lambda st, ws: [ws.pop(k) for k in ("skip", "skipped")], r"no 'skipped', 'skip'")
    refused(lambda st, ws: st.pop("batch_limit"), rf"loader state: no 'batch_limit'; .*{older}")

    def no_chunk_end(st, ws):
        for doc in ws["pending"] + ws["open"]:
            doc.pop()

    refused(no_chunk_end, rf"document .* is not \[source, .*, chunk end\]; .*{older}")
    again = build_loader(cfg, rank=0, world_size=1, micro_batch=2)
    again.load_state_dict(good)  # the state as saved resumes
    take(again, 1)


def test_one_worker_gives_the_in_process_batches(tiny_tokens):
    """A worker packs into slots of shared memory and the trainer's process copies them out:
    the batches are those packed in-process, and stay intact after the slots are reused."""
    want = take(build_loader(cfg_for(tiny_tokens), rank=0, world_size=1, micro_batch=2), 12)
    cfg = cfg_for(tiny_tokens, num_workers=1, prefetch_factor=1)
    got = take(build_loader(cfg, rank=0, world_size=1, micro_batch=2), 12)  # 3 slots, 12 batches
    same(got, want)


def test_a_table_says_whether_it_holds_raw_or_token_samples(tiny_raw):
    """No default kind: a raw table taken for a token one would skip the tokenizer check at
    start and be counted as if its index knew its tokens."""
    from data.loader.table import SampleTable

    assert load_table(SourceConfig(name="text", shards=[str(tiny_raw / "text")])).kind == "raw"
    empty = (np.zeros(0, np.int32), [], np.zeros(0, np.int64), [], "fp", "")
    with pytest.raises(TypeError, match="kind"):
        SampleTable("s", [], *empty)  # type: ignore[call-arg]
