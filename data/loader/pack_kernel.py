"""Mixing and packing, compiled (numba): which source's chunk comes next, and its placement in
rows of ``seq_len`` tokens, made on arrays, a whole batch per call. The one implementation:
a consumer stream's batches and its epoch count (stream_arrays.py) and documents packed in order
for evaluation and probes (pack_documents.py) all go through ``pack_batch``. Its rules (mixing by
tokens a chunk at a time, blocks never split, documents held aside, blocks longer than a row
dropped and counted, ``whole`` documents) and why it is compiled: docs/loader.md, "Choices".

Design choices:
- Consecutive chunks of one document that land side by side in a row are one *piece*, so the
  chunking costs no context where nothing came between them. Attention is masked per piece,
  positions restart at 0 in each, and every label is the token that truly follows in its
  document (so the last token of a split piece is still trained on); a document's last token,
  the token before a dropped block, and padding get the ignore index.
- A batch is written compact: ids, modalities, a table of segments (stretches of one document
  in a row, and each row's padding) and one of visual blocks; data/loader/expand.py derives
  every other per-token field from it where the batch is handed out.
- ``state[ST_DRY]``: counting only (an epoch's batches): the same decisions from the index's
  lengths and blocks, no token read or copied. ``NUMBA_DISABLE_JIT=1`` runs the same functions
  as plain Python, for a debugger.
- Documents come from Python into a queue per source: a row of ``docs`` each, their packing
  units in ``units``, their tokens in one staging array of all sources (int32 ids, uint8
  modalities; plain arrays: the compiled code is cached on disk and loads in every process).
  When a queue runs dry mid-batch the kernel returns ``NEED`` with the source, at a point it
  can resume from (the row being built is kept in ``state``); Python reads more and calls
  again.
- All state lives in the arrays below, so a stream's ``state_dict`` reads it from there.
"""

from __future__ import annotations

from dataclasses import astuple, dataclass

import numpy as np
from numba import njit

from data.loader.expand import IGNORE, TEXT
from data.loader.stage_kernel import copy_run, fill_units, gather_tokens

# docs columns
(
    D_SRC,
    D_SAMPLE,
    D_EPOCH,
    D_LEN,
    D_UNIT,
    D_OFF,
    D_LIMIT,
    D_TOK,
    D_U0,
    D_NU,
    D_NBLK,
    D_CEPOCH,
    D_CPOS,
    D_CERRS,
) = range(14)
N_DOC_COLS = 14
# units columns: start, end, atomic, t, h, w
U_START, U_END, U_ATOMIC, U_T, U_H, U_W = range(6)
# src columns (per source)
(
    S_TOKENS,  # tokens placed in rows (what the batches handed out carry: data/mix in final.json)
    S_DONE,
    S_ENDED,
    S_QHEAD,
    S_QLEN,
    S_NOPEN,
    S_CEPOCH,
    S_CPOS,
    S_BATCH_TOKENS,
    S_DROP_IMAGE,
    S_DROP_VIDEO,
    S_CERRS,
    S_END_EPOCH,
    S_END_POS,
    S_END_ERRS,
    S_MIX,  # tokens the mix counts: since the weights last changed (PackedLoader.load_state_dict)
) = range(16)
N_SRC_COLS = 16
# state entries (the packer's and the batch's progress)
(
    ST_NPENDING,
    ST_ROW_ACTIVE,
    ST_POS,
    ST_NCARRY,
    ST_NDEFER,
    ST_ROWS_DONE,
    ST_NSEG,
    ST_NBLK,
    ST_NPIECES,
    ST_ROW_P0,
    ST_TAIL,
    ST_NVIS,
    ST_NEED,
    ST_BATCH_ACTIVE,
    ST_STAT_ROWS,
    ST_STAT_REAL,
    ST_STAT_DBLOCKS,
    ST_STAT_DDOCS,
    ST_DRY,
) = range(19)
N_ST = 19
# The packing counters (PackStats' fields, in order)
STAT_COLS = [ST_STAT_ROWS, ST_STAT_REAL, ST_STAT_DBLOCKS, ST_STAT_DDOCS]
# return codes of pack_batch
PACKED, NEED, END = 0, 1, 2
# outcomes of placing a document
_DONE, _FULL, _BLOCKED = 0, 1, 2


