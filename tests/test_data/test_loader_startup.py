"""A fresh process compiles nothing before its first batch: every compiled function of the loader
is loaded from numba's on-disk cache (docs/loader.md, "The hot loop compiled")."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

from data.loader import LoaderConfig, SourceConfig, build_loader

ROOT = Path(__file__).resolve().parents[2]

# Counts numba's compilations (a cache hit is none) while a loader over every source of the
# tiny token folder hands out its first batches.
CHILD = """
import json, sys
from numba.core import event
compiled = []
class Listener(event.Listener):
    def on_start(self, ev):
        compiled.append(str(ev.data["dispatcher"].py_func.__qualname__))
    def on_end(self, ev):
        pass
event.register("numba:compile", Listener())
from data.loader import LoaderConfig, SourceConfig, build_loader
cfg = LoaderConfig(**json.loads(sys.argv[1]))
cfg.sources = [SourceConfig(**source) for source in cfg.sources]
loader = build_loader(cfg, rank=0, world_size=1, micro_batch=3)
it = iter(loader)
for _ in range(3):
    next(it)
it.close()
print(json.dumps(compiled))
"""


def test_a_fresh_process_loads_every_compiled_function_from_the_cache(tiny_tokens):
    names = ("code", "text", "scenes", "digits", "clips", "docs")
    settings = {
        "sources": [{"name": name, "shards": [str(tiny_tokens / name)]} for name in names],
        "seq_len": 256,
        "num_workers": 0,
        "shuffle_buffer": 8,
    }
    # This process's first batches write whatever the cache lacks (a first run of a checkout).
    cfg = LoaderConfig(**{**settings, "sources": [SourceConfig(**s) for s in settings["sources"]]})
    it = iter(build_loader(cfg, rank=0, world_size=1, micro_batch=3))
    for _ in range(3):
        next(it)
    it.close()  # type: ignore[attr-defined]
    out = subprocess.run(
        [sys.executable, "-c", CHILD, json.dumps(settings)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    compiled = json.loads(out.stdout.strip().splitlines()[-1])
    assert compiled == [], f"compiled in a fresh process before its first batches: {compiled}"


def test_counting_an_epoch_reads_the_indexes_alone(tiny_tokens, monkeypatch):
    """Epoch mode counts every consumer's batches when the loader is built: from the shard
    indexes (lengths and blocks) in runs through the compiled loop, no document read one by one
    in Python and no tar opened; the count is the real pass's (test_loader_known_good.py)."""
    from data.loader.store import ShardFiles
    from data.loader.stream import ConsumerStream

    names = ("code", "text", "scenes", "digits", "clips", "docs")
    cfg = LoaderConfig(
        sources=[SourceConfig(name=name, shards=[str(tiny_tokens / name)]) for name in names],
        seq_len=256,
        num_workers=2,
        shuffle_buffer=8,
        mode="epoch",
    )
    counted = build_loader(cfg, rank=0, world_size=2, micro_batch=3).batch_limit

    def refused(*args, **kwargs):
        raise AssertionError("counting an epoch read a document or a tar")

    monkeypatch.setattr(ConsumerStream, "load", refused)
    monkeypatch.setattr(ShardFiles, "mapped", refused)
    loader = build_loader(cfg, rank=0, world_size=2, micro_batch=3)
    assert loader.batch_limit == counted and counted > 0
