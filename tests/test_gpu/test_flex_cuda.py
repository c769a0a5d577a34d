"""FlexAttention on CUDA (compiled kernel, block mask from the compiled builder) against the
dense reference, in bf16, with packed documents and bidirectional image blocks.

Tolerance: FlexAttention in bf16 may differ from the float32 dense reference by at most twice
what SDPA in bf16 (same inputs, the dense mask) differs from it, and never by more than 2e-2 when
SDPA is closer than that: both round the same products to bf16, in another order."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from gpu_batches import packed_batch

from model.attention import _flex, build_attention_mask

pytestmark = pytest.mark.gpu
B, T, HEADS, KV_HEADS, HEAD_DIM = 2, 2048, 8, 2, 64


def attend_dense(q, k, v, mask):
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)


def max_err(got, want) -> float:
    return float((got.float() - want.float()).abs().max())


@pytest.mark.parametrize("bidirectional", [False, True])
def test_flex_matches_dense_reference_in_bf16_forward_and_backward(bidirectional):
    torch.manual_seed(0)
    dev = torch.device("cuda")
    batch = packed_batch(B, T, 1000, dev)
    kw = dict(
        doc_ids=batch["doc_ids"],
        image_ids=batch["image_ids"],
        bidirectional_images=bidirectional,
        one_doc_rows=False,
    )
    flex = build_attention_mask(B, T, dev, backend="flex", **kw)
    dense = build_attention_mask(B, T, dev, backend="sdpa", **kw).dense
    assert flex.block_mask is not None and dense is not None
    q = torch.randn(B, HEADS, T, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    k = torch.randn(B, KV_HEADS, T, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    v = torch.randn(B, KV_HEADS, T, HEAD_DIM, device=dev, dtype=torch.bfloat16)
    grad_out = torch.randn(B, HEADS, T, HEAD_DIM, device=dev, dtype=torch.bfloat16)

    def run(fn, dtype):
        inputs = [t.detach().to(dtype).requires_grad_() for t in (q, k, v)]
        out = fn(*inputs)
        out.backward(grad_out.to(dtype))
        return [out.detach()] + [t.grad for t in inputs]

    ref = run(lambda *x: attend_dense(*x, dense), torch.float32)
    sdpa = run(lambda *x: attend_dense(*x, dense), torch.bfloat16)
    got = run(lambda *x: _flex(*x, flex.block_mask, True, True), torch.bfloat16)
    for name, want, base, mine in zip(("out", "dq", "dk", "dv"), ref, sdpa, got):
        bound = max(2 * max_err(base, want), 2e-2)
        assert max_err(mine, want) <= bound, (name, max_err(mine, want), bound)


def test_one_document_rows_use_the_causal_block_mask():
    dev = torch.device("cuda")
    doc = torch.zeros(B, T, dtype=torch.long, device=dev)
    mask = build_attention_mask(B, T, dev, doc_ids=doc, backend="flex", one_doc_rows=True)
    assert mask.block_mask.shape[0] == 1  # one causal mask broadcast over the batch