@njit(cache=True, inline="always")
def _position(docs, units, doc):
    unit_at = docs[doc, D_UNIT]
    if unit_at < docs[doc, D_NU]:
        return units[docs[doc, D_U0] + unit_at, U_START] + docs[doc, D_OFF]
    return docs[doc, D_LEN]


@njit(cache=True, inline="always")
def _chunk_end(docs, units, doc, size):
    target = min(docs[doc, D_LIMIT] + size, docs[doc, D_LEN])
    unit0 = docs[doc, D_U0]
    for idx in range(unit0, unit0 + docs[doc, D_NU]):
        if units[idx, U_ATOMIC] and units[idx, U_START] < target < units[idx, U_END]:
            return units[idx, U_END]
    return target


@njit(cache=True, inline="always")
def _ready(docs, units, src, opened, source):
    """The first open document of ``source`` whose chunk so far is placed (-1: none); documents
    that ended early (dropped) leave the list."""
    i = 0
    while i < src[source, S_NOPEN]:
        doc = opened[source, i]
        placed = _position(docs, units, doc)
        if placed >= docs[doc, D_LEN]:
            count = src[source, S_NOPEN]
            opened[source, i : count - 1] = opened[source, i + 1 : count].copy()
            src[source, S_NOPEN] = count - 1
            continue
        if placed >= docs[doc, D_LIMIT]:
            return doc
        i += 1
    return -1


@njit(cache=True, inline="always")
def _pick_source(docs, units, src, opened, shares, mixed):
    total = 0
    for source in range(src.shape[0]):
        total += src[source, S_MIX]
    best = -1
    best_gap = 0.0
    for source in mixed:
        if src[source, S_DONE] and _ready(docs, units, src, opened, source) < 0:
            continue
        gap = shares[source] * total - src[source, S_MIX]
        if best < 0 or gap > best_gap:
            best, best_gap = source, gap
    return best


@njit(cache=True, inline="always")
def _next_doc(docs, units, src, opened, queue, shares, mixed, state, chunk):
    """The next chunk's document (its limit moved on); -1 when every source is done, -2 when
    a source's queue ran dry (state[ST_NEED] says which; nothing was changed)."""
    while True:
        source = _pick_source(docs, units, src, opened, shares, mixed)
        if source < 0:
            return -1
        doc = _ready(docs, units, src, opened, source)
        fresh = doc < 0
        if fresh:
            if src[source, S_QLEN] == 0:
                if src[source, S_ENDED]:
                    # where the read-ahead found the end (past any unreadable last documents)
                    src[source, S_DONE] = 1
                    src[source, S_CEPOCH] = src[source, S_END_EPOCH]
                    src[source, S_CPOS] = src[source, S_END_POS]
                    src[source, S_CERRS] = src[source, S_END_ERRS]
                    continue
                state[ST_NEED] = source
                return -2
            head = src[source, S_QHEAD]
            doc = queue[source, head]
            src[source, S_QHEAD] = head + 1  # refilled from 0 only when empty: never wraps
            src[source, S_QLEN] -= 1
            src[source, S_CEPOCH], src[source, S_CPOS] = docs[doc, D_CEPOCH], docs[doc, D_CPOS]
            src[source, S_CERRS] = docs[doc, D_CERRS]  # the skips read before it, now taken
            docs[doc, D_LIMIT] = 0
        start = docs[doc, D_LIMIT]
        docs[doc, D_LIMIT] = _chunk_end(docs, units, doc, chunk)
        src[source, S_MIX] += docs[doc, D_LIMIT] - start
        if docs[doc, D_LIMIT] < docs[doc, D_LEN]:
            if fresh:
                count = src[source, S_NOPEN]
                if count == opened.shape[1]:  # bounded by max_pending + 2; never unchecked
                    raise RuntimeError("pack_kernel: more open documents than max_pending allows")
                opened[source, count] = doc
                src[source, S_NOPEN] = count + 1
        elif not fresh:
            count = src[source, S_NOPEN]
            for i in range(count):
                if opened[source, i] == doc:
                    opened[source, i : count - 1] = opened[source, i + 1 : count].copy()
                    src[source, S_NOPEN] = count - 1
                    break
        return doc


