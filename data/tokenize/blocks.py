"""What a token folder's visual blocks need of a row, per source: counted from the indexes.

The manifest of ``earlyfuse-prep tokenize`` records per source and modality how many image and
video blocks there are and the longest (in tokens), and how many documents were rejected for
their media; the summary prints it. A run whose ``data.seq_len`` is below the longest block would
drop blocks, which the loader refuses at start (data/loader/fit.py); ``--seq-len`` at tokenize
time makes every block fit.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

from data.shards.index import read_index

MEDIA_REJECTS = {
    "image": ("unreadable-image",),
    "video": ("undecodable-video",),
}


def block_summary(out: Path, records: list[dict]) -> dict[str, dict]:
    """source -> {"image": {"blocks", "longest", "rejected"}, "video": {...}} of the token shards
    ``records`` (tokenize's per-shard records) in ``out``."""
    summary: dict[str, dict] = {}
    for rec in records:
        per = summary.setdefault(
            rec["source"],
            {m: {"blocks": 0, "longest": 0, "rejected": 0} for m in MEDIA_REJECTS},
        )
        for entry in read_index(out / rec["index_file"]):
            for start, end, t, *_ in entry.get("blocks", []):
                row = per["video" if t else "image"]
                row["blocks"] += 1
                row["longest"] = max(row["longest"], int(end) - int(start))
        reasons = Counter(r["reason"] for r in rec["rejects"])
        for modality, why in MEDIA_REJECTS.items():
            per[modality]["rejected"] += sum(reasons[r] for r in why)
    return summary


def describe(manifest: dict) -> list[str]:
    """Lines for the tokenize summary: per source, its blocks and the longest, and what a run's
    ``data.seq_len`` must be for none to be dropped."""
    lines = []
    cap = (manifest.get("options") or {}).get("max_block_tokens") or 0
    longest_all = 0
    for src in manifest["sources"]:
        parts = []
        for modality, b in (src.get("blocks") or {}).items():
            if b["blocks"] or b["rejected"]:
                parts.append(
                    f"{b['blocks']} {modality} blocks, longest {b['longest']} tokens"
                    + (f", {b['rejected']} rejected (rejects.jsonl)" if b["rejected"] else "")
                )
                longest_all = max(longest_all, b["longest"])
        if parts:
            lines.append(f"  {src['name']}: " + "; ".join(parts))
    if not lines:
        return []
    if cap and longest_all <= cap:
        lines.append(f"every block fits a row of {cap} tokens (--seq-len {cap}): none dropped")
    else:
        lines.append(
            f"rows must hold {longest_all} tokens for no block to be dropped: train with "
            f"data.seq_len >= {longest_all}, or tokenize with --seq-len SEQ_LEN to fit the blocks"
        )
    return ["visual blocks:", *lines]
