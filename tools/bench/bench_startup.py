"""Loader start-up against the number of samples: flat, or linear?

A synthetic token folder of tiny documents (``--tokens-per-doc`` text tokens each) is written to
a temporary folder: one real shard of ``--shard-samples`` documents (tar, JSONL index, binary
index, written by the project's own writers), repeated as hard links under as many shard names
as the size needs, and a token manifest listing them all (10^7 samples cost ~30 MB of disk).
For each size the script times, in this process:

- ``build``: ``build_loader`` (expand the shards, read the manifest, fingerprint, block-fit
  check); ``start``: that plus the first batch (``num_workers=0``, 1,024 tiny documents read and
  packed): what a training run waits for;
- ``restore``: a fresh loader given a state deep into the epoch (its cursor at the middle of
  the source), plus its first batch;
- ``jsonl``: parsing every line of every JSONL index with ``json.loads``, which the loader did
  at every start before binary indexes (a lower bound of its start-up then), for sizes up to
  ``--jsonl-max``.

    python tools/bench/bench_startup.py [--sizes 10000 100000 1000000 10000000] [--rounds 3]
"""

from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.loader import LoaderConfig, SourceConfig, build_loader  # noqa: E402
from data.shards import token_index  # noqa: E402
from data.shards.writer import ShardWriter  # noqa: E402
from data.vocab import VocabLayout  # noqa: E402


def npy(a: np.ndarray) -> bytes:
    buf = io.BytesIO()
    np.save(buf, a, allow_pickle=False)
    return buf.getvalue()


def write_shard(folder: Path, samples: int, tokens: int) -> dict:
    """One real token shard of ``samples`` tiny text documents: its tar, JSONL and binary index."""
    from data.schema import Sample

    rng = np.random.default_rng(0)
    writer = ShardWriter(folder / "base.tar", folder / "base.idx.jsonl")
    for i in range(samples):
        ids = rng.integers(3, 500, tokens).astype(np.int32)
        mod = np.zeros(tokens, np.uint8)
        sample = Sample(
            f"doc{i:08d}",
            {"source": "synth", "spans": [], "tokens": tokens},
            [("ids.npy", npy(ids)), ("mod.npy", npy(mod))],
        )
        writer.write(
            sample, {"tokens": tokens, "tokens_by_modality": {"text": tokens}, "blocks": []}
        )
    res = writer.close()
    jsonl = (folder / "base.idx.jsonl").read_bytes()
    token_index.write(folder / "base.idx.bin", token_index.build(jsonl))
    return {"bytes": res.bytes, "sha256": res.sha256, "index_sha256": res.index_sha256}


