"""FSQ, the visual tokenizer (images and causal video) and its metrics, on real tensors."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from model.fsq import FSQ
from model.visual_tokenizer import VisualTokenizerConfig, vtok_cpu, vtok_debug
from model.vtok_metrics import (
    CodeUse,
    code_use,
    patch_mean_baseline,
    psnr,
    psnr_of_mse,
    rgb_levels,
    ssim,
    to_unit,
)


def smooth_images(b: int, h: int, w: int, seed: int = 0) -> torch.Tensor:
    """Photo-like test images in [-1, 1]: colour ramps plus a few soft blobs."""
    g = torch.Generator().manual_seed(seed)
    yy, xx = torch.meshgrid(torch.linspace(0, 1, h), torch.linspace(0, 1, w), indexing="ij")
    out = []
    for _ in range(b):
        a = torch.rand(3, 3, generator=g) * 2 - 1
        img = a[:, 0, None, None] * xx + a[:, 1, None, None] * yy + a[:, 2, None, None] * 0.3
        for _ in range(3):
            cy, cx, r = torch.rand(3, generator=g)
            img = img + (torch.rand(3, 1, 1, generator=g) - 0.5) * torch.exp(
                -((yy - cy) ** 2 + (xx - cx) ** 2) / (0.02 + 0.05 * r)
            )
        out.append(img)
    return torch.stack(out).clamp(-1, 1)


# --- FSQ -----------------------------------------------------------------------------------
@pytest.mark.parametrize("levels", [[8, 5, 5, 5], [7, 6, 2], [8, 8, 8, 5, 5, 5]])
def test_fsq_index_round_trip(levels):
    q = FSQ(levels)
    assert q.num_codes == math.prod(levels)
    idx = torch.randperm(q.num_codes)[:5000]
    codes = q.indices_to_codes(idx, channel_dim=-1)
    assert codes.shape == (len(idx), len(levels))
    assert torch.equal(q.codes_to_indices(codes, channel_dim=-1), idx)
    if (
        q.num_codes <= 5000
    ):  # small grids: every index is a distinct code, each digit takes its L values
        all_codes = q.indices_to_codes(torch.arange(q.num_codes), channel_dim=-1)
        assert all_codes.unique(dim=0).shape[0] == q.num_codes
        for i, lv in enumerate(levels):
            assert all_codes[:, i].unique().numel() == lv
            assert all_codes[:, i].min() == -1 and all_codes[:, i].max() <= 1


def test_fsq_forward_is_on_grid_and_consistent():
    q = FSQ([8, 5, 5, 5])
    z = torch.randn(3, 4, 5, 7) * 3
    codes, idx = q(z)
    assert idx.shape == (3, 5, 7) and idx.dtype == torch.long
    assert torch.equal(q.indices_to_codes(idx), codes)
    assert torch.equal(q.codes_to_indices(codes), idx)
    # z = 0 sits on a grid point for even and odd levels (the half-step offset of even levels)
    zero, _ = q(torch.zeros(1, 4, 1, 1))
    assert torch.equal(zero, torch.zeros(1, 4, 1, 1))
    # saturating inputs reach both ends of every level
    lo, hi = q(torch.full((1, 4, 1, 1), -50.0))[1], q(torch.full((1, 4, 1, 1), 50.0))[1]
    assert int(lo) == 0 and int(hi) == q.num_codes - 1


def test_fsq_straight_through_gradient():
    q = FSQ([8, 5, 5, 5])
    z = (torch.randn(2, 4, 3, 3) * 0.7).requires_grad_()
    w = torch.randn(2, 4, 3, 3)
    codes, _ = q(z)
    (codes * w).sum().backward()
    zl = z.detach().movedim(1, -1)
    # d/dz of round(tanh(z + s) * half - off) / width, with round's derivative taken as 1
    expect = (1 - torch.tanh(zl + q._shift) ** 2) * q._half / q._width
    assert torch.allclose(z.grad, (expect * w.movedim(1, -1)).movedim(-1, 1), atol=1e-6)
    assert z.grad.abs().min() > 0


def test_fsq_marginal_entropy_rewards_spread():
    q = FSQ([8, 5, 5, 5])
    flat = q.marginal_entropy(torch.zeros(16, 4, 4, 4))
    saturated = q.marginal_entropy(torch.full((16, 4, 4, 4), 20.0))
    spread = q.marginal_entropy(torch.randn(16, 4, 4, 4))
    assert (
        ((0 <= flat) & (flat <= 1)).all()
        and (spread > flat + 0.3).all()
        and (spread > saturated + 0.3).all()
    )
    z = torch.zeros(8, 4, 2, 2).requires_grad_()
    (1 - q.marginal_entropy(z + 0.1 * torch.randn(8, 4, 2, 2))).mean().backward()
    assert z.grad.abs().sum() > 0


def test_fsq_rejects_bad_input():
    with pytest.raises(ValueError):
        FSQ([8, 1])
    with pytest.raises(ValueError):
        FSQ([8, 5]).indices_to_codes(torch.tensor([40]))
    with pytest.raises(ValueError):
        FSQ([8, 5])(torch.zeros(1, 3, 2, 2))


# --- image tokenizer -----------------------------------------------------------------------
@pytest.mark.parametrize("factor,hw", [(4, (24, 40)), (8, (16, 48)), (16, (32, 16))])
def test_encode_decode_shapes_non_square(factor, hw):
    cfg = dataclasses.replace(
        vtok_debug(), factor=factor, enc_channels=[8, 16], dec_channels=[16, 8]
    )
    m = cfg.build().eval()
    x = smooth_images(2, *hw)
    idx = m.encode(x)
    assert idx.shape == (2, hw[0] // factor, hw[1] // factor) and idx.dtype == torch.long
    assert 0 <= int(idx.min()) and int(idx.max()) < 1000
    y = m.decode(idx)
    assert y.shape == x.shape and y.abs().max() <= 1
    with pytest.raises(ValueError):
        m.encode(smooth_images(1, hw[0] + 2, hw[1]))


def test_config_validation():
    with pytest.raises(ValueError):
        VisualTokenizerConfig(factor=6)
    with pytest.raises(ValueError):
        VisualTokenizerConfig(factor=4, enc_channels=[8, 8, 8, 8])


def test_presets_build_and_run():
    for cfg in (vtok_debug(), vtok_cpu()):
        m = cfg.build()
        loss, metrics = m(smooth_images(1, 16, 24))
        assert loss.ndim == 0 and torch.isfinite(loss)
        assert {"l1", "l2", "psnr", "code_fraction"} <= set(metrics)


def test_tiny_model_loss_falls_on_fixed_batch():
    torch.manual_seed(0)
    m = vtok_debug().build()
    x = smooth_images(4, 16, 16, seed=1)
    opt = torch.optim.AdamW(m.parameters(), lr=3e-3)
    losses = []
    for _ in range(40):
        loss, _ = m(x)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < 0.5 * losses[0], losses[::8]


def test_entropy_bonus_reported_and_differentiable():
    m = dataclasses.replace(vtok_debug(), entropy=0.1).build()
    loss, metrics = m(smooth_images(2, 16, 16))
    loss.backward()
    assert 0 < float(metrics["level_entropy"]) <= 1 and m.to_latent.weight.grad.abs().sum() > 0


def test_grad_loss_term_is_added():
    x = smooth_images(2, 16, 16)
    y = x + 0.1 * torch.randn_like(x)
    base = vtok_debug().build()
    with_grad = dataclasses.replace(vtok_debug(), grad=1.0).build()
    l0, m0 = base.loss(y, x)
    l1, m1 = with_grad.loss(y, x)
    assert "grad" in m1 and "grad" not in m0
    assert torch.isclose(l1, l0 + m1["grad"])


# --- video: causal, same code space --------------------------------------------------------
def _video_model():
    torch.manual_seed(0)
    m = vtok_debug().build().eval()  # temporal_factor 2
    with torch.no_grad():  # leave the mean initialisation, so the test sees any leak
        m.t_merge.weight.add_(torch.randn_like(m.t_merge.weight) * 0.1)
        m.t_dec.weight.normal_(0, 0.1)
    return m


def test_video_shapes():
    m = _video_model()
    for t in (1, 2, 3, 6, 7):
        v = smooth_images(2 * t, 16, 24).view(2, t, 3, 16, 24)
        idx = m.encode_video(v)
        assert (
            idx.shape == (2, m.num_latent_frames(t), 4, 6) == (2, 1 + math.ceil((t - 1) / 2), 4, 6)
        )
        assert m.decode_video(idx, num_frames=t).shape == v.shape
        assert m.decode_video(idx).shape[1] == 1 + (idx.shape[1] - 1) * 2


def test_video_encoder_is_causal():
    m = _video_model()
    t, tf = 7, m.cfg.temporal_factor
    v = smooth_images(t, 16, 16).unsqueeze(0)
    with torch.no_grad():
        z = m.video_latents(v)
        for k in range(t):
            w = v.clone()
            w[:, k] = -w[:, k]
            zk = m.video_latents(w)
            group = 0 if k == 0 else 1 + (k - 1) // tf
            assert torch.equal(zk[:, :group], z[:, :group]), (
                f"frame {k} leaked into an earlier latent"
            )
            assert not torch.allclose(zk[:, group], z[:, group]), (
                f"frame {k} does not reach latent {group}"
            )


@pytest.mark.parametrize("enc_channels", [[32], [16, 32]])
def test_local_encoder_codes_see_only_their_own_patch(enc_channels):
    """With ``local_encoder`` a patch's pixels reach its own latent and no other; without it
    (3x3 convs, GroupNorm over the whole map) they reach every latent of the image: what lets a
    raster-order language model read a shape from the codes before it."""
    cfg = dict(levels=[5, 5, 5], factor=4, enc_channels=enc_channels, dec_channels=[32])
    x = smooth_images(1, 16, 24)
    y = x.clone()
    y[:, :, 4:8, 8:12] = 1.0  # latent (1, 2)
    for local in (True, False):
        m = VisualTokenizerConfig(**cfg, local_encoder=local).build().eval()
        with torch.no_grad():
            changed = (m.encoder(x) - m.encoder(y)).abs().amax(1)[0] > 1e-6
        if local:
            assert changed.nonzero().tolist() == [[1, 2]]
        else:
            assert changed.sum() > 1


def test_video_shares_the_image_code_space():
    m = _video_model()
    v = smooth_images(5, 16, 24).unsqueeze(0)
    idx = m.encode_video(v)
    assert torch.equal(idx[:, 0], m.encode(v[:, 0]))
    assert torch.equal(m.decode_video(idx[:, :1]), m.decode(idx[:, 0]).unsqueeze(1))
    # with the merge at its initialisation (mean of the group), a still video gives the image's codes
    fresh = vtok_debug().build().eval()
    still = v[:, :1].expand(-1, 5, -1, -1, -1)
    assert (fresh.encode_video(still) == fresh.encode(v[:, 0]).unsqueeze(1)).all()


def test_video_loss_trains():
    m = vtok_debug().build()
    loss, metrics = m.forward_video(smooth_images(6, 16, 16).view(2, 3, 3, 16, 16))
    loss.backward()
    assert (
        torch.isfinite(loss)
        and m.t_merge.weight.grad is not None
        and m.t_dec.weight.grad is not None
    )


# --- metrics -------------------------------------------------------------------------------
def test_psnr_and_ssim_sanity():
    x = to_unit(smooth_images(3, 24, 32))
    assert torch.isinf(psnr(x, x)).all()
    assert torch.allclose(ssim(x, x), torch.ones(3))
    y = (x + 0.05 * torch.randn_like(x)).clamp(0, 1)
    assert (psnr(x, y) > 20).all() and (psnr(x, y) < 35).all()
    assert torch.isclose(psnr_of_mse(0.01), torch.tensor(20.0, dtype=torch.float64))
    assert (ssim(x, y) < 1).all()


def test_ssim_matches_scikit_image():
    metrics = pytest.importorskip("skimage.metrics")
    x = to_unit(smooth_images(2, 24, 40))
    y = (x + 0.1 * torch.randn_like(x)).clamp(0, 1)
    ours = ssim(x, y)
    for i in range(2):
        ref = metrics.structural_similarity(
            x[i].numpy(),
            y[i].numpy(),
            channel_axis=0,
            gaussian_weights=True,
            sigma=1.5,
            use_sample_covariance=False,
            data_range=1.0,
        )
        assert abs(float(ours[i]) - ref) < 1e-4


def test_baseline_constant_image_exact_up_to_quantisation():
    assert rgb_levels(1000) == (10, 10, 10)
    assert rgb_levels(64000) == (40, 40, 40)
    assert math.prod(rgb_levels(15360)) <= 15360
    colour = torch.tensor([0.123, 0.5, 0.987])
    x = colour.view(1, 3, 1, 1).expand(2, 3, 16, 24).contiguous()
    b = patch_mean_baseline(x, 4, 1000)
    expect = torch.round(colour * 9) / 9
    assert torch.allclose(b, expect.view(1, 3, 1, 1).expand_as(b), atol=1e-6)
    assert (b - x).abs().max() <= 0.5 / 9 + 1e-6
    on_grid = torch.tensor([2 / 9, 0.0, 1.0]).view(1, 3, 1, 1).expand(1, 3, 8, 8)
    assert torch.allclose(patch_mean_baseline(on_grid, 4, 1000), on_grid, atol=1e-6)


def test_baseline_keeps_patch_means_on_smooth_images():
    x = to_unit(smooth_images(2, 32, 32))
    b = patch_mean_baseline(x, 4, 64000)
    assert float(psnr(b, x).min()) > 25  # a smooth image is nearly a bilinear thumbnail


def test_code_use():
    cu = CodeUse(10)
    cu.update(torch.arange(10).repeat(3))
    assert cu.fraction() == 1.0 and abs(cu.perplexity() - 10) < 1e-9 and cu.tokens == 30
    r = code_use(torch.tensor([1, 1, 1, 1]), 10)
    assert r["code_fraction"] == 0.1 and abs(r["code_perplexity"] - 1) < 1e-9
    half = code_use(torch.tensor(np.r_[np.zeros(5), np.ones(5)]).long(), 100)
    assert abs(half["code_perplexity"] - 2) < 1e-9
