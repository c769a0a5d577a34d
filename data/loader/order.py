"""Which samples a consumer (one rank's one worker) reads, in which order, in each epoch.

- Seeds come from hashing (seed, epoch, source, ...), never from a shared RNG stream, so any
  consumer computes its order alone, for any epoch, in the same time.
- Shards are shuffled per epoch; samples are shuffled within windows of ``buffer`` consecutive
  positions (a bounded shuffle that keeps reads local to a few shards).
- Consumer c of C takes positions c, c + C, c + 2C, ... of the epoch order: no sample is read by
  two consumers within an epoch, and every sample is read by one.
- After a ``redistribute`` (another world size or worker count mid-epoch), an epoch may carry a
  *skip mask* over its order's positions: those already consumed by the old consumers. The new
  consumers split only the rest, the same way. The mask is stored packed (bits, zlib, base64):
  the consumed set is nearly a prefix of the order, so it compresses to a few bytes.
"""

from __future__ import annotations

import base64
import hashlib
import zlib

import numpy as np


def seed_of(*parts) -> int:
    return int.from_bytes(hashlib.sha256(repr(parts).encode()).digest()[:8], "little")


def epoch_order(
    shard: np.ndarray, *, seed: int, epoch: int, source: str, buffer: int, shuffle_shards: bool
) -> np.ndarray:
    """A permutation of sample ids [0, N) for one source and epoch."""
    n_shards = int(shard.max()) + 1 if len(shard) else 0
    rng = np.random.default_rng(seed_of(seed, epoch, source, "order"))
    shard_perm = rng.permutation(n_shards) if shuffle_shards else np.arange(n_shards)
    rank_of_shard = np.empty(n_shards, np.int64)
    rank_of_shard[shard_perm] = np.arange(n_shards)
    # Stable sort by shard position keeps each shard's samples in index order.
    order = np.argsort(rank_of_shard[shard], kind="stable")
    if buffer > 1:
        for start in range(0, len(order), buffer):
            window = order[start : start + buffer]
            order[start : start + buffer] = window[rng.permutation(len(window))]
    return order


def consumer_slice(order: np.ndarray, consumer: int, consumers: int) -> np.ndarray:
    return order[consumer::consumers]


def pack_mask(mask: np.ndarray) -> str:
    """A boolean mask as text for a loader state (JSON and ``torch.load(weights_only=True)`` safe)."""
    return base64.b64encode(zlib.compress(np.packbits(mask.astype(bool)).tobytes(), 6)).decode(
        "ascii"
    )


def unpack_mask(text: str, n: int) -> np.ndarray:
    bits = np.frombuffer(zlib.decompress(base64.b64decode(text)), np.uint8)
    if len(bits) != (n + 7) // 8:
        raise ValueError(f"a skip mask of {len(bits) * 8} bits for an epoch order of {n} samples")
    return np.unpackbits(bits, count=n).astype(bool)
