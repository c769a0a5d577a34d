"""``earlyfuse-prep stats DIR``: what a shard folder holds, from its manifest and indexes alone
(no tar is opened, so it is fast on any size). ``DIR`` is a local folder or an fsspec URL
(``s3://bucket/raw``); a raw folder (ingest) is described here, a token folder (tokenize) by
data/shards/token_stats.py."""

from __future__ import annotations

import json
import statistics
from collections import Counter, defaultdict
from pathlib import Path

from data.image_prep import SWAPS_SIDES
from data.names import REJECTS_FILE
from data.schema import on_terminal
from data.shards.content import repeat_of
from data.shards.index import index_of
from data.shards.manifest import MANIFEST_FORMAT, TOKEN_FORMAT, load_manifest
from data.shards.storage import Folder


def _dist(values: list[float]) -> dict:
    if not values:
        return {"count": 0}
    return {
        "count": len(values),
        "min": min(values),
        "median": statistics.median(values),
        "max": max(values),
    }


def collect_stats(out: str | Path, *, examples: int = 3) -> dict:
    from data.shards.token_stats import collect_token_stats

    folder = Folder(out)
    manifest = load_manifest(out, formats=(MANIFEST_FORMAT, TOKEN_FORMAT))
    if manifest["format"] == TOKEN_FORMAT:
        return collect_token_stats(folder, manifest, examples=examples)
    img_w, img_h, img_px, vid_dur, vid_frames, vid_fps = [], [], [], [], [], []
    docs_by_types: Counter = Counter()
    uncaptioned: dict[str, dict[str, int]] = {}
    first_of: dict[str, str] = {}  # whole-document fingerprint -> its first source:key
    duplicates: list[str] = []
    animated: list[str] = []  # images of several frames (source:key), the first tokenized
    for shard in manifest["shards"]:
        for entry in index_of(folder, shard["index"]):
            docs_by_types["+".join(sorted(set(entry["types"])))] += 1
            where = f"{shard['source']}:{entry['key']}"
            kept = repeat_of(first_of, entry, where)
            if kept:
                duplicates.append(f"{where} = {kept}")
            _count_uncaptioned(uncaptioned, shard["source"], entry["types"])
            for media in entry.get("media", []):
                if "frames" in media:
                    vid_dur.append(media["duration"])
                    vid_frames.append(media["frames"])
                    vid_fps.append(media["fps"])
                else:
                    if media.get("animation_frames", 1) > 1:
                        animated.append(f"{where} ({media['animation_frames']} frames)")
                    turned = media.get("orientation", 1) in SWAPS_SIDES  # EXIF: as shown
                    img_w.append(media["height" if turned else "width"])
                    img_h.append(media["width" if turned else "height"])
                    img_px.append(media["width"] * media["height"])
    totals = manifest["totals"]
    return {
        "folder": str(folder),
        "format": manifest["format"],
        "samples": totals["samples"],
        "bytes": totals["bytes"],
        "shards": totals["shards"],
        "segments": totals["segments"],
        "documents_by_content": dict(docs_by_types.most_common()),
        "sources": [
            {key: source[key] for key in ("name", "kind", "samples", "bytes", "shards", "rejects")}
            for source in manifest["sources"]
        ],
        "images": {"width": _dist(img_w), "height": _dist(img_h), "pixels": _dist(img_px)},
        "videos": {
            "duration_s": _dist(vid_dur),
            "frames": _dist(vid_frames),
            "fps": _dist(vid_fps),
        },
        # Documents of images or videos with no text at all (e.g. an image without a caption
        # file): kept, but counted, since a captioned source is usually meant to be captioned.
        "media_without_text": uncaptioned,
        # Documents whose whole content (every segment's text or media bytes, in order) repeats an
        # earlier document's: `ingest --dedupe` leaves them out.
        "duplicates": {"documents": len(duplicates), "examples": duplicates[:examples]},
        # Animated GIF/WebP and multi-page TIFF: tokenize takes their first frame.
        "animated_images": {"images": len(animated), "examples": animated[:examples]},
        "rejects": totals["rejects"],
        "rejects_by_reason": dict(
            sorted(totals["rejects_by_reason"].items(), key=lambda item: -item[1])
        ),
        "reject_examples": reject_examples(folder, examples),
        "repaired_utf8": totals["repaired_utf8"],
    }


def reject_examples(folder: Folder, examples: int) -> dict[str, list[str]]:
    """The first ``examples`` rejects of each reason in the folder's rejects.jsonl."""
    found: dict[str, list[str]] = defaultdict(list)
    if folder.exists(REJECTS_FILE):
        for line in folder.read_bytes(REJECTS_FILE).decode("utf-8").splitlines():
            reject = json.loads(line)
            if len(found[reject["reason"]]) < examples:
                where = reject.get("path", reject.get("key", "?"))
                found[reject["reason"]].append(
                    f"{reject.get('source', '?')}:{where}: {reject.get('detail', '')}"
                )
    return dict(found)


