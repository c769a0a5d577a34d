"""The mixing and packing loop of a consumer stream, compiled (numba): the same decisions as
``ConsumerStream.next_doc`` and ``Packer.pack``/``compact`` (stream.py, packer.py), made on
arrays instead of Python objects, a whole batch per call.

Design choices:
- Why compiled: in Python each chunk handed out and each piece placed cost ~10-30 us of
  interpreter work (issue 18: the loader ran at 0.25x LitData in-process, with the Python per
  document the biggest share). Compiled, a batch's ~20 documents and ~40 pieces cost a few
  microseconds; what is left is copying tokens.
- A transliteration, not a new algorithm: every branch of the Python path has its counterpart
  here, in the same order, so that both give the same batches bit for bit
  (tools/bench/bench_loader_versions.py --check compares them; tests/test_data/
  test_pack_kernel.py packs with both). The Python path stays: it packs dry (counting an
  epoch), single rows (tests, evaluation) and runs where numba is absent.
- Documents come from Python (data/loader/fast_stream.py reads them, with every check and skip
  of ``ConsumerStream.load``) into a queue per source: a row of ``docs`` each, their packing
  units in ``units``, their tokens in a staging array per source (int32 ids, uint8
  modalities). When a queue runs dry mid-batch the kernel returns ``NEED`` with the source, at a
  point it can resume from (the row being built is kept in ``st``); Python reads more and calls
  again.
- All state lives in the arrays below, so the stream's ``state_dict`` reads it from there.
"""

from __future__ import annotations

import numpy as np
from numba import njit

IGNORE = -100
TEXT = 0  # Modality.TEXT (data/vocab.py; tests check they agree)

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
) = range(13)
N_DOC_COLS = 13
# units columns: start, end, atomic, t, h, w
U_START, U_END, U_ATOMIC, U_T, U_H, U_W = range(6)
# src columns (per source)
(
    S_TOKENS,
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
) = range(11)
N_SRC_COLS = 11
# st entries (the packer's and the batch's progress)
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
) = range(18)
N_ST = 18
# return codes of pack_batch
OK, NEED, END = 0, 1, 2
# outcomes of placing a document
_DONE, _FULL, _BLOCKED = 0, 1, 2


@njit(cache=True, inline="always")
def _position(docs, units, d):
    u = docs[d, D_UNIT]
    if u < docs[d, D_NU]:
        return units[docs[d, D_U0] + u, U_START] + docs[d, D_OFF]
    return docs[d, D_LEN]


@njit(cache=True, inline="always")
def _chunk_end(docs, units, d, size):
    target = min(docs[d, D_LIMIT] + size, docs[d, D_LEN])
    u0 = docs[d, D_U0]
    for k in range(u0, u0 + docs[d, D_NU]):
        if units[k, U_ATOMIC] and units[k, U_START] < target < units[k, U_END]:
            return units[k, U_END]
    return target


@njit(cache=True, inline="always")
def _ready(docs, units, src, opened, s):
    """The first open document of source s whose chunk so far is placed (-1: none); documents
    that ended early (dropped) leave the list."""
    i = 0
    while i < src[s, S_NOPEN]:
        d = opened[s, i]
        p = _position(docs, units, d)
        if p >= docs[d, D_LEN]:
            n = src[s, S_NOPEN]
            opened[s, i : n - 1] = opened[s, i + 1 : n].copy()
            src[s, S_NOPEN] = n - 1
            continue
        if p >= docs[d, D_LIMIT]:
            return d
        i += 1
    return -1


@njit(cache=True, inline="always")
def _pick_source(docs, units, src, opened, shares, mixed):
    total = 0
    for s in range(src.shape[0]):
        total += src[s, S_TOKENS]
    best = -1
    best_gap = 0.0
    for s in mixed:
        if src[s, S_DONE] and _ready(docs, units, src, opened, s) < 0:
            continue
        gap = shares[s] * total - src[s, S_TOKENS]
        if best < 0 or gap > best_gap:
            best, best_gap = s, gap
    return best


