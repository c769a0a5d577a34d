"""Document masking, FlexAttention vs SDPA, sliding window and bidirectional image blocks."""

from __future__ import annotations

import dataclasses
import os

import pytest
import torch

from data.vocab import Modality
from model.attention import AttentionConfig, build_attention_mask

pytestmark = [
    pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile"),
    pytest.mark.usefixtures("one_thread"),
]

TOL = dict(atol=2e-5, rtol=1e-4)  # fp32; observed differences are ~1e-6


def _logits(model, batch, **drop):
    keys = ("modality", "position_ids", "position_thw", "doc_ids", "image_ids")
    return model(batch["input_ids"], **{k: batch[k] for k in keys if k not in drop})


@pytest.mark.parametrize("variant", ["plain", "mrope", "window", "mot"])
def test_document_masking_equals_each_document_alone(kit, variant):
    torch.manual_seed(0)
    extra = {}
    if variant == "mrope":
        extra["rope"] = dataclasses.replace(kit.tiny_config().rope, mrope_sections=[2, 1, 1])
    if variant == "window":
        extra["attention"] = AttentionConfig(n_heads=4, n_kv_heads=2, sliding_window=5)
    if variant == "mot":
        extra["ffn"] = dataclasses.replace(kit.tiny_config().ffn, modality_groups=[0, 0, 1, 1, 1])
    model = kit.tiny_config(**extra).build().eval()
    g = torch.Generator().manual_seed(1)
    docs = [
        kit.text_doc(11, Modality.TEXT, g),
        kit.image_doc(3, 3, g),
        kit.text_doc(9, Modality.CODE, g),
    ]
    packed = kit.pack(docs, 48)
    with torch.no_grad():
        full = _logits(model, packed)
        start = 0
        for doc in docs:
            alone = kit.pack([doc], len(doc[0]))
            out = _logits(model, alone, doc_ids=True)  # one document: no doc mask at all
            torch.testing.assert_close(full[:, start : start + len(doc[0])], out, **TOL)
            start += len(doc[0])
        # And the mask matters: without doc_ids the later documents see the earlier ones.
        leaky = _logits(model, packed, doc_ids=True)
        assert (leaky[:, 11:] - full[:, 11:]).abs().max() > 1e-3


def _flex_vs_sdpa(kit, batch, **attn):
    torch.manual_seed(0)
    cfg = kit.tiny_config(
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, backend="sdpa", **attn)
    )
    model = cfg.build().eval()
    flex = (
        dataclasses.replace(cfg, attention=dataclasses.replace(cfg.attention, backend="flex"))
        .build()
        .eval()
    )
    flex.load_state_dict(model.state_dict())
    with torch.no_grad():
        return _logits(model, batch), _logits(flex, batch)


@pytest.mark.parametrize(
    "attn",
    [
        {},
        {"sliding_window": 7},
        {"bidirectional_images": True},
        {"local_window": 7, "global_every": 2, "bidirectional_images": True},
    ],
    ids=["doc", "doc+window", "doc+bidir-images", "doc+local/global"],
)
def test_flex_and_sdpa_agree(kit, mixed_batch, attn):
    a, b = _flex_vs_sdpa(kit, mixed_batch, **attn)
    torch.testing.assert_close(a, b, **TOL)


def test_flex_mask_is_block_sparse_and_built_once(kit, mixed_batch, monkeypatch):
    import model.attention as A

    calls = []
    real = A.create_block_mask
    monkeypatch.setattr(A, "create_block_mask", lambda *a, **k: calls.append(1) or real(*a, **k))
    cfg = kit.tiny_config(
        n_layers=3, attention=AttentionConfig(n_heads=4, n_kv_heads=2, backend="flex")
    )
    with torch.no_grad():
        cfg.build()(mixed_batch["input_ids"], doc_ids=mixed_batch["doc_ids"])
    assert len(calls) == 1  # one block mask per batch, shared by the 3 layers
    local_global = kit.tiny_config(
        n_layers=4,
        attention=AttentionConfig(
            n_heads=4, n_kv_heads=2, backend="flex", local_window=8, global_every=2
        ),
    )
    calls.clear()
    with torch.no_grad():
        local_global.build()(mixed_batch["input_ids"], doc_ids=mixed_batch["doc_ids"])
    assert len(calls) == 2  # one per kind of layer (local, global), shared by 2 layers each


