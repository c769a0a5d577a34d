"""The compact batch layout (data/loader/expand.py): a batch packed compact and expanded equals
the same rows packed and expanded as batches of one row, in-process, through a worker's slot of shared
memory and through the fallback when no slot is free (pickled)."""

from __future__ import annotations

import pickle

import numpy as np
import pytest

from data.loader import LoaderConfig, SourceConfig, transport
from data.loader.batch_buffer import BATCH_DTYPES, ROW_FIELDS
from data.loader.dataset import PackedLoader
from data.loader.expand import slot_numel
from data.loader.packed_batch import PackedBatch
from data.loader.stream import ConsumerStream
from data.loader.table_load import load_table
from data.vocab import Modality

SOURCES = ("code", "text", "scenes", "digits", "clips", "docs")


def _stream(tokens, micro_batch: int, **kw) -> ConsumerStream:
    tables = [load_table(SourceConfig(name=s, shards=[str(tokens / s)])) for s in SOURCES]
    cfg = LoaderConfig(
        sources=[SourceConfig(name=s, shards=[str(tokens / s)]) for s in SOURCES],
        **{"seq_len": 256, "shuffle_buffer": 8, **kw},
    )
    return ConsumerStream(
        tables,
        [1.0] * len(SOURCES),
        cfg,
        consumer=0,
        consumers=1,
        micro_batch=micro_batch,
        pad_id=0,
    )


def _rows_one_by_one(tokens, n_rows: int, **kw) -> dict[str, np.ndarray]:
    """The batch fields of ``n_rows`` rows, each packed and expanded as a batch of its own."""
    rows = _batches(_stream(tokens, 1, **kw), n_rows)
    out = {key: np.concatenate([r[key] for r in rows]) for key in ROW_FIELDS.values()}
    out["position_thw"] = np.concatenate([r["position_thw"] for r in rows])
    out["num_real_tokens"] = np.array(sum(int(r["num_real_tokens"]) for r in rows))
    return out


def _batches(stream: ConsumerStream, n: int, *, pickled: bool = False) -> list[dict]:
    out = []
    for _ in range(n):
        packed = stream.next_batch()
        assert isinstance(packed, PackedBatch)
        if pickled:  # what the worker queue does to a batch (its ring aside)
            packed.ring = None
            packed = pickle.loads(pickle.dumps(packed))
        out.append({k: v.numpy() for k, v in packed.to_dict().items()})
    return out


@pytest.mark.parametrize("settings", [{}, {"seq_len": 128, "allow_block_drops": True}])
def test_batches_expand_to_the_rows_packed_one_by_one(tiny_tokens, settings):
    rows, batches = 4, 6
    want = _rows_one_by_one(tiny_tokens, rows * batches, **settings)
    got = _batches(_stream(tiny_tokens, rows, **settings), batches)
    for key in (*want.keys() - {"num_real_tokens"},):
        joined = np.concatenate([b[key] for b in got])
        assert joined.dtype == BATCH_DTYPES[key], key
        np.testing.assert_array_equal(joined, want[key], err_msg=key)
    assert sum(int(b["num_real_tokens"]) for b in got) == int(want["num_real_tokens"])
    # What the comparison covered: several images in a row, video blocks (rows of 128 hold
    # images only: their videos are longer, dropped)
    assert (want["image_ids"] > (0 if not settings else -1)).any()
    assert (want["modality"] == int(Modality.VIDEO)).any() == (not settings)
    assert int(want["num_real_tokens"]) < want["input_ids"].size  # rows with padding


def test_a_worker_batch_crosses_as_its_compact_layout(tiny_tokens):
    rows = 4
    in_process = _batches(_stream(tiny_tokens, rows), 4)
    stream = _stream(tiny_tokens, rows)
    stream.ring = transport.SlotRing(2, slot_numel(rows, stream.cfg.seq_len))
    try:
        first = stream.next_batch()
        assert isinstance(first, PackedBatch) and first.slot is not None
        assert first.compact.ids is None  # the per-token part is in the slot, not the message
        assert int(stream.ring.flags[first.slot]) == 1
        got = [{k: v.numpy() for k, v in first.to_dict().items()}]
        assert int(stream.ring.flags.sum()) == 0  # expanded out of the slot, the slot freed
        got += _batches(stream, 1)
        # No free slot (the trainer holds them all): ordinary arrays, pickled across
        stream.ring.flags[:] = 1
        got += _batches(stream, 2, pickled=True)
    finally:
        transport.forget(stream.ring.token)
    for a, b in zip(in_process, got, strict=True):
        assert a.keys() == b.keys()
        for key in a:
            np.testing.assert_array_equal(a[key], b[key], err_msg=key)


