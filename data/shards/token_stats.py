"""``earlyfuse-prep stats TOKEN_DIR``: what a token folder (``earlyfuse-prep tokenize``) holds,
per source and modality, from its manifest and indexes alone (no tar is opened): documents,
tokens, visual blocks and the longest of them, documents holding each modality, tokens per
document. A local folder or an fsspec URL (``s3://bucket/tokens``)."""

from __future__ import annotations

from data.shards.index import index_of
from data.shards.stats import reject_lines
from data.shards.storage import Folder
from data.vocab import MODALITY_NAMES

VISUAL = ("image", "video")
BOUNDS = ("<|bos|>", "<|eos|>")  # every document's first and last token


def collect_token_stats(folder: Folder, manifest: dict, *, examples: int = 3) -> dict:
    from data.shards.stats import _dist, reject_examples

    sources: dict[str, dict] = {}
    for shard in manifest["shards"]:
        src = sources.setdefault(
            shard["source"],
            {
                "name": shard["source"],
                "documents": 0,
                "shards": 0,
                "bytes": 0,
                "tokens": dict.fromkeys(MODALITY_NAMES, 0),
                "blocks": {m: {"blocks": 0, "longest": 0} for m in VISUAL},
                "documents_with": dict.fromkeys(MODALITY_NAMES, 0),
                "_lengths": [],
            },
        )
        src["shards"] += 1
        src["bytes"] += shard["bytes"]
        for entry in index_of(folder, shard["index"]):
            src["documents"] += 1
            src["_lengths"].append(entry["tokens"])
            for m, n in entry["tokens_by_modality"].items():
                src["tokens"][m] += n
                # <|bos|> and <|eos|> are text tokens: a caption-less photo holds them, no text
                src["documents_with"][m] += n > (len(BOUNDS) if m == "text" else 0)
            for start, end, frames, _, _ in entry.get("blocks", []):
                block = src["blocks"]["video" if frames else "image"]
                block["blocks"] += 1
                block["longest"] = max(block["longest"], end - start)
    for src in sources.values():
        src["tokens_per_document"] = _dist(src.pop("_lengths"))
    totals = manifest["totals"]
    return {
        "folder": str(folder),
        "format": manifest["format"],
        "documents": totals["samples"],
        "shards": len(manifest["shards"]),
        "bytes": totals["bytes"],
        "tokens": totals["tokens"],
        "tokens_by_modality": {m: totals["tokens_by_modality"].get(m, 0) for m in MODALITY_NAMES},
        "sources": list(sources.values()),
        "tokenizers": manifest.get("tokenizers", {}),
        "options": manifest.get("options", {}),
        "rejects": totals["rejects"],
        "rejects_by_reason": dict(
            sorted(totals["rejects_by_reason"].items(), key=lambda item: -item[1])
        ),
        "reject_examples": reject_examples(folder, examples),
    }


def format_token_stats(s: dict) -> str:
    from data.shards.stats import human_bytes

    lines = [
        f"{s['folder']}: token shards, {s['documents']} documents in {s['shards']} shards, "
        f"{s['tokens']:,} tokens, {human_bytes(s['bytes'])}",
        "",
        f"  {'source':<20} {'docs':>6} {'tokens':>10} "
        + " ".join(f"{m:>9}" for m in MODALITY_NAMES)
        + f" {'images (longest)':>17} {'videos (longest)':>17}",
    ]
    for src in s["sources"]:
        blocks = src["blocks"]
        lines.append(
            f"  {src['name']:<20} {src['documents']:>6} {sum(src['tokens'].values()):>10} "
            + " ".join(f"{src['tokens'][m]:>9}" for m in MODALITY_NAMES)
            + "".join(
                f" {blocks[m]['blocks']:>8} ({blocks[m]['longest']:>5})"
                if blocks[m]["blocks"]
                else f" {'-':>17}"
                for m in VISUAL
            )
        )
    lines += ["", "  documents holding each modality (text: more than <|bos|> and <|eos|>):"]
    for src in s["sources"]:
        held = ", ".join(f"{m} {n}" for m, n in src["documents_with"].items() if n)
        lines.append(f"    {src['name']:<18} {held or 'none'}")
    lines += ["", "  tokens per document:"]
    for src in s["sources"]:
        d = src["tokens_per_document"]
        if d["count"]:
            lines.append(
                f"    {src['name']:<18} min {d['min']} · median {d['median']:g} · max {d['max']}"
            )
    total = s["tokens_by_modality"]
    lines += ["", "  all: " + ", ".join(f"{m} {total[m]:,}" for m in MODALITY_NAMES)]
    lines += reject_lines(s)
    return "\n".join(lines)
