"""earlyfuse's loader against the loaders of the field on the same documents, in one process
webdataset, MosaicML Streaming (``mosaicml-streaming``), LitData
(``litdata``) and Megatron-Energon (``megatron-energon``).

Every token document of a token folder (ids int32 and modalities uint8, as tokenize wrote them)
is converted, untimed, into each peer's own format: webdataset tars (``KEY.ids.npy``,
``KEY.mod.npy``), Streaming MDS shards (two ``ndarray`` columns), LitData chunks (a dict of two
arrays per item) and an Energon dataset (the webdataset tars, prepared by Energon: its index and
a ``CrudeWebdataset`` with a cooker). Each peer's documents go through a minimal packer of the
same row length (concatenate, cut into rows of ``--seq-len``, ids and modalities as tensors);
earlyfuse runs its whole loader (index, hashed order, token-weighted mix of the folder's
sources, SHA-256 and vocabulary checks -- each shard's whole tar and every id when the shard is
first read, per document where that fails --, packing that keeps visual blocks whole, labels,
document ids, 1-D and M-RoPE positions, image ids), every field expanded in the loader (ten
fields a token: int32, labels int64), as training, evaluation, the probes and the tools receive
them; in-process right after packing, with a worker in this process after the queue. The
peers' minimal packers hand out ids and modalities only.

Two modes: in-process (``num_workers=0``) and one DataLoader worker (the packing runs in the
worker for every loader; Energon's own ``get_loader`` runs its worker). Timing starts after a
loader's first batch (its start-up is printed apart). Peers run round-robin, interleaved, the
order rotated each round, for ``--rounds`` rounds of ``--round-tokens`` real tokens; medians.
A peer whose package is absent is skipped (nothing is installed here); install them into a
virtual environment of their own (they pin other torch/numpy versions than the project).

    python tools/bench/bench_peers.py --tokens runs/demo/tokens [--rounds 5] [--workers 0 1]
"""

from __future__ import annotations

import argparse
import importlib.util
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

PEERS = {
    "webdataset": "webdataset",
    "streaming": "streaming",
    "litdata": "litdata",
    "energon": "megatron.energon",
}