@njit(cache=True, inline="always")
def _segment(seg, state, start, end, piece, offset, label, label_mod):
    """One more row of the batch's segments (expand.CompactBatch.segments)."""
    idx = state[ST_NSEG]
    seg[idx, 0], seg[idx, 1], seg[idx, 2] = start, end, piece
    seg[idx, 3], seg[idx, 4], seg[idx, 5] = offset, label, label_mod
    state[ST_NSEG] = idx + 1


@njit(cache=True, inline="always")
def _flush(work, doc, row_a, doc_a, row_b, cut, L):
    """Doc tokens [doc_a, doc_a + row_b - row_a) at row positions [row_a, row_b), one piece
    (joined to the row's last piece when it continues it). ``cut``: the document's next token
    starts a dropped block, so the piece's last token predicts nothing."""
    docs, _units, src, staged_ids, staged_mod, state, out = work
    out_ids, out_mod, seg, _blocks, pieces, _row_pieces, vis, _real = out
    count = row_b - row_a
    if count <= 0:
        return
    state[ST_STAT_REAL] += count
    doc_b = doc_a + count
    source = docs[doc, D_SRC]
    piece0, np_ = state[ST_ROW_P0], state[ST_NPIECES]
    last = np_ - 1
    if state[ST_TAIL] == doc and np_ > piece0 and pieces[last, 3] == doc_a:
        pid = last - piece0
        piece_a = pieces[last, 2]
        row_piece_a = row_a - (doc_a - piece_a)
        pieces[last, 3] = doc_b
    else:
        pid, piece_a, row_piece_a = np_ - piece0, doc_a, row_a
        pieces[np_, 0], pieces[np_, 1], pieces[np_, 2], pieces[np_, 3] = (
            source,
            docs[doc, D_SAMPLE],
            doc_a,
            doc_b,
        )
        state[ST_NPIECES] = np_ + 1
    state[ST_TAIL] = doc
    base = state[ST_ROWS_DONE] * L
    ids, mod, tok = staged_ids, staged_mod, docs[doc, D_TOK]
    if not state[ST_DRY] and not (
        copy_run(out_ids[base + row_a : base + row_b], ids[tok + doc_a : tok + doc_b], count)
        and copy_run(out_mod[base + row_a : base + row_b], mod[tok + doc_a : tok + doc_b], count)
    ):
        raise ValueError("pack_batch: a piece lies outside the batch or its document")
    label, label_mod = IGNORE, TEXT  # dry, or the document's last token: nothing follows
    if not state[ST_DRY] and doc_b < docs[doc, D_LEN]:
        label = IGNORE if cut else ids[tok + doc_b]
        label_mod = mod[tok + doc_b]
    _segment(seg, state, base + row_a, base + row_b, pid, doc_a - piece_a, label, label_mod)
    src[source, S_BATCH_TOKENS] += count
    src[source, S_TOKENS] += count
    if docs[doc, D_NBLK]:  # the row's end writes the blocks the piece holds, if any
        slot = state[ST_NVIS]
        if slot > 0 and vis[slot - 1, 0] == pid:
            slot -= 1
        vis[slot, 0], vis[slot, 1], vis[slot, 2], vis[slot, 3], vis[slot, 4] = (
            pid,
            doc,
            row_piece_a,
            piece_a,
            doc_b,
        )
        state[ST_NVIS] = slot + 1


