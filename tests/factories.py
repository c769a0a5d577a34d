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


def mp4_bytes(
    frames: int = 8, fps: int = 8, w: int = 32, h: int = 32, pts: list[int] | None = None
) -> bytes:
    """A real H.264 mp4 (PyAV/libx264) of a bright bar moving right; ``pts`` (in 1/fps ticks of a
    1/1000 time base) makes a variable-frame-rate clip."""
    from fractions import Fraction

    import av

    buf = io.BytesIO()
    with av.open(buf, mode="w", format="mp4") as c:
        s = c.add_stream("libx264", rate=fps)
        s.width, s.height, s.pix_fmt = w, h, "yuv420p"
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
