"""The loader's O(1) start: binary shard indexes, manifest-only tables, lazy
epoch orders, and batches handed over from a worker through shared slots."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from test_data.test_loader import cfg_for, take

from data.cli import main as prep_main
from data.loader import build_loader
from data.loader.config import SourceConfig
from data.loader.dataset import PackedLoader
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
    assert t.keys == [e["key"] for e in lines]
    assert t.tokens.tolist() == [e["tokens"] for e in lines]
    assert t.blocks == [e["blocks"] for e in lines]
    assert t.ids_at.tolist() == [e["members"]["ids.npy"] for e in lines]
    # Pickled to a worker without its memory maps.
    import pickle

    again = pickle.loads(pickle.dumps(t))
    assert again._indexes == {} and again.key_of(3) == t.key_of(3)


def test_folders_without_binary_indexes_give_the_same_batches(tokens, tmp_path):
    cfg = cfg_for(tokens, cache_dir=str(tmp_path / "cache"))
    want = take(build_loader(cfg, rank=0, world_size=1, micro_batch=2), 4)
    # A folder from before binary indexes: none beside the shards, none in the manifest.
    for p in tokens.rglob("*" + token_index.SUFFIX):
        p.unlink()
    m = json.loads((tokens / "manifest.json").read_text())
    for s in m["shards"]:
        s.pop("index_bin", None)
        s.pop("blocks", None)
    (tokens / "manifest.json").write_text(json.dumps(m))
    same(take(build_loader(cfg, rank=0, world_size=1, micro_batch=2), 4), want)
    assert len(list((tmp_path / "cache" / "index").glob("*.idx.bin"))) == len(m["shards"])
    # earlyfuse-prep index writes them beside the shards and the summaries into the manifest.
    assert prep_main(["index", str(tokens)]) == 0
    assert len(list(tokens.rglob("*" + token_index.SUFFIX))) == len(m["shards"])
    assert all("blocks" in s for s in json.loads((tokens / "manifest.json").read_text())["shards"])
    shutil.rmtree(tmp_path / "cache")
    same(take(build_loader(cfg, rank=0, world_size=1, micro_batch=2), 4), want)
    assert not (tmp_path / "cache" / "index").exists()  # nothing built: they were used


def test_a_stale_binary_index_is_never_used(tokens, tmp_path):
    cfg = cfg_for(tokens, cache_dir=str(tmp_path / "cache"))
    want = take(build_loader(cfg, rank=0, world_size=1, micro_batch=2), 4)
    a = next((tokens / "code").glob("*" + token_index.SUFFIX))
    b = next((tokens / "text").glob("*" + token_index.SUFFIX))
    shutil.copyfile(b, a)  # another shard's index under this shard's name
    same(take(build_loader(cfg, rank=0, world_size=1, micro_batch=2), 4), want)
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


def test_a_state_saved_with_the_old_order_resumes_in_it(tiny_tokens):
    """States of loaders before order version 2 have no "order": their cursors index the
    whole-epoch permutation of version 1, which they keep (exact resume)."""
    cfg = cfg_for(tiny_tokens, num_workers=0)
    tables = [load_table(s) for s in cfg.sources]

    def v1_loader():
        ld = PackedLoader(cfg, tables, rank=0, world_size=1, micro_batch=2, pad_id=0)
        ld.order_version = 1
        return ld

    ref = take(v1_loader(), 6)
    first = v1_loader()
    take(first, 3)
    state = json.loads(json.dumps(first.state_dict()))
    for ws in state["worker_states"].values():
        assert ws.pop("order") == 1  # what an old loader's state looks like
    again = build_loader(cfg, rank=0, world_size=1, micro_batch=2)
    again.load_state_dict(state)
    assert again.order_version == 1
    same(take(again, 3), ref[3:])
    fresh = take(build_loader(cfg, rank=0, world_size=1, micro_batch=2), 3)
    assert not all(torch.equal(a["input_ids"], b["input_ids"]) for a, b in zip(fresh, ref))


def test_one_worker_gives_the_in_process_batches(tiny_tokens):
    """A worker packs into slots of shared memory and the trainer's process copies them out:
    the batches are those packed in-process, and stay intact after the slots are reused."""
    want = take(build_loader(cfg_for(tiny_tokens), rank=0, world_size=1, micro_batch=2), 12)
    cfg = cfg_for(tiny_tokens, num_workers=1, prefetch_factor=1)
    got = take(build_loader(cfg, rank=0, world_size=1, micro_batch=2), 12)  # 3 slots, 12 batches
    same(got, want)
