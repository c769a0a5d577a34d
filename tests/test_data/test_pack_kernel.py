"""The compiled mixing and packing loop (data/loader/pack_kernel.py, stream_arrays.py): a restore
mid-document resumes exactly, a worker gives the in-process batches and states, a shard that
fails its check is read one by one with each skip counted once, and redistributed states (more
held documents than steady state, masked epochs) resume exactly. The batches themselves are
compared with recorded ones in test_loader_known_good.py."""

from __future__ import annotations

import json
import shutil

import pytest
import torch
from factories import flip_token_bytes

from data.loader import build_loader
from data.loader.config import LoaderConfig, SourceConfig

SOURCES = ("code", "text", "scenes", "digits", "clips", "docs")
WEIGHTS = (1.0, 2.0, 1.5, 0.5, 1.0, 1.0)


def config(tokens, sources=SOURCES, **kw) -> LoaderConfig:
    return LoaderConfig(
        sources=[
            SourceConfig(name=s, shards=[str(tokens / s)], weight=w)
            for s, w in zip(SOURCES, WEIGHTS)
            if s in sources
        ],
        **{"seq_len": 256, "num_workers": 0, "shuffle_buffer": 8, **kw},
    )


def run(tokens, n, state=None, micro_batch=3, **kw) -> tuple[list[dict], list[dict], object]:
    """Up to ``n`` batches (fewer when an epoch ends) and the loader's state after each."""
    loader = build_loader(config(tokens, **kw), rank=0, world_size=1, micro_batch=micro_batch)
    if state is not None:
        loader.load_state_dict(state)
    batches, states = [], []
    it = iter(loader)
    for batch in it:
        batches.append(batch)
        states.append(json.loads(json.dumps(loader.state_dict())))
        if len(batches) == n:
            break
    it.close()
    return batches, states, loader


