"""Score a *decoded* scene (a drawing or a reconstruction) against a scene's facts.

``check_scene`` (scenes.py) verifies a lossless PNG exactly; a picture that went through the
visual tokenizer is blurred at shape edges and shifted in colour, and a drawing may be
anything. This classifier is deliberately simple and documented (docs/evaluation.md):

1. **Pixel labels.** Every pixel takes the nearest (Euclidean RGB) of the six palette colours
   and the three background greys (96, 128, 160); a pixel nearest a grey is background. A pixel
   further than ``MAX_DISTANCE`` from every reference is background too (a muddy blend of two
   colours is no evidence of either).
2. **Colour.** The palette colour with the most pixels, if it has at least ``MIN_PIXELS``
   (scaled to the image area); otherwise nothing was drawn.
3. **Position.** The grid cell (``scenes.cell_box``: the four quadrants) holding the centroid of that colour's
   pixels.
4. **Shape.** That colour's largest 4-connected blob, compared with a square, a circle and an
   upright triangle each filling the blob's bounding box (drawn at 8x and averaged down, so edge
   pixels are partly covered): the template that differs from the blob in the fewest pixels.

Scored on single-shape scenes (the caption names one colour, shape and cell), so each figure
has a clear chance level (measured, not assumed: the same drawings scored against another
scene's facts). ``score_caption`` scores a generated caption against the same facts.
``shape_iou`` compares a reconstructed shape with the true one pixel by pixel.
"""

from __future__ import annotations

import numpy as np
from PIL import Image, ImageDraw

from .scenes import BACKGROUNDS, PALETTE, POSITIONS, caption_facts, cell_box

NAMES = list(PALETTE)
REFERENCES = np.array(
    [PALETTE[n] for n in NAMES] + [(g, g, g) for g in BACKGROUNDS.values()], np.float32
)
MAX_DISTANCE = 90.0  # RGB units; beyond it a pixel matches no reference
MIN_PIXELS_PER_1024 = 6  # a drawn shape covers at least this many pixels per 32x32 of image


def pixel_labels(image: np.ndarray) -> np.ndarray:
    """[H, W] int: palette index (``NAMES``) of each pixel, or -1 for background."""
    px = np.asarray(image, np.float32)[..., :3]
    d = np.linalg.norm(px[..., None, :] - REFERENCES[None, None], axis=-1)  # [H, W, refs]
    best = d.argmin(-1)
    labels = np.where(best < len(NAMES), best, -1)
    return np.where(d.min(-1) <= MAX_DISTANCE, labels, -1)


def _largest_blob(mask: np.ndarray) -> np.ndarray:
    """The largest 4-connected component of a boolean mask (a small flood fill, no scipy)."""
    seen = np.zeros_like(mask, bool)
    best: list[tuple[int, int]] = []
    h, w = mask.shape
    for top, left in zip(*np.nonzero(mask)):
        if seen[top, left]:
            continue
        stack, blob = [(int(top), int(left))], []
        seen[top, left] = True
        while stack:
            y, x = stack.pop()
            blob.append((y, x))
            for row_step, col_step in ((1, 0), (-1, 0), (0, 1), (0, -1)):
                n_rows, n_cols = y + row_step, x + col_step
                if (
                    0 <= n_rows < h
                    and 0 <= n_cols < w
                    and mask[n_rows, n_cols]
                    and not seen[n_rows, n_cols]
                ):
                    seen[n_rows, n_cols] = True
                    stack.append((n_rows, n_cols))
        if len(blob) > len(best):
            best = blob
    out = np.zeros_like(mask, bool)
    if best:
        rows, cols = zip(*best)
        out[list(rows), list(cols)] = True
    return out


def _template(shape: str, w: int, h: int, scale: int = 8) -> np.ndarray:
    """A shape filling a w x h box, drawn 8x larger and averaged down (its area coverage)."""
    big = Image.new("L", (w * scale, h * scale), 0)
    draw = ImageDraw.Draw(big)
    W, H = w * scale, h * scale
    if shape == "square":
        draw.rectangle([0, 0, W - 1, H - 1], fill=255)
    elif shape == "circle":
        draw.ellipse([0, 0, W - 1, H - 1], fill=255)
    else:
        draw.polygon([(0, H - 1), (W - 1, H - 1), ((W - 1) / 2, 0)], fill=255)
    return np.asarray(big.resize((w, h), Image.Resampling.BOX), np.float32) / 255.0


