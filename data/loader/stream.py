"""One consumer's stream (a rank's worker): mix sources by tokens, read documents, pack rows,
group them into batches, and say exactly where it is.

Design choices:
- Mixing by tokens, deterministically, a chunk at a time: the next chunk (at most
  ``mix_chunk`` tokens, default ``seq_len``, never cutting a visual block) comes from the
  source furthest below its share (weight x tokens handed out so far, minus its own tokens).
  A long document is handed out a chunk at a time (the OLMo / Megatron practice of cutting
  documents into row-sized instances), so each step carries the mix instead of one source's
  long document filling many rows. No RNG, shares exact to within one chunk, and the state is
  a few counters plus the documents handed out in part (``open``).
- The state (``state_dict``) is cursors, counters and the held-aside documents' positions:
  kilobytes. Restoring recomputes each source's epoch order (hashing, O(samples), the same cost
  at any position) and seeks to the cursor through the index; nothing is replayed.
- Bad data never stops a run: an unreadable sample is skipped, counted and logged with its
  shard and key; ``max_consecutive_errors`` in a row stops with an error naming the last one.
  A read slower than ``stall_seconds`` is reported by a watchdog thread while it hangs.
- Epoch mode: every consumer packs the same number of batches (the fewest any consumer can
  fill, counted from the index alone); the samples beyond that are *held back*, counted and
  reported, never repeated.
"""

from __future__ import annotations

import atexit
import io
import re
import sys
import threading
import time
from dataclasses import dataclass, field

import numpy as np
import torch

from data.loader import store, transport
from data.loader.config import LoaderConfig
from data.loader.expand import CompactBatch, expand, slot_views
from data.loader.online import OnlineTokenizer, online_options
from data.loader.order import (
    ORDER_VERSION,
    ConsumerSlice,
    EpochOrder,
    consumer_slice,
    epoch_order,
    unpack_mask,
)
from data.loader.packer import BatchBuffer, Doc, Packer, Row, units_of
from data.loader.sample_check import check_ids, read_members
from data.loader.shard_check import CheckedShard, check_shard
from data.loader.store import ShardFiles, ShardView
from data.loader.table import SampleTable
from data.tokenize.blocks import visual_blocks
from data.vocab import MODALITY_NAMES, Modality

# The header numpy writes for a 1-D little-endian array (what earlyfuse-prep tokenize stores).
_NPY_1D = re.compile(
    rb"\{'descr': '([<|][iu][1248])', 'fortran_order': False, 'shape': \((\d+),\), \}"
)


_TEXT_M = int(Modality.TEXT)
_NOT_TEXT = [int(m) for m in Modality if m != Modality.TEXT]

_HEADERS: dict[bytes, tuple[np.dtype, int]] = {}  # header text -> (dtype, length), parsed once


def npy_layout(data: bytes | memoryview) -> tuple[np.dtype, int, int] | None:
    """(dtype, length, where the values start) of a 1-D little-endian integer .npy with a version
    1 header, the kind tokenize writes; None for any other kind."""
    if data[:8] != b"\x93NUMPY\x01\x00":
        return None
    hlen = int.from_bytes(data[8:10], "little")
    header = bytes(data[10 : 10 + hlen])
    known = _HEADERS.get(header)
    if known is None:
        m = _NPY_1D.match(header)
        if not m:
            return None
        known = (np.dtype(m.group(1).decode()), int(m.group(2)))
        if len(_HEADERS) < 65536:  # one per (dtype, length): documents repeat lengths
            _HEADERS[header] = known
    return known[0], known[1], 10 + hlen


def read_npy(data: bytes | memoryview) -> np.ndarray:
    """``np.load`` of a 1-D integer .npy, without its header parser (``ast.literal_eval`` was 40 %
    of the loader's time on short documents); any other .npy goes through ``np.load`` (pickle
    never allowed). A short or bad payload is a ValueError like np.load's."""
    layout = npy_layout(data)
    if layout is not None:
        return np.frombuffer(data, dtype=layout[0], count=layout[1], offset=layout[2])
    return np.load(io.BytesIO(data), allow_pickle=False)


def sample_where(t: SampleTable, sample: int) -> tuple[str, str]:
    """(shard URL, key) of a sample, for messages; the key is looked up only when needed, and a
    shard whose index cannot be read gives the sample's number instead."""
    try:
        return t.shards[t.shard_of(sample)], t.key_of(sample)
    except (OSError, ValueError, IndexError):
        return t.name, f"#{sample}"