def make_folder(root: Path, base: Path, base_info: dict, n: int, per_shard: int, tokens: int):
    """A token folder of ``n`` samples: ``n / per_shard`` hard links of the base shard."""
    src = root / "synth"
    src.mkdir(parents=True)
    layout = VocabLayout(text_size=512)
    (root / "tokenizers").mkdir()
    layout.save(root / "tokenizers" / "vocab_layout.json")
    shards = []
    for k in range(n // per_shard):
        stem = f"shard-{k:06d}"
        for ext in (".tar", ".idx.jsonl", token_index.SUFFIX):
            os.link(base / f"base{ext}", src / f"{stem}{ext}")
        shards.append(
            {
                "path": f"synth/{stem}.tar",
                "index": f"synth/{stem}.idx.jsonl",
                "index_bin": f"synth/{stem}{token_index.SUFFIX}",
                "source": "synth",
                "samples": per_shard,
                "tokens": {"text": per_shard * tokens},
                "blocks": {m: {"blocks": 0, "longest": 0} for m in ("image", "video")},
                **base_info,
            }
        )
    manifest = {
        "format": "earlyfuse-token-shards",
        "version": 1,
        "fingerprint": hashlib.sha256(str(n).encode()).hexdigest()[:24],
        "tokenizers": {
            "text": "synthetic",
            "layout": layout.fingerprint(),
            "visual": "none",
            "folder": "tokenizers",
        },
        "sources": [{"name": "synth", "samples": n, "tokens": {"text": n * tokens}}],
        "shards": shards,
        "totals": {"samples": n, "tokens": n * tokens, "rejects": 0},
    }
    (root / "manifest.json").write_text(json.dumps(manifest))
    return src


def cfg_for(src: Path, seq_len: int) -> LoaderConfig:
    return LoaderConfig(
        sources=[SourceConfig(name="synth", shards=[str(src)])],
        seq_len=seq_len,
        num_workers=0,
        mode="infinite",
        cache_dir=str(src.parent / "cache"),
    )


def time_start(cfg: LoaderConfig) -> tuple[float, float, dict]:
    """(seconds to build the loader, to its first batch, the state after it)."""
    t0 = time.perf_counter()
    ld = build_loader(cfg, rank=0, world_size=1, micro_batch=8)
    built = time.perf_counter() - t0
    it = iter(ld)
    next(it)
    dt = time.perf_counter() - t0
    state = ld.state_dict()
    it.close()
    return built, dt, state


def time_restore(cfg: LoaderConfig, state: dict, n: int) -> float:
    deep = json.loads(json.dumps(state))
    for ws in deep["worker_states"].values():
        ws["cursors"][0][1] = n // 2  # the middle of the epoch
    t0 = time.perf_counter()
    ld = build_loader(cfg, rank=0, world_size=1, micro_batch=8)
    ld.load_state_dict(deep)
    it = iter(ld)
    next(it)
    dt = time.perf_counter() - t0
    it.close()
    return dt


def time_jsonl(src: Path) -> float:
    t0 = time.perf_counter()
    for idx in sorted(src.glob("*.idx.jsonl")):
        for line in idx.read_bytes().splitlines():
            json.loads(line)
    return time.perf_counter() - t0


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
    work = Path(tempfile.mkdtemp(prefix="bench-startup-", dir=a.work_dir))
    res: dict = {
        "machine": f"{platform.machine()}, {os.cpu_count()} cores",
        "load_before": os.getloadavg(),
        "sizes": {},
    }
    try:
        base = work / "base"
        base.mkdir()
        info = write_shard(base, a.shard_samples, a.tokens_per_doc)
        folders = {}
        for n in a.sizes:
            folders[n] = make_folder(
                work / f"n{n}", base, info, n, a.shard_samples, a.tokens_per_doc
            )
        for n in a.sizes:  # warm: imports, page cache
            time_start(cfg_for(folders[n], a.seq_len))
        builds: dict[int, list[float]] = {n: [] for n in a.sizes}
        starts: dict[int, list[float]] = {n: [] for n in a.sizes}
        restores: dict[int, list[float]] = {n: [] for n in a.sizes}
        jsonl: dict[int, list[float]] = {n: [] for n in a.sizes if n <= a.jsonl_max}
        for _ in range(a.rounds):
            for n in a.sizes:
                cfg = cfg_for(folders[n], a.seq_len)
                built, dt, state = time_start(cfg)
                builds[n].append(built)
                starts[n].append(dt)
                restores[n].append(time_restore(cfg, state, n))
                if n in jsonl:
                    jsonl[n].append(time_jsonl(folders[n]))
        small = min(a.sizes)
        for n in a.sizes:
            row = {
                "shards": n // a.shard_samples,
                "build_s": statistics.median(builds[n]),
                "start_s": statistics.median(starts[n]),
                "restore_s": statistics.median(restores[n]),
                "jsonl_s": statistics.median(jsonl[n]) if n in jsonl else None,
            }
            row["start_vs_smallest"] = row["start_s"] / statistics.median(starts[small])
            res["sizes"][n] = row
            js = f"{row['jsonl_s'] * 1e3:9.0f} ms" if row["jsonl_s"] is not None else "        —"
            print(
                f"{n:>11,} samples ({row['shards']:>5} shards): build_loader "
                f"{row['build_s'] * 1e3:6.1f} ms, + first batch {row['start_s'] * 1e3:6.1f} ms ({row['start_vs_smallest']:.2f}x), restore "
                f"mid-epoch {row['restore_s'] * 1e3:7.1f} ms; json.loads of every index line {js}"
            )
        res["load_after"] = os.getloadavg()
        print(json.dumps(res, indent=1))
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
