"""Before the first batch: can the sources be mixed as configured, and does every block fit a row?

A block longer than ``seq_len`` can only be dropped by the packer (token shards cannot be
re-encoded smaller), so a source whose images were tokenized at a larger budget than the run's
rows would silently train on its captions alone. The manifest gives every shard's longest block,
so such a source is refused at start, at no per-sample cost, unless ``data.allow_block_drops``
accepts the drops (docs/loader.md, "Packing").
"""

from __future__ import annotations

import functools
import os

from data.loader.config import LoaderConfig
from data.loader.table import SampleTable, TokenTable
from data.tokenize.docs import block_flags


def oversize_blocks(table: TokenTable, seq_len: int) -> dict[str, list[int]]:
    """modality -> [blocks longer than seq_len, blocks in all, the longest] of a token source.
    From the manifest's per-shard summaries: no index is read unless some block is too long,
    and then only to count them for the message."""
    out = {m: [0, 0, 0] for m in ("image", "video")}
    for got in table.shard_blocks:
        for m, row in out.items():
            row[1] += int(got[m]["blocks"])
            row[2] = max(row[2], int(got[m]["longest"]))
    if all(row[2] <= seq_len for row in out.values()):
        return out
    for si in range(len(table.shards)):
        blocks = table.index(si).blocks  # every sample's [start, end, t, h, w], in order
        over = blocks[:, 1] - blocks[:, 0] > seq_len
        out["image"][0] += int((over & (blocks[:, 2] == 0)).sum())
        out["video"][0] += int((over & (blocks[:, 2] != 0)).sum())
    return out


def _budget(table: TokenTable) -> str:
    opts = table.tokenize_options
    return f"tokenized with {block_flags(opts)}" if opts else "its tokenize options are unknown"


def check_blocks_fit(cfg: LoaderConfig, tables: list[SampleTable], *, what: list[str]) -> None:
    """ValueError naming each token source whose blocks would be dropped at ``cfg.seq_len``
    (``what``: what each is, "source"), unless ``cfg.allow_block_drops``."""
    if cfg.allow_block_drops:
        return
    problems, longest = [], 0
    for t, said in zip(tables, what, strict=True):
        if not isinstance(t, TokenTable):
            continue  # raw sources are tokenized with budgets fitted to the row
        for modality, (over, total, most) in oversize_blocks(t, cfg.seq_len).items():
            if over:
                longest = max(longest, most)
                problems.append(
                    f"{said} {t.name}: {over} of its {total} {modality} blocks are longer than "
                    f"data.seq_len={cfg.seq_len} (the longest {most} tokens; {_budget(t)})"
                )
    if problems:
        raise ValueError(
            "visual blocks longer than a row would be dropped, so the model would never see them:\n  "
            + "\n  ".join(problems)
            + f"\nFix: tokenize again with `earlyfuse-prep tokenize ... --seq-len {cfg.seq_len}` "
            f"(images and videos are made small enough to fit), or raise data.seq_len to at least "
            f"{longest}, or set data.allow_block_drops=true to train without those blocks "
            "(each dropped block is counted: data/dropped_blocks in metrics.jsonl and final.json)"
        )


def check_mix(cfg: LoaderConfig, tables: list[SampleTable], weights: list, consumers: int) -> None:
    """ValueError naming a source whose weight is no share of the tokens (0 leaves it out, as a
    run does with an unreadable source; not 0 for all), a name two sources share (names key the
    mix and its metrics), or in infinite mode a source with a share and fewer documents than
    consumers (ranks x workers), each of which reads a slice of it (docs/loader.md, "Order")."""
    names = [t.name for t in tables]
    for t, weight in zip(tables, weights):
        if not (isinstance(weight, int | float) and 0 <= weight < float("inf")):
            raise ValueError(f"source {t.name}: weight {weight!r}; give a number >= 0")
        if names.count(t.name) > 1:
            raise ValueError(f"two sources are named {t.name!r}; give each its own name")
        if cfg.mode == "infinite" and weight > 0 and len(t) < consumers:
            raise ValueError(
                f"source {t.name}: {len(t)} document(s), fewer than the {consumers} consumers "
                "(ranks x data.num_workers) that each read a slice of it in infinite mode; give "
                "it more documents or use fewer workers"
            )
    if not any(weight > 0 for weight in weights):
        raise ValueError(f"sources {names}: every weight is 0, nothing to mix")
    listed: dict[str, str] = {}  # a shard's real path -> the source listing it
    folders = functools.cache(os.path.realpath)  # one lookup a folder, not a shard
    for url, name in ((url, t.name) for t in tables for url in t.shards):
        local = "://" not in url and not url.startswith("pipe:")
        real = os.path.join(folders(os.path.dirname(url)), os.path.basename(url)) if local else url
        if real in listed:  # e.g. a folder and a glob inside it
            raise ValueError(
                f"shard {url} is listed twice (sources {listed[real]} and {name}): its documents "
                "would count double; list each shard once"
            )
        listed[real] = name