@njit(cache=True, inline="always")
def _place(work, doc, pos, L, drop_document, whole):
    """Place as much of document ``doc`` as fits from pos: (outcome, new pos), the outcome done
    (its chunk placed), full (the row filled, the document continues) or blocked (a block, or
    a whole document, must wait for a later row)."""
    docs, units, src, _staged_ids, _staged_mod, state, _out = work
    n_units, unit, offset = docs[doc, D_NU], docs[doc, D_UNIT], docs[doc, D_OFF]
    limit, length, unit0 = docs[doc, D_LIMIT], docs[doc, D_LEN], docs[doc, D_U0]
    # whole_documents, or a picture/clip in it: a document that fits a row waits for one, unsplit
    if (
        (whole or docs[doc, D_NBLK] > 0)
        and pos > 0
        and unit == 0
        and offset == 0
        and limit == length
        and L - pos < length <= L
    ):
        return _BLOCKED, pos
    piece_start = pos
    doc_start = units[unit0 + unit, U_START] + offset if unit < n_units else length
    outcome = _DONE
    while unit < n_units:
        unit_at = unit0 + unit
        doc_at = units[unit_at, U_START] + offset
        if doc_at >= limit:
            break
        left = units[unit_at, U_END] - doc_at
        if units[unit_at, U_ATOMIC]:
            if left > L:
                _flush(work, doc, piece_start, doc_start, pos, True, L)
                src[docs[doc, D_SRC], S_DROP_VIDEO if units[unit_at, U_T] else S_DROP_IMAGE] += 1
                if drop_document:
                    state[ST_STAT_DDOCS] += 1
                    docs[doc, D_UNIT], docs[doc, D_OFF] = n_units, offset
                    return _DONE, pos
                state[ST_STAT_DBLOCKS] += 1
                unit += 1
                piece_start = pos
                doc_start = units[unit0 + unit, U_START] + offset if unit < n_units else length
                continue
            if left > L - pos:
                outcome = _FULL if pos == L else _BLOCKED
                break
            pos += left
            unit += 1
        else:
            idx = min(left, L - pos, limit - doc_at)
            if idx == 0:
                outcome = _FULL
                break
            pos += idx
            if idx == left:
                unit, offset = unit + 1, 0
            else:
                offset += idx
    docs[doc, D_UNIT], docs[doc, D_OFF] = unit, offset
    _flush(work, doc, piece_start, doc_start, pos, False, L)
    return outcome, pos


@njit(cache=True, inline="always")
def _end_row(work, pos, L, pad_id):
    """A row's padding (one more segment: piece the row's piece count, or -1 in an empty row)
    and its visual blocks, in row order."""
    docs, units, _src, _staged_ids, _staged_mod, state, out = work
    out_ids, out_mod, seg, blocks, _pieces, _row_pieces, vis, real = out
    row = state[ST_ROWS_DONE]
    base = row * L
    real[row] = pos
    if pos < L:
        out_ids[base + pos : base + L] = pad_id
        out_mod[base + pos : base + L] = TEXT
        npieces = state[ST_NPIECES] - state[ST_ROW_P0]
        _segment(seg, state, base + pos, base + L, npieces if npieces else -1, 0, IGNORE, 0)
    n_blocks = state[ST_NBLK]
    for slot in range(state[ST_NVIS]):
        doc, row_a, doc_a, doc_b = vis[slot, 1], vis[slot, 2], vis[slot, 3], vis[slot, 4]
        last = base + row_a + doc_b - doc_a
        unit0 = docs[doc, D_U0]
        for idx in range(unit0, unit0 + docs[doc, D_NU]):
            if units[idx, U_ATOMIC] and units[idx, U_START] >= doc_a and units[idx, U_END] <= doc_b:
                if n_blocks == blocks.shape[0]:  # blocks shorter than 4 tokens: a bad index
                    raise ValueError("pack_kernel: more visual blocks than a batch can hold")
                blocks[n_blocks, 0] = base + row_a + units[idx, U_START] - doc_a
                blocks[n_blocks, 1] = last
                blocks[n_blocks, 2:5] = units[idx, U_T : U_W + 1]  # the grid, as fill_units
                n_blocks += 1
    state[ST_NBLK] = n_blocks


