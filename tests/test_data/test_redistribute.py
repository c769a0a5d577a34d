"""``redistribute``: a loader's position moved mid-epoch onto another world size or worker count,
on real token shards. Every document is delivered exactly once over the old and new batches
(epoch mode, except those held back), nothing repeats within an epoch (infinite mode, through
repeated redistributions), the mix holds, and a redistributed state resumes exactly."""

from __future__ import annotations

import json
from collections import Counter, defaultdict

import pytest
import torch

from data.loader import LoaderConfig, SourceConfig
from data.loader.dataset import PackedLoader
from data.loader.redistribute import redistribute
from data.loader.stream import ConsumerStream
from data.loader.table_load import load_table


def cfg_for(tokens, weights, **kw) -> LoaderConfig:
    srcs = [SourceConfig(name=s, shards=[str(tokens / s)], weight=w) for s, w in weights.items()]
    return LoaderConfig(
        sources=srcs, **{"seq_len": 256, "num_workers": 0, "shuffle_buffer": 8, **kw}
    )


def loaders(cfg, tables, world_size, micro_batch=2):
    return [
        PackedLoader(cfg, tables, rank=r, world_size=world_size, micro_batch=micro_batch, pad_id=0)
        for r in range(world_size)
    ]


def take(loader, n=None):
    """n batches (all, when None) of the loader, its workers stopped after."""
    it = iter(loader)
    out = []
    for b in it:
        out.append(b)
        if n is not None and len(out) == n:
            break
    it.close()
    return out


def onto(old_states, cfg, tables, world_size):
    """The new world's loaders, each restored from its redistributed state."""
    new = loaders(cfg, tables, world_size)
    for ld in new:
        st = redistribute(old_states, ld)
        assert len(json.dumps(st)) < 64_000  # masks packed: still kilobytes
        ld.load_state_dict(json.loads(json.dumps(st)))
    return new


def spans_by_doc(batches):
    out = defaultdict(list)
    for b in batches:
        for s, sample, a, e in b["pieces"].reshape(-1, 4).tolist():
            if s >= 0:
                out[(s, sample)].append((a, e))
    return out


EPOCH = {"scenes": 1.0, "digits": 1.0, "text": 1.0, "docs": 1.0}


@pytest.mark.parametrize("world_size,workers", [(1, 2), (3, 0)])
def test_epoch_mode_delivers_every_document_once_across_a_redistribute(
    tiny_tokens, world_size, workers
):
    cfg = cfg_for(tiny_tokens, EPOCH, mode="epoch")
    tables = [load_table(s) for s in cfg.sources]
    old = loaders(cfg, tables, 2)
    batches = take(old[0], 3) + take(old[1], 2)  # uneven on purpose: cursors at other places
    states = [ld.state_dict() for ld in old]
    new_cfg = cfg_for(tiny_tokens, EPOCH, mode="epoch", num_workers=workers)
    new = onto(states, new_cfg, tables, world_size)
    assert len({ld.batch_limit for ld in new}) == 1  # every new rank counted the same
    runs = [take(ld) for ld in new]
    assert (
        len({len(r) for r in runs}) == 1 and len(runs[0]) == new[0].batch_limit * new[0].workers > 0
    )
    spans = spans_by_doc(batches + [b for r in runs for b in r])
    full = 0
    for (s, sample), sp in spans.items():
        sp.sort()
        assert all(e0 <= a1 for (_, e0), (a1, _) in zip(sp, sp[1:])), (
            s,
            sample,
            sp,
        )  # no token twice
        full += (
            sp[0][0] == 0
            and sp[-1][1] == tables[s].tokens_of(sample)
            and all(e0 == a1 for (_, e0), (a1, _) in zip(sp, sp[1:]))
        )
    held = sum(ld.held_back() for ld in new)
    assert full + held == sum(len(t) for t in tables) and full > held
    # A redistributed state resumes exactly: rank 0 stopped after 3 batches and restored.
    first = onto(states, new_cfg, tables, world_size)[0]
    head = take(first, 3)
    again = loaders(new_cfg, tables, world_size)[0]
    again.load_state_dict(json.loads(json.dumps(first.state_dict())))
    tail = take(again)
    assert len(head) + len(tail) == len(runs[0])
    for a, b in zip(runs[0], head + tail):
        for key in a:
            assert torch.equal(a[key], b[key]), key


