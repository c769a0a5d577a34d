"""Video frames for the visual tokenizer, decoded with decord straight from the tar's bytes.

Design choices:
- Frames are picked by their *real* timestamps (decord's per-frame start times), not by a
  stride computed from the average fps: for target time t the frame shown at t is taken.
  So variable-frame-rate clips are sampled evenly in time, and a source slower than the
  target fps simply gives each of its frames once (LLaVA-NeXT's stride arithmetic gets the
  times wrong there, and crashes below half the target). Where the container gives frames no
  time (AVI, MPEG-PS with B-frames) the times are counted from the average frame rate and the
  frames read in order, as decord's seeks there land on other frames (data.media.frame_times).
- A cap on the number of frames (from a token budget) spreads the kept frames evenly over
  the clip's duration instead of cutting its end.
- decord reads each clip from a temporary file (``data.media.video_path``): given bytes, it
  holds three more copies of them. One reader per clip, one thread, released at once; RSS stays
  flat over thousands of decodes (docs/benchmarks.md, "Tokenizer inputs").
- Frames are decoded at their native size and resized here (Pillow, as images are), a few at a
  time. decord returns 4, 6 or 12 "channels" (and then fails to copy them) for frames of some
  widths that are not a multiple of 32 (8, 16, 24, 48, 72, ...: its row padding divided by the
  width), whether the width is the clip's own (a 48x64 clip) or one asked of its resize
  (``VideoReader(width=24, height=40)`` of a 180x320 clip). Such a clip is decoded instead at its
  width rounded up to a multiple of 32 (never seen to fail) and resized to the target from there.
  The shape of every decoded batch is checked.
- Rotation metadata (a phone's portrait clip stored landscape) is applied by decord: frames come
  out as the clip is shown, as the ingest probe measured them.
- HDR (PQ, HLG) and BT.2020 or Display P3 clips are brought to SDR BT.709 after the resize
  (data/video_colour.py), as images are brought to sRGB.
"""

from __future__ import annotations

import math
import pickle
import sys
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from data.image_prep import ImagePrep
from data.media import (
    captured_c_stderr,
    clip_duration,
    decord_message,
    frame_times,
    note_decode_failure,
    shown_size,
    video_path,
)
from data.video_colour import colour_of, to_sdr


@dataclass(frozen=True)
class VideoSampling:
    target_fps: float = 4.0
    max_frames: int = 16


def pick_frames(timestamps: np.ndarray, target_fps: float, max_frames: int) -> np.ndarray:
    """Indices of the frames to decode, given decord's [n, 2] (start, end) times in seconds."""
    starts = np.asarray(timestamps, dtype=np.float64)[:, 0]
    num_frames = len(starts)
    if num_frames == 0:
        raise ValueError("video has no frames")
    first_start = starts[0]
    end = max(float(np.asarray(timestamps)[-1, 1]), first_start)
    count = max(1, math.ceil((end - first_start) * target_fps - 1e-6))
    if count > max_frames:
        targets = first_start + (end - first_start) * np.arange(max_frames) / max_frames
    else:
        targets = first_start + np.arange(count) / target_fps
    # decord's times are float32 (0.4 s reads 0.4000000060): a target on a frame's start must
    # take that frame, so the slack is a few float32 steps at the clip's length, not 1e-9 s.
    slack = 4 * float(np.spacing(np.float32(max(abs(end), 1.0))))
    picked = np.searchsorted(starts, targets + slack, side="right") - 1
    return np.unique(np.clip(picked, 0, num_frames - 1))


@dataclass
class Frames:
    frames: np.ndarray  # uint8 [T, H, W, 3]
    times: np.ndarray  # float64 [T], start time of each frame in seconds
    source_fps: float
    duration: float


