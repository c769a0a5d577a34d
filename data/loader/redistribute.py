"""Move a loader's position onto another split (world size x workers), mid-epoch, exactly.

    old = [torch.load(f)["stream"] for f in every old rank's rank_RRRRR.pt]
    loader.load_state_dict(redistribute(old, loader))     # any rank of the new world

The rules (what was consumed becomes a skip mask per epoch, documents held aside are dealt
round-robin, counters keep their sums over ranks, epoch mode counts its batches again) are
docs/loader.md's "Another world size". Pure: each new rank computes all new consumers from all
old states and keeps its own, so no rank needs to talk to another. The micro batch may change
because a state is taken between batches, never mid-batch.
"""

from __future__ import annotations

import copy
from collections import Counter

import numpy as np

from data.loader.dataset import PackedLoader
from data.loader.order import pack_mask, unpack_mask


def redistribute(old: list[dict], loader: PackedLoader) -> dict:
    """This rank's state for ``loader`` (any world size and workers), from every old rank's
    ``PackedLoader.state_dict()``; ``loader.load_state_dict`` accepts it."""
    _check(old, loader)
    # The new consumers' counters start at a fresh stream's and the old ones' are added
    fresh = loader.make_stream(0, dry=True).state_dict()
    olds, n = consumer_states(old, fresh), loader.consumers
    new = [copy.deepcopy(fresh) for _ in range(n)]
    same_mix = old[0]["shares"] == loader.state_dict()["shares"]  # new weights: mixed from here
    for s, t in enumerate(loader.tables):
        epoch, masks = _consumed(s, len(t), olds)
        total = sum(st["cursors"][s][2] for st in olds)
        mix = sum(st["mix"][s] for st in olds) if same_mix else 0  # epoch mode counts it
        for k, st in enumerate(new):
            st["cursors"][s] = [epoch, 0, total // n + (k < total % n), 0]
            st["mix"][s] = mix // n + (k < mix % n)
            st["skip"] += [[s, e, m] for e, m in masks.items()]
    j = 0
    for c, st in enumerate(olds):
        # A document held aside may also be open (chunks still to come): it goes to one new
        # consumer, in both of its lists there.
        goes_to: dict[tuple, int] = {}
        for what in ("pending", "open"):
            for d in st[what]:
                key = tuple(d[:3])
                if key not in goes_to:
                    goes_to[key] = j % n
                    j += 1
                new[goes_to[key]][what].append(list(d))
        to = new[c % n]
        to["dropped_by"] = _sum_drops(to["dropped_by"], st["dropped_by"])
        to["errors"] += st["errors"]
        to["stats"] = {k: v + st["stats"][k] for k, v in to["stats"].items()}
        to["tokens_by_modality"] = [
            a + b for a, b in zip(to["tokens_by_modality"], st["tokens_by_modality"])
        ]
    # The samples skipped before, named once: every new consumer carries them all (the count
    # of distinct skipped samples is a union, data/skipped).
    skipped = sorted({(s, sample) for st in olds for s, sample in st["skipped"]})
    for st in new:
        st["skipped"] = [list(pair) for pair in skipped]
    limit = loader.count_batches(new) if loader.cfg.mode == "epoch" else None
    mine = range(loader.rank * loader.workers, (loader.rank + 1) * loader.workers)
    return {
        **loader.state_dict(),
        "handed_out": 0,
        "batch_limit": limit,
        "worker_states": {str(w): new[c] for w, c in enumerate(mine)},
        "redistributed": {
            "from_world_size": old[0]["world_size"],
            "from_workers": old[0]["workers"],
            "from_consumers": len(olds),
        },
    }


def consumer_states(old: list[dict], fresh: dict) -> list[dict]:
    """Every old consumer's state in consumer order, ``fresh`` where a worker handed out none."""
    out = [fresh] * (old[0]["world_size"] * old[0]["workers"])
    for st in old:
        for w, ws in st["worker_states"].items():
            out[st["rank"] * st["workers"] + int(w)] = ws
    return out


def _sum_drops(a: list, b: list) -> list:
    total: Counter[tuple[int, int]] = Counter()
    for s, m, k in a + b:
        total[(s, m)] += k
    return [[s, m, k] for (s, m), k in sorted(total.items())]


def _check(old: list[dict], loader: PackedLoader) -> None:
    if not old:
        raise ValueError("redistribute needs the loader state of every old rank; none given")
    for st in old:
        loader.check_state(st, same=("seq_len",))
        for k in ("world_size", "workers"):
            if st[k] != old[0][k]:
                raise ValueError(
                    f"the old loader states disagree on {k} ({st[k]} != {old[0][k]}): "
                    "they are not one run's"
                )
    ranks = sorted(st["rank"] for st in old)
    if ranks != list(range(old[0]["world_size"])):
        raise ValueError(
            f"redistribute needs one loader state per old rank 0..{old[0]['world_size'] - 1}, "
            f"got ranks {ranks}: a missing rank's position would be lost"
        )


def _consumed(s: int, n: int, olds: list[dict]) -> tuple[int, dict[int, str]]:
    """(the slowest old consumer's epoch, packed mask per epoch from there to the fastest's of
    the order positions already consumed) for source ``s`` with ``n`` samples."""
    cur = [st["cursors"][s] for st in olds]
    lo, hi = min(c[0] for c in cur), max(c[0] for c in cur)
    # All consumers of one state share its masks and drop them only once past their epoch, so
    # the slowest still holds any mask of an epoch >= its own (order.py).
    held: dict[int, str] = {}
    for st in olds:
        for src, e, m in st["skip"]:
            if src == s:
                held.setdefault(e, m)
    out = {}
    # Up to the last epoch any mask covers too: a mask of an earlier redistribute may lie beyond
    # every cursor (its consumers had read into that epoch, the slower new ones have not yet).
    for e in range(lo, max([hi, *held]) + 1):
        before = unpack_mask(held[e], n) if e in held else np.zeros(n, bool)
        free = np.flatnonzero(~before)  # positions the old consumers split
        done = before.copy()
        for c, (ec, pc, _tokens, _done) in enumerate(cur):
            if e <= ec:
                mine = free[c :: len(cur)]  # old consumer c's slice of them
                if pc > len(mine) and e == ec:
                    raise ValueError(
                        f"an old consumer's cursor ({pc}) is past its slice ({len(mine)}) of "
                        f"source {s} epoch {e}: the states are not of this data"
                    )
                done[mine if e < ec else mine[:pc]] = True
        if done.any():  # nothing consumed yet: no mask needed
            out[e] = pack_mask(done)
    return lo, out
