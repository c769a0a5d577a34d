"""Validate and describe inputs at ingest: text decoding, image and video probes.

Design choices:
- Images: the header is read first and the pixel count checked *before* any decode, so a
  decompression bomb is never decoded in full (Pillow itself only raises above ~179 M pixels);
  then a decode pass catches truncated files (JPEG at 1/8 scale: all data read, little pixel
  work). Width and height are the header's; the original bytes are what gets stored.
- Videos: probed with decord from a temporary copy of the bytes (``video_path``), first and
  last frame decoded.
  decord writes FFmpeg's complaints, raw input bytes included, straight to the C stderr; the
  probe captures fd 2 and keeps FFmpeg's reasons, without the bytes, as the reject detail.
- Text: strict UTF-8 by default; ``repair=True`` replaces bad bytes with U+FFFD and counts them.
"""

from __future__ import annotations

import atexit
import io
import os
import re
import tempfile
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from PIL import Image, UnidentifiedImageError

from data.image_prep import bomb_detail, exif_orientation, warnings_naming
from data.schema import Reject
from data.video_colour import pixel_shape

MAX_IMAGE_PIXELS = 64_000_000  # the commands' default limit on an input image, by its header

IMAGE_FORMATS = {
    "JPEG": "jpg",
    "PNG": "png",
    "WEBP": "webp",
    "GIF": "gif",
    "BMP": "bmp",
    "TIFF": "tiff",
    "MPO": "jpg",
    "AVIF": "avif",
}
# .jfif is how browsers on Windows save a JPEG, .3gp older phones' clips, .mpg MPEG-PS: all read
# by Pillow and decord. Not .mts/.m2ts: decord fails on H.264 with B-frames in MPEG-TS, which is
# what camcorders write, so "convert it" (unknown-type) is the more useful answer there.
IMAGE_EXTS = {".jpg", ".jpeg", ".jfif", ".png", ".webp", ".avif", ".gif", ".bmp", ".tif", ".tiff"}
VIDEO_EXTS = {".mp4", ".webm", ".mkv", ".mov", ".avi", ".m4v", ".3gp", ".mpg"}


@dataclass(frozen=True)
class ImageInfo:
    width: int
    height: int
    format: str  # Pillow's name, e.g. "JPEG"
    ext: str  # member extension derived from the real format, e.g. "jpg"
    mode: str
    # Frames of an animated GIF/WebP or pages of a TIFF: the first is the one tokenized, so
    # the segment says how many there were (stats counts such images).
    animation_frames: int = 1
    # EXIF orientation (1-8): width and height are the stored bytes'; 5-8 show them turned by 90
    # degrees. Kept only when it is not 1, for stats to give the sizes as shown.
    orientation: int = 1

    def meta(self) -> dict:
        meta = {
            "width": self.width,
            "height": self.height,
            "format": self.format,
            "mode": self.mode,
        }
        if self.animation_frames > 1:
            meta["animation_frames"] = self.animation_frames
        if self.orientation != 1:
            meta["orientation"] = self.orientation
        return meta


@dataclass(frozen=True)
class VideoInfo:
    width: int
    height: int
    frames: int
    fps: float
    duration: float  # seconds, as long as the container says (clip_duration)

    def meta(self) -> dict:
        return {
            "width": self.width,
            "height": self.height,
            "frames": self.frames,
            "fps": round(self.fps, 6),
            "duration": round(self.duration, 6),
        }


# The ISO-BMFF brands of HEIC/HEIF (iPhones' photos), which Pillow does not read without a plugin.
HEIF_BRANDS = {b"heic", b"heix", b"heim", b"heis", b"hevc", b"hevx", b"mif1", b"msf1"}


def wide_codec(raw: bytes) -> str | None:
    """The codec, utf-32 or utf-16, whose byte order mark opens ``raw`` (Windows tools write
    UTF-16 with it), else None. UTF-32's little-endian mark starts with UTF-16's: it goes first."""
    if raw.startswith((b"\xff\xfe\0\0", b"\0\0\xfe\xff")):
        return "utf-32"
    return "utf-16" if raw.startswith((b"\xff\xfe", b"\xfe\xff")) else None


