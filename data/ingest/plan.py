"""Plan an ingest: list every input once, cut the list into shards, fingerprint the result.

Design choices:
- The plan depends only on the inputs and the flags that shape the output (limits, shard
  size), never on ``--workers`` or ``--partition``: so every worker count, partitioning and
  resumed run writes the same shards, byte for byte, under the same names.
- Shards never span sources (``DIR/<source>/shard-NNNNNN.tar``): the loader weights sources,
  so a source is a set of shards it can glob.
- Target sizes apply to the estimated input bytes (file sizes); a shard ends up smaller when
  some of its inputs are rejected.
- Duplicate keys are found here, across all sources: the first input keeps the key, later
  ones are rejected naming the first.
- ``val_fraction``: a held-out split by hash of each sample's key (like scikit-learn's
  ``train_test_split``, but stable: adding or removing other inputs never moves a sample to the
  other side, and reruns agree). Validation samples go to shards of their own under
  ``val/<source>/`` (manifest source ``val/<source>``), so ``DIR/<source>`` is training data
  only and ``DIR/val`` all of the validation data.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import math
from collections.abc import Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path

from tqdm import tqdm

from data.schema import Reject
from data.sources import Item, Limits, SourceSpec, build_source
from data.sources.base import special_file

MIN_VAL_DOCS = 10  # the held-out documents a source's validation figures should rest on at least

# Raised whenever what ingest writes for the same plan changes (new rejects, new fields): a
# folder begun by an earlier version is then refused, not finished with shards of another kind
PLAN_VERSION = 4


@dataclass
class ShardPlan:
    index: int  # position in the whole plan (partitions take index % P == I)
    source: int  # index into Plan.sources
    name: str  # "<source>/shard-NNNNNN" (validation: "val/<source>/shard-NNNNNN"), no extension
    items: list[Item] = field(default_factory=list)
    split: str = "train"  # train | val


@dataclass
class Plan:
    sources: list[SourceSpec]
    limits: Limits
    shard_max_bytes: int
    shard_max_samples: int
    shards: list[ShardPlan]
    fingerprint: str
    counts: dict  # per source: items planned, rejected at plan time
    val_fraction: float = 0.0
    dedupe: bool = False  # leave out exact duplicate documents (data/ingest/dedupe.py)

    def describe(self) -> dict:
        return {
            "fingerprint": self.fingerprint,
            "num_shards": len(self.shards),
            "shard_max_bytes": self.shard_max_bytes,
            "shard_max_samples": self.shard_max_samples,
            "limits": self.limits.describe(),
            "version": PLAN_VERSION,
            "val_fraction": self.val_fraction,
            "dedupe": self.dedupe,
        }


def _manifest_fingerprint(folder: str) -> str:
    """The shard hashes of a raw folder's manifest (what --exclude-content-of compares with)."""
    from pathlib import Path

    from data.shards.manifest import load_manifest

    try:
        m = load_manifest(Path(folder))
    except (OSError, ValueError) as e:
        raise ValueError(f"--exclude-content-of {folder}: not a raw shard folder ({e})") from None
    blob = json.dumps([s.get("sha256") for s in m["shards"]]).encode()
    return hashlib.sha256(blob).hexdigest()[:16]


def _item_blob(item: Item) -> bytes:
    rej = item.reject.to_dict() if item.reject else None
    return json.dumps(
        [item.key, item.label, list(item.ref), item.size, rej], sort_keys=True
    ).encode()


def _listed(src) -> Iterator[Item]:
    """The source's items; a failure to list them (unreadable table, bad encoding) is fatal."""
    spec = src.spec
    try:
        if why := special_file(Path(spec.path)):  # a URL has no stat: None
            raise ValueError(f"{spec.path}: {why}")
        yield from src.items()
    except (OSError, UnicodeDecodeError, ValueError) as e:
        raise ValueError(
            f"source {spec.name} ({spec.kind}:{spec.path}): cannot list inputs: {e}"
        ) from e


