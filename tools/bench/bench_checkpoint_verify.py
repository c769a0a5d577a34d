"""What checking a checkpoint costs at resume, against what resuming reads
anyway, in one process, round-robin over ``--rounds``:

- ``sizes``: every file's size against ``meta.json`` (finds a truncated file);
- ``sha256``: sizes, then every file's SHA-256 (finds a corrupted byte; what resume does, and
  what a save spends hashing, shared over the ranks);
- ``load``: every ``.pt`` file read back weights-only (``train/safe_load.py``): a lower bound of
  what the resume itself reads.

Printed: medians in ms, MB/s, and the ratio of ``sha256`` to ``load``. The first round warms the
page cache, so all three read from memory (a cold resume reads from disk for both).

    .venv/bin/python tools/bench/bench_checkpoint_verify.py RUN_DIR [--step N] [--rounds 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from train.checkpoint import verify_files  # noqa: E402
from train.safe_load import safe_torch_load  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("run_dir", type=Path)
    parser.add_argument("--step", type=int, default=None, help="default: checkpoints/latest")
    parser.add_argument("--rounds", type=int, default=7)
    args = parser.parse_args()
    root = args.run_dir / "checkpoints"
    tag = (
        f"step_{args.step:08d}" if args.step is not None else (root / "latest").read_text().strip()
    )
    folder = root / tag
    files = json.loads((folder / "meta.json").read_text())["files"]
    total = sum(entry["bytes"] for entry in files.values())

    def load_all() -> None:
        for name in files:
            if name.endswith(".pt"):
                safe_torch_load(folder / name, allow_deepspeed=True)

    variants = {
        "sizes": lambda: verify_files(folder, files, hashes=False),
        "sha256": lambda: verify_files(folder, files, hashes=True),
        "load": load_all,
    }
    times: dict[str, list[float]] = {variant: [] for variant in variants}
    for round_no in range(args.rounds + 1):
        for name, fn in variants.items():
            started = time.perf_counter()
            fn()
            if round_no:  # round 0 warms the page cache
                times[name].append(time.perf_counter() - started)
    print(f"{folder}: {len(files)} files, {total / 1e6:.1f} MB, {args.rounds} rounds")
    med = {variant: statistics.median(samples) for variant, samples in times.items()}
    for name, seconds in med.items():
        print(f"  {name:7s} {seconds * 1e3:9.2f} ms  {total / 1e6 / seconds:9.0f} MB/s")
    print(f"  sha256 / load = {med['sha256'] / med['load']:.2f}")


if __name__ == "__main__":
    main()
