"""Video frames for the visual tokenizer, decoded with decord straight from the tar's bytes.

Design choices:
- Frames are picked by their *real* timestamps (decord's per-frame start times), not by a
  stride computed from the average fps: for target time t the frame shown at t is taken.
  So variable-frame-rate clips are sampled evenly in time, and a source slower than the
  target fps simply gives each of its frames once (LLaVA-NeXT's stride arithmetic gets the
  times wrong there, and crashes below half the target).
- A cap on the number of frames (from a token budget) spreads the kept frames evenly over
  the clip's duration instead of cutting its end.
- No temp files: decord reads an ``io.BytesIO``. One reader per clip, one thread, released
  at once; ``tools/bench/bench_tokenize_inputs.py`` measures RSS over thousands of decodes.
"""

from __future__ import annotations

import io
import math
from dataclasses import dataclass

import numpy as np

from data.image_prep import ImagePrep
from data.media import captured_c_stderr, note_decode_failure


@dataclass(frozen=True)
class VideoSampling:
    target_fps: float = 4.0
    max_frames: int = 16


def pick_frames(timestamps: np.ndarray, target_fps: float, max_frames: int) -> np.ndarray:
    """Indices of the frames to decode, given decord's [n, 2] (start, end) times in seconds."""
    starts = np.asarray(timestamps, dtype=np.float64)[:, 0]
    n = len(starts)
    if n == 0:
        raise ValueError("video has no frames")
    t0 = starts[0]
    end = max(float(np.asarray(timestamps)[-1, 1]), t0)
    count = max(1, math.ceil((end - t0) * target_fps - 1e-6))
    if count > max_frames:
        targets = t0 + (end - t0) * np.arange(max_frames) / max_frames
    else:
        targets = t0 + np.arange(count) / target_fps
    idx = np.searchsorted(starts, targets + 1e-9, side="right") - 1
    return np.unique(np.clip(idx, 0, n - 1))


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

    ``size`` (width, height), known from the shard index, lets one reader decode straight at
    the target size (FFmpeg's scaler: no full-size frames in Python); without it the clip is
    opened once more to learn its size."""
    import decord

    err: Exception | None
    with captured_c_stderr() as log:
        try:
            if size is None:
                probe = decord.VideoReader(io.BytesIO(raw), num_threads=1)
                size = probe[0].shape[1], probe[0].shape[0]
                del probe
            tw, th = prep.target_size(*size)
            if (tw, th) != tuple(size):
                vr = decord.VideoReader(io.BytesIO(raw), num_threads=1, width=tw, height=th)
            else:
                vr = decord.VideoReader(io.BytesIO(raw), num_threads=1)
            n = len(vr)
            ts = vr.get_frame_timestamp(list(range(n)))
            fps = float(vr.get_avg_fps())
            idx = pick_frames(ts, sampling.target_fps, sampling.max_frames)
            frames = vr.get_batch(idx.tolist()).asnumpy()
            del vr
        except Exception as e:  # decord raises bare RuntimeError/DECORDError
            err = e
        else:
            err = None
    if err is not None:
        note_decode_failure()
        tail = [ln for ln in (log[0] if log else "").splitlines() if ln.isprintable()]
        raise ValueError(f"cannot decode video: {tail[-1] if tail else err}")
    return Frames(frames, np.asarray(ts)[idx, 0], fps, float(np.asarray(ts)[-1, 1]))
