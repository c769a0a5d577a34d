"""The visual blocks of tokenized documents.

- ``visual_blocks``: the blocks of one document, as a token shard's index records them
  (``blocks``). Written by ``earlyfuse-prep tokenize`` for every token document and computed the
  same way by the loader for raw shards it tokenizes itself: a library module, so that the loader
  never imports the tokenize command.
- ``block_summary`` / ``describe``: what a token folder's blocks need of a row, per source,
  counted from the indexes. The manifest of ``earlyfuse-prep tokenize`` records per source and
  modality how many image and video blocks there are and the longest (in tokens), and how many
  documents were rejected for their media; the summary prints it. A run whose ``data.seq_len`` is
  below the longest block would drop blocks, which the loader refuses at start
  (data/loader/fit.py); ``--seq-len`` at tokenize time makes every block fit.
"""

from __future__ import annotations

from collections import Counter


def visual_blocks(spans: list[dict]) -> list[list[int]]:
    """[start, end, t, h, w] of each image/video block (t = 0 for an image): what a packer needs
    to keep blocks whole, and M-RoPE positions, from the index alone."""
    out = []
    for span in spans:
        if span["type"] == "image":
            out.append([span["start"], span["end"], 0, *span["grid"]])
        elif span["type"] == "video":
            out.append([span["start"], span["end"], *span["grid"]])
    return out


MEDIA_REJECTS = {
    "image": ("unreadable-image",),
    "video": ("undecodable-video", "over-doc-budget"),
}


def shard_block_stats(blocks_of_docs) -> dict[str, dict]:
    """{"image": {"blocks", "longest"}, "video": {...}} of one shard, from each document's
    ``visual_blocks`` (tokenize keeps it in the shard's record, so the manifest never re-reads
    indexes, which may lie in object storage)."""
    stats: dict[str, dict] = {modality: {"blocks": 0, "longest": 0} for modality in MEDIA_REJECTS}
    grids: Counter = Counter()  # "HxW" of every image block: what earlyfuse-generate draws
    for blocks in blocks_of_docs:
        for start, end, frames, height, width in blocks:
            row = stats["video" if frames else "image"]
            row["blocks"] += 1
            row["longest"] = max(row["longest"], int(end) - int(start))
            if not frames:
                grids[f"{int(height)}x{int(width)}"] += 1
    stats["image"]["grids"] = dict(grids)
    return stats


def block_summary(records: list[dict]) -> dict[str, dict]:
    """source -> {"image": {"blocks", "longest", "rejected", "grids"}, "video": {...}} of the token shards
    ``records`` (tokenize's per-shard records, each with its ``block_stats``)."""
    summary: dict[str, dict] = {}
    for rec in records:
        per = summary.setdefault(
            rec["source"],
            {media: {"blocks": 0, "longest": 0, "rejected": 0} for media in MEDIA_REJECTS},
        )
        for modality, got in rec["block_stats"].items():
            per[modality]["blocks"] += got["blocks"]
            per[modality]["longest"] = max(per[modality]["longest"], got["longest"])
            if "grids" in got:
                merged = Counter(per[modality].get("grids", {})) + Counter(got["grids"])
                per[modality]["grids"] = dict(merged)
        reasons = Counter(reason["reason"] for reason in rec["rejects"])
        for modality, why in MEDIA_REJECTS.items():
            per[modality]["rejected"] += sum(reasons[reason] for reason in why)
    return summary


def image_grids(manifest: dict) -> dict[str, int]:
    """ "HxW" -> image blocks of that grid, over every source of a token folder's manifest (empty
    when it holds no images)."""
    total: Counter = Counter()
    for src in manifest.get("sources", []):
        total.update(((src.get("blocks") or {}).get("image") or {}).get("grids") or {})
    return dict(total.most_common())


def describe(manifest: dict) -> list[str]:
    """Lines for the tokenize summary: per source, its blocks and the longest, and what a run's
    ``data.seq_len`` must be for none to be dropped."""
    lines = []
    cap = (manifest.get("options") or {}).get("max_block_tokens") or 0
    longest_all = 0
    for src in manifest["sources"]:
        parts = []
        for modality, block_stats in (src.get("blocks") or {}).items():
            if block_stats["blocks"] or block_stats["rejected"]:
                parts.append(
                    f"{block_stats['blocks']} {modality} blocks, "
                    f"longest {block_stats['longest']} tokens"
                    + (
                        f", {block_stats['rejected']} rejected (rejects.jsonl)"
                        if block_stats["rejected"]
                        else ""
                    )
                )
                longest_all = max(longest_all, block_stats["longest"])
        if parts:
            lines.append(f"  {src['name']}: " + "; ".join(parts))
    if not lines:
        return []
    if cap and longest_all <= cap:
        lines.append(  # the least of --seq-len, --max-block-tokens and --doc-budget
            f"every block has at most {cap} tokens: a run with data.seq_len >= {cap} drops none"
        )
    else:
        lines.append(
            f"rows must hold {longest_all} tokens for no block to be dropped: train with "
            f"data.seq_len >= {longest_all}, or tokenize with --seq-len SEQ_LEN to fit the blocks"
        )
    return ["visual blocks:", *lines]
