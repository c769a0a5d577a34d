"""One consumer's stream (a rank's worker): read documents in its slice of each source's epoch
order, feed them to the compiled loop that mixes and packs them (pack_kernel.py, through
stream_arrays.py), group rows into batches, and say exactly where it is (stream_state.py).
What it guarantees (mixing by tokens, exact resume from kilobytes without replaying, bad data
skipped, counted and logged, a stalled read reported, epoch mode's equal batch counts):
docs/loader.md, "Choices".
"""

from __future__ import annotations

import functools
import sys
import time
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import numpy as np

from data.loader import store, transport
from data.loader.batch_buffer import BatchBuffer
from data.loader.config import DataUnreadable, LoaderConfig
from data.loader.expand import slot_views
from data.loader.online import OnlineTokenizer
from data.loader.order import ConsumerSlice, EpochOrder, unpack_mask
from data.loader.pack_kernel import Doc, units_of
from data.loader.packed_batch import PackedBatch
from data.loader.sample_check import check_ids, read_members
from data.loader.shard_check import CheckedShard, check_shard
from data.loader.store import ShardFiles, ShardView
from data.loader.stream_arrays import StreamArrays
from data.loader.stream_state import SourceCursor
from data.loader.table import SampleTable, TokenTable
from data.loader.watchdog import Watchdog, sample_where
from data.shards.npy import read_npy
from data.tokenize.blocks import visual_blocks
from data.vocab import MODALITY_NAMES