def decode_frames(
    raw: bytes, sampling: VideoSampling, prep: ImagePrep, size: tuple[int, int] | None = None
) -> Frames:
    """Sample and resize a clip's frames; ValueError with decord's reason if it cannot.

    ``size`` (width, height) is accepted for callers that know it from the index; the frames'
    true size (as decoded, rotation applied) is what the resize uses."""
    import decord

    del size  # the decoded frames say their size; the index can only agree
    err: Exception | None = None
    with captured_c_stderr() as log, video_path(raw) as clip:
        try:
            reader = decord.VideoReader(clip, num_threads=1)
            timestamps, counted = frame_times(reader)
            fps = float(reader.get_avg_fps())
            picked = pick_frames(timestamps, sampling.target_fps, sampling.max_frames)
            height, width, channels = reader[0].shape
            shown = shown_size(width, height, raw)
            if channels != 3 or counted:  # a safe width (above), or a reader at its start
                del reader
                width = -(-width // 32) * 32 if channels != 3 else width
                safe = {"width": width, "height": height} if channels != 3 else {}
                reader = decord.VideoReader(clip, num_threads=1, **safe)
            frames = []
            for got in _in_order(reader, picked) if counted else _seeking(reader, picked):
                if got.shape[1:] != (height, width, 3):
                    raise RuntimeError(
                        f"decord returned frames of shape {got.shape[1:]}, not {(height, width, 3)}"
                    )
                frames += [_resize(frame, prep, shown) for frame in got]
            del reader
        except Exception as e:  # decord raises bare RuntimeError/DECORDError
            err = e
    if err is not None:
        note_decode_failure()
        raise ValueError(f"cannot decode video: {decord_message(log[0] if log else '', err)}")
    colour = colour_of(raw)
    return Frames(
        to_sdr(np.stack(frames), colour) if colour else np.stack(frames),
        np.asarray(timestamps)[picked, 0],
        fps,
        clip_duration(np.asarray(timestamps), fps),
    )


_DECODE_BATCH = 8  # frames decoded at native size at once (8 frames of 1080p: 50 MB)


def _seeking(reader, picked: np.ndarray) -> Iterator[np.ndarray]:
    for start in range(0, len(picked), _DECODE_BATCH):
        yield reader.get_batch(picked[start : start + _DECODE_BATCH].tolist()).asnumpy()


def _in_order(reader, picked: np.ndarray) -> Iterator[np.ndarray]:
    """The picked frames of a clip whose container gives its frames no time, read one after
    another from the start: decord seeks by time, and there its seeks land on other frames (an
    AVI with B-frames came out shuffled, an MPEG-PS clip as its first frame repeated)."""
    wanted, batch = set(picked.tolist()), []
    for index in range(int(picked[-1]) + 1):
        frame = reader.next()
        if index in wanted:
            batch.append(frame.asnumpy())
        if len(batch) == _DECODE_BATCH or (batch and index == picked[-1]):
            yield np.stack(batch)
            batch = []


def _resize(frame: np.ndarray, prep: ImagePrep, shown: tuple[int, int]) -> np.ndarray:
    """``frame`` resized to the target of the clip's ``shown`` (width, height): the frame itself
    may be wider (decoded at a safe width), the aspect of what is shown is kept."""
    from PIL import Image

    target_w, target_h = prep.target_size(*shown)
    if (target_h, target_w) == frame.shape[:2]:
        return np.ascontiguousarray(frame)
    image = Image.fromarray(frame).resize(
        (target_w, target_h), Image.Resampling.BICUBIC, reducing_gap=3.0
    )
    return np.asarray(image, dtype=np.uint8)


def decode_child() -> None:
    """The child of data/loader/decode_guard.py: a pickled ``(raw, sampling, prep, size)`` from
    stdin (written by its parent, never by the input), a pickled ``(True, frames)``, ``(False,
    why)`` (the clip cannot be decoded) or ``(None, error)`` (this machine failed: an OSError,
    such as a temporary folder without room, which the parent raises) to stdout."""
    raw, sampling, prep, size = pickle.loads(sys.stdin.buffer.read())
    result: tuple[bool | None, object]
    try:
        result = (True, decode_frames(raw, sampling, prep, size))
    except ValueError as e:
        result = (False, str(e))
    except OSError as e:
        result = (None, e)
    sys.stdout.buffer.write(pickle.dumps(result, protocol=pickle.HIGHEST_PROTOCOL))
    sys.stdout.buffer.flush()