def make_plan(
    specs: list[SourceSpec],
    limits: Limits,
    *,
    shard_max_bytes: int,
    shard_max_samples: int,
    progress: bool = True,
    val_fraction: float = 0.0,
    exclude: tuple[str, ...] = (),
    dedupe: bool = False,
) -> Plan:
    if shard_max_bytes < 0 or shard_max_samples < 0:
        raise ValueError(
            f"--shard-size {shard_max_bytes} / --shard-samples {shard_max_samples}: give 0 (no "
            "limit) or more"
        )
    if shard_max_bytes <= 0 and shard_max_samples <= 0:
        raise ValueError("set a shard size: --shard-size and/or --shard-samples")
    if not 0.0 <= val_fraction < 1.0:
        raise ValueError(f"--val-fraction {val_fraction}: give a fraction in [0, 1)")
    shape = {
        "version": PLAN_VERSION,
        "sources": [asdict(source_spec) for source_spec in specs],
        "limits": limits.describe(),
        "shard_max_bytes": shard_max_bytes,
        "shard_max_samples": shard_max_samples,
        "val_fraction": val_fraction,
        # which shards of which folders: another training set is another plan
        "exclude": [[str(folder), _manifest_fingerprint(folder)] for folder in exclude],
        "dedupe": dedupe,
    }
    digest = hashlib.sha256(json.dumps(shape, sort_keys=True).encode())
    first_seen: dict[str, str] = {}
    shards: list[ShardPlan] = []
    counts: dict[str, dict] = {}
    bar = tqdm(desc="planning", unit=" inputs", disable=not progress, leave=False)
    for source_index, spec in enumerate(specs):
        src = build_source(spec, limits)
        # One run of shards per split: [current shard, its bytes, its samples, shards so far].
        runs: dict[str, list] = {"train": [None, 0, 0, 0], "val": [None, 0, 0, 0]}
        n_items = n_rej = 0
        lowest: list[float] = []  # the MIN_VAL_DOCS lowest split positions, negated (a max-heap)
        for item in _listed(src):
            if item.reject is None:
                if item.key in first_seen:
                    item = Item(
                        item.key,
                        item.label,
                        ("rejected",),
                        0,
                        Reject(
                            item.label,
                            "duplicate-key",
                            f"key {item.key!r} already used by {first_seen[item.key]}",
                            key=item.key,
                            source=spec.name,
                        ),
                    )
                else:
                    first_seen[item.key] = f"{spec.name}:{item.label}"
            accepted = item.reject is None
            if accepted:
                position = split_position(item.key)
                if len(lowest) < MIN_VAL_DOCS:
                    heapq.heappush(lowest, -position)
                elif position < -lowest[0]:
                    heapq.heapreplace(lowest, -position)
            # Rejects stay with the training shards (listed once, whatever the split).
            split = "val" if accepted and in_validation(item.key, val_fraction) else "train"
            run = runs[split]
            cur, cur_bytes, cur_samples, shard_no = run
            full = (
                cur is not None
                and accepted
                and cur_samples > 0
                and (
                    (shard_max_bytes > 0 and cur_bytes + item.size > shard_max_bytes)
                    or (shard_max_samples > 0 and cur_samples >= shard_max_samples)
                )
            )
            if cur is None or full:
                folder = spec.name if split == "train" else f"val/{spec.name}"
                cur = ShardPlan(
                    len(shards), source_index, f"{folder}/shard-{shard_no:06d}", split=split
                )
                shards.append(cur)
                shard_no += 1
                cur_bytes = cur_samples = 0
            cur.items.append(item)
            if accepted:
                cur_bytes += item.size
                cur_samples += 1
            run[:] = [cur, cur_bytes, cur_samples, shard_no]
            n_items += 1
            n_rej += not accepted
            digest.update(_item_blob(item))
            bar.update()
        if not n_items:
            raise ValueError(f"source {spec.name} ({spec.kind}:{spec.path}): no inputs found")
        counts[spec.name] = {
            "inputs": n_items,
            "rejected_at_plan": n_rej,
            # the --val-fraction that holds out MIN_VAL_DOCS of its documents (None: fewer)
            "val_fraction_needed": (
                math.nextafter(-lowest[0], 1.0) if len(lowest) == MIN_VAL_DOCS else None
            ),
        }
    bar.close()
    return Plan(
        specs,
        limits,
        shard_max_bytes,
        shard_max_samples,
        shards,
        digest.hexdigest()[:24],
        counts,
        val_fraction,
        dedupe,
    )


def split_position(key: str) -> float:
    """Where a sample's key falls in [0, 1): those below ``--val-fraction`` are held out. A hash
    of the key alone, so the choice never depends on the other inputs, their order or the
    worker count."""
    digest = hashlib.sha256(key.encode("utf-8")).digest()
    return int.from_bytes(digest[:8], "big") / 2.0**64


def in_validation(key: str, fraction: float) -> bool:
    """Whether a sample belongs to the validation split."""
    return fraction > 0 and split_position(key) < fraction
