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
- ``dry=True`` packs lengths only (from the index): the same decisions without reading a tar,
  used to count an epoch's rows on every consumer.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np

from data.vocab import Modality

IGNORE = -100


@dataclass
class Unit:
    start: int
    end: int
    atomic: bool
    t: int = 0  # latent frames (0: image)
    h: int = 0
    w: int = 0


def units_of(length: int, blocks: list) -> list[Unit]:
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


@dataclass
class Doc:
    source: int
    sample: int
    epoch: int
    length: int
    units: list[Unit]
    ids: np.ndarray | None = None  # int32 [length] (None when packing dry)
    mod: np.ndarray | None = None
    unit: int = 0  # next unit to place
    offset: int = 0  # tokens of that unit already placed (text only)
    limit: int = -1  # end of the chunk handed out so far (-1: the whole document)

    def __post_init__(self) -> None:
        if self.limit < 0:
            self.limit = self.length

    def position(self) -> int:
        """Doc tokens already placed or dropped: where the next piece starts."""
        return (
            self.units[self.unit].start + self.offset
            if self.unit < len(self.units)
            else self.length
        )

    def cursor(self) -> list[int]:
        return [self.source, self.sample, self.epoch, self.unit, self.offset, self.limit]

    def chunk_placed(self) -> bool:
        """Every token handed out so far is placed (or dropped): ready for its next chunk."""
        return self.position() >= self.limit

    def chunk_end(self, size: int) -> int:
        """Where the chunk after ``limit`` ends: ``size`` tokens on, stretched to the end of a
        visual block it would cut (a block is never split, not even between chunks)."""
        target = min(self.limit + size, self.length)
        for u in self.units:
            if u.atomic and u.start < target < u.end:
                return u.end
        return target


