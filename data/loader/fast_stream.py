"""A consumer stream's batches through the compiled loop (data/loader/pack_kernel.py): the
arrays it works on, how documents reach them, and the stream's state read back from them.

Design choices:
- Documents are read by the stream's own ``_read_next`` (order, epochs, the whole-shard and
  per-document checks, skips and their log lines: all unchanged), a few batches' worth of one
  source at a time, when the kernel says that source's queue ran dry. Their tokens are copied
  into that source's staging arrays (int32 ids, uint8 modalities; documents still being placed
  are carried over), so the kernel reads every document from one place whatever shard or
  kind it came from.
- Reading ahead moves the stream's cursors (``stream.cursors``) past what has been packed; the
  cursor a saved state holds is the one recorded with the last document the kernel took from
  each queue. Read errors are therefore counted when a document is read ahead, not when it
  would have been packed; the batches are the same.
- The stream's Python fields (``open``, ``packer.pending``, ``packer.stats``, ``cursors``) are
  the starting point (a fresh stream or a restored state) and are not kept up to date while
  the kernel runs: ``state_dict`` reads the kernel's arrays. Restoring a state drops this
  object; the next batch builds it again from the restored fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np
from numba import typed

from data.loader import pack_kernel as K
from data.loader.expand import CompactBatch
from data.loader.order import ConsumerSlice
from data.loader.packer import Doc
from data.loader.shard_check import CheckedShard
from data.loader.stage_kernel import fill_units, gather_tokens
from data.vocab import MODALITY_NAMES, Modality

if TYPE_CHECKING:
    from data.loader.stream import ConsumerStream

_IMAGE, _VIDEO = int(Modality.IMAGE), int(Modality.VIDEO)


def _tokens_of(doc: Doc) -> tuple[np.ndarray, np.ndarray]:
    assert doc.ids is not None and doc.mod is not None  # read (never a dry document here)
    return doc.ids, doc.mod


class FastPath:
    def __init__(self, stream: ConsumerStream) -> None:
        self.stream = stream
        cfg, packer = stream.cfg, stream.packer
        S = len(stream.tables)
        self.B, self.L = stream.micro_batch, cfg.seq_len
        self.chunk, self.max_pending = stream.chunk, cfg.max_pending
        self.drop_document = cfg.oversize == "drop_document"
        self.pad_id = packer.pad_id
        # A few batches of one source a refill (at least one document)
        self.refill_tokens = 4 * self.B * self.L
        self.docs = np.zeros((8192, K.N_DOC_COLS), np.int64)
        self.units = np.zeros((16384, 6), np.int64)
        self.ndocs = self.nunits = 0
        self.src = np.zeros((S, K.N_SRC_COLS), np.int64)
        cap = cfg.max_pending + 2
        self.opened = np.zeros((S, 2 * cap), np.int64)
        self.queue = np.zeros((S, 1024), np.int64)
        self.pending = np.zeros(4 * cap, np.int64)
        self.carry = np.zeros(4 * cap, np.int64)
        self.defer = np.zeros(4 * cap, np.int64)
        self.shares = np.asarray(stream.shares, np.float64)
        self.mixed = np.asarray([s for s, _ in stream._mixed], np.int64)
        self.st = np.zeros(K.N_ST, np.int64)
        self.ids_l = typed.List([np.zeros(0, np.int32) for _ in range(S)])
        self.mod_l = typed.List([np.zeros(0, np.uint8) for _ in range(S)])
        n = self.B * self.L
        self.seg = np.zeros((n + self.B, 6), np.int64)
        self.blocks = np.zeros((n // 4 + 16, 5), np.int64)
        self.pieces = np.zeros((n, 4), np.int64)
        self.row_pieces = np.zeros(self.B, np.int64)
        self.vis = np.zeros((self.L, 5), np.int64)
        self.mod_count = np.zeros(len(MODALITY_NAMES), np.int64)
        # Per source: where each shard's samples start (token tables; runs of checked shards)
        self._starts = [np.asarray(getattr(t, "starts", [0]), np.int64) for t in stream.tables]
        # The starting point: the stream's Python fields (fresh, or just restored)
        self.skip = [dict(c.skip) for c in stream.cursors]
        for s, c in enumerate(stream.cursors):
            self.src[s, K.S_TOKENS], self.src[s, K.S_DONE] = c.tokens, int(c.done)
            self.src[s, K.S_ENDED] = int(c.done)
            self.src[s, K.S_CEPOCH], self.src[s, K.S_CPOS] = c.epoch, c.pos
        for (s, m), count in packer.dropped_by.items():
            self.src[s, K.S_DROP_VIDEO if m == _VIDEO else K.S_DROP_IMAGE] = count
        stats = packer.stats
        self.st[K.ST_STAT_ROWS], self.st[K.ST_STAT_REAL] = stats.rows, stats.real_tokens
        self.st[K.ST_STAT_DBLOCKS], self.st[K.ST_STAT_DDOCS] = (
            stats.dropped_blocks,
            stats.dropped_docs,
        )
        index: dict[int, int] = {}  # id(Doc) -> its row (a document open and pending is one)
        by_source: list[list[Doc]] = [[] for _ in range(S)]

        def row_of(doc: Doc) -> int:
            if id(doc) not in index:
                index[id(doc)] = self._add(doc, (-1, -1))
                by_source[doc.source].append(doc)
            return index[id(doc)]

        pending = [row_of(doc) for doc in packer.pending]
        opened = [[row_of(doc) for doc in docs] for docs in stream.open]
        for s, docs in enumerate(by_source):  # staged before the lists refer to them
            self._stage(s, [(index[id(d)], *_tokens_of(d)) for d in docs], [])
        self.pending[: len(pending)] = pending
        self.st[K.ST_NPENDING] = len(pending)
        for s, rows in enumerate(opened):
            self.opened[s, : len(rows)] = rows
            self.src[s, K.S_NOPEN] = len(rows)

    # --- documents into the arrays ----------------------------------------------------------------
    def _add(self, doc: Doc, cursor: tuple[int, int]) -> int:
        """A row of ``docs`` (and its units) for ``doc``; its tokens are staged by ``_stage``."""
        if self.ndocs == len(self.docs):
            self.docs = np.concatenate([self.docs, np.zeros_like(self.docs)])
        nu = len(doc.units)
        while self.nunits + nu > len(self.units):
            self.units = np.concatenate([self.units, np.zeros_like(self.units)])
        d, u0 = self.ndocs, self.nunits
        for k, u in enumerate(doc.units):
            self.units[u0 + k] = (u.start, u.end, int(u.atomic), u.t, u.h, u.w)
        self.docs[d] = (
            doc.source,
            doc.sample,
            doc.epoch,
            doc.length,
            doc.unit,
            doc.offset,
            doc.limit,
            0,
            u0,
            nu,
            len(doc.blocks),
            *cursor,
        )
        self.ndocs, self.nunits = d + 1, u0 + nu
        return d

    def _live(self, s: int) -> list[int]:
        """Rows of source ``s``'s documents whose tokens may still be placed (no repeats)."""
        src, st = self.src, self.st
        rows = list(self.opened[s, : src[s, K.S_NOPEN]])
        rows += list(self.pending[: st[K.ST_NPENDING]])
        if st[K.ST_ROW_ACTIVE]:
            rows += list(self.carry[: st[K.ST_NCARRY]]) + list(self.defer[: st[K.ST_NDEFER]])
        head = src[s, K.S_QHEAD]
        rows += list(self.queue[s, head : head + src[s, K.S_QLEN]])
        seen: dict[int, None] = {}
        for d in rows:
            if self.docs[d, K.D_SRC] == s:
                seen[int(d)] = None
        return list(seen)

    def _stage(self, s: int, new: list[tuple[int, np.ndarray, np.ndarray]], runs: list) -> None:
        """Source ``s``'s staging arrays: its live documents' tokens, then the new documents':
        ``new`` (row, ids, modalities) read one by one and ``runs`` (``_fast_run``) in order."""
        old_ids, old_mod = self.ids_l[s], self.mod_l[s]
        live = self._live(s)
        rows = np.asarray(live + [d for d, _, _ in new], np.int64)
        for run in runs:
            rows = np.concatenate([rows, run[0]])
        lengths = self.docs[rows, K.D_LEN]
        at = np.cumsum(lengths) - lengths
        old_at = self.docs[rows[: len(live)], K.D_TOK]
        self.docs[rows, K.D_TOK] = at
        ids = np.empty(int(lengths.sum()), np.int32)
        mod = np.empty(len(ids), np.uint8)
        for d, a, n in zip(live, old_at.tolist(), lengths[: len(live)].tolist()):
            o = int(self.docs[d, K.D_TOK])
            ids[o : o + n], mod[o : o + n] = old_ids[a : a + n], old_mod[a : a + n]
        for d, doc_ids, doc_mod in new:
            o = int(self.docs[d, K.D_TOK])
            ids[o : o + len(doc_ids)], mod[o : o + len(doc_ids)] = doc_ids, doc_mod
        for run_rows, groups in runs:
            for mapped, sel, ids_at, mod_at in groups:
                d = run_rows[sel]
                gather_tokens(
                    mapped, ids_at, mod_at, self.docs[d, K.D_LEN], self.docs[d, K.D_TOK], ids, mod
                )
        self.ids_l[s], self.mod_l[s] = ids, mod

    def _fast_run(self, s: int, most: int):
        """The next documents of source ``s`` (at most ``most``, in one epoch) that lie in
        shards that passed the whole-shard check, added as rows without a ``Doc`` each:
        (their rows, per shard (map bytes, which of them, where their ids and modalities
        start)) -- None when the next document is not such (it is read one by one)."""
        stream = self.stream
        t, c = stream.tables[s], stream.cursors[s]
        sl = stream._slices.get((s, c.epoch))
        if sl is None:
            sl = stream._slice(s, c.epoch)
        k = min(len(sl) - c.pos, most)
        if k <= 0:
            return None
        if isinstance(sl, ConsumerSlice):
            samples = sl.take(c.pos, c.pos + k)
        else:  # a redistributed epoch, or an order version 1 state: the slice as an array
            samples = np.asarray(sl[c.pos : c.pos + k], np.int64)
        starts = self._starts[s]
        si = np.searchsorted(starts, samples, side="right") - 1
        ok = np.ones(k, bool)
        shards: dict[int, CheckedShard] = {}
        for u in np.unique(si).tolist():
            checked = stream._checked_shard(s, t, u)
            if (
                checked is not None
                and checked.ids_dtype == np.dtype("<i4")
                and checked.mod_dtype == np.dtype("u1")
            ):
                shards[u] = checked
            else:
                ok &= si != u
        k = int(np.argmin(ok)) if not ok.all() else k  # the run ends before the first other
        if k == 0:
            return None
        samples, si = samples[:k], si[:k]
        i = samples - starts[si]
        lengths = np.empty(k, np.int64)
        bstart, bcount = np.empty(k, np.int64), np.empty(k, np.int64)
        groups = []
        for u in np.unique(si).tolist():
            checked = shards[u]
            sel = np.flatnonzero(si == u)
            j = i[sel]
            lengths[sel] = checked.lengths[j]
            bstart[sel], bcount[sel] = checked.block_start[j], checked.block_count[j]
            mapped = np.frombuffer(checked.mapped, np.uint8)
            groups.append((mapped, sel, checked.ids_at[j], checked.mod_at[j], checked, j))
        # rows of docs, then units (per shard: its blocks table)
        d0 = self.ndocs
        self._reserve(k, int((2 * bcount + 1).sum()))
        rows = np.arange(d0, d0 + k, dtype=np.int64)
        u0, nu, nblk = np.empty(k, np.int64), np.empty(k, np.int64), np.empty(k, np.int64)
        u_at = self.nunits
        out_groups = []
        for mapped, sel, ids_at, mod_at, checked, _j in groups:
            gu0, gnu, gnb = (
                np.empty(len(sel), np.int64),
                np.empty(len(sel), np.int64),
                np.empty(len(sel), np.int64),
            )
            u_at = fill_units(
                self.units,
                u_at,
                lengths[sel],
                bstart[sel],
                bcount[sel],
                checked.index.blocks,
                gu0,
                gnu,
                gnb,
            )
            u0[sel], nu[sel], nblk[sel] = gu0, gnu, gnb
            out_groups.append((mapped, sel, ids_at, mod_at))
        self.nunits = u_at
        block = self.docs[d0 : d0 + k]
        block[:, K.D_SRC], block[:, K.D_SAMPLE], block[:, K.D_EPOCH] = s, samples, c.epoch
        block[:, K.D_LEN], block[:, K.D_UNIT], block[:, K.D_OFF] = lengths, 0, 0
        block[:, K.D_LIMIT], block[:, K.D_TOK] = lengths, 0
        block[:, K.D_U0], block[:, K.D_NU], block[:, K.D_NBLK] = u0, nu, nblk
        block[:, K.D_CEPOCH] = c.epoch
        block[:, K.D_CPOS] = c.pos + 1 + np.arange(k)
        self.ndocs = d0 + k
        c.pos += k
        stream.consecutive_errors = 0
        return rows, out_groups

    def _reserve(self, docs: int, units: int) -> None:
        while self.ndocs + docs > len(self.docs):
            self.docs = np.concatenate([self.docs, np.zeros_like(self.docs)])
        while self.nunits + units > len(self.units):
            self.units = np.concatenate([self.units, np.zeros_like(self.units)])

    def _refill(self, s: int) -> None:
        """Read source ``s``'s next documents into its (empty) queue: runs of checked shards'
        documents at once, any other one by one through the stream (which checks, skips and
        counts as always)."""
        stream, src = self.stream, self.src
        cursor = stream.cursors[s]
        new, runs, order, tokens, count = [], [], [], 0, 0
        cap = self.queue.shape[1]
        while tokens < self.refill_tokens and count < cap:
            if stream._whole[s]:
                run = self._fast_run(s, min(256, cap - count))
                if run is not None:
                    runs.append(run)
                    order.append(run[0])
                    tokens += int(self.docs[run[0], K.D_LEN].sum())
                    count += len(run[0])
                    continue
            doc = stream._read_next(s)
            if doc is None:
                if cursor.done:
                    src[s, K.S_ENDED] = 1
                    break
                continue  # unreadable: skipped and counted by the stream
            d = self._add(doc, (cursor.epoch, cursor.pos))
            new.append((d, *_tokens_of(doc)))
            order.append(np.asarray([d], np.int64))
            tokens += doc.length
            count += 1
        self._stage(s, new, runs)  # before the queue lists them: they are not live tokens yet
        rows = np.concatenate(order) if order else np.zeros(0, np.int64)
        self.queue[s, : len(rows)] = rows
        src[s, K.S_QHEAD], src[s, K.S_QLEN] = 0, len(rows)

    def _compact(self) -> None:
        """Between batches: drop the rows of documents nothing refers to any more."""
        src, st = self.src, self.st
        live = [self.pending[: st[K.ST_NPENDING]]]
        for s in range(len(src)):
            live.append(self.opened[s, : src[s, K.S_NOPEN]])
            head = src[s, K.S_QHEAD]
            live.append(self.queue[s, head : head + src[s, K.S_QLEN]])
        keep = np.unique(np.concatenate(live))
        remap = np.full(self.ndocs, -1, np.int64)
        remap[keep] = np.arange(len(keep))
        docs = self.docs[keep]
        # their units, in order
        nu = docs[:, K.D_NU]
        starts = np.repeat(docs[:, K.D_U0] - np.cumsum(nu) + nu, nu)
        take = starts + np.arange(int(nu.sum()))
        units = self.units[take]
        docs[:, K.D_U0] = np.cumsum(nu) - nu
        self.docs[: len(keep)] = docs
        self.units[: len(units)] = units
        self.ndocs, self.nunits = len(keep), len(units)
        n = st[K.ST_NPENDING]
        self.pending[:n] = remap[self.pending[:n]]
        for s in range(len(src)):
            k = src[s, K.S_NOPEN]
            self.opened[s, :k] = remap[self.opened[s, :k]]
            q = self.queue[s, src[s, K.S_QHEAD] : src[s, K.S_QHEAD] + src[s, K.S_QLEN]]
            q[:] = remap[q]

    # --- batches -------------------------------------------------------------------------------------
    def pack(self, ids: np.ndarray, mod: np.ndarray) -> tuple | None:
        """The next batch, its ids and modalities packed into ``ids``/``mod`` (flat [B * L]):
        (``CompactBatch``, pieces table, tokens per source, tokens per modality), or None at the
        end of the data (epoch mode: the incomplete batch is held back)."""
        real = np.empty(self.B, np.int64)
        if not self._run(ids, mod, real):
            return None
        st = self.st
        seg = self.seg[: st[K.ST_NSEG]].copy()
        blocks = self.blocks[: st[K.ST_NBLK]].copy()
        by_modality = self.mod_count.copy()
        return (
            CompactBatch(self.B, self.L, ids, mod, seg, blocks, real),
            K.pieces_table(self.pieces, self.row_pieces),
            self.src[:, K.S_BATCH_TOKENS].tolist(),
            by_modality,
        )

    def _run(self, ids: np.ndarray, mod: np.ndarray, real: np.ndarray) -> bool:
        if self.ndocs > 3 * len(self.docs) // 4:
            self._compact()
        while True:
            code = K.pack_batch(
                self.docs,
                self.units,
                self.src,
                self.opened,
                self.queue,
                self.pending,
                self.carry,
                self.defer,
                self.shares,
                self.mixed,
                self.st,
                self.ids_l,
                self.mod_l,
                ids,
                mod,
                self.seg,
                self.blocks,
                self.pieces,
                self.row_pieces,
                self.vis,
                real,
                self.mod_count,
                self.B,
                self.L,
                self.chunk,
                self.max_pending,
                self.drop_document,
                self.pad_id,
            )
            if code == K.OK:
                return True
            if code == K.END:
                return False
            self._refill(int(self.st[K.ST_NEED]))

    def dropped_matrix(self) -> np.ndarray:
        return self.src[:, [K.S_DROP_IMAGE, K.S_DROP_VIDEO]].copy()

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What ``stream_state.save_state`` saves, read from the arrays."""
        return self.snapshot().to_dict()

    def snapshot(self) -> FastState:
        """The state after the last batch, as copies of the few array rows it needs (a few
        microseconds; made into ``state_dict``'s lists only when asked for)."""
        src, st = self.src, self.st
        rows = [self.pending[: st[K.ST_NPENDING]]]
        rows += [self.opened[s, : src[s, K.S_NOPEN]] for s in range(len(src))]
        cursors = self.docs[np.concatenate(rows)][:, _CURSOR_COLS]
        stream = self.stream
        return FastState(
            src[:, _SRC_COLS].copy(),
            cursors,
            int(st[K.ST_NPENDING]),
            st[_STAT_COLS].copy(),
            stream.batches,
            stream.errors,
            stream.tokens_by_modality.copy(),
            self.skip,
            stream.order_version,
        )


_CURSOR_COLS = [K.D_SRC, K.D_SAMPLE, K.D_EPOCH, K.D_UNIT, K.D_OFF, K.D_LIMIT]
_SRC_COLS = [K.S_CEPOCH, K.S_CPOS, K.S_TOKENS, K.S_DONE, K.S_DROP_IMAGE, K.S_DROP_VIDEO]
_STAT_COLS = [K.ST_STAT_ROWS, K.ST_STAT_REAL, K.ST_STAT_DBLOCKS, K.ST_STAT_DDOCS]


class FastState:
    """A consumer stream's state as a few arrays: what a batch carries from a worker (pickled
    small) and the loader keeps; ``to_dict`` gives ``stream_state.save_state``'s format."""

    def __init__(self, src, cursors, n_pending, stats, batches, errors, by_modality, skip, order):
        self.src, self.cursors, self.n_pending, self.stats = src, cursors, n_pending, stats
        self.batches, self.errors, self.by_modality = batches, errors, by_modality
        self.skip, self.order = skip, order

    def to_dict(self) -> dict:
        src = self.src.tolist()
        cursors = self.cursors.tolist()
        rows, real, dblocks, ddocs = self.stats.tolist()
        return {
            "cursors": [r[:4] for r in src],
            "pending": cursors[: self.n_pending],
            "open": cursors[self.n_pending :],
            "dropped_by": [
                [s, m, n]
                for s, r in enumerate(src)
                for m, n in ((_IMAGE, r[4]), (_VIDEO, r[5]))
                if n
            ],
            "batches": self.batches,
            "errors": self.errors,
            "stats": {
                "rows": rows,
                "real_tokens": real,
                "dropped_blocks": dblocks,
                "dropped_docs": ddocs,
            },
            "tokens_by_modality": self.by_modality.tolist(),
            "skip": [
                [s, e, m]
                for s in range(len(src))
                for e, m in sorted(self.skip[s].items())
                if e >= src[s][0]
            ],
            "order": self.order,
        }
