"""``pack_documents``: documents packed into rows by the training loader's compiled loop
(data/loader/pack_kernel.py), in the order given, for evaluation and probes (the held-out pass,
``earlyfuse-eval``'s dependence probe, the needle prompts).

from data.loader import pack_documents
batch = next(pack_documents([doc], len(doc.ids)))   # one document alone in a row of its length
for batch in pack_documents(docs, 2048, batch_rows=8): ...

Design choices:
- The kernel the training batches go through, with one source and nothing to mix: every
  document is handed out whole (a chunk larger than any document), in order, so the packing
  rules are the loader's by construction (text split across rows, a visual block never,
  documents held aside while a block waits, a block longer than a row dropped and counted,
  ``whole_documents``), and so are labels, positions and document ids (``expand``).
- Documents are read lazily, one when the kernel asks for the next (it returns ``NEED``), so
  a caller counting what it hands over counts what was packed.
- A document is anything with ``ids``, ``modality`` and ``blocks`` (``[start, end, t, h, w]``
  each), as data/token_docs.py reads them from token shards.
- Batches come as the loader hands them out (its field names and dtypes, data/loader/
  batch_buffer.py) plus ``num_real_tokens``; the last batch is filled up with blank rows (every
  label ignored), so no document is held back whatever ``batch_rows`` is.
- The arrays are cut back to the documents still held aside after every batch, so a pass over
  a whole validation set holds one batch's documents at a time.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np
import torch

from data.loader import pack_kernel as kernel
from data.loader.batch_buffer import BatchBuffer
from data.loader.expand import IGNORE, CompactBatch, expand
from data.loader.packer import PackStats, units_of

# As the training loader's default: documents held aside while a visual block waits for room
MAX_PENDING = 4
# Larger than any document: each is handed out in one chunk (no mixing to interleave)
_WHOLE = 1 << 60


class Document(Protocol):
    ids: np.ndarray
    modality: np.ndarray
    blocks: list


def pack_documents(
    docs: Iterable[Document],
    seq_len: int,
    *,
    batch_rows: int = 1,
    pad_id: int = 0,
    whole_documents: bool = False,
    stats: PackStats | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of ``batch_rows`` rows of ``seq_len`` tokens packed from ``docs`` (read lazily, in
    order). ``whole_documents``: a document that fits a row is never split across rows (the
    loader's ``data.whole_documents``). ``stats``: updated as rows are packed (rows, real tokens,
    dropped blocks and documents)."""
    if batch_rows < 1:
        raise ValueError(f"batch_rows {batch_rows}: give at least 1")
    packing = _InOrder(
        seq_len, batch_rows, pad_id, whole_documents, stats if stats is not None else PackStats()
    )
    documents = iter(docs)
    while (batch := packing.next_batch(documents)) is not None:
        yield batch


