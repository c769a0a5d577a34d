"""Memory of a process that meets failing video decodes, and what the
loader's guard (data/loader/decode_guard.py) costs.

Each variant runs in a fresh process that has imported torch and the visual stack, as a
DataLoader worker has, and decodes ``--failures`` broken clips (random bytes in an mp4's place:
decord fails on each after allocating) then ``--good`` real clips:

- ``plain``: ``decode_frames`` directly (the loader's workers before the guard);
- ``guard``: ``DecodeGuard`` with its default budget (the first failures in the worker, the rest
  and every later clip in a forked child).

Printed per variant: RSS growth over the failures (MB, and KB per failure), and the mean time of
a good clip's decode after them (the price of the fork, paid only past the budget).

    .venv/bin/python tools/bench/bench_decode_leak.py [--failures 600] [--good 50]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]

CHILD = r"""
import json, os, sys, time
sys.path[:0] = [sys.argv[1], os.path.join(sys.argv[1], "tests")]
import torch  # noqa: F401  (a worker has it: the fork copies its page tables)
from factories import mp4_bytes
from data.image_prep import ImagePrep
from data.video_frames import VideoSampling, decode_frames
from data.loader.decode_guard import DecodeGuard

variant, failures, good_n = sys.argv[2], int(sys.argv[3]), int(sys.argv[4])
def rss_mb():
    with open("/proc/self/status") as f:
        return next(int(l.split()[1]) for l in f if l.startswith("VmRSS")) / 1024
good = mp4_bytes(frames=16, w=64, h=64)
bad = [os.urandom(5000) for _ in range(8)]
prep, sampling = ImagePrep(factor=8, max_pixels=32 * 32, max_grid=32), VideoSampling(4.0, 8)
decode = decode_frames if variant == "plain" else DecodeGuard()
decode(good, sampling, prep, (64, 64))  # warm: FFmpeg loaded, first allocations made
r0 = rss_mb()
failed = 0
for i in range(failures):
    try:
        decode(bad[i % len(bad)], sampling, prep, (64, 64))
    except ValueError:
        failed += 1
grown = rss_mb() - r0
t0 = time.perf_counter()
for _ in range(good_n):
    decode(good, sampling, prep, (64, 64))
per_good = (time.perf_counter() - t0) / good_n
print(json.dumps({"failed": failed, "grown_mb": grown, "good_ms": per_good * 1e3}))
"""


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--failures", type=int, default=600)
    parser.add_argument("--good", type=int, default=50)
    args = parser.parse_args()
    print(f"{args.failures} failing decodes, then {args.good} good 64x64 clips (16 frames, 8 kept)")
    for variant in ("plain", "guard"):
        out = subprocess.run(
            [sys.executable, "-c", CHILD, str(ROOT), variant, str(args.failures), str(args.good)],
            capture_output=True,
            text=True,
            check=True,
            env={"OMP_NUM_THREADS": "1", "PATH": "/usr/bin:/bin"},
        ).stdout
        result = json.loads(out.strip().splitlines()[-1])
        print(
            f"  {variant:6s} failed {result['failed']:4d}  RSS +{result['grown_mb']:6.1f} MB "
            f"({result['grown_mb'] * 1024 / max(1, result['failed']):5.1f} KB/failure)  "
            f"good clip {result['good_ms']:6.1f} ms"
        )


if __name__ == "__main__":
    main()