def test_epoch_mode_counts_a_redistribute_with_new_weights_as_it_packs(tiny_tokens):
    """New weights on a redistribute start the mix from 0: the batches counted for epoch mode
    are those the new consumers then pack (counted from the old mix, rank 0 was promised one
    more batch than it could fill)."""
    cfg = cfg_for(tiny_tokens, EPOCH, mode="epoch")
    tables = [load_table(s) for s in cfg.sources]
    old = loaders(cfg, tables, 2)
    take(old[0], 3), take(old[1], 2)
    states = [ld.state_dict() for ld in old]
    weights = {"scenes": 5.0, "digits": 1.0, "text": 1.0, "docs": 1.0}
    (new,) = onto(states, cfg_for(tiny_tokens, weights, mode="epoch"), tables, 1)
    assert len(take(new)) == new.batch_limit


def _through_redistributes(cfg, tables) -> tuple[list[dict], list]:
    """2 ranks for 15 steps, then 3 for 6, then 1 for 60: the batches, and the last loaders."""
    batches, lds = [], loaders(cfg, tables, 2)
    for n_new, steps in ((3, 15), (1, 6)):
        for ld in lds:
            batches += take(ld, steps)
        states = [ld.state_dict() for ld in lds]
        if n_new == 1:  # the second redistribute composes with the masks of the first
            assert any(ws["skip"] for st in states for ws in st["worker_states"].values())
        lds = onto(states, cfg, tables, n_new)
    batches += take(lds[0], 60)
    return batches, lds


def test_infinite_mode_repeats_nothing_within_an_epoch_through_redistributes(tiny_tokens):
    """2 ranks, then 3, then 1: every document delivered once per epoch (its first token, at
    the start of a piece, as often as the epochs the last consumer has passed, or once more in
    the epoch it is in), and the token mix on target."""
    weights = {"text": 0.5, "scenes": 0.3, "digits": 0.2}
    cfg = cfg_for(tiny_tokens, weights)
    tables = [load_table(s) for s in cfg.sources]
    batches, lds = _through_redistributes(cfg, tables)
    starts: Counter = Counter()
    for batch in batches:
        for s, sample, start, _ in batch["pieces"].reshape(-1, 4).tolist():
            if s >= 0 and start == 0:
                starts[(s, sample)] += 1
    for s, t in enumerate(tables):
        passed = lds[0].state_dict()["worker_states"]["0"]["cursors"][s][0]
        assert passed >= 2 or s == 0  # the small sources went round a few times
        for sample in range(len(t)):
            assert passed <= starts[(s, sample)] <= passed + 1, (s, sample, passed)
    got = torch.stack([b["tokens_by_source"] for b in batches]).sum(0).double()
    for share, w in zip((got / got.sum()).tolist(), weights.values()):
        assert abs(share - w) < 0.03, (share, w)


def test_redistribute_refuses_other_data_and_incomplete_worlds(tiny_tokens):
    cfg = cfg_for(tiny_tokens, {"scenes": 1.0, "digits": 1.0})
    tables = [load_table(s) for s in cfg.sources]
    old = loaders(cfg, tables, 2)
    take(old[0], 1)
    states = [ld.state_dict() for ld in old]
    other = cfg_for(tiny_tokens, {"scenes": 1.0})
    with pytest.raises(ValueError, match="fingerprint"):
        redistribute(states, loaders(other, [load_table(s) for s in other.sources], 1)[0])
    with pytest.raises(ValueError, match="one loader state per old rank"):
        redistribute(states[:1], loaders(cfg, tables, 1)[0])
    with pytest.raises(ValueError, match="seq_len"):
        redistribute(
            states,
            loaders(cfg_for(tiny_tokens, {"scenes": 1.0, "digits": 1.0}, seq_len=512), tables, 1)[
                0
            ],
        )
    with pytest.raises(ValueError, match="redistribute"):  # plain loading still refuses
        loaders(cfg, tables, 1)[0].load_state_dict(states[0])


