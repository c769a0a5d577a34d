"""A consumer stream's batches through the compiled loop (data/loader/pack_kernel.py): the
arrays it works on, how documents reach them, and the stream's state read back from them.

Design choices:
- Documents are read by the stream's own ``read_next`` (order, epochs, the whole-shard and
  per-document checks, skips and their log lines: all unchanged), a few batches' worth of one
  source at a time, when the kernel says that source's queue ran dry; runs of documents of
  shards that passed the whole-shard check are added at once, without a Python object each
  (stage_kernel.py). Counting an epoch (a dry stream) adds its token sources' documents the
  same way, from their shards' indexes alone (shard_check.IndexedShard): lengths and blocks
  are all the packing decisions read, so the count costs the compiled loop's time, not a
  Python call per document.
- Their tokens are appended to one pair of staging arrays (int32 ids, uint8 modalities) shared
  by every source, so the kernel reads every document from one place whatever shard or kind it
  came from; when they are full, they are made again with the documents still being placed.
- Skips are counted per source as documents are read ahead, and each document's row records the
  count so far: a state counts a skip once the kernel takes a document after it.
- Reading ahead moves the stream's cursors (``stream.cursors``) past what has been packed; the
  cursor a saved state holds is the one recorded with the last document the kernel took from
  each queue, and its skips those read before that document (or before the source's end).
- The arrays are the stream's packing state, its only one: a stream makes them when it is
  made, and restoring a state makes them again from the documents and counters the saved
  state names (stream_state.load_state). The state after each batch is a snapshot of a few
  array rows (fast_state.py), made into the saved dict when a checkpoint asks for it.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from data.loader import pack_kernel as kernel
from data.loader.batch_tables import count_modalities, pieces_table
from data.loader.expand import CompactBatch
from data.loader.fast_state import FastState, snapshot_arrays
from data.loader.order import ConsumerSlice
from data.loader.packer import Doc
from data.loader.shard_check import CheckedShard, IndexedShard
from data.loader.stage_kernel import fill_units, gather_tokens, take_rows
from data.loader.stream_state import skipped_samples
from data.vocab import MODALITY_NAMES, Modality

if TYPE_CHECKING:
    from data.loader.stream import ConsumerStream

_VIDEO = int(Modality.VIDEO)


_NO_IDS, _NO_MOD = np.zeros(0, np.int32), np.zeros(0, np.uint8)


def tokens_of(doc: Doc) -> tuple[np.ndarray, np.ndarray]:
    """A document's ids and modalities (none for a dry one: lengths and blocks only)."""
    if doc.ids is None or doc.mod is None:
        return _NO_IDS, _NO_MOD
    return doc.ids, doc.mod


