"""Clips part: short captioned H.264 mp4 clips (`OUT/clips/clip_NNNN.mp4` + `captions.jsonl`).

Three kinds, each caption stating the motion:
- motion: one flat-coloured shape crossing a plain background ("a green square moves from
  left to right");
- pan: a window sliding across a real photo ("the camera pans right across a photograph of
  a cat");
- zoom: a window shrinking (in) or growing (out) around a fixed point of a real photo.

Encoded by libx264 through PyAV (yuv420p, so width and height are even) with one thread,
macroblock-tree rate control off (it was the one source of run-to-run byte differences) and
the muxer in bitexact mode (no creation time), hence the same bytes for the same seed. fps
varies (5, 8, 12, 24) so the video path of the loader (sampling by timestamps at a target
fps) sees real variety.

`check_clip(frames, facts)` verifies a caption from decoded frames: the shape's centroid for
motion clips (colour and direction; the shape is stated but not checked), the summed
frame-to-frame shift (phase correlation) for pans, and which of
"last = centre of first, enlarged" / "first = centre of last, enlarged" fits for zooms.
"""

from __future__ import annotations

import io
import pathlib
from fractions import Fraction

import numpy as np
from PIL import Image, ImageDraw
from tqdm import tqdm

from ._common import rng_for, write_jsonl
from .photos import Photo, available
from .scenes import BACKGROUNDS, PALETTE, SHAPES, article

TARGET = 60
FPS = (5, 8, 12, 24)
SIZES = ((64, 64), (96, 64))  # (width, height)
KINDS = ("motion", "pan", "motion", "zoom")  # half the clips are checkable moving shapes
MOTION_PHRASES = {
    "right": "from left to right",
    "left": "from right to left",
    "down": "from top to bottom",
    "up": "from bottom to top",
}
# Self-similar textures: a pan or zoom across them looks the same either way, so such a
# caption could not be checked (and says little); clips use the other photos.
NOT_FOR_CLIPS = {"brick.png", "grass.png", "gravel.png"}
CLIP_TOL = 60  # per-channel colour tolerance after yuv420p chroma subsampling and compression


# ---------------------------------------------------------------- encoding


def encode_mp4(frames: list[np.ndarray], fps: int) -> bytes:
    import av  # optional dependency (the [demo] extra); imported only when clips are made

    h, w = frames[0].shape[:2]
    buf = io.BytesIO()
    # fflags=+bitexact: no encoder-version-dependent or time-dependent metadata in the file.
    with av.open(buf, mode="w", format="mp4", options={"fflags": "+bitexact"}) as container:
        stream = container.add_stream(
            "libx264",
            rate=fps,
            options={
                "crf": "20",
                "preset": "medium",
                "threads": "1",
                # x264's macroblock-tree rate control gives
                # different bytes from run to run within one
                # process (seen with libx264 core 165); without
                # it the output is stable, at a small cost in size.
                "x264-params": "mbtree=0",
            },
        )
        stream.width, stream.height, stream.pix_fmt = w, h, "yuv420p"
        stream.codec_context.thread_count = 1  # multi-threaded x264 is not byte-deterministic
        stream.codec_context.time_base = Fraction(1, fps)
        for i, pixels in enumerate(frames):
            frame = av.VideoFrame.from_ndarray(pixels, format="rgb24")
            # Explicit timestamps (frame i at i/fps), never left for the encoder to guess.
            frame.pts, frame.time_base = i, Fraction(1, fps)
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():  # flush delayed frames
            container.mux(packet)
    return buf.getvalue()


# ---------------------------------------------------------------- generation


def _frame_count(rng: np.random.Generator, fps: int, minimum: int) -> int:
    seconds = rng.uniform(0.5, 2.0)
    return max(minimum, int(round(seconds * fps)))


