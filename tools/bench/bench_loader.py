"""Loader benchmarks, on the demo's token shards (``make demo``), in one process:

1. Throughput of the token-shard path on one core: our loader (``num_workers=0``, so this
   process is the one worker: read through the index, order, mix by tokens, pack rows of
   ``--seq-len``, collate) against plain ``webdataset`` iterating the same shards and
   ``np.load``-ing every sample's ids and modality arrays, alternating rounds. Printed: the
   ratio of tokens/s (target >= 0.8) and our absolute tokens/s per core (a 1B model at 45 % MFU
   on an H100 eats about 70k tokens/s).
2. RSS over a long run: the loader's process RSS sampled while it packs ``--samples`` samples'
   worth of tokens (default 10^5, about 77 passes over the demo data), first tenth against the
   end (target: flat).
3. ``load_state_dict`` + first batch from a state at the start of the stream against from the
   state after those 10^5 samples (target: equal; restoring seeks, never replays).

    .venv/bin/python tools/bench/bench_loader.py [--tokens runs/demo/tokens] [--samples 100000]
"""

from __future__ import annotations

import argparse
import glob
import io
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.loader import LoaderConfig, build_loader  # noqa: E402
from tools.bench import loader_start, machine, status_mib, token_loader_config  # noqa: E402


def ours(cfg: LoaderConfig, min_tokens: int) -> tuple[int, float]:
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=8)
    it, n, t0 = iter(loader), 0, time.perf_counter()
    while n < min_tokens:
        n += int(next(it)["num_real_tokens"])
    dt = time.perf_counter() - t0
    it.close()
    return n, dt


def plain_wds(shards: list[str], min_tokens: int) -> tuple[int, float]:
    import webdataset as wds

    n, t0 = 0, time.perf_counter()
    while n < min_tokens:
        for sample in wds.WebDataset(shards, shardshuffle=False, empty_check=False):
            ids = np.load(io.BytesIO(sample["ids.npy"]), allow_pickle=False)
            np.load(io.BytesIO(sample["mod.npy"]), allow_pickle=False)
            json.loads(sample["json"])
            n += len(ids)
    return n, time.perf_counter() - t0


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=Path, default=Path("runs/demo/tokens"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--round-tokens", type=int, default=2_000_000, help="tokens per timed round")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument(
        "--samples", type=int, default=100_000, help="stream length for the RSS and restore figures"
    )
    a = ap.parse_args(argv)
    if not (a.tokens / "manifest.json").is_file():
        sys.exit(f"{a.tokens}: no token shards; run `make demo` first (or pass --tokens)")
    manifest = json.loads((a.tokens / "manifest.json").read_text())
    cfg = token_loader_config(a.tokens, a.seq_len, num_workers=0, mode="infinite")
    shards = sorted(glob.glob(str(a.tokens / "*" / "*.tar")))
    res: dict = {
        "machine": machine(),
        "sources": [source.name for source in cfg.sources],
        "shards": len(shards),
        "seq_len": a.seq_len,
    }

    ours(cfg, 200_000), plain_wds(shards, 200_000)  # warm the page cache and imports
    o, w = [], []
    for _ in range(a.rounds):
        n, dt = ours(cfg, a.round_tokens)
        o.append(n / dt)
        n, dt = plain_wds(shards, a.round_tokens)
        w.append(n / dt)
    res["throughput"] = {
        "ours_tokens_per_s": statistics.mean(o),
        "plain_wds_tokens_per_s": statistics.mean(w),
        "ratio": statistics.mean(o) / statistics.mean(w),
    }

    per_sample = manifest["totals"]["tokens"] / manifest["totals"]["samples"]
    target = int(a.samples * per_sample)
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=8)
    it = iter(loader)
    next(it)
    start_state = json.loads(json.dumps(loader.state_dict()))
    marks: list[float] = []
    n, t0 = 0, time.perf_counter()
    while n < target:
        n += int(next(it)["num_real_tokens"])
        if len(marks) < 100 and n >= target * len(marks) / 100:
            marks.append(status_mib("VmRSS"))
    late_state = json.loads(json.dumps(loader.state_dict()))
    it.close()
    res["rss"] = {
        "tokens": n,
        "samples_approx": round(n / per_sample),
        "seconds": time.perf_counter() - t0,
        "rss_mib_at_10pct": marks[10],
        "rss_mib_at_end": status_mib("VmRSS"),
        "rss_mib_max": max(marks),
    }

    at_start, late = [], []
    for _ in range(3):
        at_start.append(loader_start(cfg, start_state)[1])
        late.append(loader_start(cfg, late_state)[1])
    res["restore"] = {
        "start_s": statistics.median(at_start),
        "late_s": statistics.median(late),
        "ratio": statistics.median(late) / statistics.median(at_start),
        "state_bytes": len(json.dumps(late_state)),
    }

    t, r, rs = res["throughput"], res["rss"], res["restore"]
    print(
        f"token path: {t['ours_tokens_per_s']:,.0f} tokens/s per core packed at seq_len {a.seq_len}, "
        f"{t['ratio']:.2f}x plain webdataset + np.load ({t['plain_wds_tokens_per_s']:,.0f} tokens/s) (target >= 0.8)"
    )
    print(
        f"RSS: {r['rss_mib_at_10pct']:.0f} MiB at 10 % of {r['samples_approx']:,} samples, {r['rss_mib_at_end']:.0f} MiB "
        f"at the end (max {r['rss_mib_max']:.0f})"
    )
    print(
        f"restore + first batch: {rs['start_s'] * 1e3:.0f} ms at the start, {rs['late_s'] * 1e3:.0f} ms after "
        f"{r['samples_approx']:,} samples ({rs['ratio']:.2f}x); state {rs['state_bytes']:,} bytes"
    )
    print(json.dumps(res, indent=1))
    return res


if __name__ == "__main__":
    main()
