"""The compiled mixing and packing loop (data/loader/pack_kernel.py, fast_stream.py) against the
Python path it transliterates (``data.compiled_packer=false``): the same batches and the same
state after every batch, in every mode that changes a decision, across a restore from one path
into the other, through a worker, and over a shard that fails its check."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

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


def run(tokens, n, state=None, **kw) -> tuple[list[dict], list[dict], object]:
    """Up to ``n`` batches (fewer when an epoch ends) and the loader's state after each."""
    loader = build_loader(config(tokens, **kw), rank=0, world_size=1, micro_batch=3)
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


SETTINGS = [
    {},
    {"seq_len": 512, "mix_chunk": 96},  # long documents handed out a chunk at a time
    {"seq_len": 128, "allow_block_drops": True},  # videos longer than a row: dropped blocks
    {"seq_len": 128, "allow_block_drops": True, "oversize": "drop_document"},
    {"mode": "epoch"},  # to the end: every source done, the last batch held back
    {"max_pending": 1, "shuffle_shards": False},
    {"seq_len": 512, "whole_documents": True},  # documents that fit a row wait for one
]


@pytest.mark.parametrize("settings", SETTINGS)
def test_the_compiled_loop_packs_what_the_python_path_packs(tiny_tokens, settings):
    n = 1000 if settings.get("mode") == "epoch" else 40
    want, want_states, _ = run(tiny_tokens, n, compiled_packer=False, **settings)
    got, got_states, loader = run(tiny_tokens, n, **settings)
    assert loader.make_stream(0)._fast_path() is not None  # numba is there: compiled
    assert_same(want, got)
    assert want_states == got_states
    if settings.get("allow_block_drops"):
        assert sum(int(b["dropped_blocks"].sum()) for b in got) > 0  # the drops were exercised
    if settings.get("whole_documents"):  # documents were held for a later row: other rows
        split, _, _ = run(tiny_tokens, n, **{**settings, "whole_documents": False})
        assert any(not torch.equal(a["doc_ids"], b["doc_ids"]) for a, b in zip(got, split))


@pytest.mark.parametrize("first_compiled", [True, False])
def test_a_state_of_one_path_resumes_in_the_other(tiny_tokens, first_compiled):
    whole, _, _ = run(tiny_tokens, 30, seq_len=512, mix_chunk=96)
    head, states, _ = run(
        tiny_tokens, 13, seq_len=512, mix_chunk=96, compiled_packer=first_compiled
    )
    assert states[-1]["worker_states"]["0"]["open"] or states[-1]["worker_states"]["0"]["pending"]
    tail, _, _ = run(
        tiny_tokens, 17, states[-1], seq_len=512, mix_chunk=96, compiled_packer=not first_compiled
    )
    assert_same(whole, head + tail)


def test_a_worker_runs_the_compiled_loop_with_the_same_batches(tiny_tokens):
    want, want_states, _ = run(tiny_tokens, 12, compiled_packer=False)
    got, got_states, _ = run(tiny_tokens, 12, num_workers=1)
    assert_same(want, got)
    assert want_states == got_states


@pytest.mark.parametrize("settings", [{}, {"mode": "epoch"}])
def test_a_shard_that_fails_its_check_is_read_one_by_one_with_the_same_skips(
    tiny_tokens, tmp_path, capfd, settings
):
    """The bad document is skipped and counted as the Python path counts it: a skip read ahead
    counts once the compiled loop takes a document after it (or reaches the source's end), so
    every state agrees, and a state resumed is not counted twice."""
    tokens = tmp_path / "tokens"
    shutil.copytree(tiny_tokens, tokens)
    tar = tokens / "scenes" / "shard-000000.tar"
    last = len((tar.parent / "shard-000000.idx.jsonl").read_text().splitlines()) - 1
    key = flip_token_bytes(tar, 3, n=1)
    flip_token_bytes(tar, last, n=1)  # in epoch mode: unreadable documents at a source's end
    n = 1000 if settings else 40
    want, want_states, _ = run(tokens, n, compiled_packer=False, **settings)
    err = capfd.readouterr().err
    got, got_states, _ = run(tokens, n, **settings)
    assert_same(want, got)
    assert want_states == got_states
    assert want_states[-1]["worker_states"]["0"]["errors"] >= 2
    assert f"sample {key}" in err and f"sample {key}" in capfd.readouterr().err
    # resumed from a state of either path: the same skips, counted once
    head, states, _ = run(tokens, 7, **settings)
    tail, tail_states, _ = run(tokens, len(want) - 7, states[-1], compiled_packer=False, **settings)
    assert_same(want, head + tail)
    assert tail_states[-1] == want_states[-1]


