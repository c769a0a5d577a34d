"""``pack_documents``: documents packed into rows as the training loader packs them, for
evaluation and probes (the held-out pass, ``earlyfuse-eval``'s dependence probe).

from data.loader import pack_documents
batch = next(pack_documents([doc], len(doc.ids)))   # one document alone in a row of its length
for batch in pack_documents(docs, 2048, batch_rows=8): ...

Design choices:
- The training packer's rules (data/loader/packer.py): text split across rows, a visual block
  never, documents held aside while a block waits, a block longer than a row dropped and
  counted; labels, positions and document ids as the loader writes them.
- A document is anything with ``ids``, ``modality`` and ``blocks`` (``[start, end, t, h, w]``
  each), as data/token_docs.py reads them from token shards.
- Batches come as the loader hands them out (its field names and dtypes, data/loader/
  batch_buffer.py) plus ``num_real_tokens``; the last batch is filled up with blank rows (every
  label ignored), so no document is held back whatever ``batch_rows`` is.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Protocol

import numpy as np
import torch

from data.loader.batch_buffer import BatchBuffer
from data.loader.packer import Doc, Packer, PackStats, Row, units_of


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
    stats: PackStats | None = None,
) -> Iterator[dict[str, torch.Tensor]]:
    """Batches of ``batch_rows`` rows of ``seq_len`` tokens packed from ``docs`` (read lazily, in
    order). ``stats``: updated as rows are packed (rows, real tokens, dropped blocks)."""
    if batch_rows < 1:
        raise ValueError(f"batch_rows {batch_rows}: give at least 1")
    packer = Packer(seq_len, pad_id=pad_id)
    if stats is not None:
        packer.stats = stats
    documents = iter(docs)

    def next_doc() -> Doc | None:
        doc = next(documents, None)
        if doc is None:
            return None
        length = len(doc.ids)
        units = units_of(length, [list(block) for block in doc.blocks])
        return Doc(0, 0, 0, length, units, doc.ids, doc.modality)

    while True:
        rows: list[Row] = []
        while len(rows) < batch_rows:
            row = packer.pack(next_doc, into=Row())
            if row is None:
                break
            rows.append(row)
        if not rows:
            return
        yield finished(packer, rows, batch_rows)


def blank_batch(batch_rows: int, seq_len: int, pad_id: int = 0) -> dict[str, torch.Tensor]:
    """A batch of blank rows (padding, every label ignored): what a rank with fewer batches than
    another evaluates, so that every rank calls the model as often."""
    return finished(Packer(seq_len, pad_id=pad_id), [], batch_rows)


def finished(packer: Packer, rows: list[Row], batch_rows: int) -> dict[str, torch.Tensor]:
    """``rows`` filled up with blank ones to ``batch_rows``, every field written."""
    rows = rows + [Row() for _ in range(batch_rows - len(rows))]
    buffer = BatchBuffer(batch_rows, packer.L, packer.pad_id)
    packer.finish(rows, buffer.fields)
    out = buffer.split()
    out["num_real_tokens"] = torch.tensor(sum(row.real for row in rows))
    return out
