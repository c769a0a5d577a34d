"""Ingest throughput per worker, against writing the same bytes with ``tarfile`` alone.

    python tools/bench/bench_ingest.py [--images 300] [--texts 2000] [--repeat 3]

Two corpora built in a temp folder (smooth random JPEGs with captions; text files cut from the
standard library's sources), each timed in this process: ``earlyfuse-prep ingest --workers 1``
against a bare ``tarfile`` copy of the same files; docs/benchmarks.md, "Ingest", has the figures.
"""

from __future__ import annotations

import argparse
import io
import sys
import sysconfig
import tarfile
import tempfile
import time
from functools import partial
from pathlib import Path

import numpy as np
from PIL import Image

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))
from data.ingest import ingest  # noqa: E402
from tools.bench import machine, medians, rounds  # noqa: E402


def make_images(root: Path, n: int) -> None:
    root.mkdir(parents=True)
    rng = np.random.default_rng(0)
    for i in range(n):
        # Smooth random fields compress like photos, not like white noise.
        small = rng.integers(0, 255, (16, 16, 3), dtype=np.uint8)
        image = Image.fromarray(small).resize((384, 256), Image.Resampling.BICUBIC)
        buf = io.BytesIO()
        image.save(buf, format="JPEG", quality=90)
        (root / f"im{i:05d}.jpg").write_bytes(buf.getvalue())
        (root / f"im{i:05d}.txt").write_text(f"a smooth random field, number {i}")


def make_texts(root: Path, n: int) -> None:
    root.mkdir(parents=True)
    files = sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py"))
    count = 0
    for path in files:
        text = path.read_text(encoding="utf-8", errors="replace")
        for j in range(0, len(text), 6000):
            (root / f"t{count:05d}.txt").write_text(text[j : j + 6000])
            count += 1
            if count == n:
                return


def tar_baseline(src: Path, out: Path) -> float:
    started = time.perf_counter()
    with tarfile.open(out, "w") as tar:
        for path in sorted(src.iterdir()):
            data = path.read_bytes()
            info = tarfile.TarInfo(path.name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
    return time.perf_counter() - started


def run_ingest(kind: str, src: Path, samples: int) -> float:
    out = Path(tempfile.mkdtemp(dir=src.parent)) / "out"
    started = time.perf_counter()
    summary = ingest(out, [f"{kind}:{src}"], workers=1, shard_max_bytes=64 << 20)
    seconds = time.perf_counter() - started
    assert summary["manifest"]["totals"]["samples"] == samples, (summary["manifest"], samples)
    return seconds


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--images", type=int, default=300)
    parser.add_argument("--texts", type=int, default=2000)
    parser.add_argument("--repeat", type=int, default=3)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_ingest_") as scratch:
        tmp = Path(scratch)
        make_images(tmp / "images", args.images)
        make_texts(tmp / "text", args.texts)
        print(f"machine: {machine()}")
        print(f"{'corpus':<8} {'what':<10} {'MB/s':>8} {'samples/s':>10}   ratio ingest/tarfile")
        for kind in ("images", "text"):
            files = sorted((tmp / kind).iterdir())
            samples = args.images if kind == "images" else len(files)
            measures = {
                "tarfile": partial(tar_baseline, tmp / kind, tmp / "base.tar"),
                "ingest": partial(run_ingest, kind, tmp / kind, samples),
            }
            times = medians(rounds(measures, args.repeat))
            megabytes = sum(path.stat().st_size for path in files) / 1e6
            for what, seconds in times.items():
                ratio = f"   {times['tarfile'] / seconds:.3f}" if what == "ingest" else ""
                print(
                    f"{kind:<8} {what:<10} {megabytes / seconds:8.1f} {samples / seconds:10.0f}{ratio}"
                )


if __name__ == "__main__":
    main()
