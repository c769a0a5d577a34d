"""Interleaved part: documents mixing prose, pictures and clips (`OUT/interleaved/docs.jsonl`).

Most documents use the OBELICS layout that public interleaved corpora ship in:
`{"texts": [...], "images": [...]}`, two aligned lists where each position holds exactly one
non-null entry. Every fourth document uses our native form, `{"segments": [...]}` with
text, image and video segments, which is the only way to put a video in a document.
Media paths are relative to the jsonl file and point at files of this corpus.

The prose is templated from the facts of the pictures it sits next to, so it is true of
them: a model that reads the picture can predict the text, which is what interleaved data
is for.
"""

from __future__ import annotations

import collections
import pathlib

import numpy as np

from ._common import rng_for, write_jsonl
from .photos import Photo

TARGET = 80
_COUNT_WORDS = ["no", "one", "two", "three", "four", "five", "six", "seven", "eight", "nine"]


def _plural(n: int, word: str) -> str:
    return f"{_COUNT_WORDS[n] if n < len(_COUNT_WORDS) else n} {word}{'' if n == 1 else 's'}"


def _sentence(text: str) -> str:
    return text[0].upper() + text[1:] + "."


def shape_gallery(rng: np.random.Generator, scenes: list[dict]) -> dict:
    """Two or three scenes, each with its description, then a sentence true of all of them."""
    k = min(len(scenes), int(rng.integers(2, 4)))
    picked = [scenes[i] for i in sorted(rng.choice(len(scenes), size=k, replace=False).tolist())]
    texts: list[str | None] = [
        f"Here are {_COUNT_WORDS[k]} small pictures of simple shapes on grey backgrounds."
    ]
    images: list[str | None] = [None]
    caption_first = bool(rng.integers(2))  # real pages put captions above or below pictures
    for n, scene in enumerate(picked, 1):
        pair = [(f"Picture {n}: {scene['caption']}.", None), (None, f"../scenes/{scene['image']}")]
        for t, i in pair if caption_first else pair[::-1]:
            texts.append(t)
            images.append(i)
    kinds = collections.Counter(s["shape"] for scene in picked for s in scene["facts"]["shapes"])
    total = sum(kinds.values())
    parts = [_plural(kinds[s], s) for s in ("circle", "square", "triangle") if kinds[s]]
    listing = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    texts.append(f"Together the pictures show {_plural(total, 'shape')}: {listing}.")
    images.append(None)
    return {"texts": texts, "images": images}


def photo_note(rng: np.random.Generator, photos: list[Photo]) -> dict:
    """One or two photographs with their captions and where they come from."""
    k = min(len(photos), int(rng.integers(1, 3)))
    picked = [photos[i] for i in sorted(rng.choice(len(photos), size=k, replace=False).tolist())]
    texts: list[str | None] = [
        "Sample photographs that ship with Python imaging libraries."
        if k > 1
        else f"A photograph of {picked[0].subject}."
    ]
    images: list[str | None] = [None]
    for n, photo in enumerate(picked):
        if n:
            texts.append(f"The next picture shows {photo.subject}.")
            images.append(None)
        texts += [None, photo.caption, "Source: " + photo.source]
        images += [f"../photos/{photo.file}", None, None]
    return {"texts": texts, "images": images}


def clip_story(
    rng: np.random.Generator, clips: list[dict], photos_by_path: dict[str, Photo]
) -> dict:
    """Native form: for a pan/zoom clip, its photo then the clip; for a motion clip, the clip alone."""
    clip = clips[int(rng.integers(len(clips)))]
    facts = clip["facts"]
    video = {"type": "video", "path": f"../clips/{clip['file']}"}
    seconds = f"{facts['duration']:g}"
    if facts["kind"] == "motion":
        return {
            "segments": [
                {
                    "type": "text",
                    "text": f"A short animation, {seconds} seconds at {facts['fps']} frames per second.",
                },
                video,
                {"type": "text", "text": _sentence(clip["caption"])},
            ]
        }
    photo = photos_by_path[facts["photo"]]
    return {
        "segments": [
            {"type": "text", "text": f"A photograph of {photo.subject}."},
            {"type": "image", "path": facts["photo"]},
            {"type": "text", "text": photo.caption},
            {"type": "text", "text": f"The clip below was made from it: {clip['caption']}."},
            video,
        ]
    }


def build_interleaved(
    out: pathlib.Path,
    *,
    seed: int,
    count: int,
    scenes: list[dict],
    photos: list[Photo],
    clips: list[dict],
) -> dict:
    photos_by_path = {f"../photos/{p.file}": p for p in photos}
    docs = []
    for i in range(count):
        rng = rng_for(seed, "interleaved", i)
        if i % 4 == 3 and clips:
            docs.append(clip_story(rng, clips, photos_by_path))
        elif i % 4 in (1,) and photos:
            docs.append(photo_note(rng, photos))
        else:
            docs.append(shape_gallery(rng, scenes))
    return {"documents": len(docs), "bytes": write_jsonl(out / "interleaved" / "docs.jsonl", docs)}
