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
    # Each code from its own patch only: the encoder's convs are 1x1 and its norms per position
    # (a 3x3 conv or a GroupNorm lets a code see its neighbours, or the whole image). A language
    # model reads codes in raster order, so codes that already carry what lies below or to the
    # right of them hand it the picture before it is drawn: it learns to read those hints instead
    # of the caption, and cannot draw without them (docs/visual_tokenizer.md, "Local codes").
    local_encoder: bool = False
    colour_path: bool = True  # mean-colour skip around both trunks (see module doc)
    temporal_factor: int = 4  # frames per latent frame after the first (video)
    l1: float = 1.0
    l2: float = 1.0
    grad: float = 0.0  # weight of the finite-difference (edge) L1 term
    entropy: float = 0.0  # weight of the code-use bonus (FSQ.marginal_entropy)

    def __post_init__(self) -> None:
        self.levels = [int(value) for value in self.levels]
        self.enc_channels = [int(value) for value in self.enc_channels]
        self.dec_channels = [int(value) for value in self.dec_channels]
        if self.factor not in (2, 4, 8, 16):
            raise ValueError(f"factor must be 2, 4, 8 or 16, got {self.factor}")
        for name, widths in (
            ("enc_channels", self.enc_channels),
            ("dec_channels", self.dec_channels),
        ):
            if not widths or 2 ** (len(widths) - 1) > self.factor:
                raise ValueError(
                    f"{name} needs 1..{int(math.log2(self.factor)) + 1} widths, got {widths}"
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


class ChannelNorm(nn.Module):
    """LayerNorm over the channels of each position alone (a GroupNorm pools the whole map)."""

    def __init__(self, c: int) -> None:
        super().__init__()
        self.norm = nn.LayerNorm(c)

    def forward(self, x: Tensor) -> Tensor:
        return self.norm(x.permute(0, 2, 3, 1)).permute(0, 3, 1, 2)


def _encoder_norm(c: int, cfg: VisualTokenizerConfig) -> nn.Module:
    return ChannelNorm(c) if cfg.local_encoder else _norm(c, cfg.norm_groups)


class ResBlock(nn.Module):
    def __init__(self, c: int, groups: int, *, kernel: int = 3, norm=None) -> None:
        super().__init__()
        make_norm = norm or (lambda width: _norm(width, groups))
        self.body = nn.Sequential(
            make_norm(c),
            nn.SiLU(),
            nn.Conv2d(c, c, kernel, padding=kernel // 2),
            make_norm(c),
            nn.SiLU(),
            nn.Conv2d(c, c, kernel, padding=kernel // 2),
        )

    def forward(self, x: Tensor) -> Tensor:
        return x + self.body(x)


class Encoder(nn.Module):
    """Pixels -> features at latent resolution (before the projection to FSQ channels)."""

    def __init__(self, cfg: VisualTokenizerConfig) -> None:
        super().__init__()
        widths = cfg.enc_channels
        self.stem_factor = cfg.factor // 2 ** (len(widths) - 1)
        kernel = 1 if cfg.local_encoder else 3
        norm = lambda width: _encoder_norm(width, cfg)  # noqa: E731
        layers: list[nn.Module] = [
            nn.Conv2d(3 * self.stem_factor**2, widths[0], kernel, padding=kernel // 2)
        ]
        for stage, width in enumerate(widths):
            if stage:  # stride-2 stage: a 2x2 unshuffle + 1x1 conv is cheaper than a strided 3x3
                layers += [nn.PixelUnshuffle(2), nn.Conv2d(4 * widths[stage - 1], width, 1)]
            layers += [
                ResBlock(width, cfg.norm_groups, kernel=kernel, norm=norm)
                for _ in range(cfg.enc_blocks)
            ]
        layers += [norm(widths[-1]), nn.SiLU()]
        self.trunk = nn.Sequential(*layers)
        self.factor = cfg.factor
        self.colour = nn.Conv2d(3, widths[-1], 1) if cfg.colour_path else None

    def forward(self, x: Tensor) -> Tensor:
        features = self.trunk(F.pixel_unshuffle(x, self.stem_factor) if self.stem_factor > 1 else x)
        if self.colour is not None:
            features = features + self.colour(F.avg_pool2d(x, self.factor))
        return features


class Decoder(nn.Module):
    """Normalised FSQ codes -> pixels; ``extra`` is added to the input features (video)."""

    def __init__(self, cfg: VisualTokenizerConfig) -> None:
        super().__init__()
        widths, groups = cfg.dec_channels, cfg.norm_groups
        self.head_factor = cfg.factor // 2 ** (len(widths) - 1)
        self.inp = nn.Conv2d(len(cfg.levels), widths[0], 3, padding=1)
        layers: list[nn.Module] = []
        for stage, width in enumerate(widths):
            if stage:
                layers += [
                    nn.Conv2d(widths[stage - 1], 4 * width, 3, padding=1),
                    nn.PixelShuffle(2),
                ]
            layers += [ResBlock(width, groups) for _ in range(cfg.dec_blocks)]
        to_pixels = nn.Conv2d(widths[-1], 3 * self.head_factor**2, 3, padding=1)
        layers += [_norm(widths[-1], groups), nn.SiLU(), to_pixels]
        self.trunk = nn.Sequential(*layers)
        self.factor = cfg.factor
        self.colour = nn.Conv2d(len(cfg.levels), 3, 1) if cfg.colour_path else None
        if self.colour is not None:  # start as the colour path alone (module doc)
            nn.init.zeros_(to_pixels.weight)
            nn.init.zeros_(cast(Tensor, to_pixels.bias))  # a Conv2d has a bias unless told not

    def forward(self, q: Tensor, extra: Tensor | None = None) -> Tensor:
        features = self.inp(q)
        if extra is not None:
            features = features + extra
        pixels = self.trunk(features)
        if self.head_factor > 1:
            pixels = F.pixel_shuffle(pixels, self.head_factor)
        if self.colour is not None:
            pixels = pixels + F.interpolate(
                self.colour(q), scale_factor=self.factor, mode="bilinear", align_corners=False
            )
        return pixels


class VisualTokenizer(nn.Module):
    def __init__(self, cfg: VisualTokenizerConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.fsq = FSQ(cfg.levels)
        self.encoder = Encoder(cfg)
        self.to_latent = nn.Conv2d(cfg.enc_channels[-1], len(cfg.levels), 1)
        self.decoder = Decoder(cfg)
        group_size, enc_width, code_dim = cfg.temporal_factor, cfg.enc_channels[-1], len(cfg.levels)
        # Video: causal merge of a group's features (init: mean) and per-offset decoder inputs.
        self.t_merge = nn.Conv2d(group_size * enc_width, enc_width, 1)
        with torch.no_grad():
            self.t_merge.weight.copy_(
                torch.eye(enc_width)
                .repeat(1, group_size)
                .div(group_size)
                .view(enc_width, group_size * enc_width, 1, 1)
            )
            cast(Tensor, self.t_merge.bias).zero_()
        self.t_dec = nn.Conv2d(2 * code_dim, group_size * cfg.dec_channels[0], 1)
        nn.init.zeros_(self.t_dec.weight)
        nn.init.zeros_(cast(Tensor, self.t_dec.bias))

    @property
    def num_codes(self) -> int:
        return self.fsq.num_codes

    def _check(self, x: Tensor) -> None:
        factor = self.cfg.factor
        if x.shape[-3] != 3 or x.shape[-1] % factor or x.shape[-2] % factor:
            raise ValueError(
                f"images need 3 channels and H, W multiples of {factor}, got {tuple(x.shape)}"
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
        cfg = self.cfg
        diff = y.float() - x.float()
        l1_loss, l2_loss = diff.abs().mean(), diff.pow(2).mean()
        total = cfg.l1 * l1_loss + cfg.l2 * l2_loss
        metrics = {"l1": l1_loss.detach(), "l2": l2_loss.detach()}
        if cfg.grad:
            grad_loss = (diff[..., 1:, :] - diff[..., :-1, :]).abs().mean() + (
                diff[..., 1:] - diff[..., :-1]
            ).abs().mean()
            total = total + cfg.grad * grad_loss
            metrics["grad"] = grad_loss.detach()
        with torch.no_grad():  # PSNR on [0, 1] of the batch, the number the monitors plot
            metrics["psnr"] = 10 * torch.log10(
                4 / y.detach().float().clamp(-1, 1).sub(x.float()).pow(2).mean()
            )
        return total, metrics

    def forward(self, images: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        """One training step's loss: ``loss, metrics = model(images)``, images in [-1, 1]."""
        latents = self.latents(images)
        codes, indices = self.fsq(latents)
        loss, metrics = self.loss(self.decoder(codes), images)
        if self.cfg.entropy:
            level_entropy = self.fsq.marginal_entropy(latents)
            loss = loss + self.cfg.entropy * (1 - level_entropy).mean()
            metrics["level_entropy"] = level_entropy.detach().mean()
        with torch.no_grad():
            metrics["code_fraction"] = torch.tensor(indices.unique().numel() / self.num_codes)
        return loss, metrics

    # --- video -------------------------------------------------------------------------
    def num_latent_frames(self, t: int) -> int:
        return 1 + math.ceil((t - 1) / self.cfg.temporal_factor)

    def video_latents(self, frames: Tensor) -> Tensor:
        """``[B, T, 3, H, W]`` -> continuous latents ``[B, T_lat, d, h, w]`` before FSQ."""
        batch_size, num_frames = frames.shape[:2]
        self._check(frames)
        group_size = self.cfg.temporal_factor
        feats = self.encoder(frames.flatten(0, 1))
        feats = feats.view(batch_size, num_frames, *feats.shape[1:])
        latent_frames = [feats[:, 0]]
        # frames group_start .. group_start + group_size - 1; a short last group is padded with
        # its own last frame
        for group_start in range(1, num_frames, group_size):
            group = [
                feats[:, min(frame, num_frames - 1)]
                for frame in range(group_start, group_start + group_size)
            ]
            latent_frames.append(self.t_merge(torch.cat(group, 1)))
        latents = self.to_latent(torch.stack(latent_frames, 1).flatten(0, 1))
        return latents.view(batch_size, len(latent_frames), *latents.shape[1:])

    def quantize_video(self, frames: Tensor) -> tuple[Tensor, Tensor]:
        """``[B, T, 3, H, W]`` -> (codes ``[B, T_lat, d, h, w]``, indices ``[B, T_lat, h, w]``)."""
        return self.fsq(self.video_latents(frames), channel_dim=2)

    @torch.no_grad()
    def encode_video(self, frames: Tensor) -> Tensor:
        return self.quantize_video(frames)[1]

    def decode_video_codes(self, q: Tensor, num_frames: int | None = None) -> Tensor:
        batch_size, num_latent = q.shape[:2]
        group_size, dec_width = self.cfg.temporal_factor, self.cfg.dec_channels[0]
        out = [self.decoder(q[:, 0])]
        for latent in range(1, num_latent):
            extra = self.t_dec(torch.cat([q[:, latent - 1], q[:, latent]], 1)).view(
                batch_size, group_size, dec_width, *q.shape[-2:]
            )
            latent_codes = (
                q[:, latent].unsqueeze(1).expand(-1, group_size, -1, -1, -1).flatten(0, 1)
            )
            out.append(
                self.decoder(latent_codes, extra.flatten(0, 1)).view(
                    batch_size, group_size, 3, *out[0].shape[-2:]
                )
            )
        video = torch.cat([out[0].unsqueeze(1)] + out[1:], 1)
        return video[:, :num_frames] if num_frames is not None else video

    @torch.no_grad()
    def decode_video(self, indices: Tensor, num_frames: int | None = None) -> Tensor:
        """``[B, T_lat, h, w]`` -> ``[B, T, 3, H, W]``; T = 1 + (T_lat-1) * temporal_factor unless
        ``num_frames`` (the original count) trims the padding of a short last group."""
        codes = self.fsq.indices_to_codes(indices, channel_dim=2)
        return self.decode_video_codes(codes, num_frames).clamp(-1, 1)

    def forward_video(self, frames: Tensor) -> tuple[Tensor, dict[str, Tensor]]:
        codes, _ = self.quantize_video(frames)
        recon = self.decode_video_codes(codes, frames.shape[1])
        return self.loss(recon.flatten(0, 1), frames.flatten(0, 1))


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
