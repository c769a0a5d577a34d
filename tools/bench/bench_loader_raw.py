"""Samples/s per loader worker on raw shards tokenized online, against the offline encoder.

A worker is one process on one thread (a DataLoader worker's torch threads), so this process
runs as one: ``num_workers=0`` and ``torch.set_num_threads(1)``. docs/benchmarks.md, "Loader:
the raw path", has the method and the figures; it reads the demo's shards (``make demo``).

    .venv/bin/python tools/bench/bench_loader_raw.py [--raw runs/demo/raw] [--tokens runs/demo/tokens]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from functools import partial
from pathlib import Path

# One worker, one thread: the tokenizers library's own thread pool would otherwise give the
# offline baseline's encode_batch every core.
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

import torch  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.loader import LoaderConfig, SourceConfig, build_loader  # noqa: E402
from data.loader.config import OnlineTokenizeConfig  # noqa: E402
from tools.bench import machine, medians, rounds  # noqa: E402

KINDS = {
    "image-caption": "scenes",
    "video-caption": "clips",
    "photo-caption": "photos",
    "code (text only)": "code",
}


def ours(cfg: LoaderConfig, seconds: float) -> float:
    """Samples/s of the loader's stream over ``seconds``."""
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=1)
    stream = loader.make_stream(0)
    table_len = len(loader.tables[0])
    stream.next_batch()  # the tokenizers load on the first document: not timed
    start = stream.cursors[0].epoch * table_len + stream.cursors[0].pos
    started = time.perf_counter()
    while time.perf_counter() - started < seconds:
        stream.next_batch()
    seconds_taken = time.perf_counter() - started
    cursor = stream.cursors[0]
    return (cursor.epoch * table_len + cursor.pos - start) / seconds_taken


def offline(raw: Path, source: str, tokens: Path, opts: dict, seconds: float) -> float:
    """Samples/s of the offline encoder over ``seconds``."""
    from data.shards.reader import ShardReader, shard_entries
    from data.text_tokenizer import TextTokenizer
    from data.tokenize.encoder import DocEncoder, TokenizeOptions
    from data.tokenize.shard_job import CHUNK_DOCS, batched
    from data.tokenize.visual import load_visual_tokenizer

    text = TextTokenizer.load(tokens / "tokenizers")
    vtok = load_visual_tokenizer(tokens / "tokenizers" / "visual_tokenizer", text.layout)
    enc = DocEncoder(text, vtok, TokenizeOptions(**opts), torch.device("cpu"))
    samples, started = 0, time.perf_counter()
    while time.perf_counter() - started < seconds:
        for tar, idx, _ in shard_entries(raw, [source]):
            with ShardReader(tar, idx) as docs:
                for chunk in batched(docs, CHUNK_DOCS):
                    samples += len(enc.encode_chunk(chunk))
            if time.perf_counter() - started >= seconds:
                break
    return samples / (time.perf_counter() - started)


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n")[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter
    )
    parser.add_argument("--raw", type=Path, default=Path("runs/demo/raw"))
    parser.add_argument(
        "--tokens",
        type=Path,
        default=Path("runs/demo/tokens"),
        help="for its tokenizers/ and options",
    )
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--seconds", type=float, default=8.0, help="per timed round")
    parser.add_argument("--rounds", type=int, default=3)
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    opts = json.loads((args.tokens / "manifest.json").read_text())["options"]
    # tokenize's options: the loader's own for online tokenizing, and its document budget
    online = {field.name for field in dataclasses.fields(OnlineTokenizeConfig)}
    online_opts = OnlineTokenizeConfig(**{key: opts[key] for key in online if key in opts})
    print(f"machine: {machine()}, torch threads 1; tokenize options {opts}")
    out = {}
    for kind, source in KINDS.items():
        cfg = LoaderConfig(
            sources=[SourceConfig(name=source, shards=[str(args.raw / source)])],
            seq_len=args.seq_len,
            num_workers=0,
            shuffle_buffer=64,
            tokenizers=str(args.tokens / "tokenizers"),
            tokenize=online_opts,
            doc_budget=opts.get("doc_budget", 0),
        )
        measures = {
            "ours": partial(ours, cfg, args.seconds),
            "offline": partial(offline, args.raw, source, args.tokens, opts, args.seconds),
        }
        rates = medians(rounds(measures, args.rounds))
        online_rate, offline_rate = rates["ours"], rates["offline"]
        out[kind] = {
            "source": source,
            "ours": online_rate,
            "offline": offline_rate,
            "ratio": online_rate / offline_rate,
        }
        print(
            f"{kind:18s} ({source}): {online_rate:8.1f} samples/s per worker online, offline encoder {offline_rate:8.1f}, "
            f"ratio {online_rate / offline_rate:.2f}"
        )
    return out


if __name__ == "__main__":
    main()
