"""The loader a trainer holds: one rank's consumers behind a torch ``DataLoader``.

Consumers are (rank, worker) pairs: consumer = rank x workers + worker, each worker process
running one ``ConsumerStream``. The DataLoader takes their batches round-robin, which is
deterministic, so the rank's batch sequence is too. How its state resumes exactly although
workers prefetch, what it refuses, and epoch mode's batch count: docs/loader.md, "Exact resume",
"Guards" and "Modes".
"""

from __future__ import annotations

import functools
import hashlib
import json
import os
import signal
from collections.abc import Iterator
from dataclasses import asdict, replace
from multiprocessing.reduction import ForkingPickler
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from data.loader import transport
from data.loader.config import LoaderConfig
from data.loader.expand import slot_numel
from data.loader.fit import check_blocks_fit, check_mix
from data.loader.order import unpack_mask
from data.loader.pack_kernel import PackStats
from data.loader.packed_batch import PackedBatch
from data.loader.sample_check import attach_id_ranges
from data.loader.stream import ConsumerStream
from data.loader.stream_state import check_fields, check_state
from data.loader.table import SampleTable, TokenTable
from data.loader.table_load import load_table
from data.loader.watchdog import sample_where
from data.loader.worker_start import prepare_workers, stop_only_when_told
from data.vocab import MODALITY_NAMES

STATE_VERSION = 1


class _Pickled:
    """A worker's batch pickled in the worker's own loop, not the queue's feeder thread, so that a
    batch that cannot be pickled is an error naming the worker (docs/loader.md, "One read per
    document; a compact batch, expanded where it is handed out"). The queue pickles these bytes
    and the ring's tensors, taken on as they arrive (the worker may stop before it is handed out)."""

    __slots__ = ("data", "ring")

    def __init__(self, batch: PackedBatch) -> None:
        self.ring, batch.ring = batch.ring, None  # (a worker's first batch) see the docstring
        self.data = bytes(ForkingPickler.dumps(batch))

    def load(self) -> PackedBatch:
        batch = ForkingPickler.loads(self.data)
        batch.ring = self.ring
        return batch

    def pin_memory(self, device=None) -> PackedBatch:
        """In the DataLoader's pin-memory thread: the batch, expanded into pinned memory."""
        return self.load().pin_memory()


class _Consumers(IterableDataset):
    def __init__(self, loader: PackedLoader) -> None:
        self.ld = loader

    def __iter__(self):
        # This loader's own worker, not a DataLoader of someone else's that runs it in-process
        info = get_worker_info() if self.ld.cfg.num_workers else None
        slot = info.id if info else 0
        ld = self.ld
        worker = (slot + ld.rotation) % ld.workers
        stream = ld.make_stream(worker)
        if ld.worker_states.get(worker):
            stream.load_state_dict(ld.worker_states[worker])
        if info is not None:  # batches go to the trainer's process through shared slots
            in_flight = ld.cfg.prefetch_factor * ld.cfg.num_workers
            stream.ring = transport.SlotRing(
                in_flight + 2, slot_numel(ld.micro_batch, ld.cfg.seq_len)
            )
        else:
            stream.pin = ld.pin
        while (batch := stream.next_batch()) is not None:
            assert isinstance(batch, PackedBatch)
            batch.worker = worker
            batch.state = stream.state()  # a snapshot, made the dict when asked for
            yield batch if info is None else _Pickled(batch)


