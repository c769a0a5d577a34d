"""Checkable generation on held-out scenes (docs/evaluation.md, "Checkable generation", says why
drawings are sampled, not greedy): draw a caption and read the drawing back with a pixel
classifier; caption a picture and parse the caption back; each against chance (another scene's
facts) and the visual tokenizer's ceiling. Drawing and captioning are ``earlyfuse-generate``'s
code (tools/generate_requests.py), so the figures score what the command produces.
"""

from __future__ import annotations

import json
from pathlib import Path

from data.demo_corpus.scene_scoring import score, score_caption
from tools.generate_requests import Generator, decode_codes, draw_image

ATTRIBUTES = ("colour", "shape", "position", "all")


def scenes_in_training(scenes: list[dict], train_data) -> dict:
    """How many of ``scenes`` are pictures of the training data: their media fingerprints looked
    up in the index lines of the raw shards the token folder ``train_data`` was made from (its
    manifest's ``inputs.raw``), in the sources it holds (that raw folder's ``val/`` split is held
    out). ``unchecked`` says why, when those shards are not at hand."""
    from data.shards.content import media_fingerprint
    from data.shards.index import read_index
    from data.shards.reader import shard_entries
    from data.shards.storage import Folder
    from data.token_docs import folder_sources

    wanted: dict[str, int] = {}  # fingerprint -> scenes with that picture
    for scene in scenes:
        image = scene["image"]
        fp = media_fingerprint(image if isinstance(image, bytes) else Path(image).read_bytes())
        wanted[fp] = wanted.get(fp, 0) + 1
    try:
        raw = (Folder(train_data).read_json("manifest.json").get("inputs") or {}).get("raw")
    except (OSError, ValueError):
        return {"unchecked": f"{train_data} holds no token manifest (give the whole token folder)"}
    if not raw or "://" in str(raw) or not (Path(raw) / "manifest.json").is_file():
        return {"unchecked": f"the raw shards its tokens came from ({raw}) are not on this machine"}
    names = {source.name for source in folder_sources(train_data)}
    found: dict[str, str] = {}  # fingerprint -> the first training document with it
    try:
        for _, index, shard in shard_entries(raw):
            if shard["source"] in names:
                for entry in read_index(index):
                    for fp in set(entry.get("content", [])) & wanted.keys():
                        found.setdefault(fp, f"{shard['source']}:{entry['key']}")
    except (OSError, ValueError) as e:  # a shard gone since, an index of another writer
        return {"unchecked": f"{raw}: {e}"}
    return {
        "raw": str(raw),
        "checked": len(scenes),
        "scenes": sum(wanted[fp] for fp in found),
        "examples": list(found.values())[:5],
    }


def load_scenes(paths: list[str | Path]) -> list[dict]:
    """Rows ``{"image": path or PNG bytes, "caption", "facts"}`` of held-out scenes, from scene
    tables of the demo corpus (scenes.jsonl, drawings.jsonl) or from a raw shard folder (every
    sample whose metadata carries a scene's ``facts``: docs/evaluation.md says why)."""
    out = []
    for path in paths:
        path = Path(path)
        out.extend(_shard_scenes(path) if path.is_dir() else _table_scenes(path))
    return out


def _table_scenes(path: Path) -> list[dict]:
    out = []
    for count, line in enumerate(path.read_text(encoding="utf-8").splitlines(), 1):
        if not line.strip():
            continue
        row = json.loads(line)
        if "facts" not in row:
            raise ValueError(f"{path}:{count}: no 'facts' (not a scene table of the demo corpus)")
        image = row.get("image") or row.get("scene_image")
        out.append(
            {"image": str(path.parent / image), "caption": row["caption"], "facts": row["facts"]}
        )
    return out


def _shard_scenes(folder: Path) -> list[dict]:
    from data.shards.manifest import load_manifest
    from data.shards.reader import iter_docs

    root, sources = folder, None
    if not (folder / "manifest.json").is_file() and (folder.parent / "manifest.json").is_file():
        # ingest --val-fraction's split, RAW/val/<source>: sources val/<source> of RAW's manifest
        names = [source["name"] for source in load_manifest(folder.parent)["sources"]]
        sources = [name for name in names if name.startswith(folder.name + "/")]
        root = folder.parent if sources else folder
    if not (root / "manifest.json").is_file():
        raise ValueError(f"{folder}: not a raw shard folder (no manifest.json; see ingest --help)")
    out = []
    for raw in iter_docs(root, sources):
        meta = raw.doc.get("meta") or {}
        if "shapes" not in (meta.get("facts") or {}):  # not a scene (a clip has facts too)
            continue
        segments = raw.doc.get("segments", [])
        images = [seg["member"] for seg in segments if seg.get("type") == "image"]
        texts = [seg["text"] for seg in segments if seg.get("type") == "text"]
        caption = meta.get("caption") or (texts[0] if texts else None)
        if len(images) != 1 or caption is None:
            raise ValueError(f"{raw.shard}: {raw.key} has facts but not one image and a caption")
        out.append({"image": raw.member(images[0]), "caption": caption, "facts": meta["facts"]})
    return out


def evaluate_scenes(
    judge: Generator,
    scenes: list[dict],
    *,
    limit: int = 0,
    examples: int = 6,
    draw_temperature: float = 0.7,
    draw_guidance: float = 1.0,
    train_data=None,
    progress: bool = False,
):
    """Accuracy per attribute of drawings, captions, their chance levels and the tokenizer's
    ceiling, over the single-shape scenes (the first ``limit`` when given); with ``train_data``
    (a token folder), how many of them are training pictures (``in_training``)."""
    single = [scene for scene in scenes if len(scene["facts"]["shapes"]) == 1]
    if limit:
        single = single[:limit]
    if len(single) < 2:
        return {"scenes": len(single)}
    seen = scenes_in_training(single, train_data) if train_data else None
    tallies = {
        attribute: dict.fromkeys(ATTRIBUTES, 0)
        for attribute in ("draw", "draw_chance", "caption", "caption_chance", "ceiling")
    }
    shown: list[dict] = []
    from tqdm import tqdm

    for i, scene in enumerate(tqdm(single, desc="scenes", unit=" scenes", disable=not progress)):
        other = single[(i + 1) % len(single)]["facts"]
        codes = judge.encode_image(scene["image"])
        grid = (int(codes.shape[0]), int(codes.shape[1]))
        _, drawing, _ = draw_image(
            judge,
            scene["caption"],
            size=grid,
            side=max(grid),
            temperature=draw_temperature,
            seed=i,
            guidance=draw_guidance,  # against the same picture asked for with no caption
        )
        # greedy, as earlyfuse-generate --caption asks
        text = judge.caption(codes, max_new_tokens=48)["text"]
        for name, got in (
            ("draw", score(drawing, scene["facts"])),
            ("draw_chance", score(drawing, other)),
            ("caption", score_caption(text, scene["facts"])),
            ("caption_chance", score_caption(text, other)),
            ("ceiling", score(decode_codes(judge, codes), scene["facts"])),
        ):
            for attribute, ok in got.items():
                tallies[name][attribute] += int(ok)
        if len(shown) < examples:
            shown.append({"caption": scene["caption"], "generated_caption": text})
    count = len(single)
    out: dict = {
        "scenes": count,
        "draw_temperature": draw_temperature,
        "draw_guidance": draw_guidance,
    }
    for name, t in tallies.items():
        out[name] = {attribute: v / count for attribute, v in t.items()}
    out["examples"] = shown
    if seen is not None:
        out["in_training"] = seen
    return out
