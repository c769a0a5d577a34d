"""The shard writer's direct member headers are byte for byte what ``tarfile`` writes."""

from __future__ import annotations

import io
import tarfile

from data.schema import Sample
from data.shards.writer import ShardWriter, tarinfo


def test_members_written_directly_equal_tarfiles_own_bytes(tmp_path):
    samples = [
        Sample("short", {"segments": [{"type": "text", "text": "hé"}]}, []),
        Sample("k" * 120, {"segments": []}, [("img0.jpg", b"\xff" * 1000)]),  # a PAX name
        Sample("exact", {"segments": []}, [("vid0.mp4", b"x" * 512), ("img0.png", b"")]),
    ]
    w = ShardWriter(tmp_path / "a.tar", tmp_path / "a.idx.jsonl")
    for s in samples:
        w.write(s)
    w.close()
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=tarfile.PAX_FORMAT) as tf:
        for s in samples:
            for suffix, data in s.members():
                tf.addfile(tarinfo(f"{s.key}.{suffix}", len(data)), io.BytesIO(data))
    assert (tmp_path / "a.tar").read_bytes() == buf.getvalue()