def test_flex_on_cpu_with_grad_is_a_clear_error():
    ids = torch.zeros(1, 8, dtype=torch.long)
    with pytest.raises(RuntimeError, match="no backward on CPU"):
        build_attention_mask(1, 8, ids.device, doc_ids=ids, backend="flex")


def test_dense_mask_semantics():
    doc = torch.tensor([[0, 0, 0, 0, 1, 1, 1, -1]])
    img = torch.tensor([[-1, 0, 0, -1, 1, 1, -1, -1]])
    m = build_attention_mask(
        1,
        8,
        doc.device,
        doc_ids=doc,
        image_ids=img,
        sliding_window=2,
        bidirectional_images=True,
        backend="sdpa",
    ).dense[0, 0]
    expect = torch.zeros(8, 8, dtype=torch.bool)
    for q in range(8):
        for k in range(8):
            same_doc = doc[0, q] == doc[0, k]
            causal = 0 <= q - k < 2
            same_img = img[0, q] >= 0 and img[0, q] == img[0, k]
            expect[q, k] = bool(same_doc and (causal or same_img))
    assert torch.equal(m, expect)
    assert m[1, 2] and not m[4, 3]  # a token sees the rest of its image, never another document


def test_a_dense_mask_past_the_memory_free_is_refused_before_allocating(monkeypatch, tmp_path):
    """Measured against what the machine has free, not its total: a 64k row's 20 GiB mask fit
    a 23.5 GiB machine's total and took all but 1 GiB of it from the other jobs."""
    import model.attention as attention

    monkeypatch.setattr(attention, "available_memory", lambda: 1 << 30)
    doc = torch.arange(16384)[None] // 8192  # two documents: no causal fast path
    with pytest.raises(attention.RowsTooLong, match=r"1.2 GiB and a .* this machine has 1.0 GiB"):
        build_attention_mask(1, 16384, doc.device, doc_ids=doc, backend="sdpa")
    monkeypatch.undo()
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    assert 0 < attention.available_memory() <= total
    # Within a cgroup's limit: 64 MiB, 48 MiB in use of which 16 MiB page cache (given back)
    cgroup = tmp_path / "cgroup"
    cgroup.mkdir()
    (cgroup / "memory.max").write_text(f"{64 << 20}\n")
    (cgroup / "memory.current").write_text(f"{48 << 20}\n")
    (cgroup / "memory.stat").write_text(f"anon {32 << 20}\nfile {16 << 20}\n")
    monkeypatch.setattr(attention, "CGROUP", cgroup)
    assert attention.available_memory() == 32 << 20
    # cgroup v1's files, where v2's are not
    for name in ("memory.max", "memory.current", "memory.stat"):
        (cgroup / name).unlink()
    (cgroup / "memory").mkdir()
    (cgroup / "memory" / "memory.limit_in_bytes").write_text(f"{64 << 20}\n")
    (cgroup / "memory" / "memory.usage_in_bytes").write_text(f"{48 << 20}\n")
    (cgroup / "memory" / "memory.stat").write_text(f"cache 1\ntotal_cache {16 << 20}\n")
    assert attention.available_memory() == 32 << 20
    # A shape that fitted once is not checked again: others' memory growing later does not stop
    # a run mid-training
    doc = torch.arange(64)[None] // 32
    build_attention_mask(1, 64, doc.device, doc_ids=doc, backend="sdpa")
    monkeypatch.setattr(attention, "available_memory", lambda: 0)
    build_attention_mask(1, 64, doc.device, doc_ids=doc, backend="sdpa")


def test_causal_fast_path_when_one_document_per_row():
    doc = torch.zeros(2, 6, dtype=torch.long)
    m = build_attention_mask(2, 6, doc.device, doc_ids=doc, backend="sdpa")
    assert m.causal and m.dense is None


def test_bidirectional_images_changes_only_image_and_later_positions(kit, mixed_batch):
    torch.manual_seed(0)
    causal = kit.tiny_config().build().eval()
    bidir = kit.tiny_config(
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, bidirectional_images=True)
    ).build()
    bidir.load_state_dict(causal.state_dict())
    with torch.no_grad():
        a, b = _logits(causal, mixed_batch), _logits(bidir.eval(), mixed_batch)
    first_img = int((mixed_batch["image_ids"][0] >= 0).nonzero()[0])
    torch.testing.assert_close(a[0, :first_img], b[0, :first_img], **TOL)
    assert (a[0, first_img] - b[0, first_img]).abs().max() > 1e-4


