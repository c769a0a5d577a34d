"""Frame sampling by real timestamps, on real H.264 clips decoded from bytes by decord."""

from __future__ import annotations

import numpy as np
import pytest
from factories import mp4_bytes

from data.image_prep import ImagePrep
from data.video_frames import VideoSampling, decode_frames, pick_frames

PREP = ImagePrep(factor=8, max_pixels=32 * 32)


def test_source_slower_than_target_gives_every_frame_once_with_true_times():
    # 5 fps for 2 s, asked for 8 fps: 10 distinct frames at 0, 0.2, 0.4, ... (LLaVA-NeXT crashes here).
    f = decode_frames(mp4_bytes(frames=10, fps=5), VideoSampling(target_fps=8, max_frames=64), PREP)
    assert f.frames.shape == (10, 32, 32, 3)
    np.testing.assert_allclose(f.times, np.arange(10) * 0.2, atol=1e-6)
    assert abs(f.duration - 2.0) < 1e-6


def test_faster_source_is_subsampled_at_target_times():
    f = decode_frames(
        mp4_bytes(frames=24, fps=24), VideoSampling(target_fps=8, max_frames=64), PREP
    )
    np.testing.assert_allclose(f.times, np.arange(8) / 8, atol=1e-6)


def test_short_and_single_frame_clips():
    f = decode_frames(
        mp4_bytes(frames=5, fps=25), VideoSampling(target_fps=8, max_frames=64), PREP
    )  # 0.2 s
    np.testing.assert_allclose(f.times, [0.0, 0.12], atol=1e-6)
    f = decode_frames(mp4_bytes(frames=1, fps=8), VideoSampling(target_fps=8, max_frames=64), PREP)
    assert f.frames.shape[0] == 1 and f.times.tolist() == [0.0]


@pytest.mark.parametrize("codec", ["libx265", "libx264"])
def test_a_10_bit_clip_decodes_to_the_frames_of_its_8_bit_twin(codec):
    """Phones record 10-bit HEVC (HDR by default): decord gives it as 8-bit RGB like any clip."""
    import av

    if codec not in av.codecs_available:
        pytest.skip(f"this PyAV has no {codec} encoder")
    sampling = VideoSampling(target_fps=8, max_frames=64)
    deep = decode_frames(mp4_bytes(frames=8, codec=codec, pix_fmt="yuv420p10le"), sampling, PREP)
    plain = decode_frames(mp4_bytes(frames=8), sampling, PREP)
    assert deep.frames.dtype == np.uint8 and deep.frames.shape == plain.frames.shape
    np.testing.assert_allclose(deep.times, plain.times)
    assert np.abs(deep.frames.astype(int) - plain.frames).mean() < 8  # the moving bar, both


def test_variable_frame_rate_clip_is_sampled_by_real_time():
    # Frames at 0, 0.1, 0.2, 0.3 then a 1-second gap: 1.3, 1.4 (ms timestamps).
    pts = [0, 100, 200, 300, 1300, 1400]
    f = decode_frames(
        mp4_bytes(frames=6, fps=10, pts=pts), VideoSampling(target_fps=4, max_frames=64), PREP
    )
    # Targets 0, .25, .5, .75, 1.0, 1.25 -> the frames shown then: starts 0, .2, .3, .3, .3, .3 -> unique.
    np.testing.assert_allclose(f.times, [0.0, 0.2, 0.3], atol=1e-3)


def test_a_target_on_a_frame_start_takes_that_frame_despite_float32_times():
    # decord's times are float32 (0.4 s reads 0.4000000060): every frame of a 10 fps clip at
    # 10 fps, every other one at 5 fps, never the frame before a target.
    ts = np.stack([np.arange(20) / 10, (np.arange(20) + 1) / 10], 1).astype(np.float32)
    assert pick_frames(ts, target_fps=10, max_frames=64).tolist() == list(range(20))
    assert pick_frames(ts, target_fps=5, max_frames=64).tolist() == list(range(0, 20, 2))
    assert pick_frames(ts, target_fps=10, max_frames=5).tolist() == [0, 4, 8, 12, 16]
    f = decode_frames(
        mp4_bytes(frames=20, fps=10), VideoSampling(target_fps=5, max_frames=64), PREP
    )
    np.testing.assert_allclose(f.times, np.arange(10) * 0.2, atol=1e-6)


def test_frame_cap_spreads_over_the_whole_clip():
    ts = np.stack([np.arange(100) / 25, (np.arange(100) + 1) / 25], 1)  # 4 s at 25 fps
    idx = pick_frames(ts, target_fps=8, max_frames=4)
    assert idx.tolist() == [0, 25, 50, 75]


def test_frames_are_resized_to_the_grid_and_bad_bytes_raise():
    f = decode_frames(
        mp4_bytes(frames=4, fps=8, w=64, h=48),
        VideoSampling(8, 8),
        ImagePrep(factor=8, max_pixels=32 * 24),
    )
    assert f.frames.shape[1:] == (24, 32, 3)
    with pytest.raises(ValueError, match="cannot decode video"):
        decode_frames(b"\x00" * 500, VideoSampling(), PREP)


@pytest.mark.parametrize(
    ("container", "codec"), [("avi", "libx264"), ("avi", "mpeg4"), ("mpeg", "mpeg2video")]
)
def test_a_clip_whose_container_gives_frames_no_time_is_sampled_by_its_frame_rate(container, codec):
    """AVI and MPEG-PS with B-frames give decord no time for (some) frames: it reported about
    -9e17 s, so every pick fell on the first frame (a 2 s clip became a still) and the probe's
    duration was that number; and decord's seeks in such a clip land on other frames. Frame i
    here is grey level 10 i, so the level says which frame came back."""
    import io

    import av

    from data.media import probe_video

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as out:
        stream = out.add_stream(codec, rate=10)
        stream.width, stream.height, stream.pix_fmt = 32, 32, "yuv420p"
        stream.codec_context.max_b_frames = 2
        stream.codec_context.bit_rate = 4_000_000  # flat greys kept within a level or two
        for i in range(20):
            grey = np.full((32, 32, 3), 10 * i, np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(grey, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    raw = buf.getvalue()
    info = probe_video(raw, f"clip.{container}", max_seconds=60)
    assert (info.frames, info.duration) == (20, pytest.approx(2.0))
    f = decode_frames(raw, VideoSampling(target_fps=4, max_frames=64), PREP)
    np.testing.assert_allclose(f.times, [0.0, 0.2, 0.5, 0.7, 1.0, 1.2, 1.5, 1.7], atol=1e-6)
    levels = f.frames.reshape(len(f.frames), -1).mean(1)
    np.testing.assert_allclose(levels, 10 * np.round(f.times * 10), atol=3)


@pytest.mark.parametrize("frames", [1, 2, 3])
def test_a_matroska_clip_of_a_few_frames_is_timed_by_its_frame_rate(frames):
    """decord gives the frames of a Matroska clip of three frames or fewer the time 9.2e15 s (the
    largest 64-bit value, scaled): ingest rejected such a clip as 9223372474941440.0 s long."""
    from data.media import probe_video

    raw = mp4_bytes(frames=frames, fps=15, w=64, h=48, container="matroska")
    info = probe_video(raw, "clip.mkv", max_seconds=600)
    assert (info.frames, info.duration) == (frames, pytest.approx(frames / 15))
    f = decode_frames(raw, VideoSampling(target_fps=15, max_frames=64), PREP)
    np.testing.assert_allclose(f.times, np.arange(frames) / 15, atol=1e-6)
