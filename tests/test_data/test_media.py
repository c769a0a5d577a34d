"""Validation of inputs at ingest: text decoding, image and video probes on real bytes."""

from __future__ import annotations

import resource
import subprocess
import sys
from pathlib import Path

import pytest
from factories import jpeg_bytes, mp4_bytes, png_bytes, png_header_bomb

from data.media import decode_text, probe_image, probe_video
from data.schema import Reject


def test_text_is_strict_utf8_unless_repair_is_asked():
    assert decode_text("héllo 👋".encode(), "a", repair=False) == ("héllo 👋", 0)
    assert decode_text(b"\xef\xbb\xbfbom", "a", repair=False) == ("bom", 0)
    bad = b"caf\xe9 ok \xff"
    r = decode_text(bad, "a.txt", repair=False)
    assert isinstance(r, Reject) and r.reason == "not-utf8" and "byte 3" in r.detail
    text, n = decode_text(bad, "a.txt", repair=True)
    assert text == "caf\ufffd ok \ufffd" and n == 2
    # UTF-16 with its byte order mark (both byte orders) is read as what it is.
    for encoding in ("utf-16", "utf-16-be"):
        marked = ("\ufeff" if encoding.endswith("be") else "") + "héllo 👋"
        assert decode_text(marked.encode(encoding), "w.txt", repair=False) == ("héllo 👋", 0)
    cut = "héllo".encode("utf-16")[:-1]  # an odd byte at the end
    r = decode_text(cut, "w.txt", repair=False)
    assert isinstance(r, Reject) and r.reason == "not-utf8" and "UTF-16" in r.detail
    # UTF-32's little-endian mark starts with UTF-16's: it was read as UTF-16, NULs kept
    for encoding in ("utf-32", "utf-32-be"):
        marked = ("\ufeff" if encoding.endswith("be") else "") + "héllo 👋"
        assert decode_text(marked.encode(encoding), "w.txt", repair=False) == ("héllo 👋", 0)


def test_image_probe_reads_size_and_real_format():
    info = probe_image(png_bytes(40, 30), "x", max_pixels=10**6)
    assert (info.width, info.height, info.format, info.ext) == (40, 30, "PNG", "png")
    # The extension comes from the bytes, not from a file name.
    assert probe_image(jpeg_bytes(), "looks.png", max_pixels=10**6).ext == "jpg"