@njit(cache=True, inline="always")
def _place_held(work, doc, pos, L, drop_document, whole, carry, defer, n_carry, n_defer):
    """``_place``, then the document held aside when it filled the row (carried into the next)
    or a block of it must wait (deferred): (pos, carried, deferred)."""
    outcome, pos = _place(work, doc, pos, L, drop_document, whole)
    if outcome == _FULL:
        carry[n_carry] = doc
        n_carry += 1
    elif outcome == _BLOCKED:
        defer[n_defer] = doc
        n_defer += 1
    return pos, n_carry, n_defer


@njit(cache=True)
def pack_batch(arrays, out, params):
    """Pack rows until the batch has ``B`` (PACKED), a queue runs dry (NEED: state[ST_NEED] is the
    source; call again once it has documents) or the data ended (END: the incomplete batch is
    held back by a stream; ``pack_documents`` fills it up with blank rows). ``arrays``, ``out``
    and ``params``: as ``Packing.run`` passes them."""
    docs, units, src, opened, queue, pending, carry, defer, shares, mixed, state, ids, mod = arrays
    work = (docs, units, src, ids, mod, state, out)
    row_pieces = out[5]
    n_rows, seq_len, chunk, max_pending, drop_document, whole, pad_id = params
    if not state[ST_BATCH_ACTIVE]:
        state[ST_BATCH_ACTIVE] = 1
        state[ST_ROWS_DONE] = state[ST_NSEG] = state[ST_NBLK] = state[ST_NPIECES] = 0
        src[:, S_BATCH_TOKENS] = 0
    while state[ST_ROWS_DONE] < n_rows:
        if not state[ST_ROW_ACTIVE]:  # a new row: the documents held aside go first
            state[ST_ROW_ACTIVE] = 1
            state[ST_ROW_P0] = state[ST_NPIECES]
            state[ST_TAIL] = -1
            state[ST_NVIS] = 0
            pos, n_carry, n_defer = 0, 0, 0
            for i in range(state[ST_NPENDING]):
                doc = pending[i]
                if pos == seq_len:
                    defer[n_defer] = doc
                    n_defer += 1
                    continue
                pos, n_carry, n_defer = _place_held(
                    work, doc, pos, seq_len, drop_document, whole, carry, defer, n_carry, n_defer
                )
            state[ST_NPENDING] = 0
        else:  # resumed after NEED
            pos, n_carry, n_defer = state[ST_POS], state[ST_NCARRY], state[ST_NDEFER]
        while pos < seq_len and n_defer < max_pending:
            doc = _next_doc(docs, units, src, opened, queue, shares, mixed, state, chunk)
            if doc == -2:
                state[ST_POS], state[ST_NCARRY], state[ST_NDEFER] = pos, n_carry, n_defer
                return NEED
            if doc == -1:
                break
            pos, n_carry, n_defer = _place_held(
                work, doc, pos, seq_len, drop_document, whole, carry, defer, n_carry, n_defer
            )
        pending[:n_carry] = carry[:n_carry]
        pending[n_carry : n_carry + n_defer] = defer[:n_defer]
        state[ST_NPENDING] = n_carry + n_defer
        state[ST_ROW_ACTIVE] = 0
        if pos == 0 and n_carry + n_defer == 0:
            state[ST_BATCH_ACTIVE] = 0
            return END
        state[ST_STAT_ROWS] += 1
        row_pieces[state[ST_ROWS_DONE]] = state[ST_NPIECES] - state[ST_ROW_P0]
        _end_row(work, pos, seq_len, pad_id)
        state[ST_ROWS_DONE] += 1
    state[ST_BATCH_ACTIVE] = 0
    return PACKED


# The documents a stream hands the loop (``Doc``: a document as read; its units, stretches of
# text and visual blocks: ``units_of``) and the packing counters (``PackStats``)
_NO_UNITS = np.zeros((0, 6), np.int64)