class PackedLoader:
    def __init__(
        self,
        cfg: LoaderConfig,
        tables: list[SampleTable],
        *,
        rank: int,
        world_size: int,
        micro_batch: int,
        pad_id: int,
    ) -> None:
        if cfg.mode not in ("infinite", "epoch"):
            raise ValueError(f"data.mode {cfg.mode!r}: choose infinite or epoch")
        if cfg.oversize not in ("drop_block", "drop_document"):  # before any worker streams
            raise ValueError(f"data.oversize {cfg.oversize!r}: choose drop_block or drop_document")
        self.cfg, self.tables = cfg, tables
        self.rank, self.world_size = rank, world_size
        self.micro_batch, self.pad_id = micro_batch, pad_id
        self.workers = max(1, cfg.num_workers)
        self.weights = [s.weight for s in cfg.sources] if cfg.sources else [1.0] * len(tables)
        check_mix(cfg, tables, self.weights, self.consumers)
        self.pin = torch.cuda.is_available() and cfg.pin_memory
        self._fresh_state: dict | None = None  # check_state's reference, made when first needed
        self._worker_states: dict = {}  # worker -> state dict or snapshot (worker_states)
        self._names: dict[tuple[int, int], str] = {}  # (source, sample) -> "SHARD KEY"
        self.rotation = self.handed_out = 0
        self.batch_limit: int | None = None
        # Done already when built by build_loader; a fork server's imports (worker_start.py) run
        # while this process counts the epoch below
        prepare_workers(cfg.worker_start, cfg.num_workers)
        if cfg.mode == "epoch":
            self.batch_limit = self.count_batches()

    @property
    def consumers(self) -> int:
        return self.world_size * self.workers

    def make_stream(
        self, worker: int, *, consumer: int | None = None, dry: bool = False
    ) -> ConsumerStream:
        c = self.rank * self.workers + worker if consumer is None else consumer
        s = ConsumerStream(
            self.tables,
            self.weights,
            self.cfg,
            consumer=c,
            consumers=self.consumers,
            micro_batch=self.micro_batch,
            pad_id=self.pad_id,
            dry=dry,
        )
        s.batch_limit = self.batch_limit
        return s

    def count_batches(self, states: list[dict] | None = None) -> int:
        """Batches every consumer yields in epoch mode: the fewest any consumer can fill, packing
        dry from the start or from ``states`` (one per consumer), those in a state counted too."""
        counts = []
        for c in range(self.consumers):
            s = self.make_stream(0, consumer=c, dry=True)
            if states is not None:
                s.load_state_dict(states[c])
            s.batch_limit = None
            counts.append(s.batches + sum(1 for _ in iter(s.next_batch, None)))  # dry: {}
        return min(counts)

    def __iter__(self):
        if self.cfg.num_workers == 0:
            # The one consumer's batches straight from its stream, minus a DataLoader's
            # per-batch bookkeeping (a fetcher, a sampler, a profiler range)
            it: Iterator = iter(_Consumers(self))
        else:
            # The workers start with SIGTERM blocked until stop_only_when_told takes it: torch's
            # own handler, theirs before, dies of a SIGTERM sent to the group
            old = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
            try:
                it = iter(
                    DataLoader(
                        _Consumers(self),
                        batch_size=None,
                        num_workers=self.cfg.num_workers,
                        pin_memory=self.pin,
                        prefetch_factor=self.cfg.prefetch_factor,
                        persistent_workers=False,
                        multiprocessing_context=self.cfg.worker_start,
                        worker_init_fn=functools.partial(stop_only_when_told, os.getpid()),
                        # Its own generator: a DataLoader iterator otherwise seeds from the global
                        # torch RNG, which differs between a resumed and an uninterrupted run (our
                        # workers seed themselves by hashing seed, epoch, rank, worker)
                        generator=torch.Generator().manual_seed(
                            self.cfg.seed * 1000003 + self.rank
                        ),
                    )
                )
            finally:
                signal.pthread_sigmask(signal.SIG_SETMASK, old)
        rings = set()
        try:
            for item in it:
                packed = item.load() if isinstance(item, _Pickled) else item
                if self.pin:
                    packed.pin_memory()  # (in pinned memory already: nothing more to do)
                rings.add(packed.token)
                self._worker_states[packed.worker] = packed.state
                self.handed_out += 1
                yield packed.to_dict()
        finally:
            for token in rings:
                transport.forget(token)
            # Closing this generator stops the workers now, not whenever it is garbage collected.
            if shutdown := getattr(it, "_shutdown_workers", None):
                shutdown()

    @property
    def worker_states(self) -> dict[int, dict]:
        """Each worker's state after its last batch handed out (snapshots made dicts here)."""
        states = self._worker_states
        for w, st in states.items():
            if not isinstance(st, dict):
                states[w] = st.to_dict()
        return states

    # --- state -----------------------------------------------------------------------------------
    def fingerprint(self) -> str:
        parts = [(t.name, t.fingerprint, t.tokenizer_fingerprint) for t in self.tables]
        return hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]

    def state_dict(self) -> dict:
        return {
            "version": STATE_VERSION,
            "fingerprint": self.fingerprint(),
            "rank": self.rank,
            "world_size": self.world_size,
            "workers": self.workers,
            "seq_len": self.cfg.seq_len,
            "micro_batch": self.micro_batch,
            "mode": self.cfg.mode,
            "shares": [w / sum(self.weights) for w in self.weights],
            "handed_out": self.handed_out,
            "batch_limit": self.batch_limit,
            "worker_states": {str(k): v for k, v in self.worker_states.items()},
        }

    def check_state(
        self, st: dict, same: tuple[str, ...] = ("world_size", "workers", "seq_len", "micro_batch")
    ) -> None:
        """ValueError saying what is wrong when ``st`` is not a loader state as this earlyfuse
        writes it (``state_dict``; its workers' states as a fresh stream's ``state_dict``), of
        this loader's data and mode, with this loader's ``same``."""
        if st.get("version") != STATE_VERSION:
            raise ValueError(f"loader state version {st.get('version')}, expected {STATE_VERSION}")
        mine = self.state_dict()
        check_fields(st, mine, "loader state")
        if self._fresh_state is None:  # a stream's state as a fresh one writes it, made once
            self._fresh_state = self.make_stream(0, dry=True).state_dict()
        for worker, worker_state in st["worker_states"].items():
            where = f"loader state of rank {st['rank']}, worker {worker}"
            check_state(worker_state, self._fresh_state, where)
        if st["fingerprint"] != mine["fingerprint"]:
            raise ValueError(
                f"rank {st['rank']}'s loader state was saved over other shards, tokenizers or "
                "online tokenize options (data.tokenize, data.doc_budget; fingerprint "
                f"{st['fingerprint']} != {mine['fingerprint']}); it cannot be used on this data"
            )
        for k in (*same, "mode"):
            if st[k] != mine[k]:
                fix = f"no loader state moves onto another {k}"
                if k in ("world_size", "workers", "micro_batch"):
                    fix = "data.loader.redistribute moves it onto this loader (docs/loader.md)"
                raise ValueError(
                    f"rank {st['rank']}'s loader state has {k}={st[k]}, this loader {mine[k]}; {fix}"
                )

    def load_state_dict(self, st: dict) -> None:
        self.check_state(st)
        # Epoch mode: after a redistribute, the count of the new split, not this one's
        self.batch_limit = st["batch_limit"]
        self._worker_states = {int(k): v for k, v in st["worker_states"].items()}
        if st["shares"] != self.state_dict()["shares"]:  # new weights: mixed from here on
            for w, v in self._worker_states.items():
                self._worker_states[w] = v | {"mix": [0] * len(self.tables)}
        self.handed_out = st["handed_out"]
        self.rotation = self.handed_out % self.workers

    # --- reporting -------------------------------------------------------------------------------
    def delivered(self) -> dict:
        """Tokens per modality and source and the packing figures, over the handed-out batches."""
        stats = asdict(PackStats())  # the packing counters, summed over the workers
        out: dict[str, Any] = {"batches": self.handed_out, "errors": self.skipped(), **stats}
        out |= {"tokens_by_modality": [0] * 5, "tokens_by_source": {}}
        for st in self.worker_states.values():
            for k in stats:
                out[k] += st["stats"][k]
            out["tokens_by_modality"] = [
                a + b for a, b in zip(out["tokens_by_modality"], st["tokens_by_modality"])
            ]
            for t, c in zip(self.tables, st["cursors"]):
                out["tokens_by_source"][t.name] = out["tokens_by_source"].get(t.name, 0) + c[2]
        out["dropped_by_source"] = self.dropped_blocks()
        rows = out["rows"]
        out["packing_efficiency"] = out["real_tokens"] / (rows * self.cfg.seq_len) if rows else 0.0
        if self.cfg.mode == "epoch":
            out["held_back"] = self.held_back()
        return out

    def dropped_blocks(self) -> dict[str, dict[str, int]]:
        """Visual blocks this rank's workers dropped for being longer than a row (as of the last
        batch handed out): source -> {"image": n, "video": n}, sources with none left out."""
        out: dict[str, dict[str, int]] = {}
        for st in self.worker_states.values():
            for s, m, n in st["dropped_by"]:
                per = out.setdefault(self.tables[s].name, {"image": 0, "video": 0})
                per[MODALITY_NAMES[m]] += n
        return out

    def skipped(self) -> int:
        """Skips of unreadable samples by this rank's workers (as of the last batch handed out;
        a sample skipped in two epochs counts twice: ``skipped_samples`` names each once)."""
        return sum(st["errors"] for st in self.worker_states.values())

    def skipped_samples(self) -> set[str]:
        """``"SHARD KEY"`` of every sample this rank's workers skipped as unreadable (as of the
        last batch handed out), each once."""
        pairs = {(s, sample) for st in self.worker_states.values() for s, sample in st["skipped"]}
        for s, sample in pairs - self._names.keys():
            shard, key = sample_where(self.tables[s], sample)
            self._names[(s, sample)] = f"{shard} {key}"
        return {self._names[pair] for pair in pairs}

    def held_back(self) -> int:
        """Epoch mode: documents of this rank's slices not delivered in full (never read, or held
        aside when the equalised batch count was reached); they are not repeated."""
        n = 0
        for w in range(self.workers):
            st = self.worker_states.get(w)
            consumer = self.rank * self.workers + w
            cursors = st["cursors"] if st else [[0, 0, 0, 0]] * len(self.tables)
            skip = {(s, e): m for s, e, m in st["skip"]} if st else {}
            for s, (t, c) in enumerate(zip(self.tables, cursors)):
                left = len(t)  # positions of the epoch's order split over the consumers
                if (s, c[0]) in skip:  # less those a redistribute found consumed before
                    left -= int(unpack_mask(skip[(s, c[0])], len(t)).sum())
                n += len(range(consumer, left, self.consumers)) - c[1]
            if st:  # documents handed out in part: held aside or with chunks still to come
                n += len({tuple(d[:3]) for d in st["pending"] + st["open"]})
        return n


