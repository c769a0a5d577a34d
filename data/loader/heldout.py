"""One exact pass over held-out token shards, packed into batches: what training validation
(train/tasks/lm.py) and ``earlyfuse-eval`` (tools/evaluate/heldout.py) both evaluate, so that
the two count the same tokens and compute the same CE. Its rules (the documents of each shard
folder packed into rows of their own by ``pack_documents``, the folders taking turns, no worker
processes, every rank packing the same batches): docs/evaluation.md. A folder's last batch is
filled up with blank rows, so no token is left out whatever the batch size; a rank with a batch
fewer runs a blank batch, because ZeRO-3 gathers parameters collectively: every rank must call
the model as often.
"""

from __future__ import annotations

import posixpath
from collections.abc import Generator, Iterator
from contextlib import closing
from dataclasses import dataclass
from itertools import chain

import numpy as np
import torch
from tqdm import tqdm

from data.loader.pack_documents import blank_batch, pack_documents
from data.loader.pack_kernel import PackStats
from data.loader.table import SampleTable
from data.token_docs import TokenDocument, iter_documents


@dataclass
class HeldoutBatch:
    number: int  # its place in the pass (0, 1, ...), the sources' batches interleaved
    source: int  # the table its rows came from
    fields: dict[str, torch.Tensor]  # as the loader hands a batch out (pack_documents)


@dataclass
class SourceCounts:
    documents: int = 0  # read and packed
    skipped: int = 0  # unreadable or corrupted, left out (iter_documents logs each)
    dropped_blocks: int = 0  # visual blocks longer than a row (only where drops are allowed)


class HeldoutPass:
    """``for batch in HeldoutPass(tables, seq_len=..., batch_rows=...)``: every document of
    ``tables`` (or the first ``max_docs`` of each) in batches of ``batch_rows`` rows, packed as
    the training loader packs with ``whole_documents`` (``data.whole_documents``);
    ``tensors(batch)`` gives a batch's fields as the loader hands them out. ``counts`` holds
    per source what was read, once the pass is over."""

    def __init__(
        self,
        tables: list[SampleTable],
        *,
        seq_len: int,
        batch_rows: int,
        max_docs: int = 0,
        whole_documents: bool = False,
        ranges: np.ndarray | None = None,
        progress: bool = False,
    ) -> None:
        self.tables, self.seq_len, self.batch_rows = tables, seq_len, batch_rows
        self.whole_documents = whole_documents
        self.max_docs, self.ranges, self.progress = max_docs, ranges, progress
        self.counts = [SourceCounts() for _ in tables]

    def parts(self) -> list[tuple[int, str, list[range]]]:
        """(table, shard folder, its samples) of every folder of every table's shards: what is
        packed into rows of its own."""
        out: list[tuple[int, str, list[range]]] = []
        for s, table in enumerate(self.tables):
            end = min(len(table), self.max_docs) if self.max_docs else len(table)
            folders: dict[str, list[range]] = {}
            start = 0
            for url, count in zip(table.shards, table.shard_counts().tolist()):
                if start < end:
                    folder = folders.setdefault(posixpath.dirname(url), [])
                    folder.append(range(start, min(start + count, end)))
                start += count
            out += [(s, folder, samples) for folder, samples in folders.items()]
        return out

    def _part_batches(self, s: int, samples: list[range], bar) -> Iterator[dict[str, torch.Tensor]]:
        table, counts = self.tables[s], self.counts[s]
        skipped: list = []
        docs = iter_documents(
            [table], ranges=self.ranges, skipped=skipped, samples=chain.from_iterable(samples)
        )

        def counted() -> Iterator[TokenDocument]:
            for doc in docs:
                counts.skipped += len(skipped)
                skipped.clear()
                counts.documents += 1
                bar.update(1)
                yield doc
            counts.skipped += len(skipped)  # unreadable ones after the last document

        stats = PackStats()
        yield from pack_documents(
            counted(),
            self.seq_len,
            batch_rows=self.batch_rows,
            whole_documents=self.whole_documents,
            stats=stats,
        )
        counts.dropped_blocks += stats.dropped_blocks

    def __iter__(self) -> Generator[HeldoutBatch, None, None]:
        self.counts = [SourceCounts() for _ in self.tables]
        parts = self.parts()
        total = sum(len(samples) for _, _, ranges in parts for samples in ranges)
        with tqdm(total=total, desc="held-out", unit=" docs", disable=not self.progress) as bar:
            streams = {
                k: (s, self._part_batches(s, samples, bar))
                for k, (s, _, samples) in enumerate(parts)
            }
            number = 0  # of the batch in the pass
            while streams:  # the parts take turns, a batch each
                for k in list(streams):
                    s, stream = streams[k]
                    rows = next(stream, None)
                    if rows is None:
                        del streams[k]
                        continue
                    yield HeldoutBatch(number, s, rows)
                    number += 1

    def tensors(self, batch: HeldoutBatch | None) -> dict[str, torch.Tensor]:
        """The batch's per-token fields (data/loader/batch_buffer.py) and ``num_real_tokens``,
        its rows filled up to ``batch_rows`` with blank ones; None: a blank batch."""
        if batch is None:
            return blank_batch(self.batch_rows, self.seq_len)
        return batch.fields


class RankShare:
    """The batches of a pass one rank evaluates: every ``world_size``-th from ``rank``, the first
    ``limit`` of them (0: all), then blank ones (None) until it has run as many as the rank with
    the most. ``complete`` (once iterated): whether the ranks together evaluated the whole pass.
    Every rank reads the pass up to the first batch past every rank's limit, so all reach the
    same answers."""

    def __init__(self, heldout: HeldoutPass, *, rank: int, world_size: int, limit: int = 0):
        self.heldout, self.rank, self.world_size, self.limit = heldout, rank, world_size, limit
        self.evaluated = 0  # real batches of this rank
        self.complete = True

    def __iter__(self) -> Iterator[HeldoutBatch | None]:
        world, cap = self.world_size, self.limit * self.world_size
        seen = 0  # batches of the pass within every rank's limit
        with closing(iter(self.heldout)) as batches:  # its shard files closed when we stop early
            for batch in batches:
                if cap and batch.number >= cap:
                    self.complete = False
                    break
                seen = batch.number + 1
                if batch.number % world == self.rank:
                    self.evaluated += 1
                    yield batch
        # rank 0 evaluated the most: ceil(seen / world), which is the limit when capped
        for _ in range(-(-seen // world) - self.evaluated):
            yield None
