"""A fresh process compiles nothing before its first batch: every compiled function of the loader
is loaded from numba's on-disk cache (docs/loader.md, "The hot loop compiled"); a worker finds
the loader imported and its kernels loaded, by the trainer's process it is forked from or by the
fork server (docs/loader.md, "Worker processes")."""

from __future__ import annotations

import json
import subprocess
import sys
from multiprocessing import forkserver
from pathlib import Path

import pytest
from factories import tiny_loader_config
from numba.core.registry import CPUDispatcher
from torch.utils.data import DataLoader, IterableDataset

from data.loader import LoaderConfig, SourceConfig, build_loader
from data.loader.dataset import PackedLoader, _Consumers
from data.loader.worker_start import PRELOAD

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
from multiprocessing import forkserver

from numba.core.registry import CPUDispatcher
from torch.utils.data import DataLoader, IterableDataset

from data.loader import LoaderConfig, SourceConfig, build_loader
from data.loader.dataset import PackedLoader, _Consumers
from data.loader.worker_start import PRELOAD
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


def _kernels_loaded() -> dict[str, int]:
    """Compiled signatures each of the loader's kernels holds in this process."""
    return {
        f"{name}.{attr}": len(value.signatures)
        for name, module in list(sys.modules.items())
        if name.startswith("data.loader.")
        for attr, value in vars(module).items()
        if isinstance(value, CPUDispatcher)
    }


class _WhatAWorkerFinds(IterableDataset):
    """In a DataLoader worker: whether the loader was imported before the worker started, and
    which kernels the worker loaded itself while its stream packed a few batches (none: the
    process it was forked from had)."""

    def __init__(self, loader: PackedLoader) -> None:
        self.loader = loader

    def __iter__(self):
        preloaded = PRELOAD in sys.modules
        before = _kernels_loaded()
        batches = iter(_Consumers(self.loader))
        for _ in range(3):
            next(batches)
        after = _kernels_loaded()
        yield {
            "preloaded": preloaded,
            "loaded_in_worker": sorted(k for k, n in after.items() if n > before.get(k, 0)),
        }


def _what_a_worker_finds(loader: PackedLoader, method: str) -> list[dict]:
    return list(
        DataLoader(
            _WhatAWorkerFinds(loader),
            batch_size=None,
            num_workers=1,
            multiprocessing_context=method,
        )
    )


# A fresh process (no kernel loaded yet) builds a loader with one forked worker and reports what
# the worker found; this file's helpers imported from it.
FORKED = """
import json, sys
sys.path[:0] = ["tests", "tests/test_data"]
from factories import tiny_loader_config
from test_loader_startup import _kernels_loaded, _what_a_worker_finds
from data.loader import build_loader
cfg = tiny_loader_config(__import__("pathlib").Path(sys.argv[1]), num_workers=1)
assert cfg.worker_start == "fork"
before = sum(_kernels_loaded().values())
loader = build_loader(cfg, rank=0, world_size=1, micro_batch=3)
print(json.dumps({"loaded_before_build": before, "found": _what_a_worker_finds(loader, "fork")}))
"""


def test_a_forked_worker_finds_the_loader_imported_and_its_kernels_loaded(tiny_tokens):
    """The default: the trainer's process warms the kernels when it builds the loader (in
    infinite mode it packs nothing itself), so no worker forked from it loads one. In a fresh
    process, so that nothing else has loaded them before."""
    out = subprocess.run(
        [sys.executable, "-c", FORKED, str(tiny_tokens)],
        capture_output=True,
        text=True,
        check=True,
        cwd=ROOT,
    )
    report = json.loads(out.stdout.strip().splitlines()[-1])
    assert report == {
        "loaded_before_build": 0,
        "found": [{"preloaded": True, "loaded_in_worker": []}],
    }


def test_a_worker_forks_from_a_server_with_the_loader_imported_and_its_kernels_loaded(
    tiny_tokens,
):
    server = forkserver._forkserver
    if server._forkserver_pid is not None and PRELOAD not in server._preload_modules:
        server._stop()  # started by another test of this process without the loader's preload
    cfg = tiny_loader_config(tiny_tokens, num_workers=1, worker_start="forkserver")
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=3)
    assert server._forkserver_pid is not None, "building a loader with workers starts the server"
    assert server._preload_modules[0] == "__main__"  # multiprocessing's own default is kept
    assert PRELOAD in server._preload_modules
    found = _what_a_worker_finds(loader, "forkserver")
    assert found == [{"preloaded": True, "loaded_in_worker": []}]


def test_an_unknown_worker_start_is_refused_by_name(tiny_tokens):
    for workers in (1, 0):
        cfg = tiny_loader_config(tiny_tokens, num_workers=workers, worker_start="spawn")
        with pytest.raises(
            ValueError, match="data.worker_start 'spawn': choose one of fork, forkserver"
        ):
            build_loader(cfg, rank=0, world_size=1, micro_batch=3)


def test_counting_an_epoch_reads_the_indexes_alone(tiny_tokens, monkeypatch):
    """Epoch mode counts every consumer's batches when the loader is built: from the shard
    indexes (lengths and blocks) in runs through the compiled loop, no document read one by one
    in Python and no tar opened; the count is the real pass's (test_loader_known_good.py)."""
    from data.loader.store import ShardFiles
    from data.loader.stream import ConsumerStream

    cfg = tiny_loader_config(tiny_tokens, num_workers=2, mode="epoch")
    counted = build_loader(cfg, rank=0, world_size=2, micro_batch=3).batch_limit

    def refused(*args, **kwargs):
        raise AssertionError("counting an epoch read a document or a tar")

    monkeypatch.setattr(ConsumerStream, "load", refused)
    monkeypatch.setattr(ShardFiles, "mapped", refused)
    loader = build_loader(cfg, rank=0, world_size=2, micro_batch=3)
    assert loader.batch_limit == counted and counted > 0
