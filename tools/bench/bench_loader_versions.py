"""The token loader of this checkout against the same loader of another checkout (the code before
a change), on the same token folder, in the same minutes.

Each measurement is a fresh Python process with ``PYTHONPATH`` set to one checkout: it builds
the loader exactly as ``tools/bench/bench_peers.py`` does (every source of the folder, weights
by its tokens, rows of ``--seq-len``, batches of ``--rows``, ``num_workers`` 0 or 1), takes one
batch (start-up, not timed), then times ``--round-tokens`` real tokens. The two checkouts
alternate, the order swapped each round; medians, and the ratio this / baseline per mode.

    git archive COMMIT | tar -x -C /tmp/base     # the code before, as plain files
    .venv/bin/python tools/bench/bench_loader_versions.py --baseline /tmp/base \\
        --tokens runs/demo/tokens [--rounds 5] [--workers 0 1]

``--check`` compares instead of timing: for each of a few loader settings (``CHECKS``: rows of
2,048; rows of 512 with chunked mixing; epoch mode at 256 with whole documents dropped for
blocks longer than a row; rows of 128 with such blocks dropped) and each ``--workers``, both
checkouts hash every tensor of up to ``--check-batches`` batches (values, dtypes, shapes, keys)
and the loader's state after them; any difference is printed and the exit status is 1. A
change to the loader that should not change what it delivers must pass it. ``--values``
compares integer tensors by value (widened to int64), not by dtype: a change of dtypes only
(e.g. per-token fields narrowed from int64 to int32) passes it.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parents[2]

# Both children: every source of a token folder, weighted by its tokens (as bench_peers.py).
_SOURCES = r"""
manifest = json.loads((tokens / "manifest.json").read_text())
share = {s["name"]: sum(s["tokens"].values()) for s in manifest["sources"]}
names = sorted(p.name for p in tokens.iterdir() if p.is_dir() and list(p.glob("*.tar")))
sources = [SourceConfig(name=s, shards=[str(tokens / s)], weight=float(share.get(s, 1)))
           for s in names]
"""

# Run in the child with PYTHONPATH = the checkout under test: prints one JSON line.
_CHILD = (
    r"""
import json, sys, time
from pathlib import Path
import data.loader
from data.loader import LoaderConfig, SourceConfig, build_loader

tokens, workers, seq_len, rows, n_tokens = Path(sys.argv[1]), *map(int, sys.argv[2:6])
"""
    + _SOURCES
    + r"""
cfg = LoaderConfig(
    sources=sources,
    seq_len=seq_len, num_workers=workers, mode="infinite",
)
it = iter(build_loader(cfg, rank=0, world_size=1, micro_batch=rows))
next(it)
n, t0 = 0, time.perf_counter()
while n < n_tokens:
    n += int(next(it)["num_real_tokens"])
rate = n / (time.perf_counter() - t0)
print(json.dumps({"loader": data.loader.__file__, "tokens_per_s": rate}))
it.close()
"""
)


# The same loader, hashing what it delivers: one JSON line with the digest and the batch count.
_CHECK_CHILD = (
    r"""
import hashlib, json, sys
from pathlib import Path
import data.loader
from data.loader import LoaderConfig, SourceConfig, build_loader

tokens, workers, limit, settings = Path(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), sys.argv[4]
settings = json.loads(settings)
values_only = sys.argv[5] == "values"  # integers compared as int64 values, dtypes aside
rows = settings.pop("rows")
"""
    + _SOURCES
    + r"""
cfg = LoaderConfig(
    sources=sources,
    num_workers=workers, **settings,
)
loader = build_loader(cfg, rank=0, world_size=1, micro_batch=rows)
digest, n = hashlib.sha256(), 0
for batch in loader:
    for key in sorted(batch):
        t = batch[key].contiguous().numpy()
        if values_only and t.dtype.kind in "iu":
            t = t.astype("<i8")
        digest.update(f"{key} {'' if values_only else t.dtype} {tuple(t.shape)}".encode())
        digest.update(t.tobytes())
    n += 1
    if n >= limit:
        break