def build_loader(
    cfg: LoaderConfig,
    *,
    rank: int,
    world_size: int,
    micro_batch: int,
    pad_id: int = 0,
    validation: bool = False,
    tables: list[SampleTable] | None = None,
) -> PackedLoader:
    """``tables``: the sources' sample tables when the caller has read them already (a run reads
    each index once and shares it between training, evaluation and probes)."""
    sources = cfg.validation if validation else cfg.sources
    if not sources:
        raise ValueError(
            "data.validation lists no sources" if validation else "data.sources lists no sources"
        )
    prepare_workers(cfg.worker_start, cfg.num_workers)  # early: a fork server imports meanwhile
    if tables is None:
        tables = [load_table(s, cache_dir=cfg.cache_dir) for s in sources]
    check_tokenizers(cfg, tables)
    attach_id_ranges(cfg, tables)  # every sample's ids checked against them as it is read
    what = "validation source" if validation else "source"
    check_blocks_fit(cfg, tables, what=[what] * len(tables))
    if validation:
        cfg = replace(cfg, sources=sources, mode="epoch")
    raw = [t.name for t in tables if t.kind == "raw"]
    if raw and cfg.mode == "epoch":
        fix = "" if validation else " or use data.mode=infinite"
        raise ValueError(
            f"{what}(s) {raw} hold raw shards: epoch mode counts every rank's batches from the "
            f"token counts of the index, which raw shards do not have; tokenize them "
            f"(earlyfuse-prep tokenize){fix}"
        )
    return PackedLoader(
        cfg, tables, rank=rank, world_size=world_size, micro_batch=micro_batch, pad_id=pad_id
    )


