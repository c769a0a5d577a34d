"""Where a batch's time goes in the token loader, in-process: the loader
built as ``tools/bench/bench_peers.py`` builds it (every source of a token folder, weighted by
its tokens), ``--warmup`` batches untimed, then ``--batches`` batches with each part of the
path wrapped in a ``perf_counter`` timer. Prints microseconds a batch per part and its share
of the whole (the parts nest: ``next_batch`` holds ``fast.pack``, which holds the compiled
loop's call and reading ahead; each timer adds ~0.3 us). A diagnostic, not a comparison:
``bench_peers.py`` and ``bench_loader_versions.py`` measure speed.

    .venv/bin/python tools/bench/bench_loader_parts.py --tokens runs/demo/tokens
"""

from __future__ import annotations

import argparse
import collections
import json
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

# (module, owner, attribute, label), outermost first
PARTS = (
    ("data.loader.stream", "ConsumerStream", "next_batch", "next_batch"),
    ("data.loader.batch_buffer", "BatchBuffer", "__init__", "  batch buffer"),
    ("data.loader.fast_stream", "FastPath", "pack", "  fast.pack"),
    ("data.loader.fast_stream", "FastPath", "_run", "    compiled loop + reading ahead"),
    ("data.loader.fast_stream", "FastPath", "_refill", "      reading ahead"),
    ("data.loader.fast_stream", "FastPath", "_fast_run", "        runs of documents"),
    ("data.loader.fast_stream", "FastPath", "_stage", "        staging tokens"),
    ("data.loader.stream", "ConsumerStream", "checked_shard", "        whole-shard checks"),
    ("data.loader.stream", "ConsumerStream", "state", "state snapshot"),
    ("data.loader.packed_batch", "PackedBatch", "to_dict", "to_dict"),
    ("data.loader.packed_batch", None, "expand", "  expand"),
    ("data.loader.batch_buffer", "BatchBuffer", "split", "  split into tensors"),
)


def wrap(spent: dict, module: str, owner: str | None, attr: str, label: str) -> None:
    import importlib

    holder = importlib.import_module(module)
    if owner is not None:
        holder = getattr(holder, owner)
    inner = getattr(holder, attr)

    def timed(*args, **kw):
        t0 = time.perf_counter()
        try:
            return inner(*args, **kw)
        finally:
            spent[label] += time.perf_counter() - t0

    setattr(holder, attr, timed)


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=Path, default=Path("runs/demo/tokens"))
    ap.add_argument("--batches", type=int, default=600)
    ap.add_argument("--warmup", type=int, default=50)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8)
    a = ap.parse_args(argv)
    from tools.bench.bench_peers import ours_batches

    spent: dict[str, float] = collections.defaultdict(float)
    for part in PARTS:
        wrap(spent, *part)
    batches = ours_batches(a.tokens, 0, a.seq_len, a.rows)
    for _ in range(a.warmup):
        next(batches)
    spent.clear()
    t0 = time.perf_counter()
    for _ in range(a.batches):
        next(batches)
    total = (time.perf_counter() - t0) / a.batches * 1e6
    res = {"us_per_batch": total, "parts": {}}
    print(
        f"batches of {a.rows} x {a.seq_len}: "
        f"{total:.1f} us a batch ({a.batches} batches after {a.warmup})"
    )
    for *_, label in PARTS:
        us = spent.get(label, 0.0) / a.batches * 1e6
        res["parts"][label.strip()] = us
        print(f"  {label:40s} {us:7.1f} us  {us / total:5.1%}")
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