def units_of(length: int, blocks) -> np.ndarray:
    """A document's packing units, int64 [n, 6] (start, end, atomic, t, h, w: the
    rows of ``Packing.units``): the text between its visual blocks (``[start, end, t, h, w]`` each) and the
    blocks, in order; made as a checked shard's runs make theirs (stage_kernel.fill_units)."""
    if not len(blocks):  # text and code only: most documents
        return np.array([[0, length, 0, 0, 0, 0]], np.int64) if length else _NO_UNITS
    table = np.array(blocks, np.int64).reshape(-1, 5)
    table.flags.writeable = False  # as a shard's index holds them: one compiled signature
    units = np.empty((2 * len(table) + 1, 6), np.int64)
    first, count = np.zeros(1, np.int64), np.array([len(table)], np.int64)
    where = [np.zeros(1, np.int64) for _ in range(2)]  # unit0, n_units (unused here)
    end = fill_units(units, 0, first, np.array([length]), first, count, table, *where)
    return units[:end]


@dataclass(slots=True)
class Doc:
    source: int
    sample: int
    epoch: int
    length: int
    units: np.ndarray  # units_of
    ids: np.ndarray | None = None  # int32 [length] (None in a dry stream: lengths only)
    mod: np.ndarray | None = None


@dataclass
class PackStats:
    rows: int = 0
    real_tokens: int = 0
    dropped_blocks: int = 0
    dropped_docs: int = 0


