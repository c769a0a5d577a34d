"""The shards' memory maps hold about ``store.RELEASE_BYTES`` of pages, not every page read
(data/loader/store.py, ``ShardFiles.release``): a consumer keeps every shard it reads mapped,
and the pages it has read would otherwise stay in its RSS for the whole epoch."""

from __future__ import annotations

import numpy as np
import torch
from factories import tiny_loader_config

from data.loader import build_loader, store
from data.loader.store import ShardFiles


def resident_kib(address: int) -> int:
    """The RSS of the mapping of this process that holds ``address`` (/proc/self/smaps)."""
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(part, 16) for part in head.split("-"))
                inside = low <= address < high
            elif inside and head == "Rss:":
                return int(line.split()[1])
    raise AssertionError(f"no mapping holds {address:#x}")


def test_reading_a_shard_through_its_map_keeps_few_of_its_pages(tmp_path, monkeypatch):
    monkeypatch.setattr(store, "RELEASE_BYTES", 1 << 20)
    shard = tmp_path / "shard.tar"
    shard.write_bytes(np.arange(2 << 20, dtype=np.int32).tobytes())  # 8 MiB
    files = ShardFiles(str(tmp_path / "cache"))
    total = 0
    for offset in range(0, 8 << 20, 64 << 10):  # all of it, as documents are read
        total += int(np.frombuffer(files.view(str(shard), offset, 64 << 10), np.int32)[-1])
    assert total == sum(range((16 << 10) - 1, 2 << 20, 16 << 10))  # every byte as written
    mapped = files.mapped(str(shard))
    assert mapped is not None
    address = np.frombuffer(mapped, np.uint8).ctypes.data
    # of its 8 MiB: what was read since the last release (at most RELEASE_BYTES) and the pages
    # the kernel maps around a fault
    assert resident_kib(address) <= 2 << 10


def test_batches_are_the_same_when_the_maps_are_released_after_every_read(tiny_tokens, monkeypatch):
    """Handing the pages back leaves every view of the maps valid: batches of the tiny token
    folder with the maps released after every read equal those with them released never."""
    cfg = tiny_loader_config(tiny_tokens, num_workers=0)

    def batches() -> list[dict]:
        it = iter(build_loader(cfg, rank=0, world_size=1, micro_batch=3))
        out = [next(it) for _ in range(12)]
        it.close()  # type: ignore[attr-defined]
        return out

    monkeypatch.setattr(store, "RELEASE_BYTES", 1 << 62)
    kept = batches()
    monkeypatch.setattr(store, "RELEASE_BYTES", 1)
    released = batches()
    for a, b in zip(kept, released):
        assert a.keys() == b.keys()
        for key in a:
            assert torch.equal(a[key], b[key]), key