def binary_detail(raw: bytes) -> str | None:
    """Why ``raw`` is no text: a NUL byte in its first 8 KiB (none is text, unless a UTF-16 or
    UTF-32 byte order mark opens it), or None. NULs at every other byte are named as UTF-16."""
    head = raw[:8192]
    if b"\0" not in head or wide_codec(raw):
        return None
    zeros = sorted((head[0::2].count(0), head[1::2].count(0)))
    if zeros[0] <= len(head) // 64 and zeros[1] > len(head) // 4:  # one byte of each pair
        return "NUL bytes between the letters: UTF-16 without a byte order mark? save it as UTF-8"
    return "NUL byte in the first 8 KiB"


def decode_text(raw: bytes, path: str, *, repair: bool) -> tuple[str, int] | Reject:
    """UTF-8 text (a leading BOM dropped) and the count of replaced bytes, or a not-utf8 reject.
    Text that opens with a UTF-16 or UTF-32 byte order mark is read so: its mark says so
    unambiguously, and as UTF-8 it would be NULs between the letters."""
    if raw.startswith(b"\xef\xbb\xbf"):
        raw = raw[3:]
    elif codec := wide_codec(raw):
        try:
            return raw.decode(codec), 0
        except UnicodeDecodeError as e:
            return Reject(
                path,
                "not-utf8",
                f"{codec.upper()} by its byte order mark, invalid at byte {e.start}",
            )
    try:
        return raw.decode("utf-8"), 0
    except UnicodeDecodeError as e:
        if not repair:
            return Reject(
                path,
                "not-utf8",
                f"invalid UTF-8 at byte {e.start} (rejected; "
                "--repair-utf8 keeps such text with U+FFFD)",
            )
        text = raw.decode("utf-8", errors="replace")
        bad = text.count("\ufffd") - raw.decode("utf-8", errors="ignore").count("\ufffd")
        return text, bad


def clean_json_text(text: str, path: str, *, repair: bool) -> tuple[str, int] | Reject:
    """Strings parsed from JSON can hold lone surrogates, which UTF-8 cannot encode."""
    try:
        text.encode("utf-8")
        return text, 0
    except UnicodeEncodeError as e:
        if not repair:
            return Reject(
                path,
                "not-utf8",
                f"lone surrogate at character {e.start} (rejected; "
                "--repair-utf8 keeps such text with U+FFFD)",
            )
        fixed = "".join("\ufffd" if 0xD800 <= ord(char) <= 0xDFFF else char for char in text)
        return fixed, sum(1 for char in text if 0xD800 <= ord(char) <= 0xDFFF)


