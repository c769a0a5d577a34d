"""A consumer stream's batches through the compiled loop (data/loader/pack_kernel.py): the
arrays it works on, how documents reach them (docs/loader.md, "Documents read ahead"), and the
stream's state read back from them (its one form: docs/loader.md, "Exact resume").

Design choices:
- Documents of shards that passed the whole-shard check come in runs without a Python object
  each (stage_kernel.py); so do a dry stream's, which counts an epoch from the shards' indexes
  alone (shard_check.CheckedShard.of_index): lengths and blocks are all the packing decisions
  read.
- Skips are counted per source as documents are read ahead, and each document's row records the
  count so far: a state counts a skip once the kernel takes a document after it.
- Reading ahead moves the stream's cursors (``stream.cursors``) past what has been packed; the
  cursor a saved state holds is the one recorded with the last document the kernel took from
  each queue, and its skips those read before that document (or before the source's end).
"""

from __future__ import annotations

from collections import Counter
from typing import TYPE_CHECKING

import numpy as np

from data.loader import pack_kernel as kernel
from data.loader.expand import CompactBatch
from data.loader.pack_kernel import Packing, PackStats
from data.loader.shard_check import CheckedShard
from data.loader.stage_kernel import fill_units
from data.loader.stream_state import CURSOR_COLS, SRC_COLS, StreamState
from data.vocab import MODALITY_NAMES, Modality

if TYPE_CHECKING:
    from data.loader.stream import ConsumerStream

_VIDEO = int(Modality.VIDEO)


