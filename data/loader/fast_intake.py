"""How documents reach the compiled loop's arrays (fast_stream.FastPath): read ahead a source
at a time, their rows, units and tokens added, and the rows nothing refers to any more dropped.

Design choices:
- Documents are read by the stream's own ``_read_next`` (order, epochs, the whole-shard and
  per-document checks, skips and their log lines: all unchanged), a few batches' worth of one
  source at a time, when the kernel says that source's queue ran dry; runs of documents of
  shards that passed the whole-shard check are added at once, without a Python object each
  (stage_kernel.py).
- Their tokens are appended to one pair of staging arrays (int32 ids, uint8 modalities) shared
  by every source, so the kernel reads every document from one place whatever shard or kind it
  came from; when they are full, they are made again with the documents still being placed.
- Skips are counted per source as documents are read ahead, and each document's row records the
  count so far: a state counts a skip once the kernel takes a document after it.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from data.loader import pack_kernel as kernel
from data.loader.order import ConsumerSlice
from data.loader.packer import Doc
from data.loader.shard_check import CheckedShard
from data.loader.stage_kernel import fill_units, gather_tokens, take_rows


def tokens_of(doc: Doc) -> tuple[np.ndarray, np.ndarray]:
    assert doc.ids is not None and doc.mod is not None  # read (never a dry document here)
    return doc.ids, doc.mod


class DocumentIntake:
    """The document half of ``FastPath`` (its arrays are made in ``FastPath.__init__``)."""

    stream: Any
    docs: np.ndarray
    units: np.ndarray
    ndocs: int
    nunits: int
    src: np.ndarray
    state: np.ndarray
    opened: np.ndarray
    queue: np.ndarray
    pending: np.ndarray
    carry: np.ndarray
    defer: np.ndarray
    staged_ids: np.ndarray
    staged_mod: np.ndarray
    staged_end: int
    refill_tokens: int
    read_errors: list[int]
    _starts: list[np.ndarray]

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
        epoch's rest went to other consumers: ``_read_next`` then says which)."""
        stream = self.stream
        table, cur = stream.tables[source], stream.cursors[source]
        order_slice = stream._slices.get((source, cur.epoch))
        if order_slice is None:
            order_slice = stream._slice(source, cur.epoch)
        if cur.pos >= len(order_slice):
            # The epoch's end: on to the next one here, as ``_read_next`` would (else the next
            # epoch's first document was read on its own, ~0.2 ms)
            if not stream.next_epoch(source):
                return None  # done, or nothing here: ``_read_next`` says which
            order_slice = stream._slice(source, cur.epoch)
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
        shards: dict[int, CheckedShard] = {}
        for shard in np.unique(shard_of).tolist():
            checked = stream._checked_shard(source, table, shard)
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
            if stream._whole[source]:
                run = self._fast_run(source, min(256, cap - count))
                if run is not None:
                    runs.append(run)
                    order.append(run[0])
                    tokens += int(self.docs[run[0], kernel.D_LEN].sum())
                    count += len(run[0])
                    continue
            errors = stream.errors
            doc = stream._read_next(source)
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
