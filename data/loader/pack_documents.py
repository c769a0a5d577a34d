"""``pack_documents``: documents packed into rows by the training loader's compiled loop
(data/loader/pack_kernel.py), in the order given, for evaluation and probes (the held-out pass,
``earlyfuse-eval``'s dependence probe, the needle prompts).

from data.loader import pack_documents
batch = next(pack_documents([doc], len(doc.ids)))   # one document alone in a row of its length
for batch in pack_documents(docs, 2048, batch_rows=8): ...

What it takes and gives (one source, nothing to mix, every document handed out whole, so the
packing rules are the loader's by construction; the last batch filled up with blank rows):
docs/loader.md, "pack_documents(docs, seq_len)". Documents are read lazily, one when the
kernel asks for the next (it returns ``NEED``), so a caller counting what it hands over counts
what was packed; the arrays drop the documents no longer held aside between batches
(``Packing``), so a pass over a whole validation set holds a few batches' documents at a time.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np
import torch

from data.loader import pack_kernel as kernel
from data.loader.batch_buffer import BatchBuffer
from data.loader.expand import IGNORE, TEXT, CompactBatch, expand
from data.loader.pack_kernel import Doc, Packing, PackStats, units_of

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
    stats = stats if stats is not None else PackStats()
    params = (batch_rows, seq_len, _WHOLE, MAX_PENDING, False, whole_documents, pad_id)
    cap = 4 * (MAX_PENDING + 2)
    # One source whose documents come in the order given, one at a time in the queue (read
    # lazily); none opened (each goes out whole)
    packing = Packing(1, params, open_cap=cap, held_cap=cap, stats=stats, docs_cap=16)
    documents, numbers = iter(docs), itertools.count()

    def take(_source: int) -> None:
        """The caller's next document into the queue, or the end of the documents marked."""
        doc = next(documents, None)
        if doc is None:
            packing.src[0, kernel.S_ENDED] = 1
            return
        ids = np.asarray(doc.ids)
        units = units_of(len(ids), doc.blocks)
        drow = packing.add(Doc(0, next(numbers), 0, len(ids), units), (0, 0, 0))
        packing.stage([(drow, ids, doc.modality)], [])
        packing.queue[0, 0] = drow
        packing.src[0, kernel.S_QHEAD], packing.src[0, kernel.S_QLEN] = 0, 1

    size = batch_rows * seq_len
    while True:
        buffer = BatchBuffer(batch_rows, seq_len)
        ids, mod = buffer.fields["ids"].reshape(size), np.empty(size, np.uint8)
        real = np.zeros(batch_rows, np.int64)  # a row not packed stays 0: blank
        code = packing.run(ids, mod, real, take)
        vars(stats).update(vars(packing.stats()))
        state = packing.state
        # PACKED: all rows; END: the rows packed before the documents ran out (none: no batch)
        rows_done = batch_rows if code == kernel.PACKED else int(state[kernel.ST_ROWS_DONE])
        if rows_done == 0:
            return
        segments = packing.seg[: state[kernel.ST_NSEG]].copy()
        blocks = packing.blocks[: state[kernel.ST_NBLK]].copy()
        yield _finished(buffer, pad_id, ids, mod, segments, blocks, rows_done, real)


def blank_batch(batch_rows: int, seq_len: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A batch of blank rows (padding, every label ignored): what a rank with fewer batches than
    another evaluates, so that every rank calls the model as often."""
    buffer = BatchBuffer(batch_rows, seq_len)
    size = batch_rows * seq_len
    ids, mod = buffer.fields["ids"].reshape(size), np.empty(size, np.uint8)
    no_rows = np.zeros((0, 6), np.int64), np.zeros((0, 5), np.int64)
    return _finished(buffer, pad_id, ids, mod, *no_rows, 0, np.zeros(batch_rows, np.int64))


def _finished(
    buffer: BatchBuffer,
    pad_id: int,
    ids: np.ndarray,
    mod: np.ndarray,
    segments: np.ndarray,
    blocks: np.ndarray,
    rows_done: int,
    real: np.ndarray,
) -> dict[str, torch.Tensor]:
    """The batch's fields written (``expand``), its rows from ``rows_done`` on blank (``real``
    0): padding, one segment each (piece -1, label ignored), as the kernel ends an empty row."""
    rows, seq_len = buffer.rows, buffer.L
    ids[rows_done * seq_len :] = pad_id
    mod[rows_done * seq_len :] = TEXT
    blank = np.zeros((rows - rows_done, 6), np.int64)
    blank[:, 0] = np.arange(rows_done, rows) * seq_len
    blank[:, 1] = blank[:, 0] + seq_len
    blank[:, 2], blank[:, 4] = -1, IGNORE
    compact = CompactBatch(rows, seq_len, ids, mod, np.concatenate([segments, blank]), blocks, real)
    expand(compact, buffer.fields)
    out = buffer.split()
    out["num_real_tokens"] = torch.tensor(int(real.sum()))
    return out
