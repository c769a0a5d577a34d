"""Scenes part: generated pictures whose captions state facts that can be checked from pixels.

A scene is a 32x32 picture of 1-2 flat-coloured shapes (circle, square, triangle) in six
colours, each centred in its own quadrant (the cell names the position: "top left", "top
right", "bottom left", "bottom right"), on a plain or noisy grey background. Drawings (caption
then picture) show one shape each. The scenes are kept this simple on purpose: at the demo's
scale (a 1.9M-parameter LM trained for minutes) a model learns to *draw* a caption only when
the caption decides where the shape lies and a shape covers a good share of the picture's 64
codes; with nine colours, nine cells, shapes anywhere in their cell and 64x64 pictures it drew
at chance (docs/benchmarks.md, "The demo, held out", has the ablation). Shapes are drawn
without anti-aliasing, in colours chosen so that every pair differs by more than 2 x TOL in
some channel and every colour differs from any background pixel by more than TOL, so a colour
is recovered exactly from the pixels of a lossless PNG.

`check_scene(image, facts)` verifies a caption from the pixels alone; `caption_facts`
turns a caption string back into facts, so an edited caption ("a green circle ..." instead
of "a red circle ...") can be checked too. Used by tests and by any later probe that wants
captions whose truth is known (e.g. the cross-modal dependence monitor).
"""

from __future__ import annotations

import pathlib
import re

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from ._common import rng_for, write_jsonl, write_png

TARGET = 1500  # and as many drawings: the demo LM sees each a few times (docs/benchmarks.md)
TOL = 40  # max per-channel distance of a pixel to its colour

PALETTE: dict[str, tuple[int, int, int]] = {
    "red": (220, 20, 20),
    "green": (20, 160, 20),
    "blue": (20, 40, 220),
    "yellow": (235, 225, 20),
    "white": (245, 245, 245),
    "black": (10, 10, 10),
}
BACKGROUNDS: dict[str, int] = {"dark grey": 96, "grey": 128, "light grey": 160}
NOISE = 12  # +- amplitude of the "noisy" background
SHAPES = ("circle", "square", "triangle")
SIZES = ((32, 32),)  # (width, height)

GRID = 2  # cells per side
# (row, col) of the grid -> position name, and how a caption says it.
POSITIONS: dict[str, tuple[int, int]] = {
    "top left": (0, 0),
    "top right": (0, 1),
    "bottom left": (1, 0),
    "bottom right": (1, 1),
}
PHRASES: dict[str, str] = {name: f"in the {name}" for name in POSITIONS}


def cell_box(width: int, height: int, position: str) -> tuple[int, int, int, int]:
    """Pixel box [x0, y0, x1, y1) of a named grid cell (same arithmetic in drawing and checking)."""
    row, col = POSITIONS[position]
    return (
        col * width // GRID,
        row * height // GRID,
        (col + 1) * width // GRID,
        (row + 1) * height // GRID,
    )


# ---------------------------------------------------------------- generation


def sample_facts(rng: np.random.Generator, *, max_shapes: int = 2) -> dict:
    width, height = SIZES[rng.integers(len(SIZES))]
    n = int(rng.integers(1, max_shapes + 1))
    cells = rng.choice(list(POSITIONS), size=n, replace=False)
    colours = rng.choice(list(PALETTE), size=n, replace=False)
    shapes = []
    for position, colour in zip(cells, colours):
        x0, y0, x1, y1 = cell_box(width, height, str(position))
        m = min(x1 - x0, y1 - y0)
        # Centred in its cell at 70-80 % of the cell, +-1 pixel: where a shape lies follows
        # from its position phrase, so a model can learn to draw it there (a shape anywhere
        # in its cell leaves a drawing model nothing to anchor on at the demo's scale).
        s = int(rng.integers(int(0.7 * m), int(0.8 * m) + 1))
        sx = (x0 + x1 - s) // 2 + int(rng.integers(-1, 2))
        sy = (y0 + y1 - s) // 2 + int(rng.integers(-1, 2))
        shapes.append(
            {
                "shape": str(rng.choice(SHAPES)),
                "colour": str(colour),
                "position": str(position),
                "bbox": [sx, sy, sx + s, sy + s],
            }
        )
    background = {
        "kind": str(rng.choice(["plain", "noisy"])),
        "colour": str(rng.choice(list(BACKGROUNDS))),
    }
    return {"width": int(width), "height": int(height), "shapes": shapes, "background": background}