def _count_uncaptioned(found: dict[str, dict[str, int]], source: str, types: list[str]) -> None:
    """Count a document of images or videos and no text (no caption) under its source."""
    if set(types) & {"image", "video"} and not set(types) & {"text", "code"}:
        per = found.setdefault(source, {"image": 0, "video": 0})
        for kind in set(types) & {"image", "video"}:
            per[kind] += 1


def media_without_text(out: str | Path) -> dict[str, dict[str, int]]:
    """source -> {"image": n, "video": n}: documents holding media and no text (no caption)."""
    folder = Folder(out)
    found: dict[str, dict[str, int]] = {}
    for shard in load_manifest(out)["shards"]:
        for entry in index_of(folder, shard["index"]):
            _count_uncaptioned(found, shard["source"], entry["types"])
    return found


def describe_uncaptioned(found: dict[str, dict[str, int]]) -> str | None:
    """One line for a summary, or None when every image and video has text beside it."""
    if not found:
        return None
    parts = [
        f"{src}: "
        + ", ".join(
            f"{count} {kind}{'s' if count > 1 else ''}" for kind, count in per.items() if count
        )
        for src, per in sorted(found.items())
    ]
    return "without a caption or any text: " + "; ".join(parts) + " (kept as media-only documents)"


def human_bytes(n: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1000
    return f"{n} B"


def format_stats(s: dict) -> str:
    if s.get("format") == TOKEN_FORMAT:
        from data.shards.token_stats import format_token_stats

        return format_token_stats(s)

    def describe_dist(x: dict, fmt: str = "{:g}") -> str:
        if not x["count"]:
            return "none"
        return (
            f"{x['count']} · min {fmt.format(x['min'])} · median {fmt.format(x['median'])}"
            f" · max {fmt.format(x['max'])}"
        )

    lines = [
        f"{s['folder']}: {s['samples']} samples in {s['shards']} shards, {human_bytes(s['bytes'])}"
    ]
    lines.append("")
    lines.append(
        f"  {'source':<20} {'kind':<12} {'samples':>8} {'shards':>7} {'bytes':>10} {'rejects':>8}"
    )
    for src in s["sources"]:
        lines.append(
            f"  {src['name']:<20} {src['kind']:<12} {src['samples']:>8} {src['shards']:>7} "
            f"{human_bytes(src['bytes']):>10} {src['rejects']:>8}"
        )
    lines.append("")
    lines.append(
        "  segments:  " + ", ".join(f"{name} {count}" for name, count in s["segments"].items())
    )
    lines.append(
        "  documents: "
        + ", ".join(f"{name} {count}" for name, count in s["documents_by_content"].items())
    )
    images, videos = s["images"], s["videos"]
    lines.append(f"  image width:    {describe_dist(images['width'])}")
    lines.append(f"  image height:   {describe_dist(images['height'])}")
    lines.append(f"  video seconds:  {describe_dist(videos['duration_s'], '{:.2f}')}")
    lines.append(f"  video frames:   {describe_dist(videos['frames'])}")
    lines.append(f"  video fps:      {describe_dist(videos['fps'], '{:.2f}')}")
    said = describe_uncaptioned(s["media_without_text"])
    lines.append(f"  {said}" if said else "  without a caption or any text: none")
    dup = s.get("duplicates", {"documents": 0})
    if dup["documents"]:
        lines.append(
            f"  exact duplicates: {dup['documents']} document(s) repeat an earlier one "
            f"(e.g. {on_terminal('; '.join(dup['examples']))}); ingest --dedupe leaves them out"
        )
    else:
        lines.append("  exact duplicates: none")
    moving = s.get("animated_images", {"images": 0})
    if moving["images"]:
        lines.append(
            f"  animated images: {moving['images']}, tokenized as their first frame "
            f"(e.g. {on_terminal('; '.join(moving['examples']))}); a clip belongs in a videos "
            "source"
        )
    lines.append("")
    lines += reject_lines(s)
    if s["repaired_utf8"]:
        lines.append(f"  repaired UTF-8 bytes: {s['repaired_utf8']}")
    return "\n".join(lines)


def reject_lines(s: dict) -> list[str]:
    """The rejects of a folder's stats (raw or token), with examples, for people."""
    if not s["rejects"]:
        return ["  rejects: none"]
    lines = [f"  rejects: {s['rejects']} (all in rejects.jsonl)"]
    for reason, num_rejects in s["rejects_by_reason"].items():
        lines.append(f"    {reason:<20} {num_rejects}")
        examples = s["reject_examples"].get(reason, [])
        lines += [f"        e.g. {on_terminal(example)}" for example in examples]
    return lines