@dataclass
class Row:
    ids: np.ndarray
    mod: np.ndarray
    labels: np.ndarray
    label_mod: np.ndarray
    doc_ids: np.ndarray
    pos: np.ndarray
    thw: np.ndarray
    image_ids: np.ndarray
    real: int
    pieces: list[tuple[int, int, int, int]] = field(
        default_factory=list
    )  # (source, sample, start, end)
    tail: Doc | None = None  # the document of the last piece (a next chunk of it joins that piece)


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
        dry: bool = False,
    ) -> None:
        if oversize not in ("drop_block", "drop_document"):
            raise ValueError(f"oversize {oversize!r}: choose drop_block or drop_document")
        self.L, self.pad_id, self.max_pending, self.oversize, self.dry = (
            seq_len,
            pad_id,
            max_pending,
            oversize,
            dry,
        )
        self.pending: list[Doc] = []
        self.stats = PackStats()
        # (source, modality) -> blocks dropped for being longer than a row
        self.dropped_by: dict[tuple[int, int], int] = {}

    def _count_drop(self, doc: Doc, unit: Unit) -> None:
        key = (doc.source, int(Modality.VIDEO if unit.t else Modality.IMAGE))
        self.dropped_by[key] = self.dropped_by.get(key, 0) + 1

    # --- one document into the row being built ---------------------------------------------------
    def _place(self, doc: Doc, row: Row | None, pos: int) -> tuple[str, int]:
        """Place as much of ``doc`` as fits from ``pos``; returns (outcome, new pos) with outcome
        "done" (finished), "full" (row filled, doc continues) or "blocked" (a block must wait)."""
        L = self.L
        piece_start, doc_start = pos, doc.position()
        while doc.unit < len(doc.units) and doc.position() < doc.limit:
            u = doc.units[doc.unit]
            left = u.end - u.start - doc.offset
            if u.atomic:
                if left > L:
                    self._flush(doc, row, piece_start, doc_start, pos, cut=True)
                    self._count_drop(doc, u)
                    if self.oversize == "drop_document":
                        self.stats.dropped_docs += 1
                        doc.unit = len(doc.units)
                        return "done", pos
                    self.stats.dropped_blocks += 1
                    doc.unit += 1
                    piece_start, doc_start = pos, doc.position()
                    continue
                if left > L - pos:
                    self._flush(doc, row, piece_start, doc_start, pos)
                    return ("full" if pos == L else "blocked"), pos
                pos += left
                doc.unit += 1
            else:
                k = min(left, L - pos, doc.limit - doc.position())
                if k == 0:
                    self._flush(doc, row, piece_start, doc_start, pos)
                    return "full", pos
                pos += k
                doc.offset += k
                if doc.offset == u.end - u.start:
                    doc.unit, doc.offset = doc.unit + 1, 0
        self._flush(doc, row, piece_start, doc_start, pos)
        return "done", pos

    def _flush(
        self, doc: Doc, row: Row | None, ra: int, a: int, rb: int, cut: bool = False
    ) -> None:
        """Write doc tokens [a, a + rb - ra) at row positions [ra, rb) as one piece. ``cut``: the
        doc's next token starts a dropped block, so the piece's last token predicts nothing."""
        n = rb - ra
        if n <= 0:
            return
        self.stats.real_tokens += n
        if row is None:
            return
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
        row.ids[ra:rb] = doc.ids[a:b]
        row.mod[ra:rb] = doc.mod[a:b]
        nxt = min(b + 1, doc.length)
        row.labels[ra : ra + (nxt - a - 1)] = doc.ids[a + 1 : nxt]
        row.label_mod[ra : ra + (nxt - a - 1)] = doc.mod[a + 1 : nxt]
        if cut:
            row.labels[rb - 1] = IGNORE
        row.doc_ids[ra:rb] = pid
        row.pos[ra:rb] = (a - a0) + np.arange(n)
        row.image_ids[ra0:rb] = -1  # the joined piece's images are numbered again below
        self._thw(doc, row, ra0, a0, b)

    def _thw(self, doc: Doc, row: Row, ra: int, a: int, b: int) -> None:
        p = 0  # M-RoPE position of the next token
        j = a
        blocks = [u for u in doc.units if u.atomic and u.start >= a and u.end <= b]
        if not blocks:  # text only (most pieces): t = h = w = the 1-D position
            row.thw[ra : ra + b - a] = np.arange(b - a)[:, None]
            return
        n_img = int(row.image_ids.max()) + 1
        for u in blocks + [None]:
            stop = u.start if u else b
            if stop > j:  # text before the block
                row.thw[ra + j - a : ra + stop - a] = (p + np.arange(stop - j))[:, None]
                p += stop - j
            if u is None:
                break
            r0 = ra + u.start - a
            row.thw[r0 : r0 + 3] = (p + np.arange(3))[
                :, None
            ]  # <boi>/<bov> and the two size tokens
            p += 3
            frames, h, w = max(u.t, 1), u.h, u.w
            k = r0 + 3
            for f in range(frames):
                if u.t:  # video: <frame> marker
                    row.thw[k] = (p + f, p, p)
                    k += 1
                grid_t = np.full((h, w + 1), p + f)
                grid_h = np.broadcast_to((p + np.arange(h))[:, None], (h, w + 1))
                grid_w = np.broadcast_to(p + np.arange(w + 1)[None, :], (h, w + 1))
                row.thw[k : k + h * (w + 1)] = np.stack([grid_t, grid_h, grid_w], -1).reshape(-1, 3)
                codes = row.mod[k : k + h * (w + 1)] == Modality.IMAGE
                row.image_ids[k : k + h * (w + 1)][codes] = n_img
                k += h * (w + 1)
            n_img += 1 if u.t == 0 else 0
            p += max(frames, h, w + 1)
            row.thw[k] = (p, p, p)  # <eoi>/<eov>
            p += 1
            j = u.end

    def _new_row(self) -> Row | None:
        if self.dry:
            return None
        L = self.L
        return Row(
            ids=np.full(L, self.pad_id, np.int64),
            mod=np.full(L, int(Modality.TEXT), np.int64),
            labels=np.full(L, IGNORE, np.int64),
            label_mod=np.full(L, int(Modality.TEXT), np.int64),
            doc_ids=np.full(L, -1, np.int64),
            pos=np.zeros(L, np.int64),
            thw=np.zeros((L, 3), np.int64),
            image_ids=np.full(L, -1, np.int64),
            real=0,
        )

    # --- one row ----------------------------------------------------------------------------------
    def pack(self, next_doc) -> Row | None:
        """The next row, pulling documents from ``next_doc()`` (None when the data has ended);
        None when nothing is left at all."""
        row, pos = self._new_row(), 0
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
        if row is not None:
            row.real = pos
            if row.pieces:
                pad = row.doc_ids == -1
                row.doc_ids[pad] = len(row.pieces)  # padding: its own "document"
        return row if row is not None else Row(*(None,) * 8, real=pos)  # type: ignore[arg-type]