def render(facts: dict, rng: np.random.Generator) -> np.ndarray:
    w, h = facts["width"], facts["height"]
    level = BACKGROUNDS[facts["background"]["colour"]]
    pixels = np.full((h, w, 3), level, np.int16)
    if facts["background"]["kind"] == "noisy":
        pixels += rng.integers(-NOISE, NOISE + 1, size=pixels.shape, dtype=np.int16)
    image = Image.fromarray(pixels.astype(np.uint8))
    draw = ImageDraw.Draw(image)  # ImageDraw does not anti-alias: flat, exact colours
    for s in facts["shapes"]:
        x0, y0, x1, y1 = s["bbox"]
        box = [x0, y0, x1 - 1, y1 - 1]  # PIL boxes are inclusive
        fill = PALETTE[s["colour"]]
        if s["shape"] == "square":
            draw.rectangle(box, fill=fill)
        elif s["shape"] == "circle":
            draw.ellipse(box, fill=fill)
        else:  # an upright isosceles triangle filling its box
            draw.polygon([(x0, y1 - 1), (x1 - 1, y1 - 1), ((x0 + x1 - 1) / 2, y0)], fill=fill)
    return np.asarray(image)


def article(word: str) -> str:
    return "an" if word[0] in "aeiou" else "a"


def caption(facts: dict) -> str:
    parts = [
        f"{article(s['colour'])} {s['colour']} {s['shape']} {PHRASES[s['position']]}"
        for s in facts["shapes"]
    ]
    shapes = parts[0] if len(parts) == 1 else ", ".join(parts[:-1]) + " and " + parts[-1]
    bg = facts["background"]
    return f"{shapes}, on a {bg['kind']} {bg['colour']} background"


_SHAPE_RE = re.compile(
    rf"^an? (?P<colour>{'|'.join(PALETTE)}) (?P<shape>{'|'.join(SHAPES)}) "
    rf"(?P<phrase>{'|'.join(re.escape(p) for p in PHRASES.values())})$"
)
_BG_RE = re.compile(rf"^on a (?P<kind>plain|noisy) (?P<colour>{'|'.join(BACKGROUNDS)}) background$")


def caption_facts(text: str) -> dict:
    """Parse a scene caption back into facts (no bboxes). Raises ValueError if it is not one."""
    body, _, bg_text = text.rpartition(", on a ")
    bg = _BG_RE.match("on a " + bg_text)
    if not body or not bg:
        raise ValueError(f"not a scene caption: {text!r}")
    head, _, last = body.rpartition(" and ")
    pieces = (head.split(", ") if head else []) + [last]
    by_phrase = {v: k for k, v in PHRASES.items()}
    shapes = []
    for piece in pieces:
        m = _SHAPE_RE.match(piece)
        if not m:
            raise ValueError(f"not a scene caption: {text!r} (at {piece!r})")
        shapes.append(
            {"shape": m["shape"], "colour": m["colour"], "position": by_phrase[m["phrase"]]}
        )
    return {"shapes": shapes, "background": {"kind": bg["kind"], "colour": bg["colour"]}}


# ---------------------------------------------------------------- checking


def _colour_mask(pixels: np.ndarray, rgb: tuple[int, int, int]) -> np.ndarray:
    return np.all(np.abs(pixels.astype(np.int16) - np.array(rgb, np.int16)) <= TOL, axis=-1)


def shape_of(mask: np.ndarray) -> str | None:
    """Classify one filled blob by how much of its bounding box it fills:
    square ~1.0, circle ~pi/4 = 0.79, triangle ~0.5 (measured over the sizes we draw)."""
    ys, xs = np.nonzero(mask)
    if len(xs) < 12:
        return None
    fill = len(xs) / ((xs.max() - xs.min() + 1) * (ys.max() - ys.min() + 1))
    return "square" if fill > 0.93 else "circle" if fill > 0.68 else "triangle"


