"""Builders of small real inputs shared by the tests: images with Pillow, mp4 clips with
PyAV/libx264, img2dataset-style tars. (tests/ is on pytest's pythonpath: ``import factories``.)"""

from __future__ import annotations

import io
import struct
import tarfile
import zlib
from pathlib import Path

import numpy as np
from PIL import Image


def png_bytes(w: int = 32, h: int = 24, colour=(200, 30, 30)) -> bytes:
    buf = io.BytesIO()
    Image.new("RGB", (w, h), colour).save(buf, format="PNG")
    return buf.getvalue()


def jpeg_bytes(w: int = 32, h: int = 24, seed: int = 0) -> bytes:
    rng = np.random.default_rng(seed)
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8)).save(
        buf, format="JPEG", quality=90
    )
    return buf.getvalue()


def png_header_bomb(w: int = 30000, h: int = 30000) -> bytes:
    """A tiny PNG whose IHDR claims w x h pixels (its data would not even fill one row)."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return (
        b"\x89PNG\r\n\x1a\n"
        + chunk(b"IHDR", ihdr)
        + chunk(b"IDAT", zlib.compress(b"\0" * 64))
        + chunk(b"IEND", b"")
    )


def png_solid(w: int, h: int, colour=(90, 140, 200)) -> bytes:
    """A real RGB PNG of w x h pixels of one colour, written row by row (no w x h buffer here):
    12000 x 12000 is ~420 KB on disk and 432 MB once decoded."""

    def chunk(kind: bytes, data: bytes) -> bytes:
        return (
            struct.pack(">I", len(data)) + kind + data + struct.pack(">I", zlib.crc32(kind + data))
        )

    z = zlib.compressobj(9)
    row = b"\0" + bytes(colour) * w
    body = b"".join(z.compress(row) for _ in range(h)) + z.flush()
    ihdr = struct.pack(">IIBBBBB", w, h, 8, 2, 0, 0, 0)
    return b"\x89PNG\r\n\x1a\n" + chunk(b"IHDR", ihdr) + chunk(b"IDAT", body) + chunk(b"IEND", b"")


def mp4_bytes(
    frames: int = 8,
    fps: int = 8,
    w: int = 32,
    h: int = 32,
    pts: list[int] | None = None,
    pix_fmt: str = "yuv420p",
    codec: str = "libx264",
    container: str = "mp4",
) -> bytes:
    """A real H.264 mp4 (PyAV/libx264) of a bright bar moving right; ``pts`` (in 1/fps ticks of a
    1/1000 time base) makes a variable-frame-rate clip; ``pix_fmt="yuv444p"`` allows odd sizes;
    ``codec`` another PyAV encoder (``libsvtav1``: a clip decord cannot decode; ``libvpx`` (VP8)
    with ``container="webm"``: a WebM)."""
    from fractions import Fraction

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format=container) as c:
        s = c.add_stream(codec, rate=fps)
        s.width, s.height, s.pix_fmt = w, h, pix_fmt
        s.options = {"threads": "1"}
        if pts is not None:
            s.codec_context.time_base = Fraction(1, 1000)
        for i in range(frames):
            a = np.zeros((h, w, 3), np.uint8)
            x = (i * 3) % (w - 4)
            a[:, x : x + 4] = (255, 255, 255)
            f = av.VideoFrame.from_ndarray(a, format="rgb24")
            if pts is not None:
                f.pts, f.time_base = pts[i], Fraction(1, 1000)
            for p in s.encode(f):
                c.mux(p)
        for p in s.encode():
            c.mux(p)
    return buf.getvalue()


def rotated_mp4(raw: bytes, degrees: int) -> bytes:
    """The mp4 ``raw`` with a rotation in its video track header (the ``tkhd`` display matrix, as
    phones write a portrait clip stored landscape): players and decord show it turned by
    ``degrees`` clockwise. FFmpeg 7's muxer ignores the old ``rotate`` tag, so it is patched here."""
    at = raw.find(b"tkhd") - 4
    version = raw[at + 8]
    # size, type, version+flags, times and ids (v0: 4-byte, v1: 8-byte), reserved, layer...volume
    matrix = at + 12 + (32 if version == 1 else 20) + 8 + 8
    one = 0x10000
    a, b, c, d = {90: (0, one, -one, 0), 180: (-one, 0, 0, -one), 270: (0, -one, one, 0)}[degrees]
    packed = struct.pack(">9i", a, b, 0, c, d, 0, 0, 0, 0x40000000)
    return raw[:matrix] + packed + raw[matrix + 36 :]