def test_a_worker_batch_and_its_state_cross_the_queue_as_one_buffer_of_tables(tiny_tokens):
    from multiprocessing.reduction import ForkingPickler

    rows = 4
    stream = _stream(tiny_tokens, rows)
    stream.ring = transport.SlotRing(3, slot_numel(rows, stream.cfg.seq_len))
    try:
        for _ in range(3):  # a few batches in: documents held aside and open in the state
            sent = stream.next_batch()
            assert isinstance(sent, PackedBatch)
            sent.worker, sent.state = 0, stream.state()
            message = bytes(ForkingPickler.dumps(sent))  # what the worker queue sends
            # numpy's reconstructor appears once per array pickled apart: none here
            assert b"_reconstruct" not in message
            got = pickle.loads(message)
            for name in ("segments", "blocks", "real"):
                want, have = getattr(sent.compact, name), getattr(got.compact, name)
                assert have.dtype == np.int64 and have.flags.writeable, name
                np.testing.assert_array_equal(have, want, err_msg=name)
            np.testing.assert_array_equal(got.pieces, sent.pieces)
            np.testing.assert_array_equal(got.dropped, sent.dropped)
            assert got.state.to_dict() == sent.state.to_dict()
            assert (got.slot, got.token, got.worker, got.real) == (
                sent.slot,
                sent.token,
                sent.worker,
                sent.real,
            )
            assert got.tokens_by_source == sent.tokens_by_source
            batch = got.to_dict()  # expanded out of the slot, which is freed
            assert int(batch["num_real_tokens"]) == sent.real
            sent.ring = None  # the ring's tensors crossed with the first message
    finally:
        transport.forget(stream.ring.token)


def test_a_workers_first_batch_is_read_after_the_worker_has_exited(tiny_tokens):
    """A DataLoader stops a worker once it reads the worker's end, which can come before the
    trainer is handed a batch the worker sent earlier (held back for order: a worker with one
    batch left, after a resume near an epoch's end). The ring's tensors that the worker's first
    batch carries must be taken on as the message arrives, not when the batch is handed out."""
    import multiprocessing

    from data.loader.dataset import _Pickled

    rows = 4
    want = _batches(_stream(tiny_tokens, rows), 1)
    fork = multiprocessing.get_context("fork")
    queue, received = fork.Queue(), fork.Event()

    def worker() -> None:
        stream = _stream(tiny_tokens, rows)
        stream.ring = transport.SlotRing(2, slot_numel(rows, stream.cfg.seq_len))
        queue.put(_Pickled(stream.next_batch()))  # as our DataLoader workers send a batch
        received.wait(60)  # alive until the message is read, as a DataLoader worker is

    process = fork.Process(target=worker)
    process.start()
    sent = queue.get(timeout=60)
    received.set()
    process.join(60)
    assert process.exitcode == 0
    batch = sent.load()
    try:
        got = {k: v.numpy() for k, v in batch.to_dict().items()}
    finally:
        transport.forget(batch.token)
    for key in want[0]:
        np.testing.assert_array_equal(got[key], want[0][key], err_msg=key)


class _UnpicklableBatches(PackedLoader):
    """A loader whose streams attach a state that cannot be pickled to every batch."""

    def make_stream(self, worker, **kw):
        stream = super().make_stream(worker, **kw)
        stream.state = lambda: lambda: None  # type: ignore[method-assign]
        return stream


def test_a_worker_batch_that_cannot_be_pickled_fails_the_loader_instead_of_hanging_it(
    tiny_tokens,
):
    """A batch a worker cannot pickle is an error in the trainer's process naming the worker;
    handed to torch's queue unpickled, its feeder thread would only print the error and the
    trainer would wait for the batch for ever."""
    import threading

    cfg = LoaderConfig(
        sources=[SourceConfig(name="text", shards=[str(tiny_tokens / "text")])],
        seq_len=256,
        num_workers=1,
    )
    tables = [load_table(source) for source in cfg.sources]
    loader = _UnpicklableBatches(cfg, tables, rank=0, world_size=1, micro_batch=2, pad_id=0)
    raised: list[BaseException] = []

    def first_batch():
        it = iter(loader)
        try:
            next(it)
        except Exception as error:  # noqa: BLE001  (the error the trainer would see)
            raised.append(error)
        finally:
            it.close()

    reader = threading.Thread(target=first_batch, daemon=True)
    reader.start()
    reader.join(120)
    assert not reader.is_alive(), "the loader waited for a batch its worker could not send"
    assert raised and "DataLoader worker process 0" in str(raised[0])


def test_an_in_process_loader_run_in_another_dataloaders_worker_hands_out_plain_batches(
    tiny_tokens,
):
    """``num_workers=0`` run inside a DataLoader worker of the user's own (a framework's loop, the
    peer benchmark's shared transport): the same batches as in the main process, packed without
    a ring of shared slots, which only this loader's own workers have a reader for."""
    import torch
    from torch.utils.data import DataLoader, IterableDataset

    cfg = LoaderConfig(
        sources=[SourceConfig(name=s, shards=[str(tiny_tokens / s)]) for s in SOURCES],
        seq_len=256,
        mode="epoch",
        num_workers=0,
    )

    def batches():
        return iter(
            PackedLoader(
                cfg,
                [load_table(s) for s in cfg.sources],
                rank=0,
                world_size=1,
                micro_batch=4,
                pad_id=0,
            )
        )

    class Wrapped(IterableDataset):
        def __iter__(self):
            for batch in batches():
                yield batch, torch.tensor(len(transport._rings))

    want = list(batches())
    got = list(DataLoader(Wrapped(), batch_size=None, num_workers=1))
    assert len(got) == len(want) > 1
    for a, (b, rings) in zip(want, got, strict=True):
        assert int(rings) == 0
        assert a.keys() == b.keys()
        for key in a:
            torch.testing.assert_close(a[key], b[key], rtol=0, atol=0, msg=key)
