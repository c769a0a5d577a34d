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


def scenes_in_training(scenes: list[dict], train_data) -> dict | None:
    """The scenes whose picture is in the training data's raw shards (the folder its token
    manifest was tokenized from, ``inputs.raw``), by the media fingerprint ingest writes: such
    figures measure memorisation, as --data's overlap check says of documents. None when that
    folder is not at hand (moved, or another machine's)."""
    from data.shards.content import folder_fingerprints, media_fingerprint
    from data.shards.storage import Folder

    try:
        raw = Folder(train_data).read_json("manifest.json").get("inputs", {}).get("raw")
    except (OSError, ValueError):
        return None
    if not raw or not (Path(raw) / "manifest.json").is_file():
        return None
    seen = folder_fingerprints(raw)
    found = []
    for scene in scenes:
        image = scene["image"]
        data = image if isinstance(image, bytes) else Path(image).read_bytes()
        if (where := seen.get(media_fingerprint(data))) is not None:
            found.append(where)
    return {"raw": str(raw), "checked": len(scenes), "scenes": len(found), "examples": found[:5]}


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
    from data.shards.reader import iter_docs

    if not (folder / "manifest.json").is_file():
        raise ValueError(f"{folder}: not a raw shard folder (no manifest.json; see ingest --help)")
    out = []
    for raw in iter_docs(folder):
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
    seen = scenes_in_training(single, train_data) if train_data else None
    if len(single) < 2:
        return {"scenes": len(single)}
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
