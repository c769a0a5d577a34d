"""Batches of the loader compared with recorded ones: the SHA-256 of every field of every batch
in the settings that change a packing or mixing decision (weights, infinite and epoch mode,
chunked mixing, dropped blocks and documents, workers, a redistributed state, a restore
mid-epoch, the dry count of an epoch's batches, one document packed in a row of its own).

The hashes in known_good/batches.json were written by the loader as it was before its mixing,
packing and state were made one compiled path; any change of a batch is caught here. They are
hashes of batches of the tiny token folder (tests/conftest.py), whose fingerprint is recorded
beside them: a change of the corpus or its tokenizers, not of the loader, is named as such.
Record again (only when a batch is meant to change) with

    EARLYFUSE_RECORD_KNOWN_GOOD=1 python -m pytest tests/test_data/test_loader_known_good.py
"""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

from data.loader import LoaderConfig, SourceConfig, build_loader, pack_documents
from data.loader.dataset import PackedLoader
from data.loader.heldout import HeldoutPass
from data.loader.redistribute import redistribute
from data.loader.table_load import load_table
from data.token_docs import iter_documents

RECORD = os.environ.get("EARLYFUSE_RECORD_KNOWN_GOOD") == "1"
KNOWN = Path(__file__).parent / "known_good" / "batches.json"
WEIGHTS = {"code": 1.0, "text": 2.0, "scenes": 1.5, "digits": 0.5, "clips": 1.0, "docs": 1.0}
EPOCH = {"scenes": 1.0, "digits": 1.0, "text": 1.0, "docs": 1.0}


def config(tokens: Path, weights: dict[str, float] = WEIGHTS, **kw) -> LoaderConfig:
    return LoaderConfig(
        sources=[
            SourceConfig(name=s, shards=[str(tokens / s)], weight=w) for s, w in weights.items()
        ],
        **{"seq_len": 256, "num_workers": 0, "shuffle_buffer": 8, **kw},
    )


def digest(value: torch.Tensor | np.ndarray) -> str:
    array = value.numpy() if isinstance(value, torch.Tensor) else value
    array = np.ascontiguousarray(array)
    head = f"{array.dtype.str}{array.shape}".encode()
    return hashlib.sha256(head + array.tobytes()).hexdigest()[:16]


def hashes(batches: list[dict]) -> list[dict[str, str]]:
    return [{key: digest(value) for key, value in sorted(batch.items())} for batch in batches]


def take(loader: PackedLoader, n: int | None = None) -> list[dict]:
    """``n`` batches of ``loader`` (all, when None), its workers stopped after."""
    out: list[dict] = []
    it = iter(loader)
    for batch in it:
        out.append(batch)
        if n is not None and len(out) == n:
            break
    it.close()  # type: ignore[attr-defined]
    return out


def state_digest(loader: PackedLoader) -> str:
    text = json.dumps(loader.state_dict(), sort_keys=True)
    return hashlib.sha256(text.encode()).hexdigest()[:16]


def streamed(tokens: Path, n: int, **kw) -> dict:
    loader = build_loader(config(tokens, **kw), rank=0, world_size=1, micro_batch=3)
    batches = take(loader, n)
    return {"batches": hashes(batches), "state": state_digest(loader)}


def epoch_counts(tokens: Path) -> dict:
    """The dry count of an epoch's batches per consumer (ranks x workers), and a whole epoch."""
    counts = {}
    for world_size, workers in ((1, 1), (2, 1), (2, 3), (5, 2)):
        cfg = config(tokens, EPOCH, mode="epoch", num_workers=workers)
        tables = [load_table(s) for s in cfg.sources]
        loader = PackedLoader(cfg, tables, rank=0, world_size=world_size, micro_batch=2, pad_id=0)
        counts[f"{world_size}x{workers}"] = loader.batch_limit
    loader = build_loader(config(tokens, EPOCH, mode="epoch"), rank=0, world_size=1, micro_batch=3)
    batches = take(loader)
    return {"limits": counts, "batches": hashes(batches), "state": state_digest(loader)}


def restored_mid_epoch(tokens: Path) -> dict:
    cfg = config(tokens, EPOCH, mode="epoch", seq_len=512, mix_chunk=96)
    first = build_loader(cfg, rank=0, world_size=1, micro_batch=3)
    head = take(first, 5)
    state = json.loads(json.dumps(first.state_dict()))
    assert state["worker_states"]["0"]["open"] or state["worker_states"]["0"]["pending"]
    again = build_loader(cfg, rank=0, world_size=1, micro_batch=3)
    again.load_state_dict(state)
    tail = take(again)
    return {"batches": hashes(head + tail), "state": state_digest(again)}


def redistributed(tokens: Path) -> dict:
    """Two ranks stopped unevenly mid-epoch, their states mapped onto three ranks (the first's)."""
    cfg = config(tokens, EPOCH, mode="epoch")
    tables = [load_table(s) for s in cfg.sources]
    old = [
        PackedLoader(cfg, tables, rank=rank, world_size=2, micro_batch=2, pad_id=0)
        for rank in range(2)
    ]
    take(old[0], 3)
    take(old[1], 2)
    states = [loader.state_dict() for loader in old]
    new = PackedLoader(cfg, tables, rank=0, world_size=3, micro_batch=2, pad_id=0)
    new.load_state_dict(json.loads(json.dumps(redistribute(states, new))))
    batches = take(new)
    return {"limit": new.batch_limit, "batches": hashes(batches), "state": state_digest(new)}


