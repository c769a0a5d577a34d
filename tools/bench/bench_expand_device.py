"""Where to expand a packed batch on a GPU run (``data.expand``, docs/loader.md): the trainer's
process expanding a compact batch on the GPU (``expand_torch.expand_fields``) against the
loader's way, the batch expanded on the CPU (compiled where numba is installed, else numpy) and
its ten fields (int32, labels int64) copied from
pinned memory. Both in this process, on the same batches;
prints the host time of each a batch and their ratio.

    python tools/bench/bench_expand_device.py --tokens runs/demo/tokens [--batches 60]

Needs a CUDA device (on a CPU it times the torch expansion on the CPU instead).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))


def compact_batches(tokens: Path, n: int, seq_len: int, rows: int) -> list[tuple]:
    from data.loader import LoaderConfig, SourceConfig, build_loader

    manifest = json.loads((tokens / "manifest.json").read_text())
    share = {s["name"]: sum(s["tokens"].values()) for s in manifest["sources"]}
    cfg = LoaderConfig(
        sources=[
            SourceConfig(name=name, shards=[str(tokens / name)], weight=float(w))
            for name, w in share.items()
        ],
        seq_len=seq_len,
        num_workers=0,
    )
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=rows)
    loader.compact = True
    it = iter(loader)
    keys = ("input_ids", "modality", "segments", "blocks", "row_real")
    return [tuple(batch[k] for k in keys) for batch in (next(it) for _ in range(n))]


def timed(fn, items, device) -> tuple[float, float]:
    """(host seconds a call, seconds a call until the device is done)."""
    for item in items[:5]:
        fn(item)
    if device.type == "cuda":
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for item in items:
        fn(item)
    host = (time.perf_counter() - t0) / len(items)
    if device.type == "cuda":
        torch.cuda.synchronize()
    return host, (time.perf_counter() - t0) / len(items)


def main(argv=None) -> dict:
    from data.loader.batch_buffer import BatchBuffer
    from data.loader.expand import CompactBatch, expand
    from data.loader.expand_torch import expand_fields

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=Path, default=Path("runs/demo/tokens"))
    ap.add_argument("--batches", type=int, default=60)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8)
    ap.add_argument("--rounds", type=int, default=3)
    a = ap.parse_args(argv)
    device = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    pin = device.type == "cuda"
    batches = compact_batches(a.tokens, a.batches, a.seq_len, a.rows)
    if pin:
        batches = [(ids.pin_memory(), mod.pin_memory(), *rest) for ids, mod, *rest in batches]
    buffers = [BatchBuffer(a.rows, a.seq_len, 0, pin=pin) for _ in range(8)]
    ring = iter(range(10**9))

    def on_device(item):
        return expand_fields(*item, device=device)

    def in_loader(item):  # the loader's way: expand on the CPU, then queue the copy
        ids, mod, seg, blocks, real = (x.numpy() for x in item)
        buf = buffers[next(ring) % len(buffers)]
        expand(
            CompactBatch(a.rows, a.seq_len, ids.reshape(-1), mod.reshape(-1), seg, blocks, real),
            buf.fields,
        )
        return buf.tensor.to(device, non_blocking=True)

    res: dict = {"device": str(torch.cuda.get_device_name() if pin else "cpu"), "rounds": []}
    for _ in range(a.rounds):
        trainer, loader = timed(on_device, batches, device), timed(in_loader, batches, device)
        res["rounds"].append({"trainer": trainer, "loader": loader})
        print(
            f"trainer expands on {device.type}: host {trainer[0] * 1e6:7.0f} us a batch "
            f"(done {trainer[1] * 1e6:7.0f}) | loader expands, copy: host {loader[0] * 1e6:7.0f} "
            f"us (done {loader[1] * 1e6:7.0f}) | trainer / loader host {trainer[0] / loader[0]:.1f}x"
        )
    print(json.dumps(res))
    return res


if __name__ == "__main__":
    main()
