"""The state of a consumer stream, as a snapshot of a few rows of the compiled loop's arrays
(fast_stream.py): taken after every batch (a few microseconds; a worker's batch carries it to
the trainer's process, pickled small) and made the saved dict (stream_state.py's format) only
when a checkpoint asks for it. Columns it copies, and
how they become that dict, stand together here.
"""

from __future__ import annotations

import numpy as np
from numba import njit

from data.loader import pack_kernel as kernel
from data.loader.order import ORDER_VERSION
from data.vocab import Modality

_IMAGE, _VIDEO = int(Modality.IMAGE), int(Modality.VIDEO)

# docs columns of a held-aside or open document's cursor (stream_state's [source, sample,
# epoch, unit, offset, limit]); src columns of a source (cursor, then image/video drops);
# the packing counters
CURSOR_COLS = [
    kernel.D_SRC,
    kernel.D_SAMPLE,
    kernel.D_EPOCH,
    kernel.D_UNIT,
    kernel.D_OFF,
    kernel.D_LIMIT,
]
SRC_COLS = [
    kernel.S_CEPOCH,
    kernel.S_CPOS,
    kernel.S_TOKENS,
    kernel.S_DONE,
    kernel.S_DROP_IMAGE,
    kernel.S_DROP_VIDEO,
]
STAT_COLS = [
    kernel.ST_STAT_ROWS,
    kernel.ST_STAT_REAL,
    kernel.ST_STAT_DBLOCKS,
    kernel.ST_STAT_DDOCS,
]
_COLS = tuple(np.asarray(cols, np.int64) for cols in (SRC_COLS, CURSOR_COLS, STAT_COLS))


@njit(cache=True)
def _copy_rows(
    src, state, pending, n_pending, opened, n_open, docs, src_cols, cursor_cols, stat_cols
):
    """The snapshot's arrays in one compiled call (not numpy's fancy indexing: a few calls per
    source and batch): the sources' cursor columns, the held-aside then each
    source's open documents' cursor columns, the packing counters."""
    out_src = np.empty((src.shape[0], src_cols.shape[0]), np.int64)
    for source in range(src.shape[0]):
        for col in range(src_cols.shape[0]):
            out_src[source, col] = src[source, src_cols[col]]
    total = n_pending
    for source in range(src.shape[0]):
        total += src[source, n_open]
    cursors = np.empty((total, cursor_cols.shape[0]), np.int64)
    at = 0
    for held in range(n_pending):
        for col in range(cursor_cols.shape[0]):
            cursors[at, col] = docs[pending[held], cursor_cols[col]]
        at += 1
    for source in range(src.shape[0]):
        for held in range(src[source, n_open]):
            for col in range(cursor_cols.shape[0]):
                cursors[at, col] = docs[opened[source, held], cursor_cols[col]]
            at += 1
    stats = np.empty(stat_cols.shape[0], np.int64)
    for col in range(stat_cols.shape[0]):
        stats[col] = state[stat_cols[col]]
    return out_src, cursors, stats


def snapshot_arrays(src, state, pending, opened, docs) -> tuple:
    """(source columns, cursors of the held-aside then the open documents, stats) of the
    compiled loop's arrays after a batch."""
    n_pending = int(state[kernel.ST_NPENDING])
    return _copy_rows(src, state, pending, n_pending, opened, kernel.S_NOPEN, docs, *_COLS)


class FastState:
    """A consumer stream's state as a few arrays: what a batch carries from a worker (pickled
    small) and the loader keeps; ``to_dict`` gives the saved dict (stream_state.py's format)."""

    def __init__(self, src, cursors, n_pending, stats, batches, errors, by_modality, skip, skipped):
        self.src, self.cursors, self.n_pending, self.stats = src, cursors, n_pending, stats
        self.batches, self.errors, self.by_modality = batches, errors, by_modality
        self.skip, self.skipped = skip, skipped

    def to_dict(self) -> dict:
        src = self.src.tolist()
        cursors = self.cursors.tolist()
        rows, real, dblocks, ddocs = self.stats.tolist()
        return {
            "cursors": [rec[:4] for rec in src],
            "pending": cursors[: self.n_pending],
            "open": cursors[self.n_pending :],
            "dropped_by": [
                [source, modality, dropped]
                for source, rec in enumerate(src)
                for modality, dropped in ((_IMAGE, rec[4]), (_VIDEO, rec[5]))
                if dropped
            ],
            "batches": self.batches,
            "errors": self.errors,
            "skipped": self.skipped,
            "stats": {
                "rows": rows,
                "real_tokens": real,
                "dropped_blocks": dblocks,
                "dropped_docs": ddocs,
            },
            "tokens_by_modality": self.by_modality.tolist(),
            "skip": [
                [source, epoch, mask]
                for source in range(len(src))
                for epoch, mask in sorted(self.skip[source].items())
                if epoch >= src[source][0]
            ],
            "order": ORDER_VERSION,
        }