_KEEP_SHARDS = 256  # as many as ShardFiles keeps memory maps of (a checked shard holds its map)
_KEEP_DRY = 16  # a dry stream's shard tables (rebuilt from the index when needed again)
_LOOK_AHEAD = 3  # shards of the epoch order looked at for one to check ahead (_check_ahead)


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
    ) -> None:
        self.tables, self.cfg, self.dry = tables, cfg, dry
        total = float(sum(weights))
        self.shares = [w / total for w in weights]
        # The sources that get a share, in order: what the mix picks from
        self.mixed_sources = [s for s, share in enumerate(self.shares) if share > 0]
        self.consumer, self.consumers, self.micro_batch = consumer, consumers, micro_batch
        self.pad_id = pad_id
        # Where each source's reading has got to (reading ahead moves them past what is packed;
        # the packed position is in the compiled loop's arrays)
        self.cursors = [SourceCursor() for _ in tables]
        self.chunk = cfg.mix_chunk or cfg.seq_len
        self.slices: dict[tuple[int, int], np.ndarray | ConsumerSlice] = {}
        self.errors = 0  # skips, a sample skipped again (a later epoch) counted again
        # Per source, the samples skipped since the state was restored, in read order, and the
        # distinct ones the restored state had skipped: the state names each skipped sample once
        # (skipped_samples), so data/skipped counts samples, not skips.
        self.skip_events: list[list[int]] = [[] for _ in tables]
        self.skipped_before: list[list[int]] = [[] for _ in tables]
        self.consecutive_errors = 0
        self.batches = 0
        self.batch_limit: int | None = None
        self.tokens_by_modality = np.zeros(len(MODALITY_NAMES), np.int64)
        self.dropped_before = np.zeros((len(tables), 2), np.int64)  # as of the last batch
        self.files = ShardFiles(cfg.cache_dir, cfg.cache_limit_gb)
        self._online: OnlineTokenizer | None = None  # built on the first raw document
        self.ring: transport.SlotRing | None = None  # set in a DataLoader worker
        self.pin = False  # in-process: batches expanded into pinned memory (set by the loader)
        # A dry stream reads no tar: nothing to watch (0 s: no thread)
        self.watchdog = Watchdog(0 if dry else cfg.stall_seconds, f"consumer {consumer}")
        # (source, shard) -> the shard when it passed the whole-shard check, None when it did not
        # (data/loader/shard_check.py); the dict's order is the LRU order, the least recently
        # used dropped past _KEEP_SHARDS.
        self._checked: dict[tuple[int, int], CheckedShard | None] = {}
        # (source, shard) -> its whole-shard check running ahead in a thread (_check_ahead)
        self._ahead: dict[tuple[int, int], Future] = {}
        self._pool: ThreadPoolExecutor | None = None
        # A dry stream keeps fewer shards' tables: it walks through its shards once
        self._keep_shards = _KEEP_DRY if dry else _KEEP_SHARDS
        # Per source: read in runs of a shard's documents (StreamArrays._shard_run): token
        # tables, through whole-shard checks, or from their indexes alone when counting (dry)
        whole = dry or consumers <= cfg.whole_shard_check_max_consumers
        self.whole_checked = [whole and isinstance(t, TokenTable) for t in tables]
        # The compiled loop and its arrays: where the packing is, the stream's state from here
        # on (data/loader/stream_arrays.py)
        self._fast = StreamArrays(self)

    # --- which document next -------------------------------------------------------------------
    def slice_of(self, s: int, epoch: int) -> np.ndarray | ConsumerSlice:
        key = (s, epoch)
        if key not in self.slices:
            t = self.tables[s]
            # keep one epoch per source
            self.slices = {k: v for k, v in self.slices.items() if k[0] != s}
            mask = self.cursors[s].skip.get(epoch)
            lazy = EpochOrder(
                t.shard_counts(),
                seed=self.cfg.seed,
                epoch=epoch,
                source=t.name,
                buffer=self.cfg.shuffle_buffer,
                shuffle_shards=self.cfg.shuffle_shards,
            )
            if mask is None:
                self.slices[key] = ConsumerSlice(lazy, self.consumer, self.consumers)
                return self.slices[key]
            order = lazy.full()  # a redistributed epoch: the positions left, in order
            order = order[~unpack_mask(mask, len(order))]
            self.slices[key] = order[self.consumer :: self.consumers]
        return self.slices[key]

    def slice_at_cursor(self, s: int) -> np.ndarray | ConsumerSlice | None:
        """The slice source ``s``'s cursor reads from next, moved on to the next epoch at the end
        of one; None when there is nothing to read (``next_epoch``)."""
        c = self.cursors[s]
        sl = self.slice_of(s, c.epoch)
        if c.pos < len(sl):
            return sl
        return self.slice_of(s, c.epoch) if self.next_epoch(s) else None

    def read_next(self, s: int) -> Doc | None:
        """The next document of source ``s`` in this consumer's slice; None when it could not be
        read (skipped and counted) or the source is done (epoch mode)."""
        sl = self.slice_at_cursor(s)
        if sl is None:
            return None
        c = self.cursors[s]
        sample = int(sl[c.pos])
        c.pos += 1
        return self.load(s, sample, c.epoch)

    def next_epoch(self, s: int) -> bool:
        """Source ``s``'s cursor, at the end of its slice of an epoch, moved to the next epoch's
        start (infinite mode); False when there is nothing to read there: the source is done
        (epoch mode: marked so) or the rest of a redistributed epoch went to other consumers."""
        c = self.cursors[s]
        if self.cfg.mode == "epoch":
            c.done = True
            return False
        c.skip.pop(c.epoch, None)
        c.epoch, c.pos = c.epoch + 1, 0
        # Empty only where a redistributed epoch left the rest to other consumers: a source with
        # a share and fewer documents than consumers is refused at start (fit.check_mix)
        return len(self.slice_of(s, c.epoch)) > 0

    # --- reading ---------------------------------------------------------------------------------
    def _encode_raw(self, t: SampleTable, sample: int) -> tuple[np.ndarray, np.ndarray, list]:
        """A raw document tokenized here (data/loader/online.py): ids, modalities, blocks."""
        assert self._online is not None  # built before the read: its errors are no bad sample
        si = t.shard_of(sample)
        view = ShardView(self.files, t.shards[si], t.shard_end(si))
        doc, why = self._online.encode(
            t.key_of(sample), t.members[sample], store.name(t.shards[si]), view
        )
        if doc is None:
            raise ValueError(why)
        return doc.ids.astype(np.int64), doc.modality.astype(np.int64), visual_blocks(doc.spans)

    def checked_shard(self, s: int, t: SampleTable, si: int) -> CheckedShard | None:
        """Shard ``si`` when it passes the whole-shard check (checked on first use); a dry
        stream's shards as their index describes them (nothing to check: no token is read)."""
        key = (s, si)
        if key in self._checked:
            self._checked[key] = self._checked.pop(key)  # re-inserted last: most recently used
            return self._checked[key]
        if self.dry:
            self._remember(key, CheckedShard.of_index(t.index(si)))  # type: ignore[attr-defined]
            return self._checked[key]
        url = t.shards[si]
        self.watchdog.current = (f"checking shard {url}", time.monotonic())
        try:
            ahead = self._ahead.pop(key, None)
            if ahead is not None:  # checked while the shard before it was read
                shard, size = ahead.result()
            else:
                shard, size = self._check(self._check_args(t, si), t, si)
            self.files.touched(size)  # the check read all of it
        except (OSError, ValueError):
            return None  # not remembered: read document by document, which names the error
        finally:
            self.watchdog.current = None  # checked: nothing is being read any more
        self._remember(key, shard)
        self._check_ahead(s, t)
        return shard

    def _check_args(self, t: SampleTable, si: int) -> tuple[memoryview | None, Any]:
        """What checking shard ``si`` of ``t`` reads (its map, None over fsspec; its index),
        made in the stream's thread (the shard files and the index cache are its own)."""
        mapped = self.files.mapped(t.shards[si], t.shard_end(si))
        return mapped, t.index(si) if mapped is not None else None  # type: ignore[attr-defined]

    def _check(
        self, args: tuple[memoryview | None, Any], t: SampleTable, si: int
    ) -> tuple[CheckedShard | None, int]:
        """(the shard when it passes the whole-shard check, the bytes the check read) of the
        map and index ``_check_args`` gave."""
        mapped, index = args
        if mapped is None:
            return None, 0
        shard = check_shard(
            mapped,
            index,
            shard_sha256=t.shard_sha256[si],  # type: ignore[attr-defined]
            id_ranges=t.id_ranges,
            check_hash=self.cfg.check_hashes,
        )
        return shard, len(mapped)

    def _check_ahead(self, s: int, t: SampleTable) -> None:
        """Start checking the next shard this consumer will read from source ``s`` (the first
        not checked yet among the few at and after its cursor in the epoch order) in a thread,
        while the shards before it are read (docs/loader.md, "Shards checked whole"). One shard
        ahead per source; none for an order held as an array (a redistributed epoch) or past the
        epoch's last shard."""
        cursor = self.cursors[s]
        order = self.slices.get((s, cursor.epoch))
        if not isinstance(order, ConsumerSlice) or not len(order):
            return
        if any(key[0] == s for key in self._ahead):
            return
        position = order.consumer + min(cursor.pos, len(order) - 1) * order.consumers
        after = next(
            (
                shard
                for shard in order.order.shards_from(position)[:_LOOK_AHEAD].tolist()
                if (s, shard) not in self._checked
            ),
            -1,
        )
        if after < 0:
            return
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="earlyfuse-shard-check")
        try:
            args = self._check_args(t, after)
        except (OSError, ValueError):
            return  # found again, and named, when the shard is read
        self._ahead[(s, after)] = self._pool.submit(self._check, args, t, after)

    def _remember(self, key: tuple[int, int], shard: CheckedShard | None) -> None:
        if len(self._checked) >= self._keep_shards:  # the least recently used goes
            del self._checked[next(iter(self._checked))]
        self._checked[key] = shard

    def load(self, s: int, sample: int, epoch: int) -> Doc | None:
        t = self.tables[s]
        if self.dry:
            length = t.tokens_of(sample)
            return Doc(s, sample, epoch, length, units_of(length, t.blocks_of(sample)))
        if self.whole_checked[s]:
            si, i = t.locate(sample)  # type: ignore[attr-defined]
            checked = self.checked_shard(s, t, si)
            if isinstance(checked, CheckedShard):  # a checked shard: nothing to parse or check
                ids, mod, units = checked.document(i)
                self.files.touched(ids.nbytes + mod.nbytes)
                self.consecutive_errors = 0
                return Doc(s, sample, epoch, len(ids), units, ids, mod)
        if self._online is None and not isinstance(t, TokenTable):  # not in the try below: a
            self._online = OnlineTokenizer(self.cfg)  # tokenizer that fails is no bad sample
        self.watchdog.current = ((t, sample), time.monotonic())
        try:
            if not isinstance(t, TokenTable):  # raw shards
                ids, mod, blocks = self._encode_raw(t, sample)
                length = len(ids)
            else:
                si, length, blocks, *members = t.locate_members(sample)
                url, end = t.shards[si], t.shard_end(si)
                view = functools.partial(self.files.view, url, min_bytes=end)
                ids_b, mod_b = read_members(members, view, self.cfg.check_hashes)
                # Views of the shard's memory map: nothing is copied until the packer places them.
                ids, mod = read_npy(ids_b), read_npy(mod_b)
                if ids.shape != (length,) or mod.shape != (length,):
                    raise ValueError(
                        f"{ids.shape[0]} ids / {mod.shape[0]} modalities, the index says {length}"
                    )
            check_ids(ids, mod, t.id_ranges)  # an id past the vocabulary would crash the model
        except (OSError, ValueError, EOFError) as e:
            self.errors += 1
            self.skip_events[s].append(sample)
            self.consecutive_errors += 1
            shard, key = sample_where(t, sample)
            print(f"[loader] skipped {shard} sample {key}: {e}", file=sys.stderr, flush=True)
            if self.consecutive_errors >= self.cfg.max_consecutive_errors:
                raise DataUnreadable(
                    f"{self.consecutive_errors} unreadable samples in a row, the last "
                    f"{shard} {key}: {e}"
                ) from e
            return None
        finally:
            self.watchdog.current = None
        self.consecutive_errors = 0
        return Doc(s, sample, epoch, length, units_of(length, blocks), ids, mod)

    # --- rows and batches --------------------------------------------------------------------------
    def next_batch(self) -> PackedBatch | dict | None:
        """The next batch (``PackedBatch``; ``{}`` when packing dry); None at the end."""
        if self.batch_limit is not None and self.batches >= self.batch_limit:
            return None
        fast = self._fast
        if self.dry:  # counting: the compiled loop's decisions, from the index alone
            if not fast.count():
                return None
            self.batches += 1
            return {}
        B, L = self.micro_batch, self.cfg.seq_len
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
        else:  # in-process: the ids straight into the batch's field, the modalities as uint8
            # (what the compiled loop writes everywhere; expand widens them into their field)
            buffer = BatchBuffer(B, L, pin=self.pin)
            ids, mod = buffer.fields["ids"].reshape(n), np.empty(n, np.uint8)
        packed = None
        try:
            packed = fast.pack(ids, mod)
        finally:
            if packed is None and slot is not None and ring is not None:
                ring.release(slot)  # nothing was packed into it
        if packed is None:
            return None  # the last, incomplete batch of an epoch is held back
        compact, pieces, by_source, by_modality = packed
        dropped = fast.dropped_matrix()
        real = int(compact.real.sum())
        self.batches += 1
        new_drops = dropped - self.dropped_before
        self.dropped_before = dropped
        self.tokens_by_modality += by_modality
        out = PackedBatch(compact, pieces, by_source, new_drops, real, buffer=buffer)
        if slot is not None and ring is not None:
            out.compact, out.slot, out.token = compact.tables(), slot, ring.token
            if not ring.sent:  # the slots cross to the trainer once, with the first batch
                out.ring, ring.sent = (ring.data, ring.flags), True
        return out

    # --- state (its format in stream_state.py, its arrays in stream_arrays.py) -----------------
    def state_dict(self) -> dict:
        return self.state().to_dict()

    def skipped_samples(self, taken: list[int]) -> list[list[int]]:
        """[[source, sample], ...]: every sample skipped as unreadable so far, once, oldest first.
        ``taken``: per source, how many of the skips since the restore count yet (the compiled
        loop reads ahead: a skip counts once a document after it is taken)."""
        out = []
        for s, (before, events) in enumerate(zip(self.skipped_before, self.skip_events)):
            if not before and not events:
                continue
            seen = dict.fromkeys(before)
            seen.update(dict.fromkeys(events[: taken[s]]))
            out += [[s, sample] for sample in seen]
        return out

    def state(self):
        """``state_dict`` as the compiled loop's arrays' snapshot (stream_state.StreamState:
        ``to_dict`` makes the same dict), cheaper to take per batch."""
        return self._fast.snapshot()

    def load_state_dict(self, st: dict) -> None:
        """Resume from ``st`` (checked by the loader, ``PackedLoader.check_state``): the cursors
        and counters put back, then the compiled loop's arrays made again (``StreamArrays`` reads
        the documents held aside or handed out in part again)."""
        self.cursors = [SourceCursor(e, p, t, bool(d)) for e, p, t, d in st["cursors"]]
        for s, e, m in st["skip"]:
            if e >= self.cursors[s].epoch:
                self.cursors[s].skip[e] = m
        self.slices = {}
        self.batches, self.errors = st["batches"], st["errors"]
        self.skip_events = [[] for _ in self.tables]
        self.skipped_before = [[] for _ in self.tables]
        for s, sample in st["skipped"]:
            self.skipped_before[s].append(sample)
        self.tokens_by_modality = np.asarray(st["tokens_by_modality"], np.int64)
        self._fast = StreamArrays(self, st)
        self.dropped_before = self._fast.dropped_matrix()
