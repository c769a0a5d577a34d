"""Webdataset part: one img2dataset-style shard (`OUT/wds/00000.tar`) of scenes as JPEG.

img2dataset, the usual tool for downloading image-caption corpora, writes shards of
`KEY.jpg` + `KEY.txt` + `KEY.json` with 9-digit keys; ingesting `wds:` sources must handle
exactly that. The tar is written with the stdlib so it is byte-deterministic: fixed mtime,
owner 0/0 with empty names, fixed mode, members in key order.
"""

from __future__ import annotations

import io
import json
import pathlib
import tarfile

from PIL import Image

from ._common import rng_for

TARGET = 50
MTIME = 946684800  # 2000-01-01: any fixed time; the build time would break determinism


def _add(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    info = tarfile.TarInfo(name)
    info.size, info.mtime, info.mode = len(data), MTIME, 0o644
    info.uid = info.gid = 0
    info.uname = info.gname = ""
    tar.addfile(info, io.BytesIO(data))


def build_wds(out: pathlib.Path, *, seed: int, count: int, scenes: list[dict]) -> dict:
    rng = rng_for(seed, "wds")
    picked = sorted(rng.choice(len(scenes), size=min(count, len(scenes)), replace=False).tolist())
    path = out / "wds" / "00000.tar"
    path.parent.mkdir(parents=True, exist_ok=True)
    with tarfile.open(path, "w", format=tarfile.USTAR_FORMAT) as tar:
        for n, i in enumerate(picked):
            scene = scenes[i]
            key = f"{n:09d}"
            with Image.open(out / "scenes" / scene["image"]) as png:
                image = png.convert("RGB")
            buf = io.BytesIO()
            image.save(
                buf, format="JPEG", quality=90
            )  # lossy on purpose: img2dataset shards are JPEG
            meta = {
                "key": key,
                "caption": scene["caption"],
                "status": "success",
                "width": image.width,
                "height": image.height,
                "source": f"scenes/{scene['image']}",
            }
            _add(tar, f"{key}.jpg", buf.getvalue())
            _add(tar, f"{key}.txt", scene["caption"].encode("utf-8"))
            _add(tar, f"{key}.json", json.dumps(meta, ensure_ascii=False).encode("utf-8"))
    return {"samples": len(picked), "bytes": path.stat().st_size}