def available(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except ModuleNotFoundError:
        return False


# --- the documents -------------------------------------------------------------------------------
def sources(tokens: Path) -> list[str]:
    return sorted(p.name for p in tokens.iterdir() if p.is_dir() and list(p.glob("*.tar")))


def read_documents(tokens: Path) -> list[tuple[np.ndarray, np.ndarray]]:
    """Every document of the folder, in shard order: (ids int32, modalities uint8)."""
    from data.loader import SourceConfig
    from data.loader.npy import read_npy
    from data.loader.store import ShardFiles
    from data.loader.table_load import load_table

    files, docs = ShardFiles(), []
    for name in sources(tokens):
        t = load_table(SourceConfig(name=name, shards=[str(tokens / name)]))
        for i in range(len(t)):
            rec = t.token_sample(i)
            url = t.shards[rec.shard]
            ids = read_npy(files.view(url, *rec.ids_at)).copy()
            mod = read_npy(files.view(url, *rec.mod_at)).copy()
            docs.append((ids, mod))
    return docs


class MinimalPacker:
    """Documents -> batches of ``rows`` rows of ``seq_len``: ids concatenated and cut (no
    block handling, no labels or positions), what a peer's user would at least write."""

    def __init__(self, seq_len: int, rows: int) -> None:
        self.L, self.B = seq_len, rows

    def batches(self, docs):
        import torch

        L, B = self.L, self.B
        ids = np.zeros((B, L), np.int64)
        mod = np.zeros((B, L), np.int64)
        row, pos = 0, 0
        for d_ids, d_mod in docs:
            a, n = 0, len(d_ids)
            while a < n:
                k = min(n - a, L - pos)
                ids[row, pos : pos + k] = d_ids[a : a + k]
                mod[row, pos : pos + k] = d_mod[a : a + k]
                a, pos = a + k, pos + k
                if pos == L:
                    row, pos = row + 1, 0
                    if row == B:
                        yield {
                            "input_ids": torch.from_numpy(ids),
                            "modality": torch.from_numpy(mod),
                            "num_real_tokens": torch.tensor(B * L),
                        }
                        ids, mod = np.zeros((B, L), np.int64), np.zeros((B, L), np.int64)
                        row = 0


# --- conversions (not timed) ---------------------------------------------------------------------
def to_webdataset(docs, out: Path, per_shard: int = 2000) -> list[str]:
    import webdataset as wds

    out.mkdir(parents=True)
    urls = []
    for s in range(0, len(docs), per_shard):
        url = str(out / f"shard-{s // per_shard:06d}.tar")
        with wds.TarWriter(url) as w:
            for i, (ids, mod) in enumerate(docs[s : s + per_shard], s):
                w.write({"__key__": f"d{i:08d}", "ids.npy": ids, "mod.npy": mod})
        urls.append(url)
    return urls


def to_streaming(docs, out: Path) -> str:
    from streaming import MDSWriter

    with MDSWriter(out=str(out), columns={"ids": "ndarray:int32", "mod": "ndarray:uint8"}) as w:
        for ids, mod in docs:
            w.write({"ids": ids, "mod": mod})
    return str(out)


def to_litdata(docs, out: Path) -> str:
    from litdata.streaming.writer import BinaryWriter

    w = BinaryWriter(str(out), chunk_bytes="64MB")
    for i, (ids, mod) in enumerate(docs):
        w.add_item(i, {"ids": ids, "mod": mod})
    w.done()
    w.merge()
    return str(out)


def to_energon(wds_dir: Path, urls: list[str]) -> str:
    from megatron.energon import BaseWebdatasetFactory

    BaseWebdatasetFactory.prepare_dataset(
        wds_dir,
        [Path(u).name for u in urls],
        split_parts_ratio=[("train", 1.0)],
        shuffle_seed=None,
        workers=1,
    )
    (wds_dir / ".nv-meta" / "dataset.yaml").write_text(
        "__module__: megatron.energon\n__class__: CrudeWebdataset\n"
    )
    return str(wds_dir)


# --- the peers' document streams (endless: epochs repeated) -------------------------------------
def wds_docs(urls):
    import webdataset as wds

    while True:
        for s in wds.WebDataset(urls, shardshuffle=False, empty_check=False):
            yield (
                np.load(io.BytesIO(s["ids.npy"]), allow_pickle=False),
                np.load(io.BytesIO(s["mod.npy"]), allow_pickle=False),
            )


def streaming_docs(local):
    from streaming import StreamingDataset

    ds = StreamingDataset(local=local, shuffle=False, batch_size=1)
    while True:
        for s in ds:
            yield s["ids"], s["mod"]


def litdata_docs(path):
    from litdata import StreamingDataset

    ds = StreamingDataset(path)
    while True:
        for s in ds:
            yield s["ids"], s["mod"]


def _energon_parts():
    from megatron.energon import (
        Cooker,
        DefaultTaskEncoder,
        Sample,
        basic_sample_keys,
        edataclass,
        stateless,
    )

    @edataclass
    class TokenSample(Sample):
        ids: np.ndarray
        mod: np.ndarray

    @stateless
    def cook(crude: dict) -> TokenSample:  # Energon's default decoder has np.load-ed the arrays
        return TokenSample(
            **basic_sample_keys(crude),
            ids=np.load(io.BytesIO(crude["ids.npy"]), allow_pickle=False)
            if isinstance(crude["ids.npy"], bytes)
            else crude["ids.npy"],
            mod=np.load(io.BytesIO(crude["mod.npy"]), allow_pickle=False)
            if isinstance(crude["mod.npy"], bytes)
            else crude["mod.npy"],
        )

    class Encoder(DefaultTaskEncoder):
        cookers = [Cooker(cook)]

        def batch(self, samples):
            return [(s.ids, s.mod) for s in samples]

    return Encoder


def energon_loader(path, workers: int, docs_per_batch: int = 64):
    """Energon's own loader (its workers run decoding and cooking); batches of documents."""
    from megatron.energon import WorkerConfig, get_loader, get_train_dataset

    ds = get_train_dataset(
        path,
        batch_size=docs_per_batch,
        shuffle_buffer_size=None,
        max_samples_per_sequence=None,
        worker_config=WorkerConfig(rank=0, world_size=1, num_workers=workers),
        task_encoder=_energon_parts()(),
    )
    return get_loader(ds)


def energon_docs(loader):
    it = iter(loader)
    try:
        for batch in it:
            yield from batch
    finally:
        # Its workers stopped now: left to garbage collection, one kept running at ~70 % of a
        # core through every later measurement of the run.
        shutdown = getattr(it, "_shutdown_workers", None)
        if shutdown:
            shutdown()


# --- runs ------------------------------------------------------------------------------------------
class PackedPeer:
    """A peer's document stream packed in a DataLoader worker (``torch`` IterableDataset)."""

    def __init__(self, make_docs, arg, seq_len: int, rows: int) -> None:
        self.make_docs, self.arg, self.seq_len, self.rows = make_docs, arg, seq_len, rows

    def __iter__(self):
        return MinimalPacker(self.seq_len, self.rows).batches(self.make_docs(self.arg))


def peer_batches(name: str, data, workers: int, seq_len: int, rows: int):
    if name == "energon":
        docs = energon_docs(energon_loader(data, workers))
        return iter(MinimalPacker(seq_len, rows).batches(docs))
    make = {"webdataset": wds_docs, "streaming": streaming_docs, "litdata": litdata_docs}[name]
    if workers == 0:
        return iter(MinimalPacker(seq_len, rows).batches(make(data)))
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    class Dataset(IterableDataset):
        def __init__(self) -> None:
            self.peer = PackedPeer(make, data, seq_len, rows)

        def __iter__(self):
            return iter(self.peer)

    torch.manual_seed(0)
    return iter(DataLoader(Dataset(), batch_size=None, num_workers=workers))


def ours_batches(tokens: Path, workers: int, seq_len: int, rows: int):
    from data.loader import LoaderConfig, SourceConfig, build_loader

    manifest = json.loads((tokens / "manifest.json").read_text())
    share = {s["name"]: sum(s["tokens"].values()) for s in manifest["sources"]}
    cfg = LoaderConfig(
        sources=[
            SourceConfig(name=s, shards=[str(tokens / s)], weight=float(share.get(s, 1)))
            for s in sources(tokens)
        ],
        seq_len=seq_len,
        num_workers=workers,
        mode="infinite",
    )
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=rows)
    return iter(loader)


