"""Loader start-up against the number of samples: flat, or linear?

For each size, a synthetic token folder of tiny documents (one real shard, hard-linked under as
many shard names as the size needs), timed in this process: ``build_loader``, its first batch, a
restore mid-epoch, and ``json.loads`` of every JSONL index line (a lower bound of a start that
parsed them). docs/benchmarks.md, "Loader: start-up against the number of samples", has the
method and the figures; a fresh process's first batch is measured by bench_peers.py.

    python tools/bench/bench_startup.py [--sizes 10000 100000 1000000 10000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import sys
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.loader import LoaderConfig  # noqa: E402
from data.tokenize.docs import TokenDoc  # noqa: E402
from data.vocab import Modality, VocabLayout  # noqa: E402
from tools.bench import (  # noqa: E402
    loader_start,
    machine,
    medians,
    report,
    rounds,
    token_loader_config,
    write_token_manifest,
    write_token_shards,
)


def write_base(folder: Path, samples: int, tokens: int) -> dict:
    """One real token shard of ``samples`` tiny text documents: its manifest entry."""
    rng = np.random.default_rng(0)
    text = np.full(tokens, int(Modality.TEXT), np.uint8)
    docs = (
        TokenDoc(f"doc{number:08d}", rng.integers(3, 500, tokens).astype(np.int32), text)
        for number in range(samples)
    )
    return write_token_shards(folder, "synth", docs, samples)[0]


def make_folder(root: Path, base_dir: Path, base: dict, n: int) -> Path:
    """A token folder of ``n`` samples: hard links of the base shard under as many names."""
    layout = VocabLayout(text_size=512)
    (root / "tokenizers").mkdir(parents=True)
    layout.save(root / "tokenizers" / "vocab_layout.json")
    (root / "synth").mkdir()
    shards = []
    for number in range(n // base["samples"]):
        entry = dict(base)
        for key in ("path", "index", "index_bin"):
            entry[key] = base[key].replace("shard-000000", f"shard-{number:06d}")
            os.link(base_dir / base[key], root / entry[key])
        shards.append(entry)
    tokenizers = {"text": "synthetic", "layout": layout.fingerprint(), "visual": "none"}
    fingerprint = hashlib.sha256(str(n).encode()).hexdigest()[:24]
    write_token_manifest(root, fingerprint, {**tokenizers, "folder": "tokenizers"}, shards)
    return root


def time_restore(cfg: LoaderConfig, state: dict, n: int) -> float:
    """A fresh loader given a state whose cursor is at the middle of the epoch, to its first
    batch."""
    deep = json.loads(json.dumps(state))
    for worker_state in deep["worker_states"].values():
        worker_state["cursors"][0][1] = n // 2
    return loader_start(cfg, deep)[1]


def time_jsonl(src: Path) -> float:
    started = time.perf_counter()
    for index in sorted(src.glob("*.idx.jsonl")):
        for line in index.read_bytes().splitlines():
            json.loads(line)
    return time.perf_counter() - started


def at_size(folder: Path, n: int, a) -> dict[str, float]:
    """One round at one size: the build, start, restore and (up to --jsonl-max) JSONL times."""
    cfg = token_loader_config(folder, a.seq_len, num_workers=0, mode="infinite")
    built, start, state = loader_start(cfg)
    times = {"build_s": built, "start_s": start, "restore_s": time_restore(cfg, state, n)}
    if n <= a.jsonl_max:
        times["jsonl_s"] = time_jsonl(folder / "synth")
    return times


def by_size(folders: dict[int, Path], a) -> dict[int, dict]:
    """Medians of the build, start, restore and JSONL times at each size, sizes interleaved."""
    for folder in folders.values():  # warm: imports, page cache
        loader_start(token_loader_config(folder, a.seq_len, num_workers=0, mode="infinite"))
    times = rounds({n: partial(at_size, folder, n, a) for n, folder in folders.items()}, a.rounds)
    sizes = {
        n: medians({key: [run[key] for run in runs] for key in runs[0]})
        for n, runs in times.items()
    }
    smallest = sizes[min(folders)]["start_s"]
    for n, row in sizes.items():
        row.update(shards=n // a.shard_samples, start_vs_smallest=row["start_s"] / smallest)
        js = f"{row['jsonl_s'] * 1e3:9.0f} ms" if "jsonl_s" in row else "        —"
        print(
            f"{n:>11,} samples ({row['shards']:>5} shards): build_loader "
            f"{row['build_s'] * 1e3:6.1f} ms, + first batch {row['start_s'] * 1e3:6.1f} ms ({row['start_vs_smallest']:.2f}x), restore "
            f"mid-epoch {row['restore_s'] * 1e3:7.1f} ms; json.loads of every index line {js}"
        )
    return sizes


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--sizes", type=int, nargs="+", default=[10**4, 10**5, 10**6, 10**7])
    ap.add_argument("--shard-samples", type=int, default=10_000)
    ap.add_argument("--tokens-per-doc", type=int, default=16)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--jsonl-max", type=int, default=10**6, help="largest size to parse JSONL at")
    ap.add_argument("--work-dir", type=Path, default=None)
    a = ap.parse_args(argv)
    res: dict = {"machine": machine(), "load_before": os.getloadavg()}
    with tempfile.TemporaryDirectory(prefix="bench-startup-", dir=a.work_dir) as scratch:
        work = Path(scratch)
        base = work / "base"
        base.mkdir()
        info = write_base(base, a.shard_samples, a.tokens_per_doc)
        folders = {n: make_folder(work / f"n{n}", base, info, n) for n in a.sizes}
        res["sizes"] = by_size(folders, a)
        res["load_after"] = os.getloadavg()
        return report(res)


if __name__ == "__main__":
    main()
