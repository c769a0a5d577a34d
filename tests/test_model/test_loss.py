"""The chunked CE against the plain one, and the monitors' sums in the loss result."""

from __future__ import annotations

import json
import math

import pytest
import torch
import torch.nn.functional as F

from data.vocab import Modality
from model.loss import chunked_linear_cross_entropy

pytestmark = pytest.mark.usefixtures("one_thread")


def _reference(h, w, t, z, text_end, visual_start):
    logits = (h @ w.t()).float()
    lse = torch.logsumexp(logits, -1)
    loss = F.cross_entropy(logits, t) + z * lse.pow(2).mean()
    gap = logits[:, visual_start:].mean(-1) - logits[:, :text_end].mean(-1)
    return loss, F.cross_entropy(logits, t, reduction="none"), lse, gap


@pytest.mark.parametrize("chunk", [1, 7, 32, 1000])
@pytest.mark.parametrize("z", [0.0, 1e-2])
def test_chunked_ce_equals_unchunked_values_and_grads(chunk, z):
    torch.manual_seed(0)
    N, D, V = 45, 16, 300
    h0, w0 = torch.randn(N, D) * 2, torch.randn(V, D)
    t = torch.randint(0, V, (N,))
    h1, w1 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    h2, w2 = h0.clone().requires_grad_(), w0.clone().requires_grad_()
    ref = _reference(h1, w1, t, z, 100, 250)
    got = chunked_linear_cross_entropy(
        h2, w2, t, z_loss_coef=z, chunk_size=chunk, text_end=100, visual_start=250
    )
    for a, b in zip(ref, got):
        torch.testing.assert_close(b, a.detach(), atol=1e-5, rtol=1e-5)
    (ref[0] * 3.0).backward()  # a non-unit upstream gradient must be honoured too
    (got[0] * 3.0).backward()
    torch.testing.assert_close(h2.grad, h1.grad, atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(w2.grad, w1.grad, atol=1e-6, rtol=1e-5)
    assert not got[1].requires_grad and not got[2].requires_grad


def test_unchunked_path_agrees_with_chunked():
    torch.manual_seed(1)
    h, w, t = torch.randn(20, 8), torch.randn(50, 8), torch.randint(0, 50, (20,))
    a = chunked_linear_cross_entropy(
        h, w, t, z_loss_coef=1e-3, chunk_size=0, text_end=20, visual_start=30
    )
    b = chunked_linear_cross_entropy(
        h, w, t, z_loss_coef=1e-3, chunk_size=6, text_end=20, visual_start=30
    )
    for x, y in zip(a, b):
        torch.testing.assert_close(x, y)


def test_chunked_ce_bf16_close_to_fp32():
    torch.manual_seed(2)
    h, w, t = torch.randn(33, 32), torch.randn(500, 32) * 0.2, torch.randint(0, 500, (33,))
    ref = chunked_linear_cross_entropy(h, w, t, chunk_size=0)[0]
    hb, wb = h.bfloat16().requires_grad_(), w.bfloat16().requires_grad_()
    got = chunked_linear_cross_entropy(hb, wb, t, chunk_size=8)[0]
    got.backward()
    assert (
        abs(got.item() - ref.item()) < 2e-2
        and hb.grad.dtype == torch.bfloat16
        and wb.grad.dtype == torch.bfloat16
    )


def test_per_modality_sums_add_up_to_the_total(kit, mixed_batch):
    torch.manual_seed(0)
    model = kit.tiny_config().build()
    r = model(**mixed_batch)
    n = int((mixed_batch["labels"] != -100).sum())
    assert int(r.num_tokens) == n == int(r.count.sum())
    torch.testing.assert_close(r.ce_sum.sum() / n, r.ce)
    torch.testing.assert_close(
        r.loss.detach(), r.ce + model.cfg.loss.z_loss_coef * r.z_loss + r.aux_loss
    )
    # Every modality of the batch is present and counted by the modality of the *target* token.
    labels, mods = mixed_batch["labels"], mixed_batch["modality"]
    target_mod = torch.cat([mods[:, 1:], mods[:, -1:]], 1)[labels != -100]
    assert torch.equal(r.count, torch.bincount(target_mod, minlength=len(Modality)))
    assert all(
        int(r.count[m]) > 0
        for m in (Modality.TEXT, Modality.CODE, Modality.IMAGE, Modality.STRUCTURE)
    )
    # log Z and the logit gap match a direct computation from full logits.
    with torch.no_grad():
        logits = model(**{k: v for k, v in mixed_batch.items() if k != "labels"})[labels != -100]
        lse = torch.logsumexp(logits, -1)
        gap = logits[:, model.cfg.visual_offset :].mean(-1) - logits[
            :, : model.cfg.text_vocab_size
        ].mean(-1)
    per_mod = lambda x: torch.zeros(len(Modality)).index_add_(0, target_mod, x)  # noqa: E731
    torch.testing.assert_close(r.logz_sum, per_mod(lse), atol=1e-4, rtol=1e-5)
    torch.testing.assert_close(r.logit_gap_sum, per_mod(gap), atol=1e-4, rtol=1e-5)
    assert (r.hidden_norm_sum[r.count > 0] > 0).all()
    r.loss.backward()
    assert model.output.weight.grad is not None and model.tok_embeddings.weight.grad.abs().sum() > 0
    means = r.modality_means()
    assert set(means) == {"loss/text", "loss/code", "loss/image", "loss/structure"}


def test_initial_loss_is_about_ln_vocab(kit, mixed_batch):
    torch.manual_seed(0)
    r = kit.tiny_config().build()(**mixed_batch)
    assert abs(r.ce.item() - math.log(kit.layout.size)) < 1.0


def test_no_labels_gives_zero_loss_and_zero_grads(kit, mixed_batch):
    model = kit.tiny_config().build()
    b = dict(mixed_batch, labels=torch.full_like(mixed_batch["labels"], -100))
    r = model(**b)
    r.loss.backward()
    assert r.loss.item() == 0.0 and int(r.num_tokens) == 0
    assert model.output.weight.grad.abs().sum() == 0


def _peak_bytes(tokens: int, chunk: int, tmp_path, vocab: int = 8192, dim: int = 16) -> int:
    """Most bytes the CPU allocator held at once during the CE's forward and backward, above
    what it held before: the profiler's memory events (each carries the running total)."""
    from torch.profiler import ProfilerActivity, profile

    gen = torch.Generator().manual_seed(0)
    hidden = torch.randn(tokens, dim, generator=gen, requires_grad=True)
    weight = torch.randn(vocab, dim, generator=gen, requires_grad=True)
    targets = torch.randint(0, vocab, (tokens,), generator=gen)
    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        loss, *_ = chunked_linear_cross_entropy(hidden, weight, targets, chunk_size=chunk)
        loss.backward()
    trace = tmp_path / f"trace_{tokens}_{chunk}.json"
    prof.export_chrome_trace(str(trace))
    events = [
        event["args"]
        for event in json.loads(trace.read_text())["traceEvents"]
        if event.get("name") == "[memory]"
    ]
    before = events[0]["Total Allocated"] - events[0]["Bytes"]
    return max(event["Total Allocated"] for event in events) - before


def test_chunked_ce_memory_is_one_chunk_of_logits_at_any_length(tmp_path):
    """At 512 and 2,048 tokens (vocabulary 4,096, chunks of 128): the peak is one chunk's
    [128, V] float32 logits (2 MiB) plus a few floats per token and hidden unit (the gradient
    w.r.t. the hidden states, per-token CE and log Z); it does not grow with the logits of the
    extra tokens. The unchunked path, measured the same way, holds all [T, V] logits."""
    vocab, dim, chunk = 4096, 16, 128
    chunk_logits = chunk * vocab * 4
    per_token = 2 * dim * 4  # float32: grad_h and as many bytes again for per-token vectors
    short, long = (_peak_bytes(tokens, chunk, tmp_path, vocab, dim) for tokens in (512, 2048))
    assert chunk_logits <= long < 2 * chunk_logits + 2048 * per_token
    assert long - short < (2048 - 512) * per_token  # 1,536 more tokens' logits: 24 MiB
    assert _peak_bytes(512, 0, tmp_path, vocab, dim) > 512 * vocab * 4  # the probe sees logits
