"""The held-out pass (data/loader/heldout.py) that training validation and earlyfuse-eval share:
every token of every document exactly once, whatever the row length, batch size and number of
ranks; a capped pass split over ranks evaluates the first batches, each once, with every rank
running the model equally often."""

from __future__ import annotations

from collections import Counter

import numpy as np
import pytest

from data.loader.heldout import HeldoutPass, RankShare
from data.token_docs import iter_documents, source_tables
from data.vocab import MODALITY_NAMES

SOURCES = ("clips", "scenes", "docs", "code")  # video, image, interleaved, code


@pytest.fixture(scope="module")
def tables(tiny_tokens):
    return source_tables([s for s in source_tables(tiny_tokens) if s.name in SOURCES])


def label_counts(tables) -> dict[str, int]:
    """Label tokens per modality of every document: all tokens but each document's first."""
    out = dict.fromkeys(MODALITY_NAMES, 0)
    for doc in iter_documents(tables):
        for m in doc.modality[1:]:
            out[MODALITY_NAMES[int(m)]] += 1
    return out


def counted(heldout: HeldoutPass, batches) -> dict[str, int]:
    out = dict.fromkeys(MODALITY_NAMES, 0)
    for part in batches:
        batch = heldout.tensors(part)
        labels, mods = batch["labels"], batch["label_modality"]
        assert labels.shape == (heldout.batch_rows, heldout.seq_len)  # short batches filled up
        for m, name in enumerate(MODALITY_NAMES):
            out[name] += int(((labels >= 0) & (mods == m)).sum())
    return out


@pytest.mark.parametrize(("seq_len", "batch_rows"), [(256, 1), (256, 16), (1024, 3)])
def test_the_pass_counts_every_label_once(tables, seq_len, batch_rows):
    heldout = HeldoutPass(tables, seq_len=seq_len, batch_rows=batch_rows)
    assert counted(heldout, heldout) == label_counts(tables)
    assert [c.documents for c in heldout.counts] == [len(t) for t in tables]
    assert sum(c.dropped_blocks for c in heldout.counts) == 0


def test_sources_take_turns_so_a_capped_pass_sees_each(tables):
    heldout = HeldoutPass(tables, seq_len=256, batch_rows=2)
    first = [batch.source for batch, _ in zip(heldout, range(len(tables)))]
    assert first == list(range(len(tables)))


@pytest.mark.parametrize(("world", "limit"), [(1, 0), (3, 0), (4, 2), (2, 1), (3, 1000)])
def test_ranks_share_the_pass_and_run_equally_often(tables, world, limit):
    total = sum(1 for _ in HeldoutPass(tables, seq_len=256, batch_rows=4))
    shares, numbers = [], []
    for rank in range(world):
        share = RankShare(
            HeldoutPass(tables, seq_len=256, batch_rows=4),
            rank=rank,
            world_size=world,
            limit=limit,
        )
        parts = list(share)
        numbers += [part.number for part in parts if part is not None]
        shares.append((len(parts), share.evaluated, share.complete))
    want = min(total, limit * world) if limit else total
    assert sorted(numbers) == list(range(want))  # the first batches, each on one rank
    assert len({runs for runs, _, _ in shares}) == 1  # every rank runs the model as often
    assert all(evaluated > 0 for runs, evaluated, _ in shares[:want])
    assert {complete for _, _, complete in shares} == {want == total}


def test_a_capped_pass_over_a_small_set_still_evaluates(tables):
    """Fewer held-out documents than ranks x batch rows: every rank still takes part and the
    batches that exist are evaluated (the training loader's epoch mode evaluated none)."""
    small = source_tables([t for t in tables if t.name == "clips"])
    heldout = HeldoutPass(small, seq_len=2048, batch_rows=16)
    share = RankShare(heldout, rank=0, world_size=1, limit=2)
    assert counted(heldout, share) == label_counts(small)
    assert share.evaluated == 1 and share.complete


def test_rows_do_not_depend_on_how_folders_are_grouped_into_sources(tiny_tokens, tables):
    """One validation source over several shard folders (``tokens/val``) packs the rows that
    earlyfuse-eval packs from a source per folder."""
    from data.loader import SourceConfig

    one = source_tables([SourceConfig(name="all", shards=[str(tiny_tokens / s) for s in SOURCES])])

    def rows(tabs):
        heldout = HeldoutPass(tabs, seq_len=256, batch_rows=3)
        out = []
        for part in heldout:
            batch = heldout.tensors(part)
            out += [
                (ids.numpy().tobytes(), labels.numpy().tobytes())
                for ids, labels in zip(batch["input_ids"], batch["labels"])
            ]
        return sorted(out)

    assert len(one[0]) == sum(len(t) for t in tables)
    assert rows(one) == rows(tables)


def stretches_by_ids(heldout: HeldoutPass) -> Counter:
    """Every document stretch of the pass's rows (its ids), counted; ``batch_rows`` 1, so that a
    batch's real tokens are its row's."""
    found: Counter = Counter()
    for part in heldout:
        batch = heldout.tensors(part)
        real = int(batch["num_real_tokens"])
        ids, doc_ids = batch["input_ids"][0, :real].numpy(), batch["doc_ids"][0, :real].numpy()
        for piece in np.unique(doc_ids):
            found[ids[doc_ids == piece].tobytes()] += 1
    return found


def test_whole_documents_keep_every_held_out_document_that_fits_a_row_whole(tiny_tokens):
    """With the run's ``data.whole_documents`` the held-out pass packs as the run trained: a
    document that fits a row is one stretch of one row (its ids whole); without it documents of
    text alone may be cut at row ends, those holding a picture or clip never are. Either way
    every label is counted once."""
    seq_len = 256
    mixed = ("clips", "scenes", "docs", "text")  # the prose: documents that may be split
    tables = source_tables([s for s in source_tables(tiny_tokens) if s.name in mixed])
    docs = [doc for doc in iter_documents(tables) if len(doc.ids) <= seq_len]

    def whole_ones(found: Counter, docs=docs) -> int:
        count = 0
        for doc in docs:
            key = doc.ids.astype(np.int32).tobytes()
            if found[key]:
                found[key] -= 1
                count += 1
        return count

    split = HeldoutPass(tables, seq_len=seq_len, batch_rows=1)
    whole = HeldoutPass(tables, seq_len=seq_len, batch_rows=1, whole_documents=True)
    # a document holding a picture or clip is never split, whole_documents or not
    visual = [doc for doc in docs if doc.blocks]
    assert len(visual) > 10 and whole_ones(stretches_by_ids(split), visual) == len(visual)
    assert whole_ones(stretches_by_ids(split)) < len(docs)
    assert whole_ones(stretches_by_ids(whole)) == len(docs)
    assert counted(whole, whole) == label_counts(tables)
    assert [c.documents for c in whole.counts] == [len(t) for t in tables]