def check_scene(image: np.ndarray, facts: dict, *, exhaustive: bool = True) -> bool:
    """True when the pixels show every stated shape, in its stated colour, inside its stated
    grid cell (and within its stated bbox, when the facts carry one). With `exhaustive`,
    also that no other cell holds a shape and that the background is as stated.

    `image` is an (H, W, 3) uint8 array of a lossless scene (the PNG; JPEG chroma subsampling
    breaks exact colours: about 1 in 5 of the wds JPEGs fail), `facts` a scene's facts or
    the output of `caption_facts`.
    """
    pixels = np.asarray(image)
    if pixels.ndim != 3 or pixels.shape[2] < 3:  # greyscale cannot show the stated colours
        return False
    pixels = pixels[..., :3]
    h, w = pixels.shape[:2]
    shape_mask = np.zeros((h, w), bool)
    stated_cells = set()
    for s in facts["shapes"]:
        if (
            s.get("colour") not in PALETTE
            or s.get("position") not in POSITIONS
            or s.get("shape") not in SHAPES
        ):
            return False
        x0, y0, x1, y1 = cell_box(w, h, s["position"])
        mask = _colour_mask(pixels[y0:y1, x0:x1], PALETTE[s["colour"]])
        if shape_of(mask) != s["shape"]:
            return False
        if "bbox" in s:
            ys, xs = np.nonzero(mask)
            found = [x0 + xs.min(), y0 + ys.min(), x0 + xs.max() + 1, y0 + ys.max() + 1]
            if any(abs(a - b) > 1 for a, b in zip(found, s["bbox"])):
                return False
        shape_mask[y0:y1, x0:x1] |= mask
        stated_cells.add(s["position"])
    if not exhaustive:
        return True
    # No unstated shape: no cell other than the stated ones has a blob of any palette colour.
    for position in POSITIONS:
        if position in stated_cells:
            continue
        x0, y0, x1, y1 = cell_box(w, h, position)
        if any(_colour_mask(pixels[y0:y1, x0:x1], rgb).sum() >= 12 for rgb in PALETTE.values()):
            return False
    bg = facts.get("background")
    if bg:
        rest = pixels[~shape_mask].astype(np.float32)
        if abs(np.median(rest) - BACKGROUNDS.get(bg["colour"], -999)) > 8:
            return False
        if (rest.std() > 3) != (bg["kind"] == "noisy"):
            return False
    return True


# ---------------------------------------------------------------- building


def build_scenes(
    out: pathlib.Path, *, seed: int, count: int, progress: bool, drawings: int = 0
) -> tuple[dict, list[dict]]:
    """Write `count` scenes (`scenes.jsonl`: picture then caption, the captioning layout) and
    `drawings` more (`drawings.jsonl`: caption then picture, the layout a model learns to draw
    from, OBELICS-style with the facts beside). Returns the summary and the scenes.jsonl rows
    (other parts reuse them)."""
    rows, total = [], 0
    for i in tqdm(range(count), desc="scenes", unit="img", disable=not progress, leave=False):
        rng = rng_for(seed, "scenes", i)
        facts = sample_facts(rng)
        rel = f"img/scene_{i:04d}.png"
        total += write_png(out / "scenes" / rel, render(facts, rng))
        rows.append({"image": rel, "caption": caption(facts), "facts": facts})
    total += write_jsonl(out / "scenes" / "scenes.jsonl", rows)
    drawn = []
    for i in range(drawings):
        rng = rng_for(seed, "drawings", i)
        # One shape per drawing: the caption then says where the one shape goes, and every
        # drawing teaches that; two-shape scenes are captioned (scenes.jsonl), not drawn.
        facts = sample_facts(rng, max_shapes=1)
        rel = f"img/drawing_{i:04d}.png"
        total += write_png(out / "scenes" / rel, render(facts, rng))
        text = caption(facts)
        drawn.append(
            {
                "texts": [text, None],
                "images": [None, rel],
                "caption": text,
                "image": rel,
                "facts": facts,
            }
        )
    if drawings:
        total += write_jsonl(out / "scenes" / "drawings.jsonl", drawn)
    return {"images": count + drawings, "drawings": drawings, "bytes": total}, rows