def one_row(tokens: Path) -> dict:
    """Documents each packed alone in a row of its own length (the dependence probe's way)."""
    docs = []
    for name in ("docs", "scenes", "clips"):
        table = load_table(SourceConfig(name=name, shards=[str(tokens / name)]))
        docs += list(iter_documents([table], samples=iter(range(3))))
    assert len(docs) == 9
    out = []
    for doc in docs:
        batch = next(pack_documents([doc], len(doc.ids)))
        out.append({attr: digest(batch[key][0]) for attr, key in ONE_ROW_FIELDS.items()})
    return {"rows": out}


def heldout(tokens: Path) -> dict:
    """The held-out pass (validation and ``earlyfuse-eval``): rows of 96, batches of 4."""
    tables = [load_table(SourceConfig(name=s, shards=[str(tokens / s)])) for s in ("docs", "clips")]
    heldout_pass = HeldoutPass(tables, seq_len=96, batch_rows=4, max_docs=10)
    batches = [heldout_pass.tensors(batch) for batch in heldout_pass]
    counts = [[c.documents, c.skipped, c.dropped_blocks] for c in heldout_pass.counts]
    return {"batches": hashes(batches), "counts": counts}


# Recorded as the fields of a row packed on its own (``Row`` attributes then)
ONE_ROW_FIELDS = {
    "ids": "input_ids",
    "labels": "labels",
    "pos": "position_ids",
    "doc_ids": "doc_ids",
}

CASES = {
    "weights": lambda tokens: streamed(tokens, 10),
    "other_weights": lambda tokens: streamed(
        tokens, 8, weights={"code": 0.2, "scenes": 3.0, "clips": 1.0}, seed=7
    ),
    "chunked_mix": lambda tokens: streamed(tokens, 8, seq_len=512, mix_chunk=96),
    "dropped_blocks": lambda tokens: streamed(tokens, 8, seq_len=128, allow_block_drops=True),
    "dropped_documents": lambda tokens: streamed(
        tokens, 8, seq_len=128, allow_block_drops=True, oversize="drop_document"
    ),
    "few_pending": lambda tokens: streamed(tokens, 8, max_pending=1, shuffle_shards=False),
    "workers": lambda tokens: streamed(tokens, 8, num_workers=2),
    "epoch": epoch_counts,
    "restored_mid_epoch": restored_mid_epoch,
    "redistributed": redistributed,
    "one_row": one_row,
    "heldout": heldout,
}


@pytest.fixture(scope="module")
def known(tiny_tokens) -> dict:
    """The recorded hashes (written first when recording), checked to be of this token folder."""
    cfg = config(tiny_tokens)
    fingerprint = build_loader(cfg, rank=0, world_size=1, micro_batch=3).fingerprint()
    if RECORD:
        record = {"fingerprint": fingerprint}
        record |= {name: case(tiny_tokens) for name, case in CASES.items()}
        KNOWN.parent.mkdir(exist_ok=True)
        KNOWN.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
    recorded = json.loads(KNOWN.read_text())
    assert recorded["fingerprint"] == fingerprint, (
        f"{KNOWN} was recorded over another tiny token folder (fingerprint "
        f"{recorded['fingerprint']}, today's {fingerprint}): the corpus or its tokenizers "
        "changed, not the loader; record again on the loader the hashes were first taken of"
    )
    return recorded


@pytest.mark.parametrize("name", sorted(CASES))
def test_batches_match_the_known_good_ones(tiny_tokens, known, name):
    got = json.loads(json.dumps(CASES[name](tiny_tokens)))
    want = known[name]
    for key in want:
        if isinstance(want[key], list):
            assert len(got[key]) == len(want[key]), f"{name}: {key}: count"
            for number, (mine, theirs) in enumerate(zip(got[key], want[key])):
                assert mine == theirs, f"{name}: {key} {number} differs"
        else:
            assert got[key] == want[key], f"{name}: {key}"


def test_with_numba_jit_disabled_the_same_code_gives_the_same_batches(tiny_tokens, known):
    """``NUMBA_DISABLE_JIT=1`` (debugging: the compiled functions run as plain Python) packs the
    recorded batches too."""
    here = Path(__file__).resolve().parent
    script = f"""
import json, sys
sys.path[:0] = [{str(here)!r}, {str(here.parent)!r}]
from pathlib import Path
from test_loader_known_good import streamed
print(json.dumps(streamed(Path({str(tiny_tokens)!r}), 4, seq_len=512, mix_chunk=96)))
"""
    env = {**os.environ, "NUMBA_DISABLE_JIT": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], capture_output=True, text=True, check=True, env=env
    )
    got = json.loads(out.stdout.strip().splitlines()[-1])
    assert got["batches"] == known["chunked_mix"]["batches"][:4]