class FastPath:
    def __init__(
        self,
        stream: ConsumerStream,
        *,
        pending: list[Doc] | None = None,
        opened: list[list[Doc]] | None = None,
        stats: dict[str, int] | None = None,
        dropped_by: dict[tuple[int, int], int] | None = None,
    ) -> None:
        """The arrays of a fresh stream, or of one restored (stream_state.load_state): the
        documents held aside, those handed out in part per source (oldest first), the packing
        counters (``PackStats``' fields) and the blocks dropped per (source, modality)."""
        self.stream = stream
        cfg = stream.cfg
        pending = pending or []
        opened = opened or [[] for _ in stream.tables]
        stats = stats or {}
        n_sources = len(stream.tables)
        self.B, self.L = stream.micro_batch, cfg.seq_len
        self.chunk, self.max_pending = stream.chunk, cfg.max_pending
        self.drop_document = cfg.oversize == "drop_document"
        self.whole_documents = cfg.whole_documents
        self.pad_id = stream.pad_id
        # Counting only (an epoch's batches): documents from the index, no token read or copied
        self.dry = stream.dry
        self._counting: tuple[np.ndarray, np.ndarray] | None = None  # count()'s unused output
        # A few batches of one source a refill (at least one document)
        self.refill_tokens = 4 * self.B * self.L
        self.docs = np.zeros((8192, kernel.N_DOC_COLS), np.int64)
        self.units = np.zeros((16384, 6), np.int64)
        self.ndocs = self.nunits = 0
        self.src = np.zeros((n_sources, kernel.N_SRC_COLS), np.int64)
        # Held-aside and open documents: at most max_pending + 2 each in steady state, but a state
        # redistributed from many consumers onto fewer brings all of theirs (redistribute.py)
        cap = 2 * (cfg.max_pending + 2)
        most_open = max((len(docs) for docs in opened), default=0)
        self.opened = np.zeros((n_sources, max(cap, most_open + cap)), np.int64)
        cap = max(2 * cap, len(pending) + cap)
        self.queue = np.zeros((n_sources, 1024), np.int64)
        self.pending = np.zeros(cap, np.int64)
        self.carry = np.zeros(cap, np.int64)
        self.defer = np.zeros(cap, np.int64)
        self.shares = np.asarray(stream.shares, np.float64)
        self.mixed = np.asarray([source for source, _ in stream.mixed_sources], np.int64)
        self.state = np.zeros(kernel.N_ST, np.int64)
        self.state[kernel.ST_DRY] = int(self.dry)
        # The staging arrays of every source's documents (``_stage``: an arena appended to)
        self.staged_ids = np.zeros(0, np.int32)
        self.staged_mod = np.zeros(0, np.uint8)
        self.staged_end = 0
        size = self.B * self.L
        self.seg = np.zeros((size + self.B, 6), np.int64)
        self.blocks = np.zeros((size // 4 + 16, 5), np.int64)
        self.pieces = np.zeros((size, 4), np.int64)
        self.row_pieces = np.zeros(self.B, np.int64)
        self.vis = np.zeros((self.L, 5), np.int64)
        # Per source: where each shard's samples start (token tables; runs of checked shards)
        self._starts = [
            np.asarray(getattr(table, "starts", [0]), np.int64) for table in stream.tables
        ]
        # The packed position starts where the reading cursors are (fresh, or just restored)
        self.skip = [dict(cur.skip) for cur in stream.cursors]
        for source, cur in enumerate(stream.cursors):
            self.src[source, kernel.S_TOKENS], self.src[source, kernel.S_DONE] = (
                cur.tokens,
                int(cur.done),
            )
            self.src[source, kernel.S_ENDED] = int(cur.done)
            self.src[source, kernel.S_CEPOCH], self.src[source, kernel.S_CPOS] = cur.epoch, cur.pos
            self.src[source, kernel.S_END_EPOCH], self.src[source, kernel.S_END_POS] = (
                cur.epoch,
                cur.pos,
            )
        # Skips: counted by the stream when its documents are read ahead; a state counts those
        # before each source's last document taken (and at its end)
        self.base_errors = stream.errors
        self.base_skips = [len(events) for events in stream.skip_events]
        self.read_errors = [0] * n_sources
        for (source, modality), count in (dropped_by or {}).items():
            self.src[source, kernel.S_DROP_VIDEO if modality == _VIDEO else kernel.S_DROP_IMAGE] = (
                count
            )
        self.state[kernel.ST_STAT_ROWS] = stats.get("rows", 0)
        self.state[kernel.ST_STAT_REAL] = stats.get("real_tokens", 0)
        self.state[kernel.ST_STAT_DBLOCKS] = stats.get("dropped_blocks", 0)
        self.state[kernel.ST_STAT_DDOCS] = stats.get("dropped_docs", 0)
        index: dict[int, int] = {}  # id(Doc) -> its row (a document open and pending is one)
        by_source: list[list[Doc]] = [[] for _ in range(n_sources)]

        def row_of(doc: Doc) -> int:
            if id(doc) not in index:
                index[id(doc)] = self._add(doc, (-1, -1, 0))
                by_source[doc.source].append(doc)
            return index[id(doc)]

        pending_rows = [row_of(doc) for doc in pending]
        opened_rows = [[row_of(doc) for doc in docs] for docs in opened]
        # staged at once, before the lists refer to them (nothing staged is live yet)
        self._stage([(index[id(doc)], *tokens_of(doc)) for docs in by_source for doc in docs], [])
        self.pending[: len(pending_rows)] = pending_rows
        self.state[kernel.ST_NPENDING] = len(pending_rows)
        for source, rows in enumerate(opened_rows):
            self.opened[source, : len(rows)] = rows
            self.src[source, kernel.S_NOPEN] = len(rows)

    # --- batches -------------------------------------------------------------------------------------
    def pack(self, ids: np.ndarray, mod: np.ndarray) -> tuple | None:
        """The next batch, its ids and modalities packed into ``ids``/``mod`` (flat [B * L]):
        (``CompactBatch``, pieces table, tokens per source, tokens per modality), or None at the
        end of the data (epoch mode: the incomplete batch is held back)."""
        real = np.empty(self.B, np.int64)
        if not self._run(ids, mod, real):
            return None
        state = self.state
        seg = self.seg[: state[kernel.ST_NSEG]].copy()
        blocks = self.blocks[: state[kernel.ST_NBLK]].copy()
        by_modality = np.zeros(len(MODALITY_NAMES), np.int64)
        count_modalities(mod, real, by_modality)
        return (
            CompactBatch(self.B, self.L, ids, mod, seg, blocks, real),
            pieces_table(self.pieces, self.row_pieces),
            self.src[:, kernel.S_BATCH_TOKENS].tolist(),
            by_modality,
        )

    def count(self) -> bool:
        """Dry: the next batch's decisions made (rows, drops, cursors), no token copied; False
        at the end of the data, where ``pack`` holds the incomplete batch back."""
        if self._counting is None:
            size = self.B * self.L
            self._counting = (np.empty(size, np.int32), np.empty(size, np.uint8))
        return self._run(*self._counting, np.empty(self.B, np.int64))

    def _run(self, ids: np.ndarray, mod: np.ndarray, real: np.ndarray) -> bool:
        if self.ndocs > 3 * len(self.docs) // 4:
            self._compact()
        while True:
            code = kernel.pack_batch(
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
                self.state,
                self.staged_ids,
                self.staged_mod,
                ids,
                mod,
                self.seg,
                self.blocks,
                self.pieces,
                self.row_pieces,
                self.vis,
                real,
                self.B,
                self.L,
                self.chunk,
                self.max_pending,
                self.drop_document,
                self.whole_documents,
                self.pad_id,
            )
            if code == kernel.PACKED:
                return True
            if code == kernel.END:
                return False
            self._refill(int(self.state[kernel.ST_NEED]))

    def dropped_matrix(self) -> np.ndarray:
        # adjacent columns: a slice, a view, where fancy indexing would gather them
        assert kernel.S_DROP_VIDEO == kernel.S_DROP_IMAGE + 1
        return self.src[:, kernel.S_DROP_IMAGE : kernel.S_DROP_VIDEO + 1].copy()

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """The stream's state (stream_state.py's format), read from the arrays."""
        return self.snapshot().to_dict()

    def snapshot(self) -> FastState:
        """The state after the last batch, as copies of the few array rows it needs (a few
        microseconds; made into ``state_dict``'s lists only when asked for)."""
        state = self.state
        sources, cursors, stats = snapshot_arrays(
            self.src, state, self.pending, self.opened, self.docs
        )
        stream = self.stream
        return FastState(
            sources,
            cursors,
            int(state[kernel.ST_NPENDING]),
            stats,
            stream.batches,
            self.base_errors + int(self.src[:, kernel.S_CERRS].sum()),
            stream.tokens_by_modality.copy(),
            self.skip,
            skipped_samples(
                stream,
                [base + int(n) for base, n in zip(self.base_skips, self.src[:, kernel.S_CERRS])],
            ),
        )

    # --- documents into the arrays ----------------------------------------------------------------
    def _add(self, doc: Doc, cursor: tuple[int, int, int]) -> int:
        """A row of ``docs`` (and its units) for ``doc``; its tokens are staged by ``_stage``."""
        if self.ndocs == len(self.docs):
            self.docs = np.concatenate([self.docs, np.zeros_like(self.docs)])
        n_units = len(doc.units)
        while self.nunits + n_units > len(self.units):
            self.units = np.concatenate([self.units, np.zeros_like(self.units)])
        drow, unit0 = self.ndocs, self.nunits
        for at, unit in enumerate(doc.units, unit0):
            self.units[at] = (unit.start, unit.end, int(unit.atomic), unit.t, unit.h, unit.w)
        self.docs[drow] = (
            doc.source,
            doc.sample,
            doc.epoch,
            doc.length,
            doc.unit,
            doc.offset,
            doc.limit,
            0,
            unit0,
            n_units,
            len(doc.blocks),
            *cursor,
        )
        self.ndocs, self.nunits = drow + 1, unit0 + n_units
        return drow

    def _live(self, source: int) -> list[int]:
        """Rows of source ``source``'s documents whose tokens may still be placed (no repeats)."""
        src, state = self.src, self.state
        rows = list(self.opened[source, : src[source, kernel.S_NOPEN]])
        rows += list(self.pending[: state[kernel.ST_NPENDING]])
        if state[kernel.ST_ROW_ACTIVE]:
            rows += list(self.carry[: state[kernel.ST_NCARRY]]) + list(
                self.defer[: state[kernel.ST_NDEFER]]
            )
        head = src[source, kernel.S_QHEAD]
        rows += list(self.queue[source, head : head + src[source, kernel.S_QLEN]])
        seen: dict[int, None] = {}
        for drow in rows:
            if self.docs[drow, kernel.D_SRC] == source:
                seen[int(drow)] = None
        return list(seen)

    def _stage(self, new: list[tuple[int, np.ndarray, np.ndarray]], runs: list) -> None:
        """The tokens of new documents appended to the staging arrays:
        ``new`` (row, ids, modalities) read one by one and ``runs`` (``_fast_run``) in order.
        When they do not fit, the arrays are made again with every source's live documents
        first (their rows' ``D_TOK`` moved) and room for twice what is live."""
        if self.dry:  # no tokens: the kernel reads none
            return
        rows = np.asarray([drow for drow, _, _ in new], np.int64)
        for run in runs:
            rows = np.concatenate([rows, run[0]])
        lengths = self.docs[rows, kernel.D_LEN]
        needed = int(lengths.sum())
        if self.staged_end + needed > len(self.staged_ids):
            self._restage(needed)
        self.docs[rows, kernel.D_TOK] = self.staged_end + np.cumsum(lengths) - lengths
        self.staged_end += needed
        ids, mod = self.staged_ids, self.staged_mod
        for drow, doc_ids, doc_mod in new:
            offset = int(self.docs[drow, kernel.D_TOK])
            ids[offset : offset + len(doc_ids)], mod[offset : offset + len(doc_ids)] = (
                doc_ids,
                doc_mod,
            )
        for run_rows, groups, ids_at, mod_at in runs:
            lengths = self.docs[run_rows, kernel.D_LEN]
            dst = self.docs[run_rows, kernel.D_TOK]
            for mapped, sel in groups:
                gather_tokens(mapped, sel, ids_at, mod_at, lengths, dst, ids, mod)
            # int32 ids and uint8 modalities read through the shards' maps (store.ShardFiles)
            self.stream.files.touched(5 * int(lengths.sum()))

    def _restage(self, needed: int) -> None:
        """New staging arrays holding the live documents of every source, with room for
        ``needed`` more tokens (and as many again, so that this happens rarely)."""
        live = np.asarray(
            [drow for source in range(len(self.src)) for drow in self._live(source)], np.int64
        )
        lengths = self.docs[live, kernel.D_LEN]
        kept = int(lengths.sum())
        size = max(2 * (kept + needed), 2 * self.refill_tokens)
        ids, mod = np.empty(size, np.int32), np.empty(size, np.uint8)
        old_at = self.docs[live, kernel.D_TOK].tolist()
        new_at = (np.cumsum(lengths) - lengths).tolist()
        for old, new, count in zip(old_at, new_at, lengths.tolist()):
            ids[new : new + count] = self.staged_ids[old : old + count]
            mod[new : new + count] = self.staged_mod[old : old + count]
        self.docs[live, kernel.D_TOK] = new_at
        self.staged_ids, self.staged_mod, self.staged_end = ids, mod, kept

    def _fast_run(self, source: int, most: int):
        """The next documents of source ``source`` (at most ``most``, in one epoch; at an
        epoch's end, of the next epoch) that lie in shards that passed the whole-shard check,
        added as rows without a ``Doc`` each: (their rows, per shard (its map's bytes, which
        of the run's positions are its documents), where each document's ids and where its
        modalities start in its map) -- None when the next document is not such (it is read
        one by one) or when the source has nothing to read here (done, or a redistributed
        epoch's rest went to other consumers: ``read_next`` then says which)."""
        stream = self.stream
        table, cur = stream.tables[source], stream.cursors[source]
        order_slice = stream.slices.get((source, cur.epoch))
        if order_slice is None:
            order_slice = stream.slice_of(source, cur.epoch)
        if cur.pos >= len(order_slice):
            # The epoch's end: on to the next one here, as ``read_next`` would (else the next
            # epoch's first document would be read on its own, through ``read_next``)
            if not stream.next_epoch(source):
                return None  # done, or nothing here: ``read_next`` says which
            order_slice = stream.slice_of(source, cur.epoch)
        n_run = min(len(order_slice) - cur.pos, most)
        if n_run <= 0:
            return None
        if isinstance(order_slice, ConsumerSlice):
            samples = order_slice.take(cur.pos, cur.pos + n_run)
        else:  # a redistributed epoch, or an order version 1 state: the slice as an array
            samples = np.asarray(order_slice[cur.pos : cur.pos + n_run], np.int64)
        starts = self._starts[source]
        shard_of = np.searchsorted(starts, samples, side="right") - 1
        usable = np.ones(n_run, bool)
        shards: dict[int, CheckedShard | IndexedShard] = {}
        for shard in np.unique(shard_of).tolist():
            checked = stream.checked_shard(source, table, shard)
            if (
                checked is not None
                and checked.ids_dtype == np.dtype("<i4")
                and checked.mod_dtype == np.dtype("u1")
            ):
                shards[shard] = checked
            else:
                usable &= shard_of != shard
        if not usable.all():  # the run ends before the first document it cannot take
            n_run = int(np.argmin(usable))
        if n_run == 0:
            return None
        samples, shard_of = samples[:n_run], shard_of[:n_run]
        in_shard = samples - starts[shard_of]
        # The run's documents grouped by shard (positions in the run, in order within a shard):
        # one compiled call per group and step, not a dozen numpy calls
        uniq, inverse = np.unique(shard_of, return_inverse=True)
        by_shard = np.argsort(inverse, kind="stable")
        bounds = np.concatenate([[0], np.cumsum(np.bincount(inverse))]).tolist()
        lengths, ids_at, mod_at = (np.empty(n_run, np.int64) for _ in range(3))
        bstart, bcount = np.empty(n_run, np.int64), np.empty(n_run, np.int64)
        groups = []
        for group, shard in enumerate(uniq.tolist()):
            checked = shards[shard]
            sel = by_shard[bounds[group] : bounds[group + 1]]
            take_rows(sel, in_shard, checked.table, lengths, ids_at, mod_at, bstart, bcount)
            groups.append((checked, sel))
        # rows of docs, then units (per shard: its blocks table)
        first_doc = self.ndocs
        self._reserve(n_run, int((2 * bcount + 1).sum()))
        rows = np.arange(first_doc, first_doc + n_run, dtype=np.int64)
        unit0, n_units, nblk = (np.empty(n_run, np.int64) for _ in range(3))
        u_at = self.nunits
        for checked, sel in groups:
            u_at = fill_units(
                self.units,
                u_at,
                sel,
                lengths,
                bstart,
                bcount,
                checked.index.blocks,
                unit0,
                n_units,
                nblk,
            )
        self.nunits = u_at
        out_groups = [(checked.bytes, sel) for checked, sel in groups]
        block = self.docs[first_doc : first_doc + n_run]
        block[:, kernel.D_SRC], block[:, kernel.D_SAMPLE], block[:, kernel.D_EPOCH] = (
            source,
            samples,
            cur.epoch,
        )
        block[:, kernel.D_LEN], block[:, kernel.D_UNIT], block[:, kernel.D_OFF] = lengths, 0, 0
        block[:, kernel.D_LIMIT], block[:, kernel.D_TOK] = lengths, 0
        block[:, kernel.D_U0], block[:, kernel.D_NU], block[:, kernel.D_NBLK] = unit0, n_units, nblk
        block[:, kernel.D_CEPOCH] = cur.epoch
        block[:, kernel.D_CPOS] = cur.pos + 1 + np.arange(n_run)
        block[:, kernel.D_CERRS] = self.read_errors[source]
        self.ndocs = first_doc + n_run
        cur.pos += n_run
        stream.consecutive_errors = 0
        return rows, out_groups, ids_at, mod_at

    def _reserve(self, docs: int, units: int) -> None:
        while self.ndocs + docs > len(self.docs):
            self.docs = np.concatenate([self.docs, np.zeros_like(self.docs)])
        while self.nunits + units > len(self.units):
            self.units = np.concatenate([self.units, np.zeros_like(self.units)])

    def _refill(self, source: int) -> None:
        """Read source ``source``'s next documents into its (empty) queue: runs of checked shards'
        documents at once, any other one by one through the stream (which checks, skips and
        counts as always)."""
        stream, src = self.stream, self.src
        cursor = stream.cursors[source]
        new, runs, order, tokens, count = [], [], [], 0, 0
        cap = self.queue.shape[1]
        while tokens < self.refill_tokens and count < cap:
            if stream.whole_checked[source]:
                run = self._fast_run(source, min(256, cap - count))
                if run is not None:
                    runs.append(run)
                    order.append(run[0])
                    tokens += int(self.docs[run[0], kernel.D_LEN].sum())
                    count += len(run[0])
                    continue
            errors = stream.errors
            doc = stream.read_next(source)
            self.read_errors[source] += stream.errors - errors
            if doc is None:
                if cursor.done:
                    src[source, kernel.S_ENDED] = 1
                    src[source, kernel.S_END_EPOCH] = cursor.epoch
                    src[source, kernel.S_END_POS] = cursor.pos
                    src[source, kernel.S_END_ERRS] = self.read_errors[source]
                    break
                continue  # unreadable: skipped and counted by the stream
            drow = self._add(doc, (cursor.epoch, cursor.pos, self.read_errors[source]))
            new.append((drow, *tokens_of(doc)))
            order.append(np.asarray([drow], np.int64))
            tokens += doc.length
            count += 1
        self._stage(new, runs)  # before the queue lists them: they are not live tokens yet
        rows = np.concatenate(order) if order else np.zeros(0, np.int64)
        self.queue[source, : len(rows)] = rows
        src[source, kernel.S_QHEAD], src[source, kernel.S_QLEN] = 0, len(rows)

    def _compact(self) -> None:
        """Between batches: drop the rows of documents nothing refers to any more."""
        src, state = self.src, self.state
        live = [self.pending[: state[kernel.ST_NPENDING]]]
        for source in range(len(src)):
            live.append(self.opened[source, : src[source, kernel.S_NOPEN]])
            head = src[source, kernel.S_QHEAD]
            live.append(self.queue[source, head : head + src[source, kernel.S_QLEN]])
        keep = np.unique(np.concatenate(live))
        remap = np.full(self.ndocs, -1, np.int64)
        remap[keep] = np.arange(len(keep))
        docs = self.docs[keep]
        # their units, in order
        n_units = docs[:, kernel.D_NU]
        starts = np.repeat(docs[:, kernel.D_U0] - np.cumsum(n_units) + n_units, n_units)
        take = starts + np.arange(int(n_units.sum()))
        units = self.units[take]
        docs[:, kernel.D_U0] = np.cumsum(n_units) - n_units
        self.docs[: len(keep)] = docs
        self.units[: len(units)] = units
        self.ndocs, self.nunits = len(keep), len(units)
        n_pending = state[kernel.ST_NPENDING]
        self.pending[:n_pending] = remap[self.pending[:n_pending]]
        for source in range(len(src)):
            n_open = src[source, kernel.S_NOPEN]
            self.opened[source, :n_open] = remap[self.opened[source, :n_open]]
            queued = self.queue[
                source,
                src[source, kernel.S_QHEAD] : src[source, kernel.S_QHEAD]
                + src[source, kernel.S_QLEN],
            ]
            queued[:] = remap[queued]