def motion_clip(rng: np.random.Generator, fps: int) -> tuple[list[np.ndarray], dict, str]:
    w, h = SIZES[rng.integers(len(SIZES))]
    n = _frame_count(rng, fps, 4)
    shape, colour = str(rng.choice(SHAPES)), str(rng.choice(list(PALETTE)))
    direction = str(rng.choice(list(MOTION_PHRASES)))
    bg = str(rng.choice(list(BACKGROUNDS)))
    s = int(rng.integers(14, 21))
    horizontal = direction in ("left", "right")
    along, across = (w, h) if horizontal else (h, w)
    a0, a1 = s / 2 + 2, along - s / 2 - 2  # from one edge to the other
    if direction in ("left", "up"):
        a0, a1 = a1, a0
    c = float(rng.uniform(s / 2 + 2, across - s / 2 - 2))
    frames = []
    for t in range(n):
        a = a0 + (a1 - a0) * t / (n - 1)
        cx, cy = (a, c) if horizontal else (c, a)
        x0, y0 = int(round(cx - s / 2)), int(round(cy - s / 2))
        image = Image.new("RGB", (w, h), (BACKGROUNDS[bg],) * 3)
        draw = ImageDraw.Draw(image)
        box, fill = [x0, y0, x0 + s - 1, y0 + s - 1], PALETTE[colour]
        if shape == "square":
            draw.rectangle(box, fill=fill)
        elif shape == "circle":
            draw.ellipse(box, fill=fill)
        else:
            draw.polygon(
                [(x0, y0 + s - 1), (x0 + s - 1, y0 + s - 1), (x0 + (s - 1) / 2, y0)], fill=fill
            )
        frames.append(np.asarray(image))
    start = [a0, c] if horizontal else [c, a0]
    end = [a1, c] if horizontal else [c, a1]
    facts = {
        "kind": "motion",
        "shape": shape,
        "colour": colour,
        "direction": direction,
        "background": bg,
        "start": [round(v, 2) for v in start],
        "end": [round(v, 2) for v in end],
    }
    return frames, facts, f"{article(colour)} {colour} {shape} moves {MOTION_PHRASES[direction]}"


def _load(photo_path: pathlib.Path) -> Image.Image:
    with Image.open(photo_path) as image:
        if image.mode in ("RGBA", "LA", "P"):  # transparent silhouettes: put them on white paper
            rgba = image.convert("RGBA")
            return Image.alpha_composite(
                Image.new("RGBA", rgba.size, (255, 255, 255, 255)), rgba
            ).convert("RGB")
        return image.convert("RGB")


def _render_boxes(
    image: Image.Image, boxes: list[tuple[float, float, float, float]], w: int, h: int
):
    # resize(box=...) crops with sub-pixel precision and filters properly when shrinking.
    return [np.asarray(image.resize((w, h), Image.Resampling.BILINEAR, box=b)) for b in boxes]


def pan_clip(rng, fps, photo: Photo, image: Image.Image) -> tuple[list[np.ndarray], dict, str]:
    w, h = SIZES[rng.integers(len(SIZES))]
    n = _frame_count(rng, fps, 6)
    pw, ph = image.size
    direction = str(rng.choice(["left", "right", "up", "down"]))
    # The window keeps the clip's aspect and covers ~55% of the photo's short side, leaving
    # room to travel.
    ch = 0.55 * min(pw, ph * w / h) * h / w
    cw = ch * w / h
    horizontal = direction in ("left", "right")
    # At most a fifth of the frame per step: a pan, not a cut (and phase correlation in
    # check_clip stays unambiguous); long photos are crossed only in part.
    if horizontal:
        travel = min(pw - cw, 0.2 * (n - 1) * cw)
        x_start = float(rng.uniform(0, pw - cw - travel))
        y = float(rng.uniform(0, ph - ch))
        xs = x_start + np.linspace(0, travel, n)
        boxes = [
            (float(x), y, float(x) + cw, y + ch) for x in (xs if direction == "right" else xs[::-1])
        ]
    else:
        travel = min(ph - ch, 0.2 * (n - 1) * ch)
        y_start = float(rng.uniform(0, ph - ch - travel))
        x = float(rng.uniform(0, pw - cw))
        ys = y_start + np.linspace(0, travel, n)
        boxes = [
            (x, float(yy), x + cw, float(yy) + ch)
            for yy in (ys if direction == "down" else ys[::-1])
        ]
    facts = {
        "kind": "pan",
        "direction": direction,
        "photo": f"../photos/{photo.file}",
        "subject": photo.subject,
        "start_box": [round(v, 2) for v in boxes[0]],
        "end_box": [round(v, 2) for v in boxes[-1]],
    }
    return (
        _render_boxes(image, boxes, w, h),
        facts,
        f"the camera pans {direction} across a photograph of {photo.subject}",
    )


