"""How a batch gets from a DataLoader worker to the trainer's process: through slots of shared
memory that the worker allocates once and packs into in place (its compact layout, expand.py),
and one copy on the trainer's side, which then frees the slot; why not a tensor in the worker
queue: docs/loader.md, "One read per document; a compact batch, expanded where it is handed
out". A worker sends only a slot's number (its first message carries the slots themselves).
Slots outnumber the batches a worker may have in flight (``prefetch_factor`` plus the one being
packed); should none be free anyway, the worker packs into ordinary arrays, which the queue
hands over pickled: slower, never stuck.
"""

from __future__ import annotations

import os
import threading
import time

import numpy as np
import torch

_FREE, _FULL = 0, 1
_WAIT_S = 1.0  # how long a worker waits for a free slot before it packs outside the ring


class SlotRing:
    """A worker's shared buffers (created in the worker, mapped once by the trainer)."""

    def __init__(self, slots: int, numel: int) -> None:
        self.token = f"{os.getpid()}-{time.monotonic_ns()}"  # this worker's run, for the registry
        # int32: the compact layout's ids, and its modalities four to an element (expand.py)
        self.data = torch.empty((slots, numel), dtype=torch.int32).share_memory_()
        self.flags = torch.zeros(slots, dtype=torch.int32).share_memory_()
        self.sent = False  # the trainer has been sent the slots (with the first batch)
        self._flags = self.flags.numpy()  # numpy views: a torch call per flag cost microseconds

    def acquire(self) -> int | None:
        """A free slot (marked full: the worker packs into it), or None after ``_WAIT_S``."""
        deadline = time.monotonic() + _WAIT_S
        while True:
            if len(free := np.flatnonzero(self._flags == _FREE)):
                self._flags[free[0]] = _FULL
                return int(free[0])
            if time.monotonic() > deadline:
                return None
            time.sleep(0.001)

    def release(self, i: int) -> None:
        """Give back a slot acquired but not sent (no batch was packed into it)."""
        self._flags[i] = _FREE


# Trainer side: token -> (data, flags) as numpy views of the ring's shared tensors
_rings: dict[str, tuple[np.ndarray, np.ndarray]] = {}
_lock = threading.Lock()  # the DataLoader's pin-memory thread takes batches out too


def slot(token: str, index: int, ring: tuple | None) -> np.ndarray:
    """Slot ``index`` of the ring ``token`` (``ring``: its tensors, sent with a worker's first
    batch), as a numpy view: the trainer's process expands the batch straight from it, then
    calls ``free``."""
    with _lock:
        if ring is not None:
            _rings[token] = (ring[0].numpy(), ring[1].numpy())
        data, _ = _rings[token]
    return data[index]


def free(token: str, index: int) -> None:
    """Give slot ``index`` back to its worker (the batch has been expanded out of it)."""
    with _lock:
        _, flags = _rings[token]
    flags[index] = _FREE


def forget(token: str) -> None:
    with _lock:
        _rings.pop(token, None)