def test_packer_drains_more_held_documents_than_max_pending(tiny_tokens):
    """A redistribute may deal a consumer more held-aside documents than ``max_pending``: they
    are all placed, each from where it stopped (the sources are done: nothing new is read)."""
    cfg = cfg_for(tiny_tokens, {"text": 1.0, "scenes": 1.0}, max_pending=1)
    tables = [load_table(s) for s in cfg.sources]
    cs = ConsumerStream(tables, [1.0, 1.0], cfg, consumer=0, consumers=1, micro_batch=1, pad_id=0)
    docs = [cs.load(s, i, 0) for s in (0, 1) for i in range(3)]
    offsets = [5] + [0] * (len(docs) - 1)  # a text document half placed before
    start = {(d.source, d.sample): int(d.units[0, 0]) + offset for d, offset in zip(docs, offsets)}
    state = cs.state_dict()
    state["pending"] = [
        [d.source, d.sample, d.epoch, 0, offset, d.length] for d, offset in zip(docs, offsets)
    ]
    state["cursors"] = [[0, 0, 0, 1] for _ in cs.cursors]  # done: nothing new is read
    cs.load_state_dict(state)
    spans = defaultdict(list)
    while (batch := cs.next_batch()) is not None:
        for s, sample, a, e in batch.pieces.reshape(-1, 4).tolist():
            if s >= 0:
                spans[(s, sample)].append((a, e))
    for d in docs:
        sp = sorted(spans[(d.source, d.sample)])
        assert sp[0][0] == start[(d.source, d.sample)] and sp[-1][1] == d.length
        assert all(e0 == a1 for (_, e0), (a1, _) in zip(sp, sp[1:]))


def test_a_second_redistribute_keeps_masks_beyond_every_cursor():
    """Old consumers one epoch apart; the first redistribute starts everyone at the slower epoch
    with masks for both; a second one before anyone reaches the later epoch must carry its mask."""
    import numpy as np

    from data.loader.dataset import STATE_VERSION
    from data.loader.table import SampleTable

    n = 40
    lengths = np.random.default_rng(0).integers(10, 100, n).astype(np.int64)
    tables = [
        SampleTable(
            "s",
            ["a.tar"],
            np.zeros(n, np.int32),
            [f"k{i}" for i in range(n)],
            lengths,
            [[] for _ in range(n)],
            "fp",
            "tfp",
            "tokens",
        )
    ]
    cfg = LoaderConfig(
        sources=[SourceConfig(name="s", shards=["x"])], seq_len=256, num_workers=0, shuffle_buffer=8
    )
    reads = []

    def streams(lds, states=None):
        out = []
        for ld in lds:
            s = ld.make_stream(0, dry=True)  # lengths from the table alone: no tar needed
            if states is not None:
                s.load_state_dict(states[ld.rank]["worker_states"]["0"])
            out.append(s)
        return out

    def draw(s, k):
        for _ in range(k):
            d = s.read_next(0)
            reads.append((d.sample, d.epoch))

    def states(lds, ss):
        return [
            {
                "version": STATE_VERSION,
                "fingerprint": ld.fingerprint(),
                "rank": ld.rank,
                "world_size": ld.world_size,
                "workers": 1,
                "seq_len": 256,
                "micro_batch": 1,
                "mode": "infinite",
                "shares": [1.0],
                "handed_out": 1,
                "batch_limit": None,
                "worker_states": {"0": read_position(s)},
            }
            for ld, s in zip(lds, ss)
        ]

    def read_position(s):
        # These streams only read (``read_next``) and pack nothing: their state is where their
        # cursors have read to, as the state of a stream that packed all it read would be
        st = s.state_dict()
        st["cursors"] = [[c.epoch, c.pos, c.tokens, int(c.done)] for c in s.cursors]
        st["skip"] = [[0, e, m] for c in s.cursors for e, m in sorted(c.skip.items())]
        return st

    lds = loaders(cfg, tables, 2, micro_batch=1)
    ss = streams(lds)
    draw(ss[0], 65)  # epoch 3, position 5 of its 20
    draw(ss[1], 85)  # epoch 4, position 5
    lds2 = loaders(cfg, tables, 2, micro_batch=1)
    old = states(lds, ss)
    ss2 = streams(lds2, [redistribute(old, ld) for ld in lds2])
    draw(ss2[0], 2)
    draw(ss2[1], 2)  # both still in epoch 3
    ld3 = loaders(cfg, tables, 1, micro_batch=1)
    ss3 = streams(ld3, [redistribute(states(lds2, ss2), ld3[0])])
    draw(ss3[0], 150)
    assert len(reads) == len(set(reads))
