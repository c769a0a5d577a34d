"""What the benchmarks share: the machine and commit they ran on, rounds of contenders measured
in turn, results as JSON, memory and process trees read from Linux's /proc, a training run in a
subprocess, the device helpers of the GPU scripts, and token folders written by the project's own
writers and read by its loader (the instability suite, tools/monitor_eval/, writes its sources
with them and trains in a subprocess too).

Only the standard library is imported here: the GPU scripts run where only torch is installed,
so numpy, torch and the pipeline are imported inside the functions that need them.
"""

from __future__ import annotations

import contextlib
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Mapping
from itertools import islice
from pathlib import Path
from typing import TypeVar

ROOT = Path(__file__).resolve().parents[2]
Key = TypeVar("Key")
Result = TypeVar("Result")


def machine() -> str:
    """The CPU's model (from Linux's /proc/cpuinfo, else the architecture), its core count and
    the Python version."""
    name = platform.machine()
    with contextlib.suppress(OSError), open("/proc/cpuinfo") as cpuinfo:
        name = next(
            (line.split(":", 1)[1].strip() for line in cpuinfo if line.startswith("model name")),
            name,
        )
    return f"{name}, {os.cpu_count()} cores, Python {platform.python_version()}"


def commit() -> str:
    """The checkout's short commit, or "?" outside a git checkout (or without git)."""
    git = ["git", "-C", str(ROOT), "rev-parse", "--short", "HEAD"]
    with contextlib.suppress(OSError):
        return subprocess.run(git, capture_output=True, text=True).stdout.strip() or "?"
    return "?"


def rounds(measures: Mapping[Key, Callable[[], Result]], count: int) -> dict[Key, list[Result]]:
    """``count`` rounds of every measure, the order rotated by one each round, so that a change of
    load on a shared machine hits every contender alike: each measure's results, in round order."""
    names = list(measures)
    results: dict[Key, list[Result]] = {name: [] for name in names}
    for number in range(count):
        shift = number % len(names)
        for name in names[shift:] + names[:shift]:
            results[name].append(measures[name]())
    return results


def medians(results: dict[str, list[float]]) -> dict[str, float]:
    return {name: statistics.median(values) for name, values in results.items()}


def report(res: dict, path: str | Path | None = None) -> dict:
    """``res`` printed as JSON and, given ``path``, written there too."""
    text = json.dumps(res, indent=1)
    print(text, flush=True)
    if path:
        Path(path).write_text(text + "\n")
    return res


def status_mib(field: str) -> float:
    """A field of /proc/self/status in MiB: ``VmRSS`` (resident now) or ``VmHWM`` (its peak)."""
    with open("/proc/self/status") as status:
        for line in status:
            if line.startswith(f"{field}:"):
                return int(line.split()[1]) / 1024
    raise KeyError(f"/proc/self/status has no {field}")


def process_tree(root: int) -> list[int]:
    """``root`` and its live descendants (``/proc/PID/task/TID/children``)."""
    found, todo = [], [root]
    while todo:
        pid = todo.pop()
        found.append(pid)
        try:
            for task in os.listdir(f"/proc/{pid}/task"):
                with open(f"/proc/{pid}/task/{task}/children") as children:
                    todo.extend(int(child) for child in children.read().split())
        except OSError:  # ended meanwhile
            continue
    return found


def train_subprocess(overrides: list[str], what: str, cwd: Path | None = None) -> None:
    """``earlyfuse-train`` with ``overrides``, in a fresh process started in ``cwd``; ``what``
    failed, with the tail of its stderr, when it exits non-zero. A launcher's rank variables are
    not passed on: the run is one process of its own, not a rank of this one's job."""
    launcher = ("RANK", "WORLD_SIZE", "LOCAL_RANK", "MASTER_ADDR", "MASTER_PORT")
    env = {key: value for key, value in os.environ.items() if key not in launcher}
    command = [sys.executable, "-m", "train.app", *overrides]
    proc = subprocess.run(command, cwd=cwd, capture_output=True, text=True, env=env)
    if proc.returncode:
        raise SystemExit(f"{what} failed:\n{proc.stderr[-3000:]}")


# --- the GPU scripts ------------------------------------------------------------------------------
def device_name(device) -> str:
    import torch

    if device.type == "cuda":
        return torch.cuda.get_device_name(device)
    return platform.processor() or "cpu"


def sync(device) -> None:
    """Wait for the device's queued work, so that a timer stops when the work is done."""
    import torch

    if device.type == "cuda":
        torch.cuda.synchronize(device)