class StreamArrays(Packing):
    def __init__(self, stream: ConsumerStream, st: dict | None = None) -> None:
        """The arrays of a fresh stream, or of one restored from its saved dict ``st`` (whose
        cursors and counters ConsumerStream.load_state_dict has put back): the documents it held
        aside and handed out in part are read again from their shards, its packing counters and
        dropped blocks set."""
        self.stream = stream
        cfg = stream.cfg
        pending, opened = (st["pending"], st["open"]) if st else ([], [])
        # Held-aside and open documents: at most max_pending + 2 each in steady state, but a state
        # redistributed from many consumers onto fewer brings all of theirs (redistribute.py)
        cap = 2 * (cfg.max_pending + 2)
        most_open = max(Counter(cursor[0] for cursor in opened).values(), default=0)
        super().__init__(
            len(stream.tables),
            (
                stream.micro_batch,
                cfg.seq_len,
                stream.chunk,
                cfg.max_pending,
                cfg.oversize == "drop_document",
                cfg.whole_documents,
                stream.pad_id,
            ),
            shares=stream.shares,
            mixed=stream.mixed_sources,
            open_cap=most_open + cap,
            held_cap=max(2 * cap, len(pending) + cap),
            queue_cap=1024,
            stats=PackStats(**st["stats"]) if st else PackStats(),
            # Counting only (an epoch's batches): documents from the index, no token read or copied
            dry=stream.dry,
        )
        # Per source: where each shard's samples start (token tables; runs of checked shards)
        self._starts = [
            np.asarray(getattr(table, "starts", [0]), np.int64) for table in stream.tables
        ]
        # The packed position starts where the reading cursors are (fresh, or just restored)
        self.skip = [dict(cur.skip) for cur in stream.cursors]
        src = self.src
        for source, cur in enumerate(stream.cursors):
            src[source, kernel.S_TOKENS] = cur.tokens
            src[source, kernel.S_DONE] = src[source, kernel.S_ENDED] = int(cur.done)
            src[source, kernel.S_CEPOCH] = src[source, kernel.S_END_EPOCH] = cur.epoch
            src[source, kernel.S_CPOS] = src[source, kernel.S_END_POS] = cur.pos
        src[:, kernel.S_MIX] = st["mix"] if st else 0
        for source, modality, count in st["dropped_by"] if st else []:
            src[source, kernel.S_DROP_VIDEO if modality == _VIDEO else kernel.S_DROP_IMAGE] = count
        # (source, sample, epoch) -> the row of a document read again (-1: unreadable now:
        # skipped, counted and logged by load); one both held aside and open is one row
        rows: dict[tuple[int, int, int], int] = {}
        new = []

        def row_of(cursor: list[int]) -> int:
            source, sample, epoch = cursor[:3]
            key = (source, sample, epoch)
            if key not in rows:
                doc = stream.load(source, sample, epoch)
                rows[key] = -1
                if doc is not None:
                    rows[key] = self.add(doc, (-1, -1, 0))
                    self.docs[rows[key], CURSOR_COLS] = cursor  # placed and handed out as saved
                    new.append((rows[key], doc.ids, doc.mod))
            return rows[key]

        pending_rows = [row for row in map(row_of, pending) if row >= 0]
        opened_rows: list[list[int]] = [[] for _ in stream.tables]
        for cursor in opened:
            if (row := row_of(cursor)) >= 0:
                opened_rows[cursor[0]].append(row)
        # Skips: counted by the stream when its documents are read ahead (and above); a state
        # counts those before each source's last document taken (and at its end)
        self.base_errors = stream.errors
        self.base_skips = [len(events) for events in stream.skip_events]
        self.read_errors = [0] * len(stream.tables)
        # staged at once, before the lists refer to them (nothing staged is live yet)
        self.stage(new, [])
        self.pending[: len(pending_rows)] = pending_rows
        self.state[kernel.ST_NPENDING] = len(pending_rows)
        for source, opened_at in enumerate(opened_rows):
            self.opened[source, : len(opened_at)] = opened_at
            src[source, kernel.S_NOPEN] = len(opened_at)

    # --- batches -------------------------------------------------------------------------------------
    def pack(self, ids: np.ndarray, mod: np.ndarray) -> tuple | None:
        """The next batch, its ids and modalities packed into ``ids``/``mod`` (flat [B * L]):
        (``CompactBatch``, pieces table, tokens per source, tokens per modality), or None at the
        end of the data (epoch mode: the incomplete batch is held back)."""
        real = np.empty(self.B, np.int64)
        if self.run(ids, mod, real, self._refill) == kernel.END:
            return None
        state = self.state
        seg = self.seg[: state[kernel.ST_NSEG]].copy()
        blocks = self.blocks[: state[kernel.ST_NBLK]].copy()
        by_modality = np.empty(len(MODALITY_NAMES), np.int64)
        kernel.count_modalities(mod, real, by_modality)
        return (
            CompactBatch(self.B, self.L, ids, mod, seg, blocks, real),
            kernel.pieces_table(self.pieces, self.row_pieces),
            self.src[:, kernel.S_BATCH_TOKENS].tolist(),
            by_modality,
        )

    def count(self) -> bool:
        """Dry: the next batch's decisions made (rows, drops, cursors), no token copied (only
        padding written); False at the end of the data, where ``pack`` holds it back."""
        ids, mod = np.empty(self.B * self.L, np.int32), np.empty(self.B * self.L, np.uint8)
        return self.run(ids, mod, np.empty(self.B, np.int64), self._refill) == kernel.PACKED

    def dropped_matrix(self) -> np.ndarray:
        return self.src[:, [kernel.S_DROP_IMAGE, kernel.S_DROP_VIDEO]]

    # --- state ---------------------------------------------------------------------------------------
    def snapshot(self) -> StreamState:
        """The state after the last batch, as copies of the few array rows it needs (a few
        microseconds; made into ``state_dict``'s lists only when asked for)."""
        src, state, stream = self.src, self.state, self.stream
        held = [self.pending[: state[kernel.ST_NPENDING]]]
        held += [self.opened[source, : src[source, kernel.S_NOPEN]] for source in range(len(src))]
        taken = src[:, kernel.S_CERRS].tolist()  # the skips read before each last document taken
        return StreamState(
            src[:, SRC_COLS],
            self.docs[np.concatenate(held)][:, CURSOR_COLS],
            state[kernel.STAT_COLS],
            stream.tokens_by_modality.copy(),
            int(state[kernel.ST_NPENDING]),
            stream.batches,
            self.base_errors + sum(taken),
            self.skip,
            stream.skipped_samples([base + n for base, n in zip(self.base_skips, taken)]),
        )

    # --- documents into the arrays ----------------------------------------------------------------
    def _shard_run(self, source: int, most: int):
        """The next documents of source ``source`` (at most ``most``, in one epoch; at an
        epoch's end, of the next epoch) that lie in shards that passed the whole-shard check,
        added as rows without a ``Doc`` each: (their rows, per shard (its map's bytes, which
        of the run's positions are its documents), where each document's ids and where its
        modalities start in its map) -- None when the next document is not such (it is read
        one by one) or when the source has nothing to read here (done, or a redistributed
        epoch's rest went to other consumers: ``read_next`` then says which)."""
        stream = self.stream
        table, cur = stream.tables[source], stream.cursors[source]
        # At an epoch's end: on to the next one here, as ``read_next`` would (else the next
        # epoch's first document would be read on its own, through ``read_next``)
        order_slice = stream.slice_at_cursor(source)
        if order_slice is None:
            return None  # done, or nothing here: ``read_next`` says which
        n_run = min(len(order_slice) - cur.pos, most)
        # a lazy slice (order.ConsumerSlice) or, in a redistributed epoch, an array
        samples = np.asarray(order_slice[cur.pos : cur.pos + n_run], np.int64)
        starts = self._starts[source]
        shard_of = np.searchsorted(starts, samples, side="right") - 1
        usable = np.ones(n_run, bool)
        shards: dict[int, CheckedShard] = {}
        for shard in np.unique(shard_of).tolist():
            checked = stream.checked_shard(source, table, shard)
            if checked is not None:  # int32 ids, uint8 modalities: the only kind that passes
                shards[shard] = checked
            else:
                usable &= shard_of != shard
        if not usable.all():  # the run ends before the first document it cannot take
            n_run = int(np.argmin(usable))
        if n_run == 0:
            return None
        samples, shard_of = samples[:n_run], shard_of[:n_run]
        in_shard = samples - starts[shard_of]
        # The run's documents grouped by shard (positions in the run, in order within a shard),
        # their rows of its table (length, first block, blocks, where ids and modalities start)
        picked = np.empty((n_run, 5), np.int64)
        groups = []
        for shard in np.unique(shard_of).tolist():
            sel = np.flatnonzero(shard_of == shard)
            picked[sel] = shards[shard].table[in_shard[sel]]
            groups.append((shards[shard], sel))
        lengths, bstart, bcount, ids_at, mod_at = picked.T.copy()
        # rows of docs, then units (per shard: its blocks table)
        first_doc = self.ndocs
        self.reserve(n_run, int((2 * bcount + 1).sum()))
        rows = np.arange(first_doc, first_doc + n_run, dtype=np.int64)
        unit0, n_units = np.empty(n_run, np.int64), np.empty(n_run, np.int64)
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
            )
        self.nunits = u_at
        out_groups = [(checked.bytes, sel) for checked, sel in groups]
        block = self.docs[first_doc : first_doc + n_run]
        block[:] = 0
        block[:, kernel.D_SRC], block[:, kernel.D_SAMPLE] = source, samples
        block[:, kernel.D_EPOCH] = block[:, kernel.D_CEPOCH] = cur.epoch
        block[:, kernel.D_LEN] = block[:, kernel.D_LIMIT] = lengths
        block[:, kernel.D_U0], block[:, kernel.D_NU], block[:, kernel.D_NBLK] = (
            unit0,
            n_units,
            bcount,
        )
        block[:, kernel.D_CPOS] = cur.pos + 1 + np.arange(n_run)
        block[:, kernel.D_CERRS] = self.read_errors[source]
        self.ndocs = first_doc + n_run
        cur.pos += n_run
        stream.consecutive_errors = 0
        return rows, out_groups, ids_at, mod_at

    def _refill(self, source: int) -> None:
        """Read source ``source``'s next documents into its (empty) queue: runs of checked shards'
        documents at once, any other one by one through the stream (which checks, skips and
        counts as always)."""
        stream, src = self.stream, self.src
        cursor = stream.cursors[source]
        new, runs, order, tokens, count, run_tokens = [], [], [], 0, 0, 0
        cap = self.queue.shape[1]
        while tokens < self.refill_tokens and count < cap:
            if stream.whole_checked[source]:
                run = self._shard_run(source, min(256, cap - count))
                if run is not None:
                    runs.append(run)
                    order.append(run[0])
                    run_length = int(self.docs[run[0], kernel.D_LEN].sum())
                    tokens += run_length
                    run_tokens += run_length
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
            drow = self.add(doc, (cursor.epoch, cursor.pos, self.read_errors[source]))
            new.append((drow, doc.ids, doc.mod))
            order.append(np.asarray([drow], np.int64))
            tokens += doc.length
            count += 1
        self.stage(new, runs)  # before the queue lists them: they are not live tokens yet
        if runs and not self.dry:
            # int32 ids and uint8 modalities read through the shards' maps (store.ShardFiles)
            stream.files.touched(5 * run_tokens)
        rows = np.concatenate(order) if order else np.zeros(0, np.int64)
        self.queue[source, : len(rows)] = rows
        src[source, kernel.S_QHEAD], src[source, kernel.S_QLEN] = 0, len(rows)