@njit(cache=True, inline="always")
def _next_doc(docs, units, src, opened, queue, shares, mixed, st, chunk):
    """The next chunk's document (its limit moved on); -1 when every source is done, -2 when
    a source's queue ran dry (st[ST_NEED] says which; nothing was changed)."""
    while True:
        s = _pick_source(docs, units, src, opened, shares, mixed)
        if s < 0:
            return -1
        d = _ready(docs, units, src, opened, s)
        fresh = d < 0
        if fresh:
            if src[s, S_QLEN] == 0:
                if src[s, S_ENDED]:
                    src[s, S_DONE] = 1
                    continue
                st[ST_NEED] = s
                return -2
            head = src[s, S_QHEAD]
            d = queue[s, head]
            src[s, S_QHEAD] = head + 1  # refilled from 0 only when empty: never wraps
            src[s, S_QLEN] -= 1
            src[s, S_CEPOCH], src[s, S_CPOS] = docs[d, D_CEPOCH], docs[d, D_CPOS]
            docs[d, D_LIMIT] = 0
        start = docs[d, D_LIMIT]
        docs[d, D_LIMIT] = _chunk_end(docs, units, d, chunk)
        src[s, S_TOKENS] += docs[d, D_LIMIT] - start
        if docs[d, D_LIMIT] < docs[d, D_LEN]:
            if fresh:
                n = src[s, S_NOPEN]
                opened[s, n] = d
                src[s, S_NOPEN] = n + 1
        elif not fresh:
            n = src[s, S_NOPEN]
            for i in range(n):
                if opened[s, i] == d:
                    opened[s, i : n - 1] = opened[s, i + 1 : n].copy()
                    src[s, S_NOPEN] = n - 1
                    break
        return d


@njit(cache=True, inline="always")
def _blocks_in(docs, units, d, a, b):
    u0 = docs[d, D_U0]
    for k in range(u0, u0 + docs[d, D_NU]):
        if units[k, U_ATOMIC] and units[k, U_START] >= a and units[k, U_END] <= b:
            return True
    return False


@njit(cache=True, inline="always")
def _flush(docs, units, src, ids_l, mod_l, st, out, d, ra, a, rb, cut, L):
    """Doc tokens [a, a + rb - ra) at row positions [ra, rb) as one piece (Packer._flush)."""
    out_ids, out_mod, seg, pieces, vis, mod_count = out
    n = rb - ra
    if n <= 0:
        return
    st[ST_STAT_REAL] += n
    b = a + n
    s = docs[d, D_SRC]
    p0, np_ = st[ST_ROW_P0], st[ST_NPIECES]
    last = np_ - 1
    if st[ST_TAIL] == d and np_ > p0 and pieces[last, 3] == a:
        pid = last - p0
        a0 = pieces[last, 2]
        ra0 = ra - (a - a0)
        pieces[last, 3] = b
    else:
        pid, a0, ra0 = np_ - p0, a, ra
        pieces[np_, 0], pieces[np_, 1], pieces[np_, 2], pieces[np_, 3] = (
            s,
            docs[d, D_SAMPLE],
            a,
            b,
        )
        st[ST_NPIECES] = np_ + 1
    st[ST_TAIL] = d
    base = st[ST_ROWS_DONE] * L
    ids, mod, tok = ids_l[s], mod_l[s], docs[d, D_TOK]
    out_ids[base + ra : base + rb] = ids[tok + a : tok + b]
    out_mod[base + ra : base + rb] = mod[tok + a : tok + b]
    if b < docs[d, D_LEN]:
        label = IGNORE if cut else ids[tok + b]
        label_mod = mod[tok + b]
    else:
        label, label_mod = IGNORE, TEXT
    k = st[ST_NSEG]
    seg[k, 0], seg[k, 1], seg[k, 2], seg[k, 3], seg[k, 4], seg[k, 5] = (
        base + ra,
        base + rb,
        pid,
        a - a0,
        label,
        label_mod,
    )
    st[ST_NSEG] = k + 1
    src[s, S_BATCH_TOKENS] += n
    if docs[d, D_NBLK] and _blocks_in(docs, units, d, a0, b):
        v = st[ST_NVIS]
        if v > 0 and vis[v - 1, 0] == pid:
            v -= 1
        vis[v, 0], vis[v, 1], vis[v, 2], vis[v, 3], vis[v, 4] = pid, d, ra0, a0, b
        st[ST_NVIS] = v + 1