def assert_same(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for key in x:
            assert x[key].dtype == y[key].dtype, key
            assert torch.equal(x[key], y[key]), key


def test_a_state_mid_document_resumes_exactly(tiny_tokens):
    whole, whole_states, _ = run(tiny_tokens, 30, seq_len=512, mix_chunk=96)
    head, states, _ = run(tiny_tokens, 13, seq_len=512, mix_chunk=96)
    assert states[-1]["worker_states"]["0"]["open"] or states[-1]["worker_states"]["0"]["pending"]
    tail, tail_states, _ = run(tiny_tokens, 17, states[-1], seq_len=512, mix_chunk=96)
    assert_same(whole, head + tail)
    assert whole_states == states + tail_states


def test_a_worker_gives_the_in_process_batches_and_states(tiny_tokens):
    want, want_states, _ = run(tiny_tokens, 12)
    got, got_states, _ = run(tiny_tokens, 12, num_workers=1)
    assert_same(want, got)
    assert want_states == got_states


@pytest.mark.parametrize("settings", [{}, {"mode": "epoch"}])
def test_a_shard_that_fails_its_check_is_read_one_by_one_with_each_skip_counted_once(
    tiny_tokens, tmp_path, capfd, settings
):
    """The bad documents are skipped, logged and counted: a skip read ahead counts once the
    compiled loop takes a document after it (or reaches the source's end), so a state resumed
    mid-run counts none twice."""
    tokens = tmp_path / "tokens"
    shutil.copytree(tiny_tokens, tokens)
    tar = tokens / "scenes" / "shard-000000.tar"
    last = len((tar.parent / "shard-000000.idx.jsonl").read_text().splitlines()) - 1
    key = flip_token_bytes(tar, 3, n=1)
    flip_token_bytes(tar, last, n=1)  # in epoch mode: unreadable documents at a source's end
    n = 1000 if settings else 40
    want, want_states, _ = run(tokens, n, **settings)
    assert f"sample {key}" in capfd.readouterr().err
    assert want_states[-1]["worker_states"]["0"]["errors"] >= 2
    head, states, _ = run(tokens, 7, **settings)
    tail, tail_states, _ = run(tokens, len(want) - 7, states[-1], **settings)
    assert_same(want, head + tail)
    assert tail_states[-1] == want_states[-1]


def _redistributed(tokens, kw: dict, old_world: int, old_batches: int, rank: int, world: int):
    """A loader of ``rank`` of ``world`` consumers restored from the states of ``old_world``
    ranks that packed ``old_batches`` batches each (redistribute.py), and the restored state."""
    from data.loader.dataset import PackedLoader
    from data.loader.redistribute import redistribute
    from data.loader.table_load import load_table

    cfg = config(tokens, **kw)
    tables = [load_table(s) for s in cfg.sources]
    states = []
    for old_rank in range(old_world):
        old = PackedLoader(
            cfg, tables, rank=old_rank, world_size=old_world, micro_batch=1, pad_id=0
        )
        it = iter(old)
        for _ in range(old_batches):
            next(it)
        it.close()
        states.append(old.state_dict())
    new = PackedLoader(cfg, tables, rank=rank, world_size=world, micro_batch=1, pad_id=0)
    state = json.loads(json.dumps(redistribute(states, new)))
    new.load_state_dict(state)
    return new, state


def _resumed_halfway(new, state, tokens, kw, n: int) -> None:
    """``n`` batches of ``new`` equal its first ``n // 2`` and then those of a loader restored
    from the state after them."""
    whole, states, _ = run(tokens, n, state, **kw)
    head, head_states, _ = run(tokens, n // 2, state, **kw)
    tail, tail_states, _ = run(tokens, n - n // 2, head_states[-1], **kw)
    assert_same(whole, head + tail)
    assert states == head_states + tail_states


def test_a_state_redistributed_onto_fewer_consumers_resumes_exactly(tiny_tokens):
    """Eight ranks onto one: the one consumer takes every old consumer's held-aside and open
    documents, more than max_pending (redistribute.py), and resumes exactly from a state taken
    while it holds them."""
    # sources with at least eight samples (one for each old rank)
    kw = {"seq_len": 512, "mix_chunk": 64, "max_pending": 1, "sources": SOURCES[:4]}
    new, state = _redistributed(tiny_tokens, kw, 8, 1, 0, 1)
    assert len(state["worker_states"]["0"]["open"]) > 2 * (1 + 2)  # beyond steady state
    _resumed_halfway(new, state, tiny_tokens, {**kw, "micro_batch": 1}, 20)


def test_a_redistributed_epoch_is_left_for_the_next(tiny_tokens):
    """A state redistributed from three ranks onto two carries skip masks (what the old ranks
    read of the epoch); packing on past the end of that masked epoch goes into the next one
    (infinite mode): the compiled loop's runs roll into the next epoch themselves."""
    kw = {"seq_len": 512, "max_pending": 1, "sources": SOURCES[:4]}
    new, state = _redistributed(tiny_tokens, kw, 3, 4, 1, 2)
    start = state["worker_states"]["0"]
    assert start["skip"]  # masked epochs: what the old ranks had read
    last_epoch = max(cursor[0] for cursor in start["cursors"])
    it = iter(new)
    for _ in range(400):
        next(it)
        epochs = [cursor[0] for cursor in new.state_dict()["worker_states"]["0"]["cursors"]]
        if min(epochs) > last_epoch:
            break
    it.close()
    assert min(epochs) > last_epoch, epochs


def split_documents(batches: list[dict], seq_len: int) -> set[tuple[int, int, int]]:
    """(source, sample, batch) of the documents that fit a row but were split across rows. A
    document's pieces come in order and its next reading (the next epoch) starts again at 0;
    a reading still open in the last batch may yet grow past a row and is left out."""
    readings: dict[tuple[int, int], list[list[tuple[int, int, int]]]] = {}
    for number, batch in enumerate(batches):
        for source, sample, start, end in batch["pieces"].reshape(-1, 4).tolist():
            if end > start:
                doc = readings.setdefault((source, sample), [])
                if start == 0 or not doc:
                    doc.append([])
                doc[-1].append((number, start, end))
    last = len(batches) - 1
    return {
        (*doc, pieces[0][0])
        for doc, found in readings.items()
        for pieces in found
        if len(pieces) > 1
        and pieces[0][1] == 0
        and pieces[-1][2] <= seq_len
        and pieces[-1][0] < last
    }


def test_whole_documents_keeps_every_document_that_fits_a_row_in_one_row(tiny_tokens):
    split, _, _ = run(tiny_tokens, 40, seq_len=512)
    whole, whole_states, _ = run(tiny_tokens, 40, seq_len=512, whole_documents=True)
    assert split_documents(split, 512)  # without the option, row ends split documents
    assert not split_documents(whole, 512)
    # and a restore mid-stream resumes the same rows
    head, states, _ = run(tiny_tokens, 13, seq_len=512, whole_documents=True)
    tail, _, _ = run(tiny_tokens, 27, states[-1], seq_len=512, whole_documents=True)
    assert_same(whole, head + tail)