def check_tokenizers(cfg: LoaderConfig, tables: list[SampleTable]) -> None:
    """All sources must speak one vocabulary: token sources made with one set of tokenizers (the
    ``data.tokenizers`` folder, when given), raw sources tokenized with that folder."""
    from data.loader.online import online_options
    from data.tokenize.vtok_files import folder_fingerprints, tokenizer_key, tokenizers_differ

    mine = tokenizer_key(folder_fingerprints(cfg.tokenizers)) if cfg.tokenizers else None
    want, first = mine, f"the tokenizers in {cfg.tokenizers}"
    for t in tables:
        if t.kind == "raw":
            if mine is None or json.loads(mine)["visual"] is None:
                raise ValueError(
                    f"source {t.name} holds raw shards ({t.manifest_url}): set data.tokenizers to "
                    "the tokenizer folder to tokenize them with (with its visual_tokenizer/)"
                )
            # The options change the tokens: they belong to what a loader state must match.
            t.tokenizer_fingerprint = mine + json.dumps(
                online_options(cfg).record(), sort_keys=True
            )
            continue
        summaries = t.shard_blocks if isinstance(t, TokenTable) else []  # the manifest's, per shard
        visual = sum(int(got[m]["blocks"]) for got in summaries for m in ("image", "video"))
        if mine and visual and json.loads(mine)["visual"] is None:
            raise ValueError(  # its image and video ids could be neither drawn nor released
                f"source {t.name} holds {visual} image and video blocks ({t.manifest_url}); "
                f"{cfg.tokenizers} has no visual_tokenizer/ to read them"
            )
        if differ := tokenizers_differ(t.tokenizer_fingerprint, want or t.tokenizer_fingerprint):
            raise ValueError(
                f"source {t.name} was tokenized with other tokenizers than {first} "
                f"({t.manifest_url}: {differ}); its ids would mean other things"
            )
        # Sources of text alone leave the visual tokenizer open: the first that has one sets it
        if not (want and json.loads(want)["visual"]):
            want, first = t.tokenizer_fingerprint, f"source {t.name}'s"