def blank_batch(batch_rows: int, seq_len: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A batch of blank rows (padding, every label ignored): what a rank with fewer batches than
    another evaluates, so that every rank calls the model as often."""
    buffer = BatchBuffer(batch_rows, seq_len, pad_id)
    size = batch_rows * seq_len
    ids, mod = buffer.fields["ids"].reshape(size), np.empty(size, np.uint8)
    no_rows = np.zeros((0, 6), np.int64), np.zeros((0, 5), np.int64)
    return _finished(buffer, pad_id, ids, mod, *no_rows, 0)


def _finished(
    buffer: BatchBuffer,
    pad_id: int,
    ids: np.ndarray,
    mod: np.ndarray,
    segments: np.ndarray,
    blocks: np.ndarray,
    rows_done: int,
    real: np.ndarray | None = None,
) -> dict[str, torch.Tensor]:
    """The batch's fields written (``expand``), its rows from ``rows_done`` on blank: padding,
    one segment each (piece -1, label ignored), as the kernel ends an empty row."""
    rows, seq_len = buffer.rows, buffer.L
    lengths = np.zeros(rows, np.int64)
    if real is not None:
        lengths[:rows_done] = real[:rows_done]
    ids[rows_done * seq_len :] = pad_id
    mod[rows_done * seq_len :] = kernel.TEXT
    blank = np.zeros((rows - rows_done, 6), np.int64)
    blank[:, 0] = np.arange(rows_done, rows) * seq_len
    blank[:, 1] = blank[:, 0] + seq_len
    blank[:, 2], blank[:, 4] = -1, IGNORE
    compact = CompactBatch(
        rows, seq_len, ids, mod, np.concatenate([segments, blank]), blocks, lengths
    )
    expand(compact, buffer.fields)
    out = buffer.split()
    out["num_real_tokens"] = torch.tensor(int(lengths.sum()))
    return out


class _InOrder:
    """The compiled loop's arrays for one source whose documents come in the order given."""

    def __init__(
        self, seq_len: int, rows: int, pad_id: int, whole_documents: bool, stats: PackStats
    ) -> None:
        self.L, self.B, self.pad_id, self.whole = seq_len, rows, pad_id, whole_documents
        self.stats = stats
        self.docs = np.zeros((16, kernel.N_DOC_COLS), np.int64)
        self.units = np.zeros((64, 6), np.int64)
        self.staged_ids = np.zeros(4 * seq_len, np.int32)
        self.staged_mod = np.zeros(4 * seq_len, np.uint8)
        self.ndocs = self.nunits = self.ntokens = 0
        self.read = 0  # documents taken from the caller so far
        self.src = np.zeros((1, kernel.N_SRC_COLS), np.int64)
        cap = 4 * (MAX_PENDING + 2)
        self.opened = np.zeros((1, cap), np.int64)  # stays empty: documents go out whole
        self.queue = np.zeros((1, 1), np.int64)  # one document at a time: read lazily
        self.pending, self.carry, self.defer = (np.zeros(cap, np.int64) for _ in range(3))
        self.shares = np.ones(1, np.float64)
        self.mixed = np.zeros(1, np.int64)
        self.state = np.zeros(kernel.N_ST, np.int64)
        self.state[kernel.ST_STAT_ROWS] = stats.rows
        self.state[kernel.ST_STAT_REAL] = stats.real_tokens
        self.state[kernel.ST_STAT_DBLOCKS] = stats.dropped_blocks
        self.state[kernel.ST_STAT_DDOCS] = stats.dropped_docs
        size = rows * seq_len
        self.seg = np.zeros((size + rows, 6), np.int64)
        self.blocks = np.zeros((size // 4 + 16, 5), np.int64)
        self.pieces = np.zeros((size, 4), np.int64)
        self.row_pieces = np.zeros(rows, np.int64)
        self.vis = np.zeros((seq_len, 5), np.int64)

    def next_batch(self, documents: Iterator[Document]) -> dict[str, torch.Tensor] | None:
        self._keep_pending()
        buffer = BatchBuffer(self.B, self.L, self.pad_id)
        size = self.B * self.L
        ids, mod = buffer.fields["ids"].reshape(size), np.empty(size, np.uint8)
        real = np.zeros(self.B, np.int64)
        while True:
            code = kernel.pack_batch(
                self.docs, self.units, self.src, self.opened, self.queue, self.pending,
                self.carry, self.defer, self.shares, self.mixed, self.state, self.staged_ids,
                self.staged_mod, ids, mod, self.seg, self.blocks, self.pieces, self.row_pieces,
                self.vis, real, self.B, self.L, _WHOLE, MAX_PENDING, False, self.whole,
                self.pad_id,
            )  # fmt: skip
            if code != kernel.NEED:
                break
            self._take(next(documents, None))
        state = self.state
        stats = self.stats
        stats.rows = int(state[kernel.ST_STAT_ROWS])
        stats.real_tokens = int(state[kernel.ST_STAT_REAL])
        stats.dropped_blocks = int(state[kernel.ST_STAT_DBLOCKS])
        stats.dropped_docs = int(state[kernel.ST_STAT_DDOCS])
        # PACKED: all rows; END: the rows packed before the documents ran out (none: no batch)
        rows_done = self.B if code == kernel.PACKED else int(state[kernel.ST_ROWS_DONE])
        if rows_done == 0:
            return None
        segments = self.seg[: state[kernel.ST_NSEG]].copy()
        blocks = self.blocks[: state[kernel.ST_NBLK]].copy()
        return _finished(buffer, self.pad_id, ids, mod, segments, blocks, rows_done, real)

    def _take(self, doc: Document | None) -> None:
        """The caller's next document into the queue, or the end of the documents marked."""
        src = self.src
        if doc is None:
            src[0, kernel.S_ENDED] = 1
            return
        ids = np.asarray(doc.ids)
        length = len(ids)
        units = units_of(length, [list(block) for block in doc.blocks])
        while self.ndocs == len(self.docs):
            self.docs = np.concatenate([self.docs, np.zeros_like(self.docs)])
        while self.nunits + len(units) > len(self.units):
            self.units = np.concatenate([self.units, np.zeros_like(self.units)])
        while self.ntokens + length > len(self.staged_ids):
            self.staged_ids = np.concatenate([self.staged_ids, np.zeros_like(self.staged_ids)])
            self.staged_mod = np.concatenate([self.staged_mod, np.zeros_like(self.staged_mod)])
        for unit_at, unit in enumerate(units, self.nunits):
            self.units[unit_at] = (unit.start, unit.end, int(unit.atomic), unit.t, unit.h, unit.w)
        row = self.docs[self.ndocs]
        row[:] = 0
        row[kernel.D_SAMPLE], row[kernel.D_LEN], row[kernel.D_LIMIT] = self.read, length, length
        row[kernel.D_TOK], row[kernel.D_U0] = self.ntokens, self.nunits
        row[kernel.D_NU] = len(units)
        row[kernel.D_NBLK] = sum(unit.atomic for unit in units)
        self.staged_ids[self.ntokens : self.ntokens + length] = ids
        self.staged_mod[self.ntokens : self.ntokens + length] = doc.modality
        self.queue[0, 0] = self.ndocs
        src[0, kernel.S_QHEAD], src[0, kernel.S_QLEN] = 0, 1
        self.ndocs += 1
        self.nunits += len(units)
        self.ntokens += length
        self.read += 1

    def _keep_pending(self) -> None:
        """Between batches: the arrays cut back to the documents held aside (the only ones a
        later row places; the queue is empty, a document is queued when the kernel asks)."""
        count = int(self.state[kernel.ST_NPENDING])
        held = self.pending[:count].copy()
        docs = self.docs[held]
        units, ids, mod = [], [], []
        unit_at = token_at = 0
        for row in docs:
            first, n_units = row[kernel.D_U0], row[kernel.D_NU]
            units.append(self.units[first : first + n_units])
            start, length = row[kernel.D_TOK], row[kernel.D_LEN]
            ids.append(self.staged_ids[start : start + length])
            mod.append(self.staged_mod[start : start + length])
            row[kernel.D_U0], row[kernel.D_TOK] = unit_at, token_at
            unit_at, token_at = unit_at + n_units, token_at + length
        self.docs[:count] = docs
        if count:
            self.units[:unit_at] = np.concatenate(units)
            self.staged_ids[:token_at] = np.concatenate(ids)
            self.staged_mod[:token_at] = np.concatenate(mod)
        self.pending[:count] = np.arange(count)
        self.ndocs, self.nunits, self.ntokens = count, unit_at, token_at
