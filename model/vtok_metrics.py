"""Metrics of the visual tokenizer: PSNR, SSIM, code use, and the mean-colour baseline.

Design choices:
- Every image metric takes float images in ``[0, 1]``, shape ``[B, 3, H, W]`` (the tokenizer works
  in ``[-1, 1]``; ``to_unit`` converts), and returns one value per image so callers choose the
  reduction. ``psnr_of_mse`` turns a mean MSE over a whole set into the set's PSNR, which stays
  finite when some crops are reconstructed exactly (a per-crop mean of PSNRs would not).
- SSIM is Wang et al. (2004) with an 11-tap Gaussian window, sigma 1.5, K1 = 0.01, K2 = 0.03, over
  the *valid* region, per channel then averaged: the same numbers as scikit-image's
  ``structural_similarity(gaussian_weights=True, sigma=1.5, use_sample_covariance=False)``. The
  window shrinks (odd, sigma kept) on images smaller than 11 pixels.
- Code use over a set: the fraction of the ``num_codes`` codes hit at least once, and the
  perplexity ``exp(H)`` of the empirical code distribution (``num_codes`` means perfectly uniform).
  The fraction depends on the set size, so report it with the token count (the issue asks for
  at least ten tokens per code).
- Baseline: per ``factor x factor`` patch mean colour, each channel quantised uniformly to levels
  whose product is at most the code count (as even as possible: 1,000 codes -> 10 x 10 x 10),
  upsampled bilinearly. It spends the same bits per token as the tokenizer, so beating it means
  the network learned more than a thumbnail.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor


def to_unit(x: Tensor) -> Tensor:
    """[-1, 1] -> [0, 1], clamped (a decoder may overshoot)."""
    return ((x.float() + 1) / 2).clamp(0, 1)


def mse(x: Tensor, y: Tensor) -> Tensor:
    return ((x.float() - y.float()) ** 2).flatten(1).mean(1)


def psnr_of_mse(m: Tensor | float, data_range: float = 1.0) -> Tensor:
    """PSNR in dB; an MSE of 0 gives +inf."""
    m = torch.as_tensor(m, dtype=torch.float64)
    return 10 * torch.log10(data_range**2 / m)


def psnr(x: Tensor, y: Tensor, data_range: float = 1.0) -> Tensor:
    """Per-image PSNR in dB of two ``[B, C, H, W]`` batches in ``[0, data_range]``."""
    return psnr_of_mse(mse(x, y), data_range).float()


def _gauss(size: int, sigma: float, device) -> Tensor:
    r = torch.arange(size, dtype=torch.float32, device=device) - (size - 1) / 2
    g = torch.exp(-(r**2) / (2 * sigma**2))
    return g / g.sum()


def ssim(
    x: Tensor, y: Tensor, data_range: float = 1.0, win: int = 11, sigma: float = 1.5
) -> Tensor:
    """Per-image mean SSIM of two ``[B, C, H, W]`` batches in ``[0, data_range]``."""
    if x.shape != y.shape or x.dim() != 4:
        raise ValueError(
            f"ssim needs two equal [B, C, H, W] shapes, got {tuple(x.shape)}, {tuple(y.shape)}"
        )
    x, y = x.float(), y.float()
    win = min(win, x.shape[-1], x.shape[-2])
    win -= 1 - win % 2  # odd, so the window has a centre pixel
    c = x.shape[1]
    g = _gauss(win, sigma, x.device)
    # Separable filter: a [win, 1] then a [1, win] depthwise conv over the valid region.
    kv = g.view(1, 1, win, 1).repeat(c, 1, 1, 1)
    kh = g.view(1, 1, 1, win).repeat(c, 1, 1, 1)

    def blur(t: Tensor) -> Tensor:
        return F.conv2d(F.conv2d(t, kv, groups=c), kh, groups=c)

    c1, c2 = (0.01 * data_range) ** 2, (0.03 * data_range) ** 2
    mx, my = blur(x), blur(y)
    sxx = blur(x * x) - mx * mx
    syy = blur(y * y) - my * my
    sxy = blur(x * y) - mx * my
    s = ((2 * mx * my + c1) * (2 * sxy + c2)) / ((mx * mx + my * my + c1) * (sxx + syy + c2))
    return s.flatten(1).mean(1)


class CodeUse:
    """Accumulates a histogram of code indices over many batches."""

    def __init__(self, num_codes: int) -> None:
        self.num_codes = num_codes
        self.counts = torch.zeros(num_codes, dtype=torch.long)

    def update(self, indices: Tensor) -> None:
        self.counts += torch.bincount(indices.flatten().long().cpu(), minlength=self.num_codes)

    @property
    def tokens(self) -> int:
        return int(self.counts.sum())

    def fraction(self) -> float:
        return int((self.counts > 0).sum()) / self.num_codes

    def perplexity(self) -> float:
        p = self.counts.double() / max(1, self.tokens)
        h = -(p[p > 0] * p[p > 0].log()).sum()
        return float(h.exp())


def code_use(indices: Tensor, num_codes: int) -> dict[str, float]:
    """Fraction of codes hit and code perplexity of one set of indices."""
    cu = CodeUse(num_codes)
    cu.update(indices)
    return {
        "code_fraction": cu.fraction(),
        "code_perplexity": cu.perplexity(),
        "tokens": float(cu.tokens),
    }


def rgb_levels(num_codes: int) -> tuple[int, int, int]:
    """Levels per channel (R, G, B), product <= num_codes, as even as possible.

    Start from the integer cube root and raise one channel at a time (green first: it carries
    most of the luminance, then red, then blue) while the product still fits.
    """
    if num_codes < 8:
        raise ValueError("need at least 8 codes for 2 levels per channel")
    base = int(round(num_codes ** (1 / 3)))
    while base**3 > num_codes:
        base -= 1
    lv = [base, base, base]
    for ch in (1, 0, 2):
        if math.prod(lv) // lv[ch] * (lv[ch] + 1) <= num_codes:
            lv[ch] += 1
    return lv[0], lv[1], lv[2]


def patch_mean_baseline(images: Tensor, factor: int, num_codes: int) -> Tensor:
    """Mean colour per patch, quantised to ``rgb_levels(num_codes)``, upsampled bilinearly.

    ``images``: ``[B, 3, H, W]`` in ``[0, 1]`` with H, W multiples of ``factor``. The quantiser of a
    channel with L levels reconstructs to ``k / (L - 1)``, so black and white are exact.
    """
    b, c, h, w = images.shape
    if c != 3 or h % factor or w % factor:
        raise ValueError(
            f"need [B, 3, H, W] with H, W multiples of {factor}, got {tuple(images.shape)}"
        )
    mean = F.avg_pool2d(images.float(), factor)
    lv = (
        torch.tensor(rgb_levels(num_codes), dtype=torch.float32, device=images.device).view(
            1, 3, 1, 1
        )
        - 1
    )
    quantised = torch.round(mean.clamp(0, 1) * lv) / lv
    return F.interpolate(quantised, size=(h, w), mode="bilinear", align_corners=False).clamp(0, 1)


# --- the sceptic's baselines and detail strata --------------------------------------


def patch_means(images: Tensor, factor: int) -> Tensor:
    """[B, 3, H, W] -> [B, 3, H/f, W/f] mean colour of every patch."""
    return F.avg_pool2d(images.float(), factor)


def thumbnail(images: Tensor, factor: int) -> Tensor:
    """Unquantised patch means upsampled bilinearly: the best a mean-colour thumbnail can do."""
    height, width = images.shape[-2:]
    return F.interpolate(
        patch_means(images, factor), size=(height, width), mode="bilinear", align_corners=False
    ).clamp(0, 1)


def nearest(points: Tensor, centres: Tensor, chunk: int = 8192) -> Tensor:
    """Index of the nearest centre of each row of ``x`` (in chunks: [N, k] never exists whole)."""
    return torch.cat(
        [
            torch.cdist(points[i : i + chunk], centres).argmin(1)
            for i in range(0, len(points), chunk)
        ]
    )


def kmeans(
    points: Tensor, k: int, *, iters: int = 10, seed: int = 0, max_points: int = 20000
) -> Tensor:
    """Lloyd's k-means on [N, D] points: the centres [k, D]. Seeded with k distinct points drawn
    at random (from at most ``max_points``, also drawn at random); an empty cluster takes the
    point furthest from its centre, so all k centres are used."""
    generator = torch.Generator().manual_seed(seed)
    points = points.float()
    if len(points) > max_points:
        points = points[torch.randperm(len(points), generator=generator)[:max_points]]
    n_points = points.shape[0]
    if n_points <= k:
        return points.clone()
    centres = points[torch.randperm(n_points, generator=generator)[:k]].clone()
    for _ in range(iters):
        assign = nearest(points, centres)
        sums = torch.zeros_like(centres).index_add_(0, assign, points)
        counts = torch.bincount(assign, minlength=k).float()
        empty = counts == 0
        centres = torch.where(empty[:, None], centres, sums / counts.clamp(min=1)[:, None])
        if empty.any():
            far = ((points - centres[assign]) ** 2).sum(1).topk(int(empty.sum())).indices
            centres[empty] = points[far]
    return centres


def learn_palette(images: Tensor, factor: int, num_codes: int, *, seed: int = 0) -> Tensor:
    """A palette of ``num_codes`` colours (k-means of the patch means of ``images``, [0, 1]):
    the same bits per token as a tokenizer with that many codes."""
    means = patch_means(images, factor).permute(0, 2, 3, 1).reshape(-1, 3)
    return kmeans(means, num_codes, seed=seed).clamp(0, 1)


def palette_baseline(images: Tensor, factor: int, palette: Tensor) -> Tensor:
    """Each patch's mean colour replaced by its nearest palette colour, upsampled bilinearly."""
    batch, _, height, width = images.shape
    means = patch_means(images, factor)
    flat = means.permute(0, 2, 3, 1).reshape(-1, 3)
    quantised = palette[nearest(flat, palette.to(flat))]
    quantised = quantised.view(batch, height // factor, width // factor, 3).permute(0, 3, 1, 2)
    return F.interpolate(
        quantised, size=(height, width), mode="bilinear", align_corners=False
    ).clamp(0, 1)


FLAT_PSNR = 30.0  # a crop is "flat" when its unquantised thumbnail already reaches this PSNR


def detail_strata(images: Tensor, factor: int) -> dict[str, Tensor]:
    """Boolean masks ``flat`` / ``detailed`` over a set of [0, 1] crops: flat when the mean-colour
    thumbnail alone reconstructs it to ``FLAT_PSNR`` dB or better (a sky, a wall, a background),
    detailed otherwise (edges, texture, small shapes): what a tokenizer must keep beyond colour."""
    thumb_psnr = psnr(thumbnail(images, factor), images)
    return {"flat": thumb_psnr >= FLAT_PSNR, "detailed": thumb_psnr < FLAT_PSNR}