class Watchdog:
    """Reports a read that has not returned after ``seconds``, naming what it was reading."""

    def __init__(self, seconds: float, label: str) -> None:
        self.seconds, self.label = seconds, label
        # (what is being read: a label, or (table, sample) formatted only if it stalls; since)
        self.current: tuple[str | tuple, float] | None = None
        self.reported = 0
        self._stop = threading.Event()
        if seconds > 0:
            threading.Thread(target=self._watch, daemon=True).start()
            atexit.register(self._stop.set)  # never left running into interpreter shutdown

    def _watch(self) -> None:
        while not self._stop.wait(min(self.seconds, 5.0)):
            cur = self.current
            if cur and time.monotonic() - cur[1] > self.seconds:
                self.reported += 1
                what = cur[0] if isinstance(cur[0], str) else " sample ".join(sample_where(*cur[0]))
                print(
                    f"[loader {self.label}] read stalled for {time.monotonic() - cur[1]:.0f} s: {what}",
                    file=sys.stderr,
                    flush=True,
                )
                self.current = (cur[0], time.monotonic())


_KEEP_SHARDS = 256  # as many as ShardFiles keeps memory maps of (a checked shard holds its map)


@dataclass
class SourceCursor:
    epoch: int = 0
    pos: int = 0  # position in this consumer's slice of the epoch order
    tokens: int = 0  # tokens taken from this source
    done: bool = False  # epoch mode: this source is exhausted
    # epoch -> packed mask (order.pack_mask) of the positions of that epoch's order consumed
    # before a redistribute; the slice is then taken from the rest. Dropped once passed: every
    # consumer of one state holds the same masks, so the slowest still has any a later
    # redistribute needs.
    skip: dict[int, str] = field(default_factory=dict)


