"""A compact batch expanded three ways -- numpy (data/loader/expand.py), compiled
(expand_kernel.py) and by the trainer in torch (expand_torch.py) -- gives the same fields; a
loader that hands batches out compact, expanded by ``expand_batch``, gives what a loader that
expands them gives, in-process and through a worker."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from data.loader import build_loader
from data.loader.batch_buffer import BATCH_DTYPES, BatchBuffer
from data.loader.config import LoaderConfig, SourceConfig
from data.loader.expand import CompactBatch, expand_numpy
from data.loader.expand_kernel import expand_compiled
from data.loader.expand_torch import expand_batch, expand_fields, is_compact
from data.vocab import Modality

SOURCES = ("code", "text", "scenes", "digits", "clips", "docs")


def config(tokens, **kw) -> LoaderConfig:
    return LoaderConfig(
        sources=[SourceConfig(name=s, shards=[str(tokens / s)]) for s in SOURCES],
        **{"seq_len": 256, "num_workers": 0, "shuffle_buffer": 8, **kw},
    )


@pytest.mark.parametrize("settings", [{}, {"seq_len": 128, "allow_block_drops": True}])
def test_numpy_compiled_and_torch_expansions_agree(tiny_tokens, settings):
    stream = build_loader(config(tiny_tokens, **settings), rank=0, world_size=1, micro_batch=4)
    stream = stream.make_stream(0)
    seen_video = seen_images = False
    for _ in range(12):
        c = stream.next_batch().compact
        B, L = c.rows, c.seq_len
        ids, mod = c.ids.astype(np.int32), c.mod.astype(np.uint8)  # as a worker's slot holds them
        outs = []
        for how in (expand_numpy, expand_compiled):
            buf = BatchBuffer(B, L, 0)
            how(CompactBatch(B, L, ids, mod, c.segments, c.blocks, c.real), buf.fields)
            outs.append(buf.split())
        outs.append(
            expand_fields(
                torch.from_numpy(ids).view(B, L),
                torch.from_numpy(mod).view(B, L),
                torch.from_numpy(c.segments),
                torch.from_numpy(c.blocks),
                torch.from_numpy(c.real),
                device="cpu",
            )
        )
        for other in outs[1:]:
            assert other.keys() == outs[0].keys()
            for key in outs[0]:
                assert other[key].numpy().dtype == BATCH_DTYPES[key], key
                assert torch.equal(outs[0][key], other[key]), key
        mods = outs[0]["modality"]
        seen_video |= bool((mods == int(Modality.VIDEO)).any())
        # images (rows of 256: a second image in a row too)
        seen_images |= bool((outs[0]["image_ids"] > (-1 if settings else 0)).any())
    assert seen_images and seen_video == (not settings)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_compact_loader_expanded_by_the_trainer_gives_the_same_batches(tiny_tokens, workers):
    def batches(compact: bool) -> list[dict]:
        loader = build_loader(
            config(tiny_tokens, num_workers=workers), rank=0, world_size=1, micro_batch=3
        )
        loader.compact = compact
        it = iter(loader)
        out = [next(it) for _ in range(10)]
        it.close()
        return out

    full, compact = batches(False), batches(True)
    for a, b in zip(full, compact):
        assert is_compact(b) and not is_compact(a)
        assert b["input_ids"].dtype == torch.int32 and b["modality"].dtype == torch.uint8
        b = expand_batch(b, "cpu")
        assert a.keys() == b.keys()
        for key in a:
            assert a[key].dtype == b[key].dtype, key
            assert torch.equal(a[key], b[key]), key


def test_pinned_and_unpinned_splits_give_the_same_views():
    """A pinned batch buffer (a GPU run's) is split with torch views, an unpinned one with numpy
    views: the same keys in the same order, dtypes (batch_buffer.BATCH_DTYPES), shapes and memory."""
    buf = BatchBuffer(3, 16, 0)
    buf.tensor.copy_(torch.randint(0, 255, buf.tensor.shape, dtype=torch.uint8))
    a = buf.split()
    b = BatchBuffer.split_pinned(buf.tensor, 3, 16)  # torch's views work on any tensor
    assert list(a) == list(b) == list(BATCH_DTYPES)
    for key in a:
        assert a[key].numpy().dtype == b[key].numpy().dtype == BATCH_DTYPES[key], key
        assert a[key].data_ptr() == b[key].data_ptr() and torch.equal(a[key], b[key]), key
    assert a["position_thw"].shape == (3, 16, 3) and a["labels"].shape == (3, 16)


def test_the_compiled_expansion_refuses_tables_that_do_not_fit_the_batch():
    """numba checks no bounds: expand_compiled checks what it is given before it writes."""
    B, L = 2, 16
    ids, mod = np.zeros(B * L, np.int32), np.zeros(B * L, np.uint8)
    seg = np.asarray([[0, L, 0, 0, -100, 0], [L, 2 * L, 0, 0, -100, 0]], np.int64)
    real = np.asarray([L, L], np.int64)
    none = np.zeros((0, 5), np.int64)
    expand_compiled(CompactBatch(B, L, ids, mod, seg, none, real), BatchBuffer(B, L, 0).fields)
    with pytest.raises(ValueError, match="ids and modalities"):
        short = CompactBatch(B, L, ids, mod[:-1], seg, none, real)
        expand_compiled(short, BatchBuffer(B, L, 0).fields)
    with pytest.raises(ValueError, match="segment"):
        outside = seg.copy()
        outside[1, 1] = 2 * L + 5
        expand_compiled(
            CompactBatch(B, L, ids, mod, outside, none, real), BatchBuffer(B, L, 0).fields
        )
    # a 1 x 1 image block is 3 + 2 + 1 = 6 tokens; a second one starting inside the first
    blocks = np.asarray([[0, L, 0, 1, 1], [2, L, 0, 1, 1]], np.int64)
    with pytest.raises(ValueError, match="visual block"):
        expand_compiled(
            CompactBatch(B, L, ids, mod, seg, blocks, real), BatchBuffer(B, L, 0).fields
        )