class Packing:
    """The arrays ``pack_batch`` works on, for ``n_sources`` sources: documents as rows of
    ``docs`` (their units in ``units``, their tokens staged in ``staged_ids``/``staged_mod``),
    the queues, the documents held aside and open, the packing counters, and one batch's
    tables. A stream (stream_arrays.StreamArrays) and ``pack_documents`` bring the documents
    in; ``run`` packs a batch. ``params``: (rows, seq_len, chunk, max_pending, drop_document,
    whole, pad_id); ``open_cap``: open documents per source it holds; ``held_cap``: documents
    held aside; ``queue_cap``: queued documents per source."""

    def __init__(
        self,
        n_sources: int,
        params: tuple,
        *,
        open_cap: int,
        held_cap: int,
        stats: PackStats,
        shares: list[float] | None = None,  # None: one source
        mixed: list[int] | None = None,
        queue_cap: int = 1,
        dry: bool = False,
        docs_cap: int = 8192,
    ) -> None:
        rows, seq_len, chunk, max_pending, drop_document, whole, pad_id = params
        # one compiled signature: the same Python types in every caller
        sizes = (int(rows), int(seq_len), int(chunk), int(max_pending))
        self.params = (*sizes, bool(drop_document), bool(whole), int(pad_id))
        self.B, self.L = sizes[:2]
        self.dry = dry
        # A few batches' tokens: the least the staging arrays are made for
        self.refill_tokens = 4 * self.B * self.L
        self.docs = np.zeros((docs_cap, N_DOC_COLS), np.int64)
        self.units = np.zeros((2 * docs_cap, 6), np.int64)
        self.ndocs = self.nunits = 0
        self.src = np.zeros((n_sources, N_SRC_COLS), np.int64)
        self.opened = np.zeros((n_sources, open_cap), np.int64)
        self.queue = np.zeros((n_sources, queue_cap), np.int64)
        self.pending, self.carry, self.defer = (np.zeros(held_cap, np.int64) for _ in range(3))
        self.shares = np.asarray(shares or [1.0], np.float64)
        self.mixed = np.asarray(mixed or [0], np.int64)
        self.state = np.zeros(N_ST, np.int64)
        self.state[ST_DRY] = int(dry)
        self.state[STAT_COLS] = astuple(stats)
        self.staged_ids = np.zeros(0, np.int32)
        self.staged_mod = np.zeros(0, np.uint8)
        self.staged_end = 0
        size = self.B * self.L
        self.seg = np.zeros((size + self.B, 6), np.int64)
        self.blocks = np.zeros((size // 4 + 16, 5), np.int64)
        self.pieces = np.zeros((size, 4), np.int64)
        self.row_pieces = np.zeros(self.B, np.int64)
        self.vis = np.zeros((self.L, 5), np.int64)

    def run(self, ids: np.ndarray, mod: np.ndarray, real: np.ndarray, refill) -> int:
        """``pack_batch`` into ``ids``/``mod`` (flat [B * L]) and ``real`` (per row) until it
        returns PACKED or END; ``refill(source)`` brings documents into a queue that ran dry."""
        if self.ndocs > 3 * len(self.docs) // 4:
            self._compact()
        while True:
            arrays = (
                self.docs, self.units, self.src, self.opened, self.queue, self.pending,
                self.carry, self.defer, self.shares, self.mixed, self.state, self.staged_ids,
                self.staged_mod,
            )  # fmt: skip
            out = (ids, mod, self.seg, self.blocks, self.pieces, self.row_pieces, self.vis, real)
            code = pack_batch(arrays, out, self.params)
            if code != NEED:
                return code
            refill(int(self.state[ST_NEED]))

    def stats(self) -> PackStats:
        return PackStats(*self.state[STAT_COLS].tolist())

    def add(self, doc: Doc, cursor: tuple[int, int, int]) -> int:
        """A row of ``docs`` (and its units) for ``doc``, nothing of it placed, the whole of it its
        chunk; its tokens are staged by ``stage``."""
        n_units = len(doc.units)
        self.reserve(1, n_units)
        drow, unit0 = self.ndocs, self.nunits
        self.units[unit0 : unit0 + n_units] = doc.units
        n_blocks = int(doc.units[:, U_ATOMIC].sum())
        self.docs[drow] = (
            doc.source,
            doc.sample,
            doc.epoch,
            doc.length,
            0,
            0,
            doc.length,
            0,
            unit0,
            n_units,
            n_blocks,
            *cursor,
        )
        self.ndocs, self.nunits = drow + 1, unit0 + n_units
        return drow

    def reserve(self, docs: int, units: int) -> None:
        """Room for ``docs`` more rows of ``docs`` and ``units`` more units."""
        while self.ndocs + docs > len(self.docs):
            self.docs = np.concatenate([self.docs, np.zeros_like(self.docs)])
        while self.nunits + units > len(self.units):
            self.units = np.concatenate([self.units, np.zeros_like(self.units)])

    def stage(self, new: list[tuple], runs: list) -> None:
        """The tokens of new documents appended to the staging arrays: ``new`` (row, ids,
        modalities) one by one, and ``runs`` (stream_arrays.StreamArrays._shard_run: rows, per
        shard its map's bytes and which of the rows are its documents, where each document's ids
        and modalities start in its map) in order. When they do not fit, the arrays are made
        again with every source's live documents first (their rows' ``D_TOK`` moved) and room
        for twice what is live."""
        if self.dry:  # no tokens: the kernel reads none
            return
        rows = np.asarray([drow for drow, _, _ in new], np.int64)
        for run in runs:
            rows = np.concatenate([rows, run[0]])
        lengths = self.docs[rows, D_LEN]
        needed = int(lengths.sum())
        if self.staged_end + needed > len(self.staged_ids):
            self._restage(needed)
        self.docs[rows, D_TOK] = self.staged_end + np.cumsum(lengths) - lengths
        self.staged_end += needed
        ids, mod = self.staged_ids, self.staged_mod
        for drow, doc_ids, doc_mod in new:
            offset = int(self.docs[drow, D_TOK])
            ids[offset : offset + len(doc_ids)] = doc_ids
            mod[offset : offset + len(doc_ids)] = doc_mod
        for run_rows, groups, ids_at, mod_at in runs:
            lengths = self.docs[run_rows, D_LEN]
            dst = self.docs[run_rows, D_TOK]
            for mapped, sel in groups:
                gather_tokens(mapped, sel, ids_at, mod_at, lengths, dst, ids, mod)

    def _lists(self) -> list[np.ndarray]:
        """Views of every list of documents still to be placed: held aside (and, in a row being
        built, carried or deferred), open and queued per source."""
        src, state = self.src, self.state
        lists = [self.pending[: state[ST_NPENDING]]]
        if state[ST_ROW_ACTIVE]:
            lists += [self.carry[: state[ST_NCARRY]], self.defer[: state[ST_NDEFER]]]
        for source in range(len(src)):
            head = src[source, S_QHEAD]
            lists.append(self.opened[source, : src[source, S_NOPEN]])
            lists.append(self.queue[source, head : head + src[source, S_QLEN]])
        return lists

    def _restage(self, needed: int) -> None:
        """New staging arrays holding the live documents, with room for ``needed`` more tokens
        (and as many again, so that this happens rarely)."""
        live = np.unique(np.concatenate(self._lists()))  # a document may be in two lists
        lengths = self.docs[live, D_LEN]
        kept = int(lengths.sum())
        size = max(2 * (kept + needed), 2 * self.refill_tokens)
        ids, mod = np.empty(size, np.int32), np.empty(size, np.uint8)
        old_at = self.docs[live, D_TOK].tolist()
        new_at = (np.cumsum(lengths) - lengths).tolist()
        for old, new, count in zip(old_at, new_at, lengths.tolist()):
            ids[new : new + count] = self.staged_ids[old : old + count]
            mod[new : new + count] = self.staged_mod[old : old + count]
        self.docs[live, D_TOK] = new_at
        self.staged_ids, self.staged_mod, self.staged_end = ids, mod, kept

    def _compact(self) -> None:
        """Between batches: drop the rows of documents nothing refers to any more."""
        keep = np.unique(np.concatenate(self._lists()))
        remap = np.full(self.ndocs, -1, np.int64)
        remap[keep] = np.arange(len(keep))
        docs = self.docs[keep]
        # their units, in order
        n_units = docs[:, D_NU]
        starts = np.repeat(docs[:, D_U0] - np.cumsum(n_units) + n_units, n_units)
        take = starts + np.arange(int(n_units.sum()))
        units = self.units[take]
        docs[:, D_U0] = np.cumsum(n_units) - n_units
        self.docs[: len(keep)] = docs
        self.units[: len(units)] = units
        self.ndocs, self.nunits = len(keep), len(units)
        for rows in self._lists():
            rows[:] = remap[rows]


@njit(cache=True)
def count_modalities(mod, real, by_modality):
    """A packed batch's real tokens per modality (data/vocab.py's five) into ``by_modality``.
    Compiled: numpy's ``bincount`` first widens the batch's modalities to int64, which costs more
    than the loop that packed them. Padding is text (the loop writes it so): the other four are
    counted over the whole batch in one flat loop, which LLVM vectorises, and text is what they
    leave of the real tokens."""
    n_code = n_image = n_video = n_structure = 0
    for at in range(mod.shape[0]):
        modality = mod[at]
        n_code += modality == 1
        n_image += modality == 2
        n_video += modality == 3
        n_structure += modality == 4
    by_modality[1], by_modality[2], by_modality[3], by_modality[4] = (
        n_code,
        n_image,
        n_video,
        n_structure,
    )
    by_modality[0] = real.sum() - n_code - n_image - n_video - n_structure


@njit(cache=True)
def pieces_table(pieces, row_pieces):
    """int64 [rows, most pieces, 4] (source, sample, start, end) of each row's pieces, -1
    padded: which documents a batch holds (for checks and debugging; the model never sees it).
    Compiled for the same reason as ``count_modalities``: numpy takes a dozen calls a batch."""
    most = 0
    for row in range(row_pieces.shape[0]):
        most = max(most, row_pieces[row])
    out = np.full((row_pieces.shape[0], most, 4), -1, np.int64)
    at = 0
    for row in range(row_pieces.shape[0]):
        for piece in range(row_pieces[row]):
            out[row, piece, :] = pieces[at, :]
            at += 1
    return out
