"""Document masking, FlexAttention vs SDPA, sliding window and bidirectional image blocks."""

from __future__ import annotations

import dataclasses

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
    [{}, {"sliding_window": 7}, {"bidirectional_images": True}],
    ids=["doc", "doc+window", "doc+bidir-images"],
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