def shape_of_blob(mask: np.ndarray) -> str | None:
    """The shape whose template, filling the blob's bounding box, agrees with the most pixels
    of the box (coverage-weighted, so half-covered edge pixels count half)."""
    rows, cols = np.nonzero(mask)
    if len(cols) < 4:
        return None
    top, bottom, left, right = rows.min(), rows.max() + 1, cols.min(), cols.max() + 1
    box = mask[top:bottom, left:right].astype(np.float32)
    errors = {
        name: float(np.abs(_template(name, right - left, bottom - top) - box).sum())
        for name in ("square", "circle", "triangle")
    }
    return min(errors, key=lambda name: errors[name])


def position_of(rows: np.ndarray, cols: np.ndarray, width: int, height: int) -> str:
    centre_row, centre_col = float(rows.mean()), float(cols.mean())
    for name in POSITIONS:
        left, top, right, bottom = cell_box(width, height, name)
        if left <= centre_col < right and top <= centre_row < bottom:
            return name
    return "centre"  # unreachable for a centroid inside the image


def read_scene(image: np.ndarray) -> dict:
    """What the classifier sees in a picture: ``{"colour", "shape", "position"}`` of its
    dominant palette colour (None each when nothing is drawn), plus its pixel count."""
    labels = pixel_labels(image)
    h, w = labels.shape
    counts = np.bincount(labels[labels >= 0].ravel(), minlength=len(NAMES))
    need = max(3, round(MIN_PIXELS_PER_1024 * h * w / 1024))
    if counts.max(initial=0) < need:
        return {"colour": None, "shape": None, "position": None, "pixels": int(counts.max())}
    k = int(counts.argmax())
    mask = labels == k
    rows, cols = np.nonzero(mask)
    return {
        "colour": NAMES[k],
        "shape": shape_of_blob(_largest_blob(mask)),
        "position": position_of(rows, cols, w, h),
        "pixels": int(counts[k]),
    }


def score(image: np.ndarray, facts: dict) -> dict[str, bool]:
    """Per attribute, whether the picture shows the single stated shape's colour, shape, cell
    (and all three)."""
    return _compare(read_scene(image), facts)


def score_caption(text: str, facts: dict) -> dict[str, bool]:
    """The same for a generated caption, parsed back into facts (``caption_facts``): one that
    does not parse is wrong on every attribute."""
    try:
        got = caption_facts(text.strip().rstrip("."))["shapes"][0]
    except ValueError:
        got = {}
    return _compare(got, facts)


def _compare(got: dict, facts: dict) -> dict[str, bool]:
    if len(facts["shapes"]) != 1:
        raise ValueError("scores take single-shape scenes (their caption names one shape)")
    want = facts["shapes"][0]
    out = {k: got.get(k) == want[k] for k in ("colour", "shape", "position")}
    out["all"] = all(out.values())
    return out


def true_mask(facts: dict, shape: dict, width: int, height: int) -> np.ndarray:
    """The pixels of one shape of a scene at another resolution (what it covers, as drawn by
    scenes.render, scaled)."""
    sx, sy = width / facts["width"], height / facts["height"]
    left, top, right, bottom = shape["bbox"]
    big = Image.new("L", (facts["width"], facts["height"]), 0)
    draw = ImageDraw.Draw(big)
    box = [left, top, right - 1, bottom - 1]
    if shape["shape"] == "square":
        draw.rectangle(box, fill=255)
    elif shape["shape"] == "circle":
        draw.ellipse(box, fill=255)
    else:
        draw.polygon(
            [(left, bottom - 1), (right - 1, bottom - 1), ((left + right - 1) / 2, top)], fill=255
        )
    if (sx, sy) != (1.0, 1.0):
        big = big.resize((width, height), Image.Resampling.BILINEAR)
    return np.asarray(big) >= 128


def shape_iou(image: np.ndarray, facts: dict) -> list[float]:
    """Per shape of the scene, the IoU of the pixels labelled with its colour inside its cell
    (the reconstruction's mask) with the true shape's pixels (at the picture's resolution)."""
    labels = pixel_labels(image)
    h, w = labels.shape
    out = []
    for s in facts["shapes"]:
        truth = true_mask(facts, s, w, h)
        left, top, right, bottom = cell_box(w, h, s["position"])
        got = np.zeros_like(truth)
        got[top:bottom, left:right] = labels[top:bottom, left:right] == NAMES.index(s["colour"])
        union = int((got | truth).sum())
        out.append(int((got & truth).sum()) / union if union else 0.0)
    return out