digest.update(json.dumps(loader.state_dict(), sort_keys=True).encode())
print(json.dumps({"loader": data.loader.__file__, "digest": digest.hexdigest(), "batches": n}))
"""
)

# Loader settings the check runs (besides the token folder's sources, weighted by their tokens).
CHECKS: dict[str, dict] = {
    "rows of 2048": {"seq_len": 2048, "rows": 8},
    "rows of 512, chunks of 256": {"seq_len": 512, "rows": 4, "mix_chunk": 256},
    "epoch, 256, drop documents": {
        "seq_len": 256,
        "rows": 8,  # the whole epoch within the default --check-batches
        "mode": "epoch",
        "oversize": "drop_document",
        "allow_block_drops": True,
    },
    "rows of 128, drop blocks": {"seq_len": 128, "rows": 4, "allow_block_drops": True},
}


def run_child(checkout: Path, script: str, args: list[str]) -> dict:
    """One child on ``checkout`` (PYTHONPATH): its last JSON line, after checking that the
    loader came from the checkout named, not from an installed copy."""
    env = {**os.environ, "PYTHONPATH": str(checkout)}
    proc = subprocess.run(
        [sys.executable, "-c", script, *args],
        env=env,
        cwd=checkout,
        capture_output=True,
        text=True,
    )
    if proc.returncode:
        raise SystemExit(f"{checkout}: the loader failed:\n{proc.stderr[-3000:]}")
    got = json.loads(proc.stdout.strip().splitlines()[-1])
    if not got["loader"].startswith(str(checkout.resolve())):
        raise SystemExit(f"{checkout}: the loader was imported from {got['loader']}")
    return got


def check(
    checkout: Path, tokens: Path, workers: int, settings: dict, limit: int, values: bool
) -> dict:
    args = [str(tokens), str(workers), str(limit), json.dumps(settings)]
    return run_child(checkout, _CHECK_CHILD, [*args, "values" if values else "exact"])


def measure(checkout: Path, tokens: Path, workers: int, a: argparse.Namespace) -> float:
    args = [str(tokens), str(workers), str(a.seq_len), str(a.rows), str(a.round_tokens)]
    return float(run_child(checkout, _CHILD, args)["tokens_per_s"])


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--baseline", type=Path, required=True, help="checkout of the code before")
    ap.add_argument("--tokens", type=Path, default=Path("runs/demo/tokens"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--round-tokens", type=int, default=3_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--check", action="store_true", help="compare batch hashes, not speed")
    ap.add_argument("--check-batches", type=int, default=600)
    ap.add_argument(
        "--values",
        action="store_true",
        help="with --check: compare integer tensors by value (as int64), not by dtype and bytes",
    )
    a = ap.parse_args(argv)
    tokens = a.tokens.resolve()
    checkouts = {"baseline": a.baseline.resolve(), "this": HERE}
    if a.check:
        differ = 0
        for name, settings in CHECKS.items():
            for workers in a.workers:
                got = {
                    who: check(path, tokens, workers, settings, a.check_batches, a.values)
                    for who, path in checkouts.items()
                }
                same = got["baseline"]["digest"] == got["this"]["digest"]
                differ += not same
                print(
                    f"{name}, num_workers={workers}: {got['this']['batches']} batches "
                    f"(baseline {got['baseline']['batches']}): "
                    + ("identical" if same else "DIFFERENT"),
                    flush=True,
                )
        if differ:
            raise SystemExit(f"{differ} setting(s) deliver other batches than the baseline")
        return {"identical": True}
    res: dict = {"load_before": os.getloadavg(), "modes": {}}
    for workers in a.workers:
        rates: dict[str, list[float]] = {name: [] for name in checkouts}
        for r in range(a.rounds):
            order = list(checkouts) if r % 2 == 0 else list(reversed(checkouts))
            for name in order:
                rates[name].append(measure(checkouts[name], tokens, workers, a))
        med = {name: statistics.median(v) for name, v in rates.items()}
        res["modes"][f"workers={workers}"] = {"rates": rates, "medians": med}
        print(
            f"num_workers={workers}: baseline {med['baseline'] / 1e6:.2f} M tokens/s, this "
            f"{med['this'] / 1e6:.2f} M tokens/s: {med['this'] / med['baseline']:.2f}x "
            f"(medians of {a.rounds} rounds)",
            flush=True,
        )
    res["load_after"] = os.getloadavg()
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
