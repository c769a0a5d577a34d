"""The visual tokenizer: a convolutional FSQ autoencoder for images, and a causal video variant.

Images ``[B, 3, H, W]`` in ``[-1, 1]`` (H, W multiples of ``factor``) become code grids
``[B, H/f, W/f]`` of indices in ``0 .. prod(levels)-1``; the grid's shape follows the image's, so
the Emu3-style layout in ``data/layout.py`` stays resolution-free.

Design choices:
- Encoder stem: ``pixel_unshuffle`` (space-to-depth) by ``factor / 2**(len(enc_channels)-1)``
  before the first conv, then one stride-2 stage per further width. With one width the whole
  encoder runs at latent resolution, which is what makes a CPU preset affordable: a 3x3 conv on
  48 unshuffled channels sees a 12x12-pixel window for the price of a small conv.
- Decoder mirrors it: residual blocks at latent resolution, pixel-shuffle upsampling (a conv to
  ``4 C`` channels then depth-to-space: no checkerboard from transposed convs, no wasted FLOPs
  on nearest-neighbour copies), and a final pixel-shuffle head to RGB.
- Colour path (``colour_path``): the encoder adds a 1x1 projection of the per-patch mean colour to
  its features, the decoder adds a bilinear upsample of a 1x1 projection of the codes to its
  output, and the decoder's last conv starts at zero. At step 0 the tokenizer is therefore a
  learned version of the mean-colour baseline, and the conv trunks learn only the residual:
  detail inside a patch. This is the main reason the CPU preset beats that baseline
  (docs/visual_tokenizer.md, "The CPU check", has the ablation).
- Residual blocks: GroupNorm (batch-independent, so a code never depends on the other images of
  a batch) -> SiLU -> 3x3 conv, twice; ``norm_groups=0`` drops the norm (faster on CPU).
- Loss: ``l1 * |x - y| + l2 * (x - y)^2 + grad * |dx - dy|`` (finite differences along H and W):
  nothing needs downloaded weights. The gradient term sharpens edges at a small PSNR cost; it is
  off in the CPU preset (measured, see the docs).
- Video, causal (NVIDIA Cosmos style): frame 0 is encoded alone, exactly as an image, then each
  group of ``temporal_factor`` frames is merged into one latent frame, so
  ``T_lat = 1 + ceil((T - 1) / temporal_factor)``. The merge is a learned 1x1 conv over the
  concatenated encoder features of the group (initialised to their mean; a short last group is
  padded by repeating its own last frame), applied *before* the shared projection to FSQ, so
  video latents live in the image code space and a still video tokenizes like its first frame.
  A latent only sees frames of its own group, hence never a later frame. Decoding frame ``i`` of
  group ``j`` adds a zero-initialised, offset-specific projection of ``(codes[j-1], codes[j])`` to
  the decoder's input features: it can interpolate motion from the previous latent without
  looking ahead. The merge and these projections are the only video-specific parameters.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from model.fsq import FSQ


@dataclass(kw_only=True)
class VisualTokenizerConfig:
    levels: list[int] = field(default_factory=lambda: [8, 5, 5, 5])
    factor: int = 8  # spatial downsampling: 4, 8 or 16
    # Widths from the encoder's stem (highest resolution) down to the latent resolution; the
    # stem unshuffles by factor / 2**(len-1) pixels.
    enc_channels: list[int] = field(default_factory=lambda: [64, 128])
    enc_blocks: int = 2  # residual blocks per encoder stage
    # Widths from the latent resolution up; the head pixel-shuffles by factor / 2**(len-1).
    dec_channels: list[int] = field(default_factory=lambda: [192, 96])
    dec_blocks: int = 2
    norm_groups: int = 8  # GroupNorm groups in residual blocks; 0: no norm
    colour_path: bool = True  # mean-colour skip around both trunks (see module doc)
    temporal_factor: int = 4  # frames per latent frame after the first (video)
    l1: float = 1.0
    l2: float = 1.0
    grad: float = 0.0  # weight of the finite-difference (edge) L1 term
    entropy: float = 0.0  # weight of the code-use bonus (FSQ.marginal_entropy)

    def __post_init__(self) -> None:
        self.levels = [int(x) for x in self.levels]
        self.enc_channels = [int(x) for x in self.enc_channels]
        self.dec_channels = [int(x) for x in self.dec_channels]
        if self.factor not in (2, 4, 8, 16):
            raise ValueError(f"factor must be 2, 4, 8 or 16, got {self.factor}")
        for name, ch in (("enc_channels", self.enc_channels), ("dec_channels", self.dec_channels)):
            if not ch or 2 ** (len(ch) - 1) > self.factor:
                raise ValueError(
                    f"{name} needs 1..{int(math.log2(self.factor)) + 1} widths, got {ch}"
                )
        if self.temporal_factor < 1:
            raise ValueError("temporal_factor must be >= 1")

    @property
    def num_codes(self) -> int:
        return math.prod(self.levels)

    def build(self) -> VisualTokenizer:
        return VisualTokenizer(self)


def _norm(c: int, groups: int) -> nn.Module:
    return nn.GroupNorm(math.gcd(groups, c), c) if groups else nn.Identity()


class ResBlock(nn.Module):
    def __init__(self, c: int, groups: int) -> None:
        super().__init__()
        self.body = nn.Sequential(
            _norm(c, groups),
            nn.SiLU(),
            nn.Conv2d(c, c, 3, padding=1),
            _norm(c, groups),
            nn.SiLU(),
            nn.Conv2d(c, c, 3, padding=1),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


class Encoder(nn.Module):
    """Pixels -> features at latent resolution (before the projection to FSQ channels)."""

    def __init__(self, cfg: VisualTokenizerConfig) -> None:
        super().__init__()
        ch = cfg.enc_channels
        self.stem_factor = cfg.factor // 2 ** (len(ch) - 1)
        layers: list[nn.Module] = [nn.Conv2d(3 * self.stem_factor**2, ch[0], 3, padding=1)]
        for i, c in enumerate(ch):
            if i:  # stride-2 stage: a 2x2 unshuffle + 1x1 conv is cheaper than a strided 3x3
                layers += [nn.PixelUnshuffle(2), nn.Conv2d(4 * ch[i - 1], c, 1)]
            layers += [ResBlock(c, cfg.norm_groups) for _ in range(cfg.enc_blocks)]
        layers += [_norm(ch[-1], cfg.norm_groups), nn.SiLU()]
        self.trunk = nn.Sequential(*layers)
        self.factor = cfg.factor
        self.colour = nn.Conv2d(3, ch[-1], 1) if cfg.colour_path else None

    def forward(self, x: Tensor) -> Tensor:
        h = self.trunk(F.pixel_unshuffle(x, self.stem_factor) if self.stem_factor > 1 else x)
        if self.colour is not None:
            h = h + self.colour(F.avg_pool2d(x, self.factor))
        return h


class Decoder(nn.Module):
    """Normalised FSQ codes -> pixels; ``extra`` is added to the input features (video)."""

    def __init__(self, cfg: VisualTokenizerConfig) -> None:
        super().__init__()
        ch, g = cfg.dec_channels, cfg.norm_groups
        self.head_factor = cfg.factor // 2 ** (len(ch) - 1)
        self.inp = nn.Conv2d(len(cfg.levels), ch[0], 3, padding=1)
        layers: list[nn.Module] = []
        for i, c in enumerate(ch):
            if i:
                layers += [nn.Conv2d(ch[i - 1], 4 * c, 3, padding=1), nn.PixelShuffle(2)]
            layers += [ResBlock(c, g) for _ in range(cfg.dec_blocks)]
        to_pixels = nn.Conv2d(ch[-1], 3 * self.head_factor**2, 3, padding=1)
        layers += [_norm(ch[-1], g), nn.SiLU(), to_pixels]
        self.trunk = nn.Sequential(*layers)
        self.factor = cfg.factor
        self.colour = nn.Conv2d(len(cfg.levels), 3, 1) if cfg.colour_path else None
        if self.colour is not None:  # start as the colour path alone (module doc)
            nn.init.zeros_(to_pixels.weight)
            nn.init.zeros_(cast(Tensor, to_pixels.bias))  # a Conv2d has a bias unless told not

    def forward(self, q: Tensor, extra: Tensor | None = None) -> Tensor:
        h = self.inp(q)
        if extra is not None:
            h = h + extra
        y = self.trunk(h)
        if self.head_factor > 1:
            y = F.pixel_shuffle(y, self.head_factor)
        if self.colour is not None:
            y = y + F.interpolate(
                self.colour(q), scale_factor=self.factor, mode="bilinear", align_corners=False
            )
        return y


class VisualTokenizer(nn.Module):
    def __init__(self, cfg: VisualTokenizerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fsq = FSQ(cfg.levels)
        self.encoder = Encoder(cfg)
        self.to_latent = nn.Conv2d(cfg.enc_channels[-1], len(cfg.levels), 1)
        self.decoder = Decoder(cfg)
        tf, c, d = cfg.temporal_factor, cfg.enc_channels[-1], len(cfg.levels)
        # Video: causal merge of a group's features (init: mean) and per-offset decoder inputs.
        self.t_merge = nn.Conv2d(tf * c, c, 1)
        with torch.no_grad():
            self.t_merge.weight.copy_(torch.eye(c).repeat(1, tf).div(tf).view(c, tf * c, 1, 1))
            cast(Tensor, self.t_merge.bias).zero_()
        self.t_dec = nn.Conv2d(2 * d, tf * cfg.dec_channels[0], 1)
        nn.init.zeros_(self.t_dec.weight)
        nn.init.zeros_(cast(Tensor, self.t_dec.bias))

    @property
    def num_codes(self) -> int:
        return self.fsq.num_codes

    def _check(self, x: Tensor) -> None:
        f = self.cfg.factor
        if x.shape[-3] != 3 or x.shape[-1] % f or x.shape[-2] % f:
            raise ValueError(
                f"images need 3 channels and H, W multiples of {f}, got {tuple(x.shape)}"
            )

    # --- images ------------------------------------------------------------------------
    def latents(self, x: Tensor) -> Tensor:
        """Images -> continuous latents ``[B, d, h, w]`` before FSQ."""
        self._check(x)
        return self.to_latent(self.encoder(x))

    def quantize(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """Images -> (normalised codes [B, d, h, w] with straight-through grads, indices)."""
        return self.fsq(self.latents(x))

    @torch.no_grad()
    def encode(self, images: Tensor) -> Tensor:
        """``[B, 3, H, W]`` in [-1, 1] -> LongTensor ``[B, H/f, W/f]``."""
        return self.quantize(images)[1]

    def decode_codes(self, q: Tensor) -> Tensor:
        return self.decoder(q)

    @torch.no_grad()
    def decode(self, indices: Tensor) -> Tensor:
        """LongTensor ``[B, h, w]`` -> images ``[B, 3, h f, w f]`` in [-1, 1] (clamped)."""
        return self.decoder(self.fsq.indices_to_codes(indices)).clamp(-1, 1)

    def loss(self, y: Tensor, x: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        c = self.cfg
        d = y.float() - x.float()
        l1, l2 = d.abs().mean(), d.pow(2).mean()
        total = c.l1 * l1 + c.l2 * l2
        m = {"l1": l1.detach(), "l2": l2.detach()}
        if c.grad:
            g = (d[..., 1:, :] - d[..., :-1, :]).abs().mean() + (
                d[..., 1:] - d[..., :-1]
            ).abs().mean()
            total = total + c.grad * g
            m["grad"] = g.detach()
        with torch.no_grad():  # PSNR on [0, 1] of the batch, the number the monitors plot
            m["psnr"] = 10 * torch.log10(
                4 / y.detach().float().clamp(-1, 1).sub(x.float()).pow(2).mean()
            )
        return total, m

    def forward(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One training step's loss: ``loss, metrics = model(images)``, images in [-1, 1]."""
        z = self.latents(images)
        q, idx = self.fsq(z)
        loss, m = self.loss(self.decoder(q), images)
        if self.cfg.entropy:
            h = self.fsq.marginal_entropy(z)
            loss = loss + self.cfg.entropy * (1 - h).mean()
            m["level_entropy"] = h.detach().mean()
        with torch.no_grad():
            m["code_fraction"] = torch.tensor(idx.unique().numel() / self.num_codes)
        return loss, m

    # --- video -------------------------------------------------------------------------
    def num_latent_frames(self, t: int) -> int:
        return 1 + math.ceil((t - 1) / self.cfg.temporal_factor)

    def video_latents(self, frames: Tensor) -> Tensor:
        """``[B, T, 3, H, W]`` -> continuous latents ``[B, T_lat, d, h, w]`` before FSQ."""
        b, t = frames.shape[:2]
        self._check(frames)
        tf = self.cfg.temporal_factor
        feats = self.encoder(frames.flatten(0, 1))
        feats = feats.view(b, t, *feats.shape[1:])
        lat = [feats[:, 0]]
        for s in range(1, t, tf):  # group s .. s+tf-1; pad a short group with its own last frame
            grp = [feats[:, min(k, t - 1)] for k in range(s, s + tf)]
            lat.append(self.t_merge(torch.cat(grp, 1)))
        z = self.to_latent(torch.stack(lat, 1).flatten(0, 1))
        return z.view(b, len(lat), *z.shape[1:])

    def quantize_video(self, frames: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, T, 3, H, W]`` -> (codes ``[B, T_lat, d, h, w]``, indices ``[B, T_lat, h, w]``)."""
        return self.fsq(self.video_latents(frames), channel_dim=2)

    @torch.no_grad()
    def encode_video(self, frames: Tensor) -> Tensor:
        return self.quantize_video(frames)[1]

    def decode_video_codes(self, q: Tensor, num_frames: int | None = None) -> Tensor:
        b, tl = q.shape[:2]
        tf, c0 = self.cfg.temporal_factor, self.cfg.dec_channels[0]
        out = [self.decoder(q[:, 0])]
        for j in range(1, tl):
            extra = self.t_dec(torch.cat([q[:, j - 1], q[:, j]], 1)).view(b, tf, c0, *q.shape[-2:])
            qj = q[:, j].unsqueeze(1).expand(-1, tf, -1, -1, -1).flatten(0, 1)
            out.append(self.decoder(qj, extra.flatten(0, 1)).view(b, tf, 3, *out[0].shape[-2:]))
        video = torch.cat([out[0].unsqueeze(1)] + out[1:], 1)
        return video[:, :num_frames] if num_frames is not None else video

    @torch.no_grad()
    def decode_video(self, indices: Tensor, num_frames: int | None = None) -> Tensor:
        """``[B, T_lat, h, w]`` -> ``[B, T, 3, H, W]``; T = 1 + (T_lat-1) * temporal_factor unless
        ``num_frames`` (the original count) trims the padding of a short last group."""
        q = self.fsq.indices_to_codes(indices, channel_dim=2)
        return self.decode_video_codes(q, num_frames).clamp(-1, 1)

    def forward_video(self, frames: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        q, _ = self.quantize_video(frames)
        y = self.decode_video_codes(q, frames.shape[1])
        return self.loss(y.flatten(0, 1), frames.flatten(0, 1))


# --- presets -------------------------------------------------------------------------------
def vtok_debug() -> VisualTokenizerConfig:
    """Tiny, for tests: factor 4, 1,000 codes, a few thousand parameters."""
    return VisualTokenizerConfig(
        levels=[8, 5, 5, 5],
        factor=4,
        enc_channels=[16],
        enc_blocks=1,
        dec_channels=[16],
        dec_blocks=1,
        norm_groups=4,
        temporal_factor=2,
    )


def vtok_cpu() -> VisualTokenizerConfig:
    """The CPU preset (docs/visual_tokenizer.md): factor 4, 1,000 codes, trunks at latent resolution."""
    return VisualTokenizerConfig(
        levels=[8, 5, 5, 5],
        factor=4,
        enc_channels=[128],
        enc_blocks=2,
        dec_channels=[192],
        dec_blocks=3,
        norm_groups=8,
        temporal_factor=4,
    )
