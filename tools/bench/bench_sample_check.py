"""What the loader's per-sample checks cost, in one process, round-robin:

- ``none``: no check at all (``check_ids`` replaced by a no-op here, hashes off): the loader as
  it was before the checks;
- ``ids``: every id checked against its modality's vocabulary range (always on);
- ``ids+sha256``: the default: also the SHA-256 of each sample's members against its index
  (the three members read in one read instead of two).

Each variant packs ``--tokens-per-round`` real tokens into rows on one core (``num_workers=0``,
this process is the worker); medians over ``--rounds``; printed: tokens/s and the ratio to
``none``. Data: ``--tokens DIR`` (e.g. the demo's ``runs/demo/tokens``), or the demo corpus
built, ingested and tokenized at ``--scale`` in a temporary folder.

    .venv/bin/python tools/bench/bench_sample_check.py [--tokens runs/demo/tokens] [--rounds 7]
"""

from __future__ import annotations

import argparse
import contextlib
import statistics
import sys
import tempfile
import time
from pathlib import Path
from unittest import mock

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from data.loader import LoaderConfig, SourceConfig, build_loader  # noqa: E402


def build_tokens(root: Path, scale: float) -> Path:
    """The demo corpus at ``scale``, ingested and tokenized (an untrained debug visual tokenizer)."""
    import torch

    from data.demo_corpus import build
    from data.ingest import ingest
    from data.sources import Limits
    from data.tokenize.encoder import TokenizeOptions
    from data.tokenize.run import tokenize
    from data.train_text_tokenizer import train_text_tokenizer
    from model.visual_tokenizer import vtok_debug
    from train.tasks.vtok import save_visual_tokenizer

    c = root / "corpus"
    build(c, scale=scale, progress=False)
    kinds = [
        f"code:{c / 'code'}",
        f"text:{c / 'text'}",
        f"images:{c / 'scenes' / 'scenes.jsonl'}",
        f"images:{c / 'digits' / 'digits.csv'}",
        f"videos:{c / 'clips'}",
        f"interleaved:{c / 'interleaved' / 'docs.jsonl'}",
    ]
    # the interleaved documents name the corpus's photos and clips in sibling folders
    ingest(root / "raw", kinds, shard_max_samples=64, limits=Limits(allow_outside_paths=True))
    train_text_tokenizer([root / "raw"], root / "tok", vocab_size=2048, max_grid=32)
    torch.manual_seed(0)
    cfg = vtok_debug()
    save_visual_tokenizer(cfg.build().state_dict(), cfg, root / "vtok")
    opts = TokenizeOptions(image_max_pixels=64 * 64, video_max_pixels=32 * 32)
    tokenize(root / "raw", root / "tokens", root / "tok", root / "vtok", opts=opts)
    return root / "tokens"


def sources(tokens: Path) -> list[SourceConfig]:
    return [
        SourceConfig(name=p.name, shards=[str(p)])
        for p in sorted(tokens.iterdir())
        if p.is_dir() and list(p.glob("*.tar"))
    ]


def docs_read(tokens: Path, n_tokens: int, seq_len: int) -> int:
    """How many documents a round reads (counted in a round of its own)."""
    from data.loader.stream import ConsumerStream

    real, count = ConsumerStream.load, [0]

    def counting(self, *a):
        count[0] += 1
        return real(self, *a)

    with mock.patch.object(ConsumerStream, "load", counting):
        one_round(tokens, "ids", n_tokens, seq_len)
    return count[0]


def one_round(tokens: Path, variant: str, n_tokens: int, seq_len: int) -> float:
    cfg = LoaderConfig(
        sources=sources(tokens),
        seq_len=seq_len,
        num_workers=0,
        check_hashes=variant == "ids+sha256",
    )
    patch = (
        mock.patch("data.loader.stream.check_ids", lambda *a: None)
        if variant == "none"
        else contextlib.nullcontext()
    )
    with patch:
        loader = build_loader(cfg, rank=0, world_size=1, micro_batch=8)
        it, n, t0 = iter(loader), 0, time.perf_counter()
        while n < n_tokens:
            n += int(next(it)["num_real_tokens"])
        dt = time.perf_counter() - t0
        it.close()
    return n / dt


def per_sample_us(tokens: Path, rounds: int) -> dict[str, float]:
    """Microseconds per sample of each step alone, over every sample of every source, read from
    the page cache: the reads as before (ids, mods), the checked read (one read + SHA-256), and
    the id check."""
    from data.loader.npy import read_npy
    from data.loader.sample_check import attach_id_ranges, check_ids, read_token_sample
    from data.loader.store import ShardFiles
    from data.loader.table_load import load_table

    cfg = LoaderConfig(sources=sources(tokens))
    tables = [load_table(s) for s in cfg.sources]
    attach_id_ranges(cfg, tables)
    files = ShardFiles(None, 1.0)
    todo = [(t, i) for t in tables for i in range(len(t))]

    def read(t, i, check_hash: bool):
        rec = t.token_sample(i)
        url, end = t.shards[rec.shard], t.shard_end(rec.shard)
        return read_token_sample(
            rec, lambda off, size: files.view(url, off, size, end), check_hash=check_hash
        )

    arrays = {}
    for t, i in todo:
        ids_b, mod_b = read(t, i, False)
        arrays[(id(t), i)] = (read_npy(ids_b).astype("int64"), read_npy(mod_b).astype("int64"))
    steps = {
        "read (1 view)": lambda t, i: read(t, i, False),
        "read+sha256 (1 view)": lambda t, i: read(t, i, True),
        "ids check": lambda t, i: check_ids(*arrays[(id(t), i)], t.id_ranges),
    }
    out: dict[str, list[float]] = {k: [] for k in steps}
    for _ in range(rounds):
        for name, fn in steps.items():
            t0 = time.perf_counter()
            for t, i in todo:
                fn(t, i)
            out[name].append((time.perf_counter() - t0) / len(todo) * 1e6)
    files.close()
    return {k: statistics.median(v) for k, v in out.items()}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tokens", type=Path, default=None, help="a token folder (default: build)")
    ap.add_argument("--scale", type=float, default=0.25, help="demo corpus scale when building")
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--tokens-per-round", type=int, default=300_000)
    ap.add_argument("--seq-len", type=int, default=2048)
    a = ap.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        tokens = a.tokens or build_tokens(Path(tmp), a.scale)
        variants = ("none", "ids", "ids+sha256")
        one_round(tokens, "none", a.tokens_per_round // 4, a.seq_len)  # warm the page cache
        speed: dict[str, list[float]] = {v: [] for v in variants}
        for _ in range(a.rounds):
            for v in variants:
                speed[v].append(one_round(tokens, v, a.tokens_per_round, a.seq_len))
        base = statistics.median(speed["none"])
        print(f"{tokens}: {a.rounds} rounds of {a.tokens_per_round:,} tokens, seq_len {a.seq_len}")
        for v in variants:
            med = statistics.median(speed[v])
            print(f"  {v:11s} {med:12,.0f} tok/s   ratio to none {med / base:.3f}")
        docs = docs_read(tokens, a.tokens_per_round, a.seq_len)
        per_doc = a.tokens_per_round / base / docs * 1e6
        print(f"  {docs} documents a round: the loader spends {per_doc:.0f} us a document")
        for name, us in per_sample_us(tokens, a.rounds).items():
            print(f"  per sample, {name:21s} {us:7.1f} us ({us / per_doc:.1%} of a document's)")


if __name__ == "__main__":
    main()