@njit(cache=True, inline="always")
def _place(docs, units, src, ids_l, mod_l, st, out, d, pos, L, drop_document):
    """Place as much of document d as fits from pos (Packer._place): (outcome, new pos)."""
    n_units, unit, offset = docs[d, D_NU], docs[d, D_UNIT], docs[d, D_OFF]
    limit, length, u0 = docs[d, D_LIMIT], docs[d, D_LEN], docs[d, D_U0]
    if docs[d, D_NBLK] == 0:  # text only
        at = offset if unit < n_units else length
        k = min(L - pos, limit - at) if at < limit else 0
        if at >= limit:
            outcome = _DONE
        elif k == 0:
            outcome = _FULL
        elif at + k == length:
            docs[d, D_UNIT], docs[d, D_OFF], outcome = 1, 0, _DONE
        else:
            docs[d, D_OFF] = at + k
            outcome = _FULL if at + k < limit else _DONE
        _flush(docs, units, src, ids_l, mod_l, st, out, d, pos, at, pos + k, False, L)
        return outcome, pos + k
    piece_start = pos
    doc_start = units[u0 + unit, U_START] + offset if unit < n_units else length
    outcome = _DONE
    while unit < n_units:
        u = u0 + unit
        at = units[u, U_START] + offset
        if at >= limit:
            break
        left = units[u, U_END] - at
        if units[u, U_ATOMIC]:
            if left > L:
                _flush(
                    docs, units, src, ids_l, mod_l, st, out, d, piece_start, doc_start, pos, True, L
                )
                if units[u, U_T]:
                    src[docs[d, D_SRC], S_DROP_VIDEO] += 1
                else:
                    src[docs[d, D_SRC], S_DROP_IMAGE] += 1
                if drop_document:
                    st[ST_STAT_DDOCS] += 1
                    docs[d, D_UNIT], docs[d, D_OFF] = n_units, offset
                    return _DONE, pos
                st[ST_STAT_DBLOCKS] += 1
                unit += 1
                piece_start = pos
                doc_start = units[u0 + unit, U_START] + offset if unit < n_units else length
                continue
            if left > L - pos:
                outcome = _FULL if pos == L else _BLOCKED
                break
            pos += left
            unit += 1
        else:
            k = min(left, L - pos, limit - at)
            if k == 0:
                outcome = _FULL
                break
            pos += k
            if k == left:
                unit, offset = unit + 1, 0
            else:
                offset += k
    docs[d, D_UNIT], docs[d, D_OFF] = unit, offset
    _flush(docs, units, src, ids_l, mod_l, st, out, d, piece_start, doc_start, pos, False, L)
    return outcome, pos


@njit(cache=True, inline="always")
def _end_row(docs, units, st, out, blocks, real, pos, L, pad_id):
    """A row's padding (one more segment) and its visual blocks (Packer.compact, one row)."""
    out_ids, out_mod, seg, pieces, vis, mod_count = out
    r = st[ST_ROWS_DONE]
    base = r * L
    real[r] = pos
    if pos < L:
        out_ids[base + pos : base + L] = pad_id
        out_mod[base + pos : base + L] = TEXT
        npieces = st[ST_NPIECES] - st[ST_ROW_P0]
        k = st[ST_NSEG]
        seg[k, 0], seg[k, 1], seg[k, 2], seg[k, 3], seg[k, 4], seg[k, 5] = (
            base + pos,
            base + L,
            npieces if npieces else -1,
            0,
            IGNORE,
            0,
        )
        st[ST_NSEG] = k + 1
    nb = st[ST_NBLK]
    for v in range(st[ST_NVIS]):
        d, ra, a, b = vis[v, 1], vis[v, 2], vis[v, 3], vis[v, 4]
        last = base + ra + b - a
        u0 = docs[d, D_U0]
        for k in range(u0, u0 + docs[d, D_NU]):
            if units[k, U_ATOMIC] and units[k, U_START] >= a and units[k, U_END] <= b:
                blocks[nb, 0] = base + ra + units[k, U_START] - a
                blocks[nb, 1] = last
                blocks[nb, 2] = units[k, U_T]
                blocks[nb, 3] = units[k, U_H]
                blocks[nb, 4] = units[k, U_W]
                nb += 1
    st[ST_NBLK] = nb