def doc_ids(seq_len: int, docs: int, device):
    """One row of ``docs`` documents of (nearly) equal length: ids 0, 0, ..., 1, 1, ...; [1, T]."""
    import torch

    return (torch.arange(seq_len, device=device) * docs // seq_len).unsqueeze(0)


def allow_recompiles(lengths: int, per_length: int = 8) -> None:
    """Let dynamo keep ``per_length`` compiled variants of a function for each of ``lengths`` row
    lengths. A run has one row length, so dynamo's default of 8 variants per function (the
    blocks, the BlockMask builder per window) is plenty there; one process measuring several
    lengths needs that many per length, and past the limit dynamo would fall back to eager code
    (an uncompiled BlockMask builder materialises the dense mask) instead of measuring what a
    run of that length runs."""
    import torch._dynamo.config as dynamo_config

    name = "recompile_limit" if hasattr(dynamo_config, "recompile_limit") else "cache_size_limit"
    setattr(dynamo_config, name, max(getattr(dynamo_config, name), per_length * lengths))


# --- token folders --------------------------------------------------------------------------------
def write_token_shards(folder: Path, source: str, docs: Iterable, per_shard: int) -> list[dict]:
    """Token shards (tar, JSONL index, binary index) of ``docs`` (``TokenDoc``s, written as
    documents of ``source``), ``per_shard`` a shard, by tokenize's own writer under ``folder /
    source``: their manifest entries, as tokenize makes them."""
    import dataclasses

    from data.shards import token_index
    from data.shards.manifest import shard_entry
    from data.tokenize.blocks import shard_block_stats
    from data.tokenize.shard_job import TokenShardWriter

    (folder / source).mkdir(parents=True, exist_ok=True)
    entries: list[dict] = []
    docs = iter(docs)  # a list too is taken a shard at a time
    while chunk := list(islice(docs, per_shard)):
        rel = f"{source}/shard-{len(entries):06d}"
        writer = TokenShardWriter(folder / f"{rel}.tar", folder / f"{rel}.idx.jsonl")
        for doc in chunk:
            writer.write(dataclasses.replace(doc, source=source))
        written = dataclasses.asdict(writer.close(folder / f"{rel}{token_index.SUFFIX}"))
        entry = {**written, "tar": f"{rel}.tar", "index_file": f"{rel}.idx.jsonl", "source": source}
        entries.append(
            shard_entry(
                entry,
                index_bin=f"{rel}{token_index.SUFFIX}",
                tokens=dict(writer.tokens),
                blocks=shard_block_stats(writer.doc_blocks),
            )
        )
    return entries


def write_token_manifest(
    folder: Path, fingerprint: str, tokenizers: dict, shards: list, **fields
) -> dict:
    """The token folder's ``manifest.json`` over ``shards``, as ``earlyfuse-prep tokenize`` writes
    it: the manifest. ``fields``: more of its entries (a derived folder's ``inputs``, the
    ``options`` of the folder it derives from)."""
    from data.shards.manifest import TOKEN_FORMAT

    samples: Counter[str] = Counter()
    tokens: defaultdict[str, Counter[str]] = defaultdict(Counter)
    for entry in shards:
        samples[entry["source"]] += entry["samples"]
        tokens[entry["source"]].update(entry["tokens"])
    sources = [
        {"name": name, "samples": count, "tokens": dict(tokens[name])}
        for name, count in samples.items()
    ]
    manifest = {
        "format": TOKEN_FORMAT,
        "version": 1,
        "fingerprint": fingerprint,
        "tokenizers": tokenizers,
        **fields,
        "sources": sources,
        "shards": shards,
        "totals": {
            "samples": samples.total(),
            "tokens": sum(sum(counts.values()) for counts in tokens.values()),
            "rejects": 0,
        },
    }
    (folder / "manifest.json").write_text(json.dumps(manifest, indent=1))
    return manifest


def token_loader_config(tokens: Path, seq_len: int, **options):
    """A ``LoaderConfig`` over every source of a token folder, each weighted by its share of the
    tokens: the mix follows the shards' own proportions, so per token the loader reads the same
    documents as a loop over the shards (equal weights would favour short documents)."""
    from data.loader import LoaderConfig, SourceConfig

    manifest = json.loads((tokens / "manifest.json").read_text())
    sources = [
        SourceConfig(
            name=src["name"],
            shards=[str(tokens / src["name"])],
            weight=float(sum(src["tokens"].values())),
        )
        for src in manifest["sources"]
    ]
    return LoaderConfig(sources=sources, seq_len=seq_len, **options)


def loader_start(cfg, state: dict | None = None) -> tuple[float, float, dict]:
    """A loader built in this process (and given ``state``): (seconds to build it, seconds to its
    first batch, its state after that batch)."""
    from data.loader import build_loader

    started = time.perf_counter()
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=8)
    if state is not None:
        loader.load_state_dict(state)
    built = time.perf_counter() - started
    batches = iter(loader)
    next(batches)
    seconds = time.perf_counter() - started
    after = loader.state_dict()
    batches.close()
    return built, seconds, after
