"""A consumer stream's batches through the compiled loop (data/loader/pack_kernel.py): the
arrays it works on, how documents reach them, and the stream's state read back from them.

Design choices:
- Documents reach the arrays a few batches of one source at a time, when the kernel says that
  source's queue ran dry (fast_intake.py says how).
- Reading ahead moves the stream's cursors (``stream.cursors``) past what has been packed; the
  cursor a saved state holds is the one recorded with the last document the kernel took from
  each queue, and its skips those read before that document (or before the source's end), as
  the Python path counts them.
- The state after each batch is a snapshot of a few array rows (fast_state.py).
- The stream's Python fields (``open``, ``packer.pending``, ``packer.stats``, ``cursors``) are
  the starting point (a fresh stream or a restored state) and are not kept up to date while
  the kernel runs: ``state_dict`` reads the kernel's arrays. Restoring a state drops this
  object; the next batch builds it again from the restored fields.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

from data.loader import pack_kernel as kernel
from data.loader.batch_tables import count_modalities, pieces_table
from data.loader.expand import CompactBatch
from data.loader.fast_intake import DocumentIntake, tokens_of
from data.loader.fast_state import FastState, snapshot_arrays
from data.loader.packer import Doc
from data.loader.stream_state import skipped_samples
from data.vocab import MODALITY_NAMES, Modality

if TYPE_CHECKING:
    from data.loader.stream import ConsumerStream

_VIDEO = int(Modality.VIDEO)


class FastPath(DocumentIntake):
    def __init__(self, stream: ConsumerStream) -> None:
        self.stream = stream
        cfg, packer = stream.cfg, stream.packer
        n_sources = len(stream.tables)
        self.B, self.L = stream.micro_batch, cfg.seq_len
        self.chunk, self.max_pending = stream.chunk, cfg.max_pending
        self.drop_document = cfg.oversize == "drop_document"
        self.pad_id = packer.pad_id
        # A few batches of one source a refill (at least one document)
        self.refill_tokens = 4 * self.B * self.L
        self.docs = np.zeros((8192, kernel.N_DOC_COLS), np.int64)
        self.units = np.zeros((16384, 6), np.int64)
        self.ndocs = self.nunits = 0
        self.src = np.zeros((n_sources, kernel.N_SRC_COLS), np.int64)
        # Held-aside and open documents: at most max_pending + 2 each in steady state, but a state
        # redistributed from many consumers onto fewer brings all of theirs (redistribute.py)
        cap = 2 * (cfg.max_pending + 2)
        most_open = max((len(docs) for docs in stream.open), default=0)
        self.opened = np.zeros((n_sources, max(cap, most_open + cap)), np.int64)
        cap = max(2 * cap, len(packer.pending) + cap)
        self.queue = np.zeros((n_sources, 1024), np.int64)
        self.pending = np.zeros(cap, np.int64)
        self.carry = np.zeros(cap, np.int64)
        self.defer = np.zeros(cap, np.int64)
        self.shares = np.asarray(stream.shares, np.float64)
        self.mixed = np.asarray([source for source, _ in stream._mixed], np.int64)
        self.state = np.zeros(kernel.N_ST, np.int64)
        # The staging arrays of every source's documents (fast_intake.py: an arena appended to)
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
        # The starting point: the stream's Python fields (fresh, or just restored)
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
        # before each source's last document taken (and at its end), as the Python path does
        self.base_errors = stream.errors
        self.base_skips = [len(events) for events in stream.skip_events]
        self.read_errors = [0] * n_sources
        for (source, modality), count in packer.dropped_by.items():
            self.src[source, kernel.S_DROP_VIDEO if modality == _VIDEO else kernel.S_DROP_IMAGE] = (
                count
            )
        stats = packer.stats
        self.state[kernel.ST_STAT_ROWS], self.state[kernel.ST_STAT_REAL] = (
            stats.rows,
            stats.real_tokens,
        )
        self.state[kernel.ST_STAT_DBLOCKS], self.state[kernel.ST_STAT_DDOCS] = (
            stats.dropped_blocks,
            stats.dropped_docs,
        )
        index: dict[int, int] = {}  # id(Doc) -> its row (a document open and pending is one)
        by_source: list[list[Doc]] = [[] for _ in range(n_sources)]

        def row_of(doc: Doc) -> int:
            if id(doc) not in index:
                index[id(doc)] = self._add(doc, (-1, -1, 0))
                by_source[doc.source].append(doc)
            return index[id(doc)]

        pending = [row_of(doc) for doc in packer.pending]
        opened = [[row_of(doc) for doc in docs] for docs in stream.open]
        # staged at once, before the lists refer to them (nothing staged is live yet)
        self._stage([(index[id(doc)], *tokens_of(doc)) for docs in by_source for doc in docs], [])
        self.pending[: len(pending)] = pending
        self.state[kernel.ST_NPENDING] = len(pending)
        for source, rows in enumerate(opened):
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
                self.pad_id,
            )
            if code == kernel.PACKED:
                return True
            if code == kernel.END:
                return False
            self._refill(int(self.state[kernel.ST_NEED]))

    def dropped_matrix(self) -> np.ndarray:
        # adjacent columns (a slice; fancy indexing cost ~5 us a batch)
        assert kernel.S_DROP_VIDEO == kernel.S_DROP_IMAGE + 1
        return self.src[:, kernel.S_DROP_IMAGE : kernel.S_DROP_VIDEO + 1].copy()

    # --- state ---------------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        """What ``stream_state.save_state`` saves, read from the arrays."""
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
            stream.order_version,
            skipped_samples(
                stream,
                [base + int(n) for base, n in zip(self.base_skips, self.src[:, kernel.S_CERRS])],
            ),
        )