def zoom_clip(rng, fps, photo: Photo, image: Image.Image) -> tuple[list[np.ndarray], dict, str]:
    w, h = SIZES[rng.integers(len(SIZES))]
    n = _frame_count(rng, fps, 6)
    pw, ph = image.size
    direction = str(rng.choice(["in", "out"]))
    zoom = float(rng.uniform(2.0, 3.0))
    # The widest window is 90% of the largest one of the clip's aspect that fits; every
    # window shares its centre, so the fixed point of the zoom is the centre of every frame
    # (no window is ever clamped at a photo edge, which would shift it).
    cw = 0.9 * min(pw, ph * w / h)
    ch = cw * h / w
    cx = float(rng.uniform(cw / 2, pw - cw / 2))
    cy = float(rng.uniform(ch / 2, ph - ch / 2))
    # Geometric steps: a constant zoom rate, as a real camera zoom looks.
    scales = (
        np.geomspace(1.0, 1.0 / zoom, n) if direction == "in" else np.geomspace(1.0 / zoom, 1.0, n)
    )
    boxes = [(cx - cw * k / 2, cy - ch * k / 2, cx + cw * k / 2, cy + ch * k / 2) for k in scales]
    facts = {
        "kind": "zoom",
        "direction": direction,
        "zoom": round(zoom, 3),
        "photo": f"../photos/{photo.file}",
        "subject": photo.subject,
        "start_box": [round(v, 2) for v in boxes[0]],
        "end_box": [round(v, 2) for v in boxes[-1]],
    }
    verb = "zooms in on" if direction == "in" else "zooms out from"
    return (
        _render_boxes(image, boxes, w, h),
        facts,
        f"the camera {verb} a photograph of {photo.subject}",
    )


# ---------------------------------------------------------------- checking


def _grey(frame: np.ndarray) -> np.ndarray:
    return frame[..., :3].astype(np.float64) @ np.array([0.299, 0.587, 0.114])


