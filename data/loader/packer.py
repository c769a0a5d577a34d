"""Pack documents into rows of ``seq_len`` tokens.

Design choices:
- Text and code may be split across rows; an image or video block never is. A block that
  does not fit in what is left of a row waits (its document is held aside, at most
  ``max_pending`` documents) while later documents fill the row; the held documents start the
  next rows. A block longer than a whole row is dropped (or its document, ``oversize``) and
  counted per source and modality: token shards cannot be re-encoded smaller here (the loader
  refuses such sources at start unless drops are allowed, data/loader/fit.py).
- Documents arrive in *chunks* (``Doc.limit``: the end of the part handed out so far): the
  stream hands out a long document a chunk at a time, interleaved with other sources' chunks,
  so one long document cannot fill many rows in a row (data/loader/stream.py). Consecutive
  chunks of one document that land side by side in a row are joined into one piece, so the
  chunking costs no context where nothing came between them.
- Each row is a set of *pieces* (contiguous runs of one document). Attention is masked per
  piece (``doc_ids``), positions restart at 0 in each piece, and every label is the token that
  truly follows in its document (so the last token of a split piece is still trained on);
  a document's last token, and padding, get the ignore index.
- M-RoPE positions (t, h, w): text advances all three by one per token; inside a visual block
  the codes and row ends take (t0 + frame, t0 + row, t0 + col), and the position after the
  block continues past its largest extent (Qwen2-VL's scheme).
- ``whole_documents``: a document that fits a row and was handed out whole is never split
  across rows; when it does not fit what is left of the row it waits like a block (held aside,
  at most ``max_pending``) and starts a later row. Long-context stages use it so that a long
  file, clip or page is seen in one piece (its every token attends to its whole beginning), at
  the cost of some padding.
- A batch leaves the packer compact (``Packer.compact``: ids, modalities, a table of segments
  and one of visual blocks); data/loader/expand.py derives every other per-token field from it
  where the batch is handed out.
- Batches of a loader's stream are packed by the compiled loop (pack_kernel.py), which follows
  these rules; this packer packs documents given one by one (``pack_documents``: evaluation,
  probes).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from itertools import chain

import numpy as np

from data.loader.batch_buffer import ROW_FIELDS, BatchBuffer
from data.loader.expand import IGNORE, CompactBatch, arange, expand
from data.vocab import Modality

__all__ = ["IGNORE", "CompactBatch", "Doc", "Packer", "Row", "Unit", "units_of"]
# Modalities as plain ints: an IntEnum member next to a numpy array costs an enum attribute
# lookup per operation (numpy probes it for __array_ufunc__ and the like).
_TEXT, _IMAGE, _VIDEO = int(Modality.TEXT), int(Modality.IMAGE), int(Modality.VIDEO)


@dataclass(slots=True)
class Unit:
    start: int
    end: int
    atomic: bool
    t: int = 0  # latent frames (0: image)
    h: int = 0
    w: int = 0


def units_of(length: int, blocks: list) -> list[Unit]:
    if not blocks:  # text and code only: most documents
        return [Unit(0, length, False)] if length else []
    units, pos = [], 0
    for b in sorted(blocks):
        start, end = int(b[0]), int(b[1])
        if start > pos:
            units.append(Unit(pos, start, False))
        units.append(Unit(start, end, True, int(b[2]), int(b[3]), int(b[4])))
        pos = end
    if pos < length:
        units.append(Unit(pos, length, False))
    return units


@dataclass(slots=True)
class Doc:
    source: int
    sample: int
    epoch: int
    length: int
    units: list[Unit]
    ids: np.ndarray | None = None  # int32 [length] (None in a dry stream: lengths only)
    mod: np.ndarray | None = None
    unit: int = 0  # next unit to place
    offset: int = 0  # tokens of that unit already placed (text only)
    limit: int = -1  # end of the chunk handed out so far (-1: the whole document)
    # Its visual blocks (the atomic units), in order: what block checks iterate.
    blocks: list[Unit] = field(init=False, compare=False, repr=False)
    has_blocks: bool = field(init=False, compare=False, repr=False)

    def __post_init__(self) -> None:
        if self.limit < 0:
            self.limit = self.length
        # units_of makes one text unit at most when there is no block
        units = self.units
        if len(units) > 1 or (units and units[0].atomic):
            self.blocks = [u for u in units if u.atomic]
        else:
            self.blocks = []
        self.has_blocks = bool(self.blocks)

    def position(self) -> int:
        """Doc tokens already placed or dropped: where the next piece starts."""
        return (
            self.units[self.unit].start + self.offset
            if self.unit < len(self.units)
            else self.length
        )

    def cursor(self) -> list[int]:
        return [self.source, self.sample, self.epoch, self.unit, self.offset, self.limit]

    def blocks_in(self, a: int, b: int) -> bool:
        """Whether doc tokens [a, b) hold a whole visual block."""
        for u in self.blocks:
            if u.start >= a and u.end <= b:
                return True
        return False


@dataclass
class Row:
    # Per-token fields of a row packed on its own (``Packer.pack`` without ``into``); None in a
    # batch's blank rows, whose fields ``expand`` writes for the whole batch at once.
    ids: np.ndarray | None = None
    mod: np.ndarray | None = None
    labels: np.ndarray | None = None
    label_mod: np.ndarray | None = None
    doc_ids: np.ndarray | None = None
    pos: np.ndarray | None = None
    thw: np.ndarray | None = None
    image_ids: np.ndarray | None = None
    real: int = 0
    pieces: list[tuple[int, int, int, int]] = field(
        default_factory=list
    )  # (source, sample, start, end)
    tail: Doc | None = None  # the document of the last piece (a next chunk of it joins that piece)
    # Placed so far, for ``Packer.compact``: (row start, row end, piece, position offset, label
    # and label modality of the last token) per stretch of one document, and the pieces that
    # hold visual blocks: piece -> (document, row start, document start, document end).
    segments: list[tuple[int, int, int, int, int, int]] = field(default_factory=list)
    visual: dict[int, tuple] = field(default_factory=dict)
    # The ids and modalities of the placed stretches, in row order (views of the documents):
    # ``Packer.compact`` writes a whole batch's with one ``concatenate`` each (two slice
    # assignments per stretch cost more than the copies themselves).
    id_parts: list[np.ndarray] = field(default_factory=list)
    mod_parts: list[np.ndarray] = field(default_factory=list)


def _fields(row: Row) -> dict[str, np.ndarray]:
    return {attr: getattr(row, attr) for attr, _, _ in ROW_FIELDS} | {"thw": row.thw}


def _row_of(buffer: BatchBuffer) -> Row:
    """The one row of a one-row buffer, its fields views of the buffer."""
    f = {attr: view[0] for attr, view in buffer.fields.items()}
    return Row(
        f["ids"],
        f["mod"],
        f["labels"],
        f["label_mod"],
        f["doc_ids"],
        f["pos"],
        f["thw"],
        f["image_ids"],
        0,
    )


@dataclass
class PackStats:
    rows: int = 0
    real_tokens: int = 0
    dropped_blocks: int = 0
    dropped_docs: int = 0

    def as_dict(self) -> dict:
        return dict(self.__dict__)


class Packer:
    def __init__(
        self,
        seq_len: int,
        *,
        pad_id: int,
        max_pending: int = 4,
        oversize: str = "drop_block",
        whole_documents: bool = False,
    ) -> None:
        if oversize not in ("drop_block", "drop_document"):
            raise ValueError(f"oversize {oversize!r}: choose drop_block or drop_document")
        self.L, self.pad_id, self.max_pending, self.oversize = (
            seq_len,
            pad_id,
            max_pending,
            oversize,
        )
        self.whole_documents = whole_documents
        self.pending: list[Doc] = []
        self._pad_ids = np.full(seq_len, pad_id, np.int64)  # a row's padding (finish)
        self._pad_mod = np.full(seq_len, _TEXT, np.int64)
        self.stats = PackStats()
        # (source, modality) -> blocks dropped for being longer than a row
        self.dropped_by: dict[tuple[int, int], int] = {}

    def _count_drop(self, doc: Doc, unit: Unit) -> None:
        key = (doc.source, _VIDEO if unit.t else _IMAGE)
        self.dropped_by[key] = self.dropped_by.get(key, 0) + 1

    # --- one document into the row being built ---------------------------------------------------
    def _place(self, doc: Doc, row: Row, pos: int) -> tuple[str, int]:
        """Place as much of ``doc`` as fits from ``pos``; returns (outcome, new pos) with outcome
        "done" (finished), "full" (row filled, doc continues) or "blocked" (a block must wait)."""
        L, units, limit = self.L, doc.units, doc.limit
        # The cursor in locals (written back before the last flush: _flush does not read it)
        n_units, unit, offset = len(units), doc.unit, doc.offset
        if (
            self.whole_documents
            and pos > 0
            and unit == 0
            and offset == 0
            and limit == doc.length
            and L - pos < doc.length <= L
        ):
            return "blocked", pos  # it fits a whole row: it starts one rather than be split
        if not doc.blocks:  # text only (one unit, or none): the loop below, unrolled
            at = offset if unit < n_units else doc.length
            k = min(L - pos, limit - at) if at < limit else 0  # limit <= length
            if at >= limit:
                outcome = "done"
            elif k == 0:
                outcome = "full"
            elif at + k == doc.length:
                doc.unit, doc.offset, outcome = 1, 0, "done"
            else:
                doc.offset, outcome = at + k, ("full" if at + k < limit else "done")
            self._flush(doc, row, pos, at, pos + k)
            return outcome, pos + k
        piece_start = pos
        doc_start = units[unit].start + offset if unit < n_units else doc.length  # position()
        outcome = "done"
        while unit < n_units:
            u = units[unit]
            at = u.start + offset
            if at >= limit:
                break
            left = u.end - at
            if u.atomic:
                if left > L:
                    self._flush(doc, row, piece_start, doc_start, pos, cut=True)
                    self._count_drop(doc, u)
                    if self.oversize == "drop_document":
                        self.stats.dropped_docs += 1
                        doc.unit, doc.offset = n_units, offset
                        return "done", pos
                    self.stats.dropped_blocks += 1
                    unit += 1
                    piece_start = pos
                    doc_start = units[unit].start + offset if unit < n_units else doc.length
                    continue
                if left > L - pos:
                    outcome = "full" if pos == L else "blocked"
                    break
                pos += left
                unit += 1
            else:
                k = min(left, L - pos, limit - at)
                if k == 0:
                    outcome = "full"
                    break
                pos += k
                if k == left:
                    unit, offset = unit + 1, 0
                else:
                    offset += k
        doc.unit, doc.offset = unit, offset
        self._flush(doc, row, piece_start, doc_start, pos)
        return outcome, pos

    def _flush(self, doc: Doc, row: Row, ra: int, a: int, rb: int, cut: bool = False) -> None:
        """Write doc tokens [a, a + rb - ra) at row positions [ra, rb) as one piece. ``cut``: the
        doc's next token starts a dropped block, so the piece's last token predicts nothing."""
        n = rb - ra
        if n <= 0:
            return
        self.stats.real_tokens += n
        assert doc.ids is not None and doc.mod is not None  # read whenever a row is filled
        b = a + n
        if row.tail is doc and row.pieces[-1][3] == a:
            # The next chunk of the document just placed, right after it: one piece, so its
            # tokens attend to the chunk before and positions run on.
            pid = len(row.pieces) - 1
            a0 = row.pieces[-1][2]
            ra0 = ra - (a - a0)
            row.pieces[-1] = (doc.source, doc.sample, a0, b)
        else:
            pid, a0, ra0 = len(row.pieces), a, ra
            row.pieces.append((doc.source, doc.sample, a, b))
        row.tail = doc
        row.id_parts.append(doc.ids[a:b])
        row.mod_parts.append(doc.mod[a:b])
        # The rest of the fields follow from the segments, for a whole batch at once
        # (``compact``, then data/loader/expand.py): labels, positions, document ids.
        if b < doc.length:  # the piece's last token predicts the document's next one
            tail = (IGNORE if cut else doc.ids.item(b), doc.mod.item(b))
        else:
            tail = (IGNORE, _TEXT)
        row.segments.append((ra, rb, pid, a - a0, *tail))
        if doc.has_blocks and doc.blocks_in(a0, b):
            row.visual[pid] = (doc, ra0, a0, b)

    def compact(self, rows: list[Row], ids: np.ndarray, mod: np.ndarray) -> CompactBatch:
        """A batch of ``rows`` in the compact layout (data/loader/expand.py), its ids and
        modalities written into ``ids`` and ``mod`` ([rows * L], any integer dtype: int32 ids
        and uint8 modalities, in-process the ids straight into their field), padding after each row's
        real tokens. The rows' segments, and after a row's real tokens its padding as one more
        (piece = the row's piece count, or -1 in an empty row), tile the batch."""
        B, L = len(rows), self.L
        counts, id_parts, mod_parts = [], [], []
        real = np.empty(B, np.int64)
        block_rows: list[tuple[int, int, int, int, int]] = []
        for i, r in enumerate(rows):
            id_parts += r.id_parts
            mod_parts += r.mod_parts
            real[i] = r.real
            if r.real < L:
                r.segments.append((r.real, L, len(r.pieces) if r.pieces else -1, 0, IGNORE, 0))
                id_parts.append(self._pad_ids[: L - r.real])
                mod_parts.append(self._pad_mod[: L - r.real])
            counts.append(len(r.segments))
            if r.visual:
                base = i * L
                for pid in sorted(r.visual):  # blocks in row order (images numbered so)
                    doc, ra, a, b = r.visual[pid]
                    last = base + ra + b - a
                    for u in doc.blocks:
                        if u.start >= a and u.end <= b:
                            block_rows.append((base + ra + u.start - a, last, u.t, u.h, u.w))
        np.concatenate(id_parts, out=ids, casting="unsafe")
        np.concatenate(mod_parts, out=mod, casting="unsafe")
        seg = np.fromiter(
            chain.from_iterable(chain.from_iterable(r.segments for r in rows)),
            np.int64,
            count=6 * sum(counts),
        ).reshape(-1, 6)
        for r in rows:  # the padding segment is the batch's, not the row's
            if r.real < L:
                r.segments.pop()
        row_starts = np.repeat(arange(B) * L, counts)
        seg[:, 0] += row_starts
        seg[:, 1] += row_starts
        blocks = np.asarray(block_rows, np.int64).reshape(-1, 5)
        return CompactBatch(B, L, ids, mod, seg, blocks, real)

    def finish(self, rows: list[Row], fields: dict[str, np.ndarray]) -> None:
        """Every field of a batch's rows (``fields``: attr -> [rows, L] arrays, ``thw``
        [rows, L, 3], whose row i is ``rows[i]``'s): the compact batch expanded
        (data/loader/expand.py)."""
        n = len(rows) * self.L
        # uint8 modalities, as everywhere else (one compiled signature of expand)
        batch = self.compact(rows, fields["ids"].reshape(n), np.empty(n, np.uint8))
        expand(batch, fields)

    def _new_row(self) -> Row:
        return _row_of(BatchBuffer(1, self.L, self.pad_id))

    # --- one row ----------------------------------------------------------------------------------
    def pack(self, next_doc, into: Row | None = None) -> Row | None:
        """The next row, pulling documents from ``next_doc()`` (None when the data has ended);
        None when nothing is left at all. ``into``: a blank row of a batch's buffer, whose
        fields ``finish`` writes for the whole batch; without it a
        row of its own is made and finished."""
        row, pos = (into if into is not None else self._new_row()), 0
        waiting, self.pending = self.pending, []
        carry: list[Doc] = []
        deferred: list[Doc] = []
        for doc in waiting:
            if pos == self.L:
                deferred.append(doc)
                continue
            outcome, pos = self._place(doc, row, pos)
            if outcome == "full":
                carry.append(doc)
            elif outcome == "blocked":
                deferred.append(doc)
        while pos < self.L and len(deferred) < self.max_pending:
            doc = next_doc()
            if doc is None:
                break
            outcome, pos = self._place(doc, row, pos)
            if outcome == "full":
                carry.append(doc)
            elif outcome == "blocked":
                deferred.append(doc)
        self.pending = carry + deferred
        if pos == 0 and not self.pending:
            return None
        self.stats.rows += 1
        row.real = pos
        if into is None:
            self.finish([row], {k: v[None] for k, v in _fields(row).items()})
        return row