class ConsumerStream:
    def __init__(
        self,
        tables: list[SampleTable],
        weights: list[float],
        cfg: LoaderConfig,
        *,
        consumer: int,
        consumers: int,
        micro_batch: int,
        pad_id: int,
        dry: bool = False,
        order_version: int = ORDER_VERSION,
    ) -> None:
        self.tables, self.cfg, self.dry = tables, cfg, dry
        self.order_version = order_version
        total = float(sum(weights))
        self.shares = [w / total for w in weights]
        # (source, share) of the sources that get a share, in order: what the mix picks from
        self._mixed = [(s, share) for s, share in enumerate(self.shares) if share > 0]
        self.consumer, self.consumers, self.micro_batch = consumer, consumers, micro_batch
        self.packer = Packer(
            cfg.seq_len, pad_id=pad_id, max_pending=cfg.max_pending, oversize=cfg.oversize, dry=dry
        )
        self.cursors = [SourceCursor() for _ in tables]
        # Per source: documents with tokens not yet handed out, oldest first (the next chunk
        # comes from the first whose last chunk is placed). At most max_pending + 1 each.
        self.open: list[list[Doc]] = [[] for _ in tables]
        self.chunk = cfg.mix_chunk or cfg.seq_len
        self._slices: dict[tuple[int, int], np.ndarray | ConsumerSlice] = {}
        self.errors = 0
        self.consecutive_errors = 0
        self.batches = 0
        self.batch_limit: int | None = None
        self.tokens_by_modality = np.zeros(len(MODALITY_NAMES), np.int64)
        self._dropped_before = np.zeros((len(tables), 2), np.int64)  # as of the last batch
        self.files = ShardFiles(cfg.cache_dir, cfg.cache_limit_gb)
        self._online: OnlineTokenizer | None = None  # built on the first raw document
        self.ring: transport.SlotRing | None = None  # set in a DataLoader worker
        self.pin = False  # in-process: batches expanded into pinned memory (set by the loader)
        self.watchdog = None if dry else Watchdog(cfg.stall_seconds, f"consumer {consumer}")
        # (source, shard) -> the shard when it passed the whole-shard check, None when it did not
        # (data/loader/shard_check.py); least recently used dropped past _KEEP_SHARDS.
        self._checked: dict[tuple[int, int], CheckedShard | None] = {}
        self._used: dict[tuple[int, int], int] = {}  # when each was last used (self._tick)
        self._tick = 0
        self._check_whole = consumers <= cfg.whole_shard_check_max_consumers
        # Per source: read through whole-shard checks (token tables with shard digests)
        self._whole = [
            self._check_whole and getattr(t, "shard_sha256", None) is not None for t in tables
        ]

    # --- which document next -------------------------------------------------------------------
    def _slice(self, s: int, epoch: int) -> np.ndarray | ConsumerSlice:
        key = (s, epoch)
        if key not in self._slices:
            t = self.tables[s]
            self._slices = {
                k: v for k, v in self._slices.items() if k[0] != s
            }  # keep one epoch per source
            mask = self.cursors[s].skip.get(epoch)
            order_args = dict(
                seed=self.cfg.seed,
                epoch=epoch,
                source=t.name,
                buffer=self.cfg.shuffle_buffer,
                shuffle_shards=self.cfg.shuffle_shards,
            )
            if self.order_version == 1:  # a state saved before lazy orders: its positions
                counts = t.shard_counts()
                shard = np.repeat(np.arange(len(counts), dtype=np.int32), counts)
                order = epoch_order(shard, **order_args)  # type: ignore[arg-type]
            else:
                lazy = EpochOrder(t.shard_counts(), **order_args)  # type: ignore[arg-type]
                if mask is None:
                    self._slices[key] = ConsumerSlice(lazy, self.consumer, self.consumers)
                    return self._slices[key]
                order = lazy.full()  # a redistributed epoch: the positions left, in order
            if mask is not None:
                order = order[~unpack_mask(mask, len(order))]
            self._slices[key] = consumer_slice(order, self.consumer, self.consumers)
        return self._slices[key]

    def _ready(self, s: int) -> Doc | None:
        """The first open document of source ``s`` whose chunk so far is placed."""
        if not self.open[s]:  # most calls: nothing open
            return None
        for doc in list(self.open[s]):
            if doc.position() >= doc.length:  # ended early: its document was dropped (oversize)
                self.open[s].remove(doc)
            elif doc.chunk_placed():
                return doc
        return None

    def _pick_source(self) -> int | None:
        cursors = self.cursors
        tokens = [c.tokens for c in cursors]
        total = sum(tokens)
        best: int | None = None
        best_gap = 0.0
        for s, share in self._mixed:
            if cursors[s].done and self._ready(s) is None:
                continue
            gap = share * total - tokens[s]
            if best is None or gap > best_gap:
                best, best_gap = s, gap
        return best

    def next_doc(self) -> Doc | None:
        """The next chunk to place: a document whose ``limit`` has moved on by one chunk (the
        packer places it up to there). None when every source is done (epoch mode)."""
        while True:
            s = self._pick_source()
            if s is None:
                return None
            doc = self._ready(s)
            fresh = doc is None
            if doc is None:
                doc = self._read_next(s)
                if doc is None:
                    continue
                doc.limit = 0
            start = doc.limit
            doc.limit = doc.chunk_end(self.chunk)
            self.cursors[s].tokens += doc.limit - start
            # Open while chunks of it are still to come (most documents fit one chunk: never)
            if doc.limit < doc.length:
                if fresh:
                    self.open[s].append(doc)
            elif not fresh:
                self.open[s].remove(doc)
            return doc

    def _read_next(self, s: int) -> Doc | None:
        """The next document of source ``s`` in this consumer's slice; None when it could not be
        read (skipped and counted) or the source is done (epoch mode)."""
        c = self.cursors[s]
        sl = self._slices.get((s, c.epoch))
        if sl is None:
            sl = self._slice(s, c.epoch)
        if c.pos >= len(sl):
            if self.cfg.mode == "epoch":
                c.done = True
                return None
            c.skip.pop(c.epoch, None)
            c.epoch, c.pos = c.epoch + 1, 0
            sl = self._slice(s, c.epoch)
            if not len(sl):
                if c.epoch in c.skip:
                    return None  # the rest of this redistributed epoch went to other consumers
                raise ValueError(
                    f"source {self.tables[s].name}: fewer samples than consumers "
                    f"({self.consumers}); give it more shards or use fewer workers"
                )
        sample = int(sl[c.pos])
        c.pos += 1
        return self.load(s, sample, c.epoch)

    # --- reading ---------------------------------------------------------------------------------
    def _encode_raw(self, t: SampleTable, sample: int) -> tuple[np.ndarray, np.ndarray, list]:
        """A raw document tokenized here (data/loader/online.py): ids, modalities, blocks."""
        if self._online is None:
            if self.cfg.tokenizers is None:
                raise ValueError("raw sources need data.tokenizers (the tokenizers to use)")
            self._online = OnlineTokenizer(
                self.cfg.tokenizers,
                online_options(self.cfg),
                self.cfg.seq_len,
                failure_budget=self.cfg.video_failure_budget,
            )
        si = t.shard_of(sample)
        view = ShardView(self.files, t.shards[si], t.shard_end(si))
        doc, why = self._online.encode(
            t.key_of(sample), t.members[sample], store.name(t.shards[si]), view
        )
        if doc is None:
            raise ValueError(why)
        return doc.ids.astype(np.int64), doc.modality.astype(np.int64), visual_blocks(doc.spans)

    def _checked_shard(self, s: int, t: SampleTable, si: int) -> CheckedShard | None:
        """Shard ``si`` when it passes the whole-shard check (checked on first use)."""
        key = (s, si)
        self._tick += 1
        if key in self._checked:
            self._used[key] = self._tick
            return self._checked[key]
        url = t.shards[si]
        if self.watchdog:
            self.watchdog.current = (f"checking shard {url}", time.monotonic())
        try:
            mapped = self.files.mapped(url, t.shard_end(si))
            shard = None
            if mapped is not None:
                shard = check_shard(
                    mapped,
                    t.index(si),  # type: ignore[attr-defined]
                    shard_sha256=t.shard_sha256[si],  # type: ignore[attr-defined]
                    id_ranges=t.id_ranges,
                    check_hash=self.cfg.check_hashes,
                )
        except (OSError, ValueError):
            return None  # not remembered: read document by document, which names the error
        finally:
            if self.watchdog:
                self.watchdog.current = None  # checked: nothing is being read any more
        if len(self._checked) >= _KEEP_SHARDS:  # the least recently used goes
            oldest = min(self._used, key=self._used.__getitem__)
            del self._checked[oldest], self._used[oldest]
        self._checked[key], self._used[key] = shard, self._tick
        return shard

    def load(self, s: int, sample: int, epoch: int) -> Doc | None:
        t = self.tables[s]
        if self.dry:
            length = t.tokens_of(sample)
            return Doc(s, sample, epoch, length, units_of(length, t.blocks_of(sample)))
        if self._whole[s]:
            si, i = t.locate(sample)  # type: ignore[attr-defined]
            checked = self._checked_shard(s, t, si)
            if checked is not None:  # a checked shard: nothing to parse or check
                ids, mod, units = checked.document(i)
                self.consecutive_errors = 0
                return Doc(s, sample, epoch, len(ids), units, ids, mod)
        if self.watchdog:
            self.watchdog.current = ((t, sample), time.monotonic())
        try:
            if t.kind == "raw":
                ids, mod, blocks = self._encode_raw(t, sample)
                length = len(ids)
            else:
                si, length, blocks, j0, jsz, i0, isz, m0, msz, sha = t.locate_members(sample)
                url = t.shards[si]
                ids_b, mod_b = read_members(
                    j0,
                    jsz,
                    i0,
                    isz,
                    m0,
                    msz,
                    sha,
                    lambda off, size: self.files.view(url, off, size, t.shard_end(si)),
                    self.cfg.check_hashes,
                )
                # Views of the shard's memory map: nothing is copied until the packer places them.
                ids, mod = read_npy(ids_b), read_npy(mod_b)
                if ids.shape != (length,) or mod.shape != (length,):
                    raise ValueError(
                        f"{ids.shape[0]} ids / {mod.shape[0]} modalities, the index says {length}"
                    )
            check_ids(ids, mod, t.id_ranges)  # an id past the vocabulary would crash the model
        except (OSError, ValueError, EOFError) as e:
            self.errors += 1
            self.consecutive_errors += 1
            shard, key = sample_where(t, sample)
            print(f"[loader] skipped {shard} sample {key}: {e}", file=sys.stderr, flush=True)
            if self.consecutive_errors >= self.cfg.max_consecutive_errors:
                raise RuntimeError(
                    f"{self.consecutive_errors} unreadable samples in a row, the last "
                    f"{shard} {key}: {e}"
                ) from e
            return None
        finally:
            if self.watchdog:
                self.watchdog.current = None
        self.consecutive_errors = 0
        return Doc(s, sample, epoch, length, units_of(length, blocks), ids, mod)

    # --- rows and batches --------------------------------------------------------------------------
    def next_row(self) -> Row | None:
        return self.packer.pack(self.next_doc)

    def next_batch(self) -> PackedBatch | dict | None:
        """The next batch (``PackedBatch``; ``{}`` when packing dry); None at the end."""
        if self.batch_limit is not None and self.batches >= self.batch_limit:
            return None
        packer = self.packer
        rows: list[Row] = []
        while len(rows) < self.micro_batch:
            r = packer.pack(self.next_doc, packer.blank_row())
            if r is None:
                return None  # the last, incomplete batch of an epoch is held back
            rows.append(r)
        self.batches += 1
        if self.dry:
            return {}
        B, L = len(rows), self.cfg.seq_len
        n = B * L
        ring, slot, buffer = self.ring, None, None
        if ring is not None:
            # In a worker: the compact batch straight into a slot of shared memory
            # (data/loader/transport.py), or ordinary arrays when none is free
            slot = ring.acquire()
            if slot is not None:
                ids, mod = slot_views(ring.data[slot].numpy(), B, L)
            else:
                ids, mod = np.empty(n, np.int32), np.empty(n, np.uint8)
        else:  # in-process: the ids and modalities straight into the batch's int64 fields
            buffer = BatchBuffer(B, L, packer.pad_id, pin=self.pin)
            ids, mod = buffer.fields["ids"].reshape(n), buffer.fields["mod"].reshape(n)
        compact = packer.compact(rows, ids, mod)
        dropped = self.dropped_matrix()
        new_drops = dropped - self._dropped_before
        self._dropped_before = dropped
        real = int(compact.real.sum())
        # The modalities of the real tokens: one count per modality other than text (a third of
        # what np.bincount took), text the rest (padding is text)
        by_modality = np.zeros(len(MODALITY_NAMES), np.int64)
        for m in _NOT_TEXT:
            by_modality[m] = np.count_nonzero(mod == m)
        by_modality[_TEXT_M] = real - by_modality.sum()
        self.tokens_by_modality += by_modality
        by_source = _tokens_by_source(rows, len(self.tables))
        out = PackedBatch(compact, _pieces(rows), by_source, new_drops, real, buffer=buffer)
        if slot is not None and ring is not None:
            out.compact, out.slot, out.token = compact.tables(), slot, ring.token
            if not ring.sent:  # the slots cross to the trainer once, with the first batch
                out.ring, ring.sent = (ring.data, ring.flags), True
        return out

    def dropped_matrix(self) -> np.ndarray:
        """[sources, 2]: image and video blocks dropped so far for being longer than a row."""
        out = np.zeros((len(self.tables), 2), np.int64)
        for (s, m), n in self.packer.dropped_by.items():
            out[s, m - int(Modality.IMAGE)] = n
        return out

    # --- state -----------------------------------------------------------------------------------
    def state_dict(self) -> dict:
        return {
            "cursors": [[c.epoch, c.pos, c.tokens, int(c.done)] for c in self.cursors],
            "pending": [d.cursor() for d in self.packer.pending],
            "open": [d.cursor() for docs in self.open for d in docs],
            "dropped_by": [[s, m, n] for (s, m), n in sorted(self.packer.dropped_by.items())],
            "batches": self.batches,
            "errors": self.errors,
            "stats": self.packer.stats.as_dict(),
            "tokens_by_modality": self.tokens_by_modality.tolist(),
            "skip": [
                [s, e, m] for s, c in enumerate(self.cursors) for e, m in sorted(c.skip.items())
            ],
            "order": self.order_version,
        }

    def load_state_dict(self, st: dict) -> None:
        # Cursors are positions in an epoch order: states from before order version 2 keep theirs.
        self.order_version = st.get("order", 1)
        self.cursors = [SourceCursor(e, p, t, bool(d)) for e, p, t, d in st["cursors"]]
        for s, e, m in st.get("skip", []):  # states from before redistribute have none
            if e >= self.cursors[s].epoch:
                self.cursors[s].skip[e] = m
        self._slices = {}
        self.batches, self.errors = st["batches"], st["errors"]
        for k, v in st["stats"].items():
            setattr(self.packer.stats, k, v)
        self.tokens_by_modality = np.asarray(st["tokens_by_modality"], np.int64)
        self.packer.dropped_by = {(s, m): n for s, m, n in st.get("dropped_by", [])}
        self._dropped_before = self.dropped_matrix()
        # A document both held aside and open is one object in both lists (keyed by source,
        # sample, epoch: a consumer reads a sample once per epoch).
        docs: dict[tuple[int, int, int], Doc | None] = {}

        def restore(cursor: list[int]) -> Doc | None:
            s, sample, epoch, unit, offset = cursor[:5]
            key = (s, sample, epoch)
            if key not in docs:
                doc = self.load(s, sample, epoch)
                if doc is not None:  # unreadable now: skipped, counted and logged by load()
                    doc.unit, doc.offset = unit, offset
                    # States from before chunked mixing handed out whole documents.
                    doc.limit = cursor[5] if len(cursor) > 5 else doc.length
                docs[key] = doc
            return docs[key]

        self.packer.pending = [d for d in map(restore, st["pending"]) if d is not None]
        self.open = [[] for _ in self.tables]
        for cursor in st.get("open", []):
            doc = restore(cursor)
            if doc is not None:
                self.open[doc.source].append(doc)