def _long_ids(seq_len: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Two rows of ``seq_len`` document ids (runs of 20-420 tokens, padding -1 at the end) and
    image ids (one block of 10-60 tokens inside every other document), crossing 128-token blocks
    of FlexAttention every which way."""
    gen = torch.Generator().manual_seed(seed)
    docs, images = torch.full((2, seq_len), -1), torch.full((2, seq_len), -1)
    for row in range(2):
        start, doc, image = 0, 0, 0
        while start < seq_len - 40:
            length = int(torch.randint(20, 420, (1,), generator=gen))
            docs[row, start : start + length] = doc
            if doc % 2 == 0 and length > 20:
                offset = int(torch.randint(1, length - 15, (1,), generator=gen))
                size = min(int(torch.randint(10, 60, (1,), generator=gen)), length - offset)
                images[row, start + offset : start + offset + size] = image
                image += 1
            start, doc = start + length, doc + 1
    return docs, images


def _blocks_of(dense: torch.Tensor, size: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """[B, 1, T, T] token mask -> (any, all) per [size x size] block: [B, 1, n, n]."""
    batch, _, seq_len, _ = dense.shape
    n = seq_len // size
    tiles = dense.reshape(batch, 1, n, size, n, size).transpose(3, 4).flatten(-2)
    return tiles.any(-1), tiles.all(-1)


def _full_blocks(block_mask) -> torch.Tensor:
    """The blocks FlexAttention computes without calling the mask_mod: [B, 1, n, n] bool."""
    counts, indices = block_mask.full_kv_num_blocks, block_mask.full_kv_indices
    out = torch.zeros(indices.shape, dtype=torch.bool)
    for row in range(indices.shape[0]):
        for query_block in range(indices.shape[2]):
            used = indices[row, 0, query_block, : int(counts[row, 0, query_block])]
            out[row, 0, query_block, used.long()] = True
    return out


@pytest.mark.parametrize(
    "compile_mask", [False, pytest.param(True, marks=pytest.mark.slow)], ids=["eager", "compiled"]
)
def test_block_mask_equals_the_dense_mask(compile_mask):
    """Document + causal + bidirectional image blocks, and the local layers' mask (the same AND
    a window), on 2 rows of 640 tokens (5 x 5 blocks of 128): the BlockMask's mask_mod evaluated
    on every (query, key) equals SDPA's dense mask, its blocks (partial and full) are exactly the
    blocks the dense mask touches, and the full ones exactly the blocks it fills.
    ``compiled``: the builder CUDA uses (``torch.compile(create_block_mask)``), here on the CPU."""
    seq_len = 640
    docs, images = _long_ids(seq_len, seed=3)
    common = dict(doc_ids=docs, image_ids=images, bidirectional_images=True, local_window=300)
    with torch.no_grad():
        dense = build_attention_mask(2, seq_len, docs.device, backend="sdpa", **common)
        flex = build_attention_mask(
            2, seq_len, docs.device, backend="flex", compile_mask=compile_mask, **common
        )
    assert flex.block_mask is not None and flex.local_block_mask is not None
    rows = torch.arange(2)[:, None, None, None]
    queries = torch.arange(seq_len)[None, None, :, None]
    keys = torch.arange(seq_len)[None, None, None, :]
    for block_mask, want in (
        (flex.block_mask, dense.dense),
        (flex.local_block_mask, dense.local_dense),
    ):
        assert want is not None and block_mask.shape == (2, 1, seq_len, seq_len)
        assert torch.equal(block_mask.mask_mod(rows, 0, queries, keys), want)
        touched, filled = _blocks_of(want)
        assert torch.equal(block_mask.to_dense().bool(), touched)
        assert torch.equal(_full_blocks(block_mask), filled)
        assert 0 < int(filled.sum()) < int(touched.sum()) < touched.numel()  # all kinds occur
    # The window cuts what the global mask lets through, and nothing else.
    assert not (dense.local_dense & ~dense.dense).any() and (dense.dense & ~dense.local_dense).any()