def timed(batches, n_tokens: int) -> tuple[float, float]:
    """(seconds to the first batch, real tokens/s after it)."""
    t0 = time.perf_counter()
    first = next(batches)
    start = time.perf_counter() - t0
    n = 0
    t1 = time.perf_counter()
    while n < n_tokens:
        n += int(next(batches)["num_real_tokens"])
    rate = n / (time.perf_counter() - t1)
    close = getattr(batches, "close", None) or getattr(batches, "_shutdown_workers", None)
    if close:
        close()
    del first
    return start, rate


def main(argv=None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--tokens", type=Path, default=Path("runs/demo/tokens"))
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--rows", type=int, default=8, help="rows per batch")
    ap.add_argument("--round-tokens", type=int, default=2_000_000)
    ap.add_argument("--rounds", type=int, default=5)
    ap.add_argument("--workers", type=int, nargs="+", default=[0, 1])
    ap.add_argument("--peers", nargs="+", default=list(PEERS))
    ap.add_argument("--work-dir", type=Path, default=None, help="for the converted copies")
    a = ap.parse_args(argv)
    if not (a.tokens / "manifest.json").is_file():
        sys.exit(f"{a.tokens}: no token shards; run `make demo` first (or pass --tokens)")
    peers = [p for p in a.peers if available(PEERS[p])]
    for p in set(a.peers) - set(peers):
        print(f"skipped {p}: {PEERS[p]} is not installed")
    docs = read_documents(a.tokens)
    work = Path(tempfile.mkdtemp(prefix="bench-peers-", dir=a.work_dir))
    data: dict = {}
    try:
        urls = to_webdataset(docs, work / "wds") if {"webdataset", "energon"} & set(peers) else []
        if "webdataset" in peers:
            data["webdataset"] = urls
        if "streaming" in peers:
            data["streaming"] = to_streaming(docs, work / "mds")
        if "litdata" in peers:
            data["litdata"] = to_litdata(docs, work / "litdata")
        if "energon" in peers:
            data["energon"] = to_energon(work / "wds", urls)
        res: dict = {
            "machine": f"{platform.machine()}, {os.cpu_count()} cores",
            "documents": len(docs),
            "tokens": int(sum(len(d[0]) for d in docs)),
            "seq_len": a.seq_len,
            "rows": a.rows,
            "load_before": os.getloadavg(),
            "modes": {},
        }
        names = ["earlyfuse", *peers]
        for workers in a.workers:

            def run(name, n_tokens, workers=workers):
                if name.startswith("earlyfuse"):
                    batches = ours_batches(a.tokens, workers, a.seq_len, a.rows)
                    return timed(batches, n_tokens)
                return timed(peer_batches(name, data[name], workers, a.seq_len, a.rows), n_tokens)

            for name in names:  # warm page cache, imports and the peers' own caches
                run(name, a.round_tokens // 10)
            rates: dict[str, list[float]] = {n: [] for n in names}
            starts: dict[str, list[float]] = {n: [] for n in names}
            for r in range(a.rounds):
                order = names[r % len(names) :] + names[: r % len(names)]
                for name in order:
                    start, rate = run(name, a.round_tokens)
                    rates[name].append(rate)
                    starts[name].append(start)
            med = {n: statistics.median(v) for n, v in rates.items()}
            res["modes"][f"workers={workers}"] = {
                n: {
                    "tokens_per_s": med[n],
                    "all": rates[n],
                    "spread": (max(rates[n]) - min(rates[n])) / med[n],
                    "first_batch_s": statistics.median(starts[n]),
                    "earlyfuse_ratio": med["earlyfuse"] / med[n],
                }
                for n in names
            }
            print(f"\nnum_workers={workers} (medians of {a.rounds} rounds)")
            for n in names:
                m = res["modes"][f"workers={workers}"][n]
                print(
                    f"  {n:18s} {m['tokens_per_s']:>12,.0f} tokens/s  spread {m['spread']:4.0%}"
                    f"  first batch {m['first_batch_s'] * 1e3:6.0f} ms  earlyfuse/this "
                    f"{m['earlyfuse_ratio']:.2f}x"
                )
        res["load_after"] = os.getloadavg()
        print(json.dumps(res, indent=1))
        return res
    finally:
        shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    main()