@njit(cache=True)
def pack_batch(
    docs,
    units,
    src,
    opened,
    queue,
    pending,
    carry,
    defer,
    shares,
    mixed,
    st,
    ids_l,
    mod_l,
    out_ids,
    out_mod,
    seg,
    blocks,
    pieces,
    row_pieces,
    vis,
    real,
    mod_count,
    B,
    L,
    chunk,
    max_pending,
    drop_document,
    pad_id,
):
    """Pack rows until the batch has ``B`` (OK), a queue runs dry (NEED: st[ST_NEED] is the
    source; call again once it has documents) or the data ended (END: the incomplete batch is
    held back, as ``ConsumerStream.next_batch`` does)."""
    out = (out_ids, out_mod, seg, pieces, vis, mod_count)
    if not st[ST_BATCH_ACTIVE]:
        st[ST_BATCH_ACTIVE] = 1
        st[ST_ROWS_DONE] = st[ST_NSEG] = st[ST_NBLK] = st[ST_NPIECES] = 0
        src[:, S_BATCH_TOKENS] = 0
    while st[ST_ROWS_DONE] < B:
        if not st[ST_ROW_ACTIVE]:  # a new row: the documents held aside go first
            st[ST_ROW_ACTIVE] = 1
            st[ST_ROW_P0] = st[ST_NPIECES]
            st[ST_TAIL] = -1
            st[ST_NVIS] = 0
            pos, nc, nd = 0, 0, 0
            for i in range(st[ST_NPENDING]):
                d = pending[i]
                if pos == L:
                    defer[nd] = d
                    nd += 1
                    continue
                outcome, pos = _place(
                    docs, units, src, ids_l, mod_l, st, out, d, pos, L, drop_document
                )
                if outcome == _FULL:
                    carry[nc] = d
                    nc += 1
                elif outcome == _BLOCKED:
                    defer[nd] = d
                    nd += 1
            st[ST_NPENDING] = 0
        else:  # resumed after NEED
            pos, nc, nd = st[ST_POS], st[ST_NCARRY], st[ST_NDEFER]
        while pos < L and nd < max_pending:
            d = _next_doc(docs, units, src, opened, queue, shares, mixed, st, chunk)
            if d == -2:
                st[ST_POS], st[ST_NCARRY], st[ST_NDEFER] = pos, nc, nd
                return NEED
            if d == -1:
                break
            outcome, pos = _place(docs, units, src, ids_l, mod_l, st, out, d, pos, L, drop_document)
            if outcome == _FULL:
                carry[nc] = d
                nc += 1
            elif outcome == _BLOCKED:
                defer[nd] = d
                nd += 1
        pending[:nc] = carry[:nc]
        pending[nc : nc + nd] = defer[:nd]
        st[ST_NPENDING] = nc + nd
        st[ST_ROW_ACTIVE] = 0
        if pos == 0 and nc + nd == 0:
            st[ST_BATCH_ACTIVE] = 0
            return END
        st[ST_STAT_ROWS] += 1
        row_pieces[st[ST_ROWS_DONE]] = st[ST_NPIECES] - st[ST_ROW_P0]
        _end_row(docs, units, st, out, blocks, real, pos, L, pad_id)
        st[ST_ROWS_DONE] += 1
    st[ST_BATCH_ACTIVE] = 0
    _count_modalities(out_mod, real, L, mod_count)
    return OK


@njit(cache=True)
def _count_modalities(out_mod, real, L, mod_count):
    """Real tokens per modality (data/vocab.py's five: text, code, image, video, structure;
    padding is not counted)."""
    c0 = c1 = c2 = c3 = c4 = 0
    for r in range(real.shape[0]):
        for i in range(r * L, r * L + real[r]):
            m = out_mod[i]
            c0 += m == 0
            c1 += m == 1
            c2 += m == 2
            c3 += m == 3
            c4 += m == 4
    mod_count[0], mod_count[1], mod_count[2], mod_count[3], mod_count[4] = c0, c1, c2, c3, c4


@njit(cache=True)
def pieces_table(pieces, row_pieces):
    """int64 [rows, most pieces, 4] (source, sample, start, end) of each row's pieces, -1
    padded (packed_batch.pieces_of)."""
    B = row_pieces.shape[0]
    most = 0
    for r in range(B):
        most = max(most, row_pieces[r])
    out = np.full((B, most, 4), -1, np.int64)
    k = 0
    for r in range(B):
        for j in range(row_pieces[r]):
            out[r, j, :] = pieces[k, :]
            k += 1
    return out