def _shift(a: np.ndarray, b: np.ndarray) -> tuple[float, float]:
    """(dx, dy) that moves the content of a onto b, by phase correlation (Hann-windowed)."""
    h, w = a.shape
    win = np.outer(np.hanning(h), np.hanning(w))
    fa, fb = np.fft.fft2((a - a.mean()) * win), np.fft.fft2((b - b.mean()) * win)
    r = fb * np.conj(fa)
    corr = np.fft.ifft2(r / (np.abs(r) + 1e-9)).real
    dy, dx = np.unravel_index(np.argmax(corr), corr.shape)
    return float(dx if dx <= w // 2 else dx - w), float(dy if dy <= h // 2 else dy - h)


def _centre_zoom(frame: np.ndarray, zoom: float) -> np.ndarray:
    h, w = frame.shape
    bw, bh = w / zoom, h / zoom
    box = ((w - bw) / 2, (h - bh) / 2, (w + bw) / 2, (h + bh) / 2)
    return np.asarray(
        Image.fromarray(frame.astype(np.float32)).resize((w, h), Image.Resampling.BILINEAR, box=box)
    )


def _centroid(frame: np.ndarray, rgb) -> np.ndarray | None:
    mask = (np.abs(frame[..., :3].astype(np.int16) - np.array(rgb, np.int16)) <= CLIP_TOL).all(
        axis=-1
    )
    if mask.sum() < 10:
        return None
    ys, xs = np.nonzero(mask)
    return np.array([xs.mean(), ys.mean()])


_AXIS = {"right": (0, 1), "left": (0, -1), "down": (1, 1), "up": (1, -1)}


def check_clip(frames: np.ndarray, facts: dict) -> bool:
    """True when decoded frames [T, H, W, 3] show the motion the facts state.

    motion: the stated colour is visible in the first and last frames and its centroid moves
    the stated way by at least a quarter of the frame, with little sideways drift.
    pan: the content shifts against the stated camera direction (summed frame-to-frame shifts).
    zoom: for "in", the last frame matches the enlarged centre of the first better than the
    other way round ("out" the reverse); the enlargement factor is `facts["zoom"]` (default 2).
    """
    frames = np.asarray(frames)
    if frames.ndim != 4 or len(frames) < 2:
        return False
    kind, direction = facts.get("kind"), facts.get("direction")
    h, w = frames.shape[1:3]
    if kind == "motion":
        if facts.get("colour") not in PALETTE or direction not in _AXIS:
            return False
        p0, p1 = (
            _centroid(frames[0], PALETTE[facts["colour"]]),
            _centroid(frames[-1], PALETTE[facts["colour"]]),
        )
        if p0 is None or p1 is None:
            return False
        axis, sign = _AXIS[direction]
        d = (p1 - p0)[axis] * sign
        side = abs((p1 - p0)[1 - axis])
        return d >= 0.25 * (w, h)[axis] and side <= 0.5 * d
    if kind == "pan":
        if direction not in _AXIS:
            return False
        g = [_grey(f) for f in frames]
        total = np.sum([_shift(a, b) for a, b in zip(g, g[1:])], axis=0)
        axis, sign = _AXIS[direction]
        d = -total[axis] * sign  # the camera moves right -> the content moves left
        return d >= 0.15 * (w, h)[axis] and abs(total[1 - axis]) <= 0.5 * d
    if kind == "zoom":
        if direction not in ("in", "out"):
            return False
        zoom = float(facts.get("zoom", 2.0))
        first, last = _grey(frames[0]), _grey(frames[-1])
        err_in = np.mean((_centre_zoom(first, zoom) - last) ** 2)
        err_out = np.mean((_centre_zoom(last, zoom) - first) ** 2)
        return bool(err_in < err_out) if direction == "in" else bool(err_out < err_in)
    return False


# ---------------------------------------------------------------- building


def build_clips(
    out: pathlib.Path, *, seed: int, count: int, progress: bool, split: str = "all"
) -> tuple[dict, list[dict]]:
    """Write `count` clips; clip i's kind and fps cycle so that any prefix mixes all of them.
    Pans and zooms use the photos of ``split`` only (a held-out clip never shows a training photo)."""
    photos = [(p, path) for p, path in available(split) if p.file not in NOT_FOR_CLIPS]
    cache: dict[str, Image.Image] = {}
    folder = out / "clips"
    folder.mkdir(parents=True, exist_ok=True)
    rows, total = [], 0
    for i in tqdm(range(count), desc="clips", unit="clip", disable=not progress, leave=False):
        rng = rng_for(seed, "clips", i)
        kind = KINDS[i % len(KINDS)] if photos else "motion"
        fps = FPS[(i + i // len(FPS)) % len(FPS)]  # shifts each round so kinds meet every fps
        if kind == "motion":
            frames, facts, text = motion_clip(rng, fps)
        else:
            photo, path = photos[rng.integers(len(photos))]
            if photo.file not in cache:
                cache[photo.file] = _load(path)
            make = pan_clip if kind == "pan" else zoom_clip
            frames, facts, text = make(rng, fps, photo, cache[photo.file])
        h, w = frames[0].shape[:2]
        facts.update(
            {
                "fps": fps,
                "frames": len(frames),
                "duration": round(len(frames) / fps, 4),
                "width": w,
                "height": h,
            }
        )
        name = f"clip_{i:04d}.mp4"
        data = encode_mp4(frames, fps)
        (folder / name).write_bytes(data)
        total += len(data)
        rows.append({"file": name, "caption": text, "facts": facts})
    total += write_jsonl(folder / "captions.jsonl", rows)
    return {"clips": count, "bytes": total}, rows
