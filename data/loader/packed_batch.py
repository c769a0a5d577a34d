"""What a consumer hands the trainer's process for one batch (``PackedBatch``). Separate
from the stream (stream.py), which decides what goes into a batch: this is how a batch travels
(a slot of shared memory from a worker, pinned memory in the trainer) and is expanded into the
tensors the trainer reads.
"""

from __future__ import annotations

from dataclasses import fields

import numpy as np
import torch

from data.loader import transport
from data.loader.batch_buffer import BatchBuffer
from data.loader.expand import CompactBatch, expand, slot_views
from data.loader.stream_state import StreamState


class PackedBatch:
    """What a consumer hands the trainer's process for one batch: the batch in its compact
    layout (data/loader/expand.py; from a worker, its per-token part in a slot of shared
    memory) and a few small numbers. Not a dict or a list, so the DataLoader neither walks it
    (``default_convert``) nor pins it field by field: ``pin_memory`` expands it into pinned
    memory. ``to_dict`` expands it (once) and splits the result into the batch's tensors, views
    of one buffer."""

    def __init__(
        self,
        compact: CompactBatch,
        pieces: np.ndarray,
        tokens_by_source: list[int],
        dropped: np.ndarray,
        real: int,
        *,
        buffer: BatchBuffer | None = None,
    ) -> None:
        self.compact = compact
        self.pieces = pieces
        self.tokens_by_source = tokens_by_source
        self.dropped = dropped
        self.real = real
        # In-process: the batch's buffer, its ids already written there
        self.buffer = buffer
        self.expanded = False
        self.worker = -1
        self.state: StreamState | None = None  # the stream's after this batch (set by the loader)
        # Packed in a worker's slot of shared memory (data/loader/transport.py): which one, of
        # which worker's ring, and (first batch of a worker) the ring's tensors themselves.
        self.slot: int | None = None
        self.token = ""
        self.ring: tuple | None = None

    def __reduce__(self):
        """Pickled (a worker's batch crossing its queue) with its small int64 tables (segments,
        blocks, row lengths, pieces, drops, the state's arrays) in one buffer of bytes, which
        halves what pickling costs against numpy's array by array (docs/loader.md). The
        expansion's ``buffer`` never crosses: it is made in the trainer's process."""
        compact, state = self.compact, self.state
        arrays = [compact.segments, compact.blocks, compact.real, self.pieces, self.dropped]
        rest = None
        if state is not None:
            values = [getattr(state, field.name) for field in fields(state)]
            arrays += values[:4]
            rest = values[4:]
        if any(array.dtype != np.int64 for array in arrays):
            raise TypeError("PackedBatch: its tables must be int64 to cross a worker's queue")
        ends = np.cumsum([0] + [array.size for array in arrays]).tolist()
        layout = tuple(zip(ends, ends[1:], [array.shape for array in arrays]))
        tables = np.concatenate([array.ravel() for array in arrays]).tobytes()
        head = (compact.rows, compact.seq_len, compact.ids, compact.mod, self.tokens_by_source)
        where = (self.real, self.expanded, self.worker, self.slot, self.token, self.ring)
        return _unpickle, (head, where, tables, layout, rest)

    def expand(self, *, pin: bool = False) -> BatchBuffer:
        """The batch's per-token fields (in the trainer's process: from the slot, which is then
        freed), once; ``pin``: in pinned memory (asked for before anything expands it: the
        DataLoader's pin thread, or an in-process loader that pins)."""
        c = self.compact
        if not self.expanded:
            if self.buffer is None or (pin and not self.buffer.pinned):
                self.buffer = BatchBuffer(c.rows, c.seq_len, pin=pin)
            if self.slot is not None:
                view = transport.slot(self.token, self.slot, self.ring)
                c.ids, c.mod = slot_views(view, c.rows, c.seq_len)
            expand(c, self.buffer.fields)
            if self.slot is not None:
                transport.free(self.token, self.slot)
                self.slot, self.ring = None, None
            c.ids = c.mod = None  # views of a slot a worker now reuses, or of the buffer
            self.expanded = True
        assert self.buffer is not None
        return self.buffer

    def pin_memory(self, device=None) -> PackedBatch:
        self.expand(pin=True)
        return self

    def to_dict(self) -> dict:
        batch = self.expand().split()
        # from_numpy: torch.tensor of Python numbers costs several times more, per batch
        batch["num_real_tokens"] = torch.from_numpy(np.array(self.real, np.int64))
        batch["pieces"] = torch.from_numpy(self.pieces)
        # Every row holds at most one document piece: causal attention is then exact and the
        # model skips the document mask (decided here, on the CPU, so the model never reads its
        # doc ids back from the GPU to find out)
        batch["one_doc_rows"] = torch.from_numpy(np.array(self.pieces.shape[1] <= 1))
        batch["dropped_blocks"] = torch.from_numpy(self.dropped)
        batch["tokens_by_source"] = torch.from_numpy(np.asarray(self.tokens_by_source, np.int64))
        return batch


def _unpickle(head, where, tables, layout, rest) -> PackedBatch:
    """``PackedBatch.__reduce__``'s batch again, its tables views of one writable buffer (the
    compiled expansion takes writable arrays: one signature)."""
    flat = np.frombuffer(bytearray(tables), np.int64)
    arrays = [flat[start:end].reshape(shape) for start, end, shape in layout]
    rows, seq_len, ids, mod, tokens_by_source = head
    segments, blocks, row_real, pieces, dropped = arrays[:5]
    compact = CompactBatch(rows, seq_len, ids, mod, segments, blocks, row_real)
    batch = PackedBatch(compact, pieces, tokens_by_source, dropped, where[0])
    batch.expanded, batch.worker, batch.slot, batch.token, batch.ring = where[1:]
    if rest is not None:
        batch.state = StreamState(*arrays[5:], *rest)
    return batch