def probe_image(raw: bytes, path: str, *, max_pixels: int) -> ImageInfo | Reject:
    if not raw:
        return Reject(path, "unreadable-image", "zero-byte file")
    try:
        with warnings_naming(path), warnings.catch_warnings():
            # Our own limit is checked below; Pillow's warning between 89 M and 179 M is noise.
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)
            image = Image.open(io.BytesIO(raw))
            width, height = image.size
            if width * height > max_pixels:
                return Reject(
                    path,
                    "pixel-limit",
                    f"header claims {width}x{height} = {width * height} pixels > limit "
                    f"{max_pixels} (--max-image-pixels)",
                )
            fmt, mode = image.format or "?", image.mode
            # An MPO's second frame is the other eye of a stereo pair or a depth map, no motion
            frames = getattr(image, "n_frames", 1) if fmt != "MPO" else 1
            if fmt not in IMAGE_FORMATS:
                return Reject(path, "unreadable-image", f"unsupported image format {fmt}")
            # A full pass over the data finds truncation; JPEG's DCT scaling (draft) still reads
            # every entropy-coded byte but skips most of the pixel work: ~2.5x faster.
            image.draft("RGB", (max(1, width // 8), max(1, height // 8)))
            image.load()
            orientation = exif_orientation(image)
            return ImageInfo(width, height, fmt, IMAGE_FORMATS[fmt], mode, frames, orientation)
    except Image.DecompressionBombError as e:
        return Reject(path, "pixel-limit", bomb_detail(e, max_pixels))
    except UnidentifiedImageError:
        if raw[4:8] == b"ftyp" and raw[8:12] in HEIF_BRANDS:
            return Reject(path, "unreadable-image", "HEIC/HEIF is not read: convert it to JPEG")
        return Reject(path, "unreadable-image", "not an image Pillow recognises")
    except (OSError, SyntaxError, ValueError, EOFError) as e:
        msg = str(e)
        reason = (
            "truncated-image"
            if "truncat" in msg.lower() or isinstance(e, EOFError)
            else "unreadable-image"
        )
        return Reject(path, reason, msg)


_CAPTURE = None  # one temp file per process, reused: a decode must not pay for a new file
_DECODE_FAILURES = 0  # failed decord decodes in this process (each leaks ~40 KB inside decord)


def note_decode_failure() -> None:
    """Count a failed decord decode; the prep engines recycle a worker after enough of them."""
    global _DECODE_FAILURES
    _DECODE_FAILURES += 1


def decode_failures() -> int:
    """Failed decord decodes in this process so far (``data.engine.local`` reads it)."""
    return _DECODE_FAILURES


@contextmanager
def captured_c_stderr():
    """Redirect the C-level stderr (fd 2) into a temp file; yields a list that gets its text."""
    global _CAPTURE
    out: list[str] = []
    try:
        saved = os.dup(2)
    except OSError:  # no usable fd 2 (rare, e.g. some daemons)
        yield out
        return
    if _CAPTURE is None:
        _CAPTURE = tempfile.TemporaryFile()
        atexit.register(_CAPTURE.close)  # kept for the process's life, closed at its end
    tmp = _CAPTURE
    tmp.seek(0)
    tmp.truncate()
    os.dup2(tmp.fileno(), 2)
    try:
        yield out
    finally:
        os.dup2(saved, 2)
        os.close(saved)
        tmp.seek(0)
        out.append(tmp.read(65536).decode("utf-8", errors="replace"))


def shown_size(width: int, height: int, raw: bytes) -> tuple[int, int]:
    """(width, height) of a clip's decoded frames of ``width`` x ``height`` pixels as it is shown,
    its pixels stretched to their shape (``pixel_shape``), as players do: a DVD's 720x480 at
    32:27 is 853x480 on screen. Frames decord turned a quarter (stored 480x720) stretch upright."""
    aspect, stored = pixel_shape(raw)
    if stored == (height, width) and width != height:
        return width, max(1, round(height * aspect))
    return max(1, round(width * aspect)), height


@contextmanager
def video_path(raw: bytes) -> Iterator[str]:
    """A path to a temporary copy of ``raw``, for decord to open: given a file object, decord
    keeps three more copies of the bytes. On Linux the copy has no name (``O_TMPFILE``, opened
    through /proc/self/fd), so the kernel frees it when the process ends however it ends (a
    decode child that crashed, a worker killed); elsewhere it is a named file, removed on exit.
    The folder is Python's temporary one (``TMPDIR``); one without room is said by name."""
    folder = tempfile.gettempdir()
    try:
        fd = os.open(folder, os.O_TMPFILE | os.O_RDWR, 0o600)
        path = f"/proc/self/fd/{fd}"
        if not os.path.exists(path):  # no /proc to open it through
            os.close(fd)
            raise OSError("no /proc")
    except (AttributeError, OSError):  # no O_TMPFILE here, or a file system without it
        fd, path = tempfile.mkstemp(prefix="earlyfuse-clip-")
    try:
        try:
            with open(fd, "wb", closefd=False) as f:
                f.write(raw)
        except OSError as e:
            raise OSError(
                e.errno,
                f"{e.strerror} (writing a temporary copy of a {len(raw)}-byte clip for decord "
                f"in {folder}; set TMPDIR to a folder with room)",
            ) from None
        yield path
    finally:
        os.close(fd)
        if not path.startswith("/proc/"):
            os.unlink(path)


AVERROR_DECODER_NOT_FOUND = -0x434544F8  # FFERRTAG(0xF8, 'D', 'E', 'C')
AVERROR_INVALIDDATA = -0x41444E49  # FFERRTAG('I', 'N', 'D', 'A'), which decord prints unsigned
_FFMPEG_LINE = re.compile(r"^\[[^\]]* @ 0x[0-9a-fA-F]+\] (.+)$")  # [mov,mp4,... @ 0x55..] text
_DECORD_PREFIX = re.compile(r"^\[\d\d:\d\d:\d\d\] \S+:\d+: ")  # [19:21:25] src/x.cc:83:
# The temporary copy decord opened (video_path), which decord names in some messages
_CLIP_COPY = re.compile(r"\[?(/proc/self/fd/\d+|\S*earlyfuse-clip-[^\s\]]+)\]?:?\s")


def _readable(text: str) -> bool:
    """Plain ASCII words, not a run of the input's bytes."""
    return (
        len(text) < 200
        and text.isascii()
        and text.isprintable()
        and re.search("[A-Za-z]{3,}", text) is not None
    )


def decord_message(log: str, err: BaseException | None) -> str:
    """What FFmpeg and decord said about a failed decode, for a reject's detail. decord echoes
    the input's bytes into its "ERROR opening: <bytes>, <FFmpeg's reason>" line, so only the
    reason after the last ", " is kept; FFmpeg's own lines (``[demuxer @ 0x..] text``) are kept
    when they are plain text. Never the raw bytes, never a stray fragment of them."""
    said: list[str] = []
    for line in log.splitlines():
        found = _FFMPEG_LINE.match(line.strip())
        if found and _readable(found.group(1).strip()):
            said.append(_CLIP_COPY.sub("", found.group(1).strip()))
    if "ERROR opening:" in log:
        reason = log.rsplit("ERROR opening:", 1)[1].rpartition(", ")[2].strip()
        if _readable(reason):
            said.append(reason)
    elif err is not None:
        first = _CLIP_COPY.sub("", _DECORD_PREFIX.sub("", str(err).strip().split("\n")[0]))
        if _readable(first) and not first.startswith("Error reading"):
            said.append(first)
    unique = list(dict.fromkeys(said))[-3:]
    if "cannot find video stream" in log + str(err or ""):
        # decord prints FFmpeg's error code: a video stream whose decoder its FFmpeg lacks
        # (AVERROR_DECODER_NOT_FOUND) is no sound-only file, and re-encoding it is the fix.
        if str(AVERROR_DECODER_NOT_FOUND) in log + str(err or ""):
            return (
                "its video stream is in a codec decord's FFmpeg cannot decode (AV1 is one): "
                "re-encode it, e.g. ffmpeg -i IN -c:v libx264 OUT.mp4"
            )
        return "no video stream in the file (sound only?)"
    said_all = "; ".join(unique).replace(
        f"failed with {-AVERROR_INVALIDDATA}", "found invalid data"
    )
    if "partial file" in said_all:  # an MP4 whose index (moov) comes first, its data cut short
        return f"its data ends early (a copy cut short?): {said_all}"
    return said_all or "FFmpeg gave no readable reason"


def frame_times(reader) -> tuple[np.ndarray, bool]:
    """decord's [n, 2] (start, end) seconds of every frame of ``reader``, and whether they were
    counted from the average frame rate instead. A frame its container gave no time (AVI and
    MPEG-PS with B-frames, H.264 in AVI: decord then reports FFmpeg's "no time" value scaled,
    -1e14 s or less; a Matroska clip of three frames or fewer: the largest 64-bit value scaled,
    9.2e15 s) would pin every pick on the first frame and make the clip's duration that number:
    such a clip's times are counted from its rate, as those containers play them."""
    times = np.asarray(reader.get_frame_timestamp(list(range(len(reader)))), dtype=np.float64)
    if not ((times < -1e6) | (times > 1e12)).any():  # 1e12 s: no recording is 30,000 years long
        return times, False
    rate = float(reader.get_avg_fps())
    starts = np.arange(len(times)) / rate
    return np.stack([starts, starts + 1 / rate], axis=1), True


def clip_duration(times: np.ndarray, fps: float) -> float:
    """A clip's length from its frames' (start, end) times and average rate. decord gives the
    last frame the gap before it as its length: a time-lapse of frames 295 s apart that the
    container says lasts 591 s would last 885 s. The rate is frames over the container's
    duration, so that duration is taken, held between the last frame's start and its end."""
    start, end = float(times[-1, 0]), float(times[-1, 1])
    by_rate = len(times) / fps if fps > 0 else end
    return min(max(by_rate, start), end)


def image_format(raw: bytes | Path) -> str | None:
    """Pillow's name of the picture format of these bytes (or of a regular file's first 64 KiB:
    a FIFO or a device is never opened), None if not one."""
    try:
        if isinstance(raw, Path):
            if not raw.is_file():
                return None
            with raw.open("rb") as f:
                raw = f.read(1 << 16)
        with Image.open(io.BytesIO(raw)) as image:
            fmt = image.format
    except Exception:  # noqa: BLE001 - whatever Pillow raises, the bytes are no picture it knows
        return None
    return fmt if fmt in IMAGE_FORMATS else None


def _image_hint(raw: bytes) -> str:
    """A picture under a video's name (FFmpeg reads it as a broken clip): say what it is."""
    fmt = image_format(raw)
    return f"; the file is an image ({fmt}): give it an images source" if fmt else ""


# What FFmpeg's demuxers log when a file ends inside its data (silent for a whole file)
CUT_SHORT = re.compile(r"Read error|ended prematurely")


def video_container(raw: bytes) -> str | None:
    """The extension of a clip's container by its first bytes (a table's bytes come with no
    name): Matroska/WebM, AVI, MPEG-PS, QuickTime, other ISO media as mp4; None if unknown."""
    if raw[:4] == b"\x1aE\xdf\xa3":  # EBML: its DocType says webm or matroska
        return "webm" if b"webm" in raw[:64] else "mkv"
    if raw[:4] == b"RIFF" and raw[8:12] == b"AVI ":
        return "avi"
    if raw[:4] == b"\x00\x00\x01\xba":
        return "mpg"
    if raw[4:8] == b"ftyp":
        return "mov" if raw[8:12] == b"qt  " else "mp4"
    return None


def probe_video(raw: bytes, path: str, *, max_seconds: float) -> VideoInfo | Reject:
    if not raw:
        return Reject(path, "empty-video", "zero-byte video")
    import decord  # imported here: decord loads FFmpeg, which text-only runs never need

    err: Exception | None
    with captured_c_stderr() as log, video_path(raw) as clip:
        try:
            reader = decord.VideoReader(clip, num_threads=1)
            num_frames = len(reader)
            if num_frames == 0:
                raise RuntimeError("no frames")
            fps = float(reader.get_avg_fps())
            duration = clip_duration(frame_times(reader)[0], fps)
            first = reader[0].shape
            reader[num_frames - 1]  # decoding the last frame catches a stream cut short
            width, height = shown_size(int(first[1]), int(first[0]), raw)
            info = VideoInfo(width, height, num_frames, fps, duration)
            del reader
        except Exception as e:  # decord raises bare RuntimeError/DECORDError for every failure
            err = e
        else:
            err = None
    if err is not None:
        note_decode_failure()
        detail = "decord cannot read it: " + decord_message(log[0] if log else "", err)
        return Reject(path, "undecodable-video", detail.rstrip(".") + _image_hint(raw))
    if log and CUT_SHORT.search(log[0]):
        # A WebM/MKV has no index up front: a copy cut short still opens, as a shorter clip
        return Reject(
            path,
            "undecodable-video",
            f"its data ends early (a copy cut short?): FFmpeg could not read past frame "
            f"{info.frames} ({info.duration:.1f} s)",
        )
    if info.duration > max_seconds:
        return Reject(path, "video-too-long", f"{info.duration:.1f} s > limit {max_seconds:g} s")
    return info