def _redistributed(tokens, kw: dict, old_world: int, old_batches: int, rank: int, world: int):
    """For each path (Python, compiled): a loader of ``rank`` of ``world`` consumers, restored
    from the states of ``old_world`` ranks that packed ``old_batches`` batches each
    (redistribute.py), and the restored state."""
    from data.loader.dataset import PackedLoader
    from data.loader.redistribute import redistribute
    from data.loader.table_load import load_table

    cfg = config(tokens, compiled_packer=False, **kw)
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
    for compiled in (False, True):
        new_cfg = config(tokens, compiled_packer=compiled, **kw)
        new = PackedLoader(new_cfg, tables, rank=rank, world_size=world, micro_batch=1, pad_id=0)
        state = json.loads(json.dumps(redistribute(states, new)))
        new.load_state_dict(state)
        yield new, state


def test_a_state_redistributed_onto_fewer_consumers_resumes_in_the_compiled_loop(tiny_tokens):
    """Eight ranks onto one: the one consumer takes every old consumer's held-aside and open
    documents, more than max_pending (redistribute.py); both paths drain them the same way."""
    # sources with at least eight samples (one for each old rank)
    kw = {"seq_len": 512, "mix_chunk": 64, "max_pending": 1, "sources": SOURCES[:4]}
    out = []
    for new, state in _redistributed(tiny_tokens, kw, 8, 1, 0, 1):
        held = state["worker_states"]["0"]
        assert len(held["open"]) > 2 * (1 + 2)  # more than the steady-state capacity
        it = iter(new)
        out.append(([next(it) for _ in range(20)], new.state_dict()))
        it.close()
    assert_same(out[0][0], out[1][0])
    assert out[0][1] == out[1][1]


def test_without_numba_the_python_path_gives_the_same_batches(tiny_tokens, tmp_path):
    """numba is a dependency, but a loader imported where it is missing falls back to the
    Python path and numpy's expansion (a subprocess with ``numba`` made unimportable)."""
    here = Path(__file__).resolve().parent
    script = f"""
import sys
sys.modules["numba"] = None  # import numba -> ImportError
sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]
import torch
from pathlib import Path
from data.loader import expand
from test_pack_kernel import run
assert expand._compiled is None
batches, _, loader = run(Path({str(tiny_tokens)!r}), 8)
assert loader.make_stream(0)._fast_path() is None and not loader.cfg.compiled_packer
torch.save(batches, {str(tmp_path / "batches.pt")!r})
"""
    subprocess.run([sys.executable, "-c", script], check=True)
    without = torch.load(tmp_path / "batches.pt")
    assert_same(run(tiny_tokens, 8)[0], without)


def test_both_paths_leave_a_redistributed_epoch_for_the_next_the_same_way(tiny_tokens):
    """A state redistributed from three ranks onto two carries skip masks (what the old ranks
    read of the epoch); packing on past the end of that masked epoch into the next one
    (infinite mode) gives the same batches and states on both paths, after every batch: the
    compiled loop's runs roll into the next epoch themselves (``ConsumerStream.next_epoch``)."""
    kw = {"seq_len": 512, "max_pending": 1, "sources": SOURCES[:4]}
    runs = []
    for new, state in _redistributed(tiny_tokens, kw, 3, 4, 1, 2):
        start = state["worker_states"]["0"]
        assert start["skip"]  # masked epochs: what the old ranks had read
        last_epoch = max(cursor[0] for cursor in start["cursors"])
        batches, after = [], []
        it = iter(new)
        for batch in it:
            batches.append(batch)
            after.append(json.loads(json.dumps(new.state_dict())))
            epochs = [cursor[0] for cursor in after[-1]["worker_states"]["0"]["cursors"]]
            if min(epochs) > last_epoch or len(batches) == 400:
                break
        it.close()
        runs.append((batches, after, epochs))
    (a, a_states, a_epochs), (b, b_states, _) = runs
    assert_same(a, b)
    assert a_states == b_states
    # every source went on into an epoch after the redistributed one
    assert min(a_epochs) > last_epoch, a_epochs