def test_truncated_and_garbage_images_are_rejected():
    jpg = jpeg_bytes(64, 64)
    r = probe_image(jpg[: len(jpg) // 2], "cut.jpg", max_pixels=10**6)
    assert r.reason == "truncated-image"
    # cut inside its headers, Pillow says "Truncated File Read": truncated too
    assert probe_image(jpg[:400], "cut.jpg", max_pixels=10**6).reason == "truncated-image"
    assert probe_image(b"not an image at all", "x", max_pixels=10**6).reason == "unreadable-image"
    assert probe_image(b"", "x", max_pixels=10**6).reason == "unreadable-image"
    # An iPhone photo (HEIC), in a table's bytes or under a .jpg name: said what it is.
    heic = b"\x00\x00\x00\x18ftypheic\x00\x00\x00\x00mif1heic" + bytes(64)
    r = probe_image(heic, "IMG_0001.jpg", max_pixels=10**6)
    assert (r.reason, r.detail) == ("unreadable-image", "HEIC/HEIF is not read: convert it to JPEG")


def test_decompression_bombs_are_rejected_from_the_header_without_decoding():
    before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    r = probe_image(png_header_bomb(30000, 30000), "bomb.png", max_pixels=64_000_000)
    # Above Pillow's own threshold too: the detail still states the limit the user set.
    assert r.reason == "pixel-limit"
    assert r.detail == "header claims 900000000 pixels > limit 64000000 (not decoded)"
    # 100 M pixels: above our limit, below Pillow's own error threshold (it would only warn).
    r = probe_image(png_header_bomb(10000, 10000), "big.png", max_pixels=64_000_000)
    assert r.reason == "pixel-limit" and "10000x10000" in r.detail
    # A limit set above Pillow's own: Pillow still refuses, and the detail says it is not ours.
    r = probe_image(png_header_bomb(30000, 30000), "bomb.png", max_pixels=1_000_000_000)
    assert r.reason == "pixel-limit"
    assert r.detail == (
        "header claims 900000000 pixels, over Pillow's own limit of 178956970 that no setting "
        "here raises (not decoded): downscale the image first"
    )
    grown_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - before
    assert grown_kb < 100_000  # a decode of 100 M RGB pixels would take 300 MB


def test_video_probe_on_real_mp4_bytes():
    info = probe_video(mp4_bytes(frames=10, fps=5), "c.mp4", max_seconds=60)
    assert info.frames == 10 and abs(info.fps - 5) < 1e-6 and abs(info.duration - 2.0) < 1e-6
    assert (info.width, info.height) == (32, 32)
    assert probe_video(mp4_bytes(frames=1, fps=8), "one.mp4", max_seconds=60).frames == 1


def test_bad_videos_are_rejected_with_a_readable_reason(capfd):
    assert probe_video(b"", "e.mp4", max_seconds=60).reason == "empty-video"
    r = probe_video(b"\x00\x01garbage" * 100, "g.mp4", max_seconds=60)
    assert r.reason == "undecodable-video" and r.detail.isprintable()
    mp4 = mp4_bytes(frames=16)
    assert (
        probe_video(mp4[: len(mp4) // 2], "cut.mp4", max_seconds=60).reason == "undecodable-video"
    )
    # A photo under a video's name: FFmpeg calls it broken metadata; the detail says what it is.
    r = probe_video(jpeg_bytes(), "IMG_0001.mp4", max_seconds=60)
    assert r.reason == "undecodable-video"
    assert r.detail.endswith("; the file is an image (JPEG): give it an images source")
    assert "/proc/self/fd" not in r.detail  # the temporary copy decord read is no one's business
    assert "image" not in probe_video(mp4[: len(mp4) // 2], "cut.mp4", max_seconds=60).detail
    r = probe_video(mp4_bytes(frames=16, fps=8), "long.mp4", max_seconds=1.0)
    assert r.reason == "video-too-long" and "2.0 s" in r.detail
    # decord echoes raw input bytes to the C stderr; the probe keeps them off the terminal.
    assert "garbage" not in capfd.readouterr().err


def test_a_webm_cut_short_is_rejected_not_kept_as_a_shorter_clip():
    """A WebM has no index up front: half a file still opens, as a clip of its first frames.
    FFmpeg's read error at the cut tells it from a whole clip."""
    # Encoded in a fresh interpreter: once decord is imported, PyAV's VP8/VP9 encoders fail to
    # open (EINVAL) in that process, and an earlier test of this worker may have imported it
    make = (
        "from factories import mp4_bytes; import sys; sys.stdout.buffer.write(mp4_bytes("
        "frames=30, fps=10, codec='libvpx', container='webm'))"
    )
    tests = str(Path(__file__).resolve().parents[1])
    webm = subprocess.run(
        [sys.executable, "-c", make], capture_output=True, check=True, cwd=tests
    ).stdout
    whole = probe_video(webm, "v.webm", max_seconds=60)
    assert whole.frames == 30 and abs(whole.duration - 3.0) < 1e-6
    r = probe_video(webm[: len(webm) // 2], "cut.webm", max_seconds=60)
    assert r.reason == "undecodable-video"
    assert r.detail.startswith("its data ends early (a copy cut short?): FFmpeg could not read")


def test_a_sound_only_mp4_is_said_to_have_no_video_stream():
    import io

    import av
    import numpy as np

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as container:
        stream = container.add_stream("aac", rate=8000)
        for _ in range(3):
            frame = av.AudioFrame.from_ndarray(
                np.zeros((1, 1024), np.float32), format="fltp", layout="mono"
            )
            frame.sample_rate = 8000
            for packet in stream.encode(frame):
                container.mux(packet)
        for packet in stream.encode():
            container.mux(packet)
    r = probe_video(buf.getvalue(), "voice.mp4", max_seconds=60)
    assert isinstance(r, Reject) and r.reason == "undecodable-video"
    assert r.detail == "decord cannot read it: no video stream in the file (sound only?)"


def test_the_reused_stderr_capture_file_is_closed_at_exit():
    """captured_c_stderr keeps one temp file per process (a decode must not pay for a new one);
    it is closed when the process exits, not left for the interpreter to warn about."""
    import subprocess
    import sys

    code = "from data.media import captured_c_stderr\nwith captured_c_stderr():\n    pass\n"
    done = subprocess.run(
        [sys.executable, "-X", "dev", "-c", code], capture_output=True, text=True, check=True
    )
    assert "ResourceWarning" not in done.stderr, done.stderr


def test_a_video_in_a_codec_decord_cannot_decode_says_so_and_how_to_re_encode_it():
    """decord's FFmpeg has no AV1 decoder: such a clip has a video stream, and its reject must
    not send the user looking for one (it said "sound only?")."""
    import av
    import pytest
    from factories import mp4_bytes

    if "libsvtav1" not in av.codecs_available:
        pytest.skip("this PyAV has no AV1 encoder")
    clip = mp4_bytes(frames=4, w=64, h=64, codec="libsvtav1")
    r = probe_video(clip, "av1.mp4", max_seconds=60)
    assert isinstance(r, Reject) and r.reason == "undecodable-video"
    assert "sound only" not in r.detail
    assert "codec decord's FFmpeg cannot decode" in r.detail and "libx264" in r.detail


def test_a_clips_length_is_the_containers_held_to_its_last_frame():
    """decord gives the last frame the gap before it as its length: a time-lapse of frames 295 s
    apart in a 591 s container read as 885 s (video-too-long at 600). The rate is frames over
    the container's duration; the length is that, between the last frame's start and end."""
    import numpy as np

    from data.media import clip_duration

    sparse = np.array([[0.0, 295.0], [295.0, 590.0], [590.0, 885.0]])
    assert clip_duration(sparse, 3 / 591) == pytest.approx(591.0)
    steady = np.stack([np.arange(300) / 30, np.arange(1, 301) / 30], axis=1)
    assert clip_duration(steady, 30.0) == pytest.approx(10.0)
    assert clip_duration(steady, 1e-9) == pytest.approx(10.0)  # a rate too low: the last end
    assert clip_duration(steady, 1e9) == pytest.approx(299 / 30)  # too high: the last start
    assert clip_duration(steady, 0.0) == pytest.approx(10.0)


def test_a_clip_is_read_from_a_nameless_copy_and_a_full_temporary_folder_is_said(
    small_tmpfs, monkeypatch
):
    """decord reads a temporary copy (given bytes, it kept three more); on Linux the copy has
    no name, so nothing is left behind whatever ends the process. A temporary folder without room
    is one OSError naming it and TMPDIR, also from the decode child, where it read as a clip that
    killed its decoder."""
    import subprocess as sp

    import data.loader.decode_guard as guard
    from data.image_prep import ImagePrep
    from data.media import video_path
    from data.video_frames import VideoSampling

    raw = mp4_bytes(frames=300)  # 10 KB, over the 4 KB below
    monkeypatch.setattr("tempfile.tempdir", str(small_tmpfs))
    with video_path(raw) as path:
        assert path.startswith("/proc/self/fd/") and Path(path).read_bytes() == raw
        assert not list(small_tmpfs.iterdir())  # nameless
    assert probe_video(raw, "clip.mp4", max_seconds=60).frames == 300
    sp.run(["mount", "-o", "remount,size=4k", str(small_tmpfs)], check=True)
    with pytest.raises(OSError, match=f"in {small_tmpfs}; set TMPDIR to a folder with room"):
        probe_video(raw, "clip.mp4", max_seconds=60)
    monkeypatch.setenv("TMPDIR", str(small_tmpfs))  # the child's temporary folder
    prep, sampling = ImagePrep(factor=8, max_pixels=4096), VideoSampling(target_fps=2.0)
    with pytest.raises(OSError, match="set TMPDIR to a folder with room"):
        guard.decode_in_child(raw, sampling, prep)


def test_a_clip_cut_short_with_its_index_first_says_so(tmp_path):
    """An MP4 written for streaming (faststart: its index first) and cut short: FFmpeg's
    "partial file" and an error number were all the reject said."""
    av = pytest.importorskip("av")
    import numpy as np

    path = tmp_path / "fast.mp4"
    with av.open(str(path), "w", format="mp4", options={"movflags": "faststart"}) as out:
        stream = out.add_stream("libx264", rate=25)
        stream.width, stream.height, stream.pix_fmt = 64, 48, "yuv420p"
        noise = np.random.default_rng(0)
        for _ in range(30):
            frame = noise.integers(0, 255, (48, 64, 3), dtype=np.uint8)
            for packet in stream.encode(av.VideoFrame.from_ndarray(frame, format="rgb24")):
                out.mux(packet)
        for packet in stream.encode():
            out.mux(packet)
    raw = path.read_bytes()
    assert raw.find(b"moov") < raw.find(b"mdat")
    r = probe_video(raw[: len(raw) // 2], "fast.mp4", max_seconds=60)
    assert r.detail.startswith("decord cannot read it: its data ends early (a copy cut short?)")
    assert "1094995529" not in r.detail