def write_wds(path: Path, samples: list[tuple[str, dict[str, bytes]]]) -> None:
    """An img2dataset-style tar: members KEY.EXT in the given order."""
    with tarfile.open(path, "w", format=tarfile.GNU_FORMAT) as tf:
        for key, members in samples:
            for ext, data in members.items():
                ti = tarfile.TarInfo(f"{key}.{ext}")
                ti.size = len(data)
                tf.addfile(ti, io.BytesIO(data))


def many_images(root: Path, n: int, size: int = 128) -> None:
    """n noise JPEGs with sidecar captions."""
    root.mkdir(parents=True, exist_ok=True)
    for i in range(n):
        (root / f"im{i:04d}.jpg").write_bytes(jpeg_bytes(size, size, seed=i))
        (root / f"im{i:04d}.txt").write_text(f"random noise number {i}")


def colour_vtok(sample_images=None):
    """A real VisualTokenizer (the debug preset) whose weights are *set*, not trained: each 4x4
    patch's mean colour is quantised (R to 8 levels, G and B to 5) and decoded back to the mean
    colour of its bin, found by least squares on ``sample_images`` ([N, 3, H, W] in [-1, 1]). It
    keeps colours and coarse positions, which is what tests of scene scoring need, in no time."""
    import torch

    from model.visual_tokenizer import vtok_debug

    torch.manual_seed(0)
    model = vtok_debug().build().eval()
    enc, dec = model.encoder, model.decoder
    with torch.no_grad():
        final_norm = enc.trunk[-2]  # GroupNorm before the last SiLU: zero it, the trunk gives 0
        final_norm.weight.zero_()
        final_norm.bias.zero_()
        enc.colour.weight.zero_()
        enc.colour.bias.zero_()
        for c in range(3):
            enc.colour.weight[c, c] = 1.0  # channels 0..2 = the patch's mean R, G, B
        model.to_latent.weight.zero_()
        model.to_latent.bias.zero_()
        for c, gain in enumerate((1.6, 1.2, 1.2)):
            model.to_latent.weight[c, c] = gain
        if sample_images is None:
            grid = torch.linspace(-1, 1, 9)
            cols = torch.cartesian_prod(grid, grid, grid)  # 729 flat colours
            sample_images = cols[:, :, None, None].expand(-1, -1, 4, 4)
        q, _ = model.quantize(sample_images)
        means = torch.nn.functional.avg_pool2d(sample_images, 4)
        qf = torch.cat([q.permute(0, 2, 3, 1).reshape(-1, 4), torch.ones(q.numel() // 4, 1)], 1)
        target = means.permute(0, 2, 3, 1).reshape(-1, 3)
        sol = torch.linalg.lstsq(qf, target).solution  # [5, 3]
        dec.colour.weight.copy_(sol[:4].T[:, :, None, None])
        dec.colour.bias.copy_(sol[4])
    return model


class _Payload:
    """Unpickling this creates ``marker``: proof that a load ran code from the file."""

    def __init__(self, marker: Path) -> None:
        self.marker = str(marker)

    def __reduce__(self):
        return (open, (self.marker, "w"))


def plant_pickle(path: Path, marker: Path) -> None:
    """Replace a checkpoint file by a pickle whose loading would run code (it creates
    ``marker``), and, as an attacker able to write the file could, update the size and SHA-256
    the checkpoint's ``meta.json`` (or a release's ``config.json``) records for it."""
    import hashlib
    import json

    import torch

    torch.save({"module": {}, "payload": _Payload(marker)}, path)
    data = path.read_bytes()
    for folder in (path.parent, path.parent.parent):
        meta = folder / "meta.json"
        rel = str(path.relative_to(folder))
        if meta.is_file() and rel in json.loads(meta.read_text()).get("files", {}):
            m = json.loads(meta.read_text())
            m["files"][rel] = {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}
            meta.write_text(json.dumps(m))
        config = folder / "config.json"
        if config.is_file() and rel in json.loads(config.read_text()).get("files", {}):
            c = json.loads(config.read_text())
            c["files"][rel] = hashlib.sha256(data).hexdigest()
            config.write_text(json.dumps(c))


def flip_token_bytes(tar: Path, k: int, n: int = 256) -> str:
    """Flip ``n`` bytes inside the ids.npy member of sample ``k`` of a token shard (its data,
    past the .npy header), in place; returns the sample's key. Index and manifest unchanged."""
    import json

    entry = json.loads(Path(str(tar)[: -len(".tar")] + ".idx.jsonl").read_text().splitlines()[k])
    off, size = entry["members"]["ids.npy"]
    assert size >= 128 + n, f"sample {entry['key']}: ids.npy of {size} bytes is too short"
    with open(tar, "r+b") as f:
        f.seek(off + 128)
        data = f.read(n)
        f.seek(off + 128)
        f.write(bytes(b ^ 0x5A for b in data))
    return entry["key"]


def token_sample_with_id(tar: Path, k: int, new_id: int) -> str:
    """Rewrite a token shard so that sample ``k``'s first id is ``new_id``, with an index, hashes
    and manifest entry that all agree (a sample that only the vocabulary check can catch)."""
    import json

    from data.schema import Sample
    from data.shards.writer import ShardWriter
    from data.tokenize.shard_job import npy_bytes

    tar = Path(tar)
    idx = Path(str(tar)[: -len(".tar")] + ".idx.jsonl")
    entries = [json.loads(line) for line in idx.read_text().splitlines()]
    raw = tar.read_bytes()

    def member(e, suffix):
        off, size = e["members"][suffix]
        return raw[off : off + size]

    writer = ShardWriter(tar, idx)
    key = ""
    for i, e in enumerate(entries):
        ids = np.load(io.BytesIO(member(e, "ids.npy")))
        if i == k:
            ids = ids.copy()
            ids[0] = new_id
            key = e["key"]
        extra = {x: e[x] for x in ("tokens", "tokens_by_modality", "blocks") if x in e}
        doc = json.loads(member(e, "json"))
        media = [("ids.npy", npy_bytes(ids)), ("mod.npy", member(e, "mod.npy"))]
        writer.write(Sample(e["key"], doc, media), extra)
    res = writer.close()
    from data.shards import token_index
    from data.shards.storage import write_atomic

    binary = token_index.index_path_for(tar)  # the loader's binary index agrees too
    if binary.is_file():
        write_atomic(binary, token_index.build(idx.read_bytes()))
    for up in (tar.parent, tar.parent.parent):
        manifest = up / "manifest.json"
        if manifest.is_file():
            m = json.loads(manifest.read_text())
            for s in m["shards"]:
                if up / s["path"] == tar:
                    s.update(sha256=res.sha256, index_sha256=res.index_sha256, bytes=res.bytes)
            manifest.write_text(json.dumps(m))
            break
    return key


def corrupt_every_sample(tar: Path) -> list[str]:
    """Flip the last byte of every sample's ids.npy in a token shard, in place, after its index
    and manifest were written (as a disk or a copy could): every sample then fails its SHA-256.
    Returns the keys."""
    import json

    keys = []
    lines = Path(str(tar)[: -len(".tar")] + ".idx.jsonl").read_text().splitlines()
    with open(tar, "r+b") as f:
        for line in lines:
            entry = json.loads(line)
            off, size = entry["members"]["ids.npy"]
            f.seek(off + size - 1)
            byte = f.read(1)[0]
            f.seek(off + size - 1)
            f.write(bytes([byte ^ 0x5A]))
            keys.append(entry["key"])
    return keys


def tiny_loader_config(tiny_tokens: Path, **settings):
    """A LoaderConfig over every source of the session's tiny token folder (``tiny_tokens``), rows
    of 256 and a shuffle buffer of 8 unless ``settings`` say otherwise."""
    from data.loader import LoaderConfig, SourceConfig

    names = ("code", "text", "scenes", "digits", "clips", "docs")
    sources = [SourceConfig(name=name, shards=[str(tiny_tokens / name)]) for name in names]
    return LoaderConfig(**{"sources": sources, "seq_len": 256, "shuffle_buffer": 8, **settings})