class PackedBatch:
    """What a consumer hands the trainer's process for one batch: the batch in its compact
    layout (data/loader/expand.py; from a worker, its per-token part in a slot of shared
    memory) and a few small numbers. Not a dict or a list, so the DataLoader neither walks it
    (``default_convert``) nor pins it field by field: ``pin_memory`` expands it into pinned
    memory. ``to_dict`` expands it (once) and splits the result into the batch's tensors, views
    of one buffer."""

    def __init__(
        self,
        compact: CompactBatch,
        pieces: np.ndarray,
        tokens_by_source: list[int],
        dropped: np.ndarray,
        real: int,
        *,
        buffer: BatchBuffer | None = None,
    ) -> None:
        self.compact, self.pieces, self.tokens_by_source, self.dropped, self.real = (
            compact,
            pieces,
            tokens_by_source,
            dropped,
            real,
        )
        # In-process: the batch's int64 buffer, its ids and modalities already written there
        self.buffer = buffer
        self.expanded = False
        self.worker = -1
        self.state: dict | None = None
        # Packed in a worker's slot of shared memory (data/loader/transport.py): which one, of
        # which worker's ring, and (first batch of a worker) the ring's tensors themselves.
        self.slot: int | None = None
        self.token = ""
        self.ring: tuple | None = None

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state["buffer"] = None  # only made in the trainer's process (or in-process)
        return state

    def expand(self, *, pin: bool = False) -> BatchBuffer:
        """The batch's per-token fields (in the trainer's process: from the slot, which is then
        freed), once; ``pin``: in pinned memory."""
        c = self.compact
        if not self.expanded:
            if self.buffer is None or (pin and not self.buffer.pinned):
                self.buffer = BatchBuffer(c.rows, c.seq_len, 0, pin=pin)
            if self.slot is not None:
                view = transport.slot(self.token, self.slot, self.ring)
                c.ids, c.mod = slot_views(view, c.rows, c.seq_len)
            expand(c, self.buffer.fields)
            if self.slot is not None:
                transport.free(self.token, self.slot)
                self.slot, self.ring = None, None
            c.ids = c.mod = None  # views of a slot a worker now reuses, or of the buffer
            self.expanded = True
        elif pin and self.buffer is not None and not self.buffer.pinned:
            # expanded already: copied into pinned memory
            pinned = BatchBuffer(c.rows, c.seq_len, 0, pin=True)
            pinned.tensor.copy_(self.buffer.tensor)
            self.buffer = pinned
        assert self.buffer is not None
        return self.buffer

    def pin_memory(self, device=None) -> PackedBatch:
        self.expand(pin=True)
        return self

    def to_dict(self) -> dict:
        batch = self.expand().split()
        # from_numpy: torch.tensor of Python numbers costs several times more, per batch
        batch["num_real_tokens"] = torch.from_numpy(np.array(self.real, np.int64))
        batch["pieces"] = torch.from_numpy(self.pieces)
        batch["dropped_blocks"] = torch.from_numpy(self.dropped)
        batch["tokens_by_source"] = torch.from_numpy(np.asarray(self.tokens_by_source, np.int64))
        return batch


def _tokens_by_source(rows: list[Row], n: int) -> list[int]:
    out = [0] * n
    for r in rows:
        for s, _, a, b in r.pieces:
            out[s] += b - a
    return out


def _pieces(rows: list[Row]) -> np.ndarray:
    """int64 [rows, most pieces, 4] (source, sample, start, end) of each row's document pieces,
    -1 padded: which documents a batch holds (for checks and debugging; the model never sees it)."""
    most = max((len(r.pieces) for r in rows), default=0)
    out = np.full((len(rows), most, 4), -1, dtype=np.int64)
    for i, r in enumerate(rows):
        if r.pieces:
            out[i, : len(r.pieces)] = r.pieces
    return out
