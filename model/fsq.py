"""Finite scalar quantization (Mentzer et al. 2023, "Finite Scalar Quantization: VQ-VAE Made Simple").

Each of ``d = len(levels)`` latent channels is bounded to a small interval and rounded to one of
``levels[i]`` integers; the code of a position is the tuple of its ``d`` integers, so there are
``prod(levels)`` codes and the implicit codebook is the grid itself.

Design choices:
- No codebook, no commitment loss, no EMA, no re-seeding: every grid point is reachable by
  construction, which is why FSQ keeps near-full code use where VQ collapses.
- Bound: ``tanh(z + shift) * half - offset`` with ``half = (L - 1) * (1 - eps) / 2``. For odd L the
  rounded values are ``-(L-1)/2 .. (L-1)/2``; an even L has no integer centre, so the interval is
  moved by ``offset = 0.5`` (values ``-L/2 .. L/2 - 1``) and ``shift = atanh(offset / half)`` keeps
  ``z = 0`` on a grid point. ``eps`` keeps tanh's open interval from touching a rounding boundary
  it could never reach.
- Rounding uses a straight-through estimator: forward is ``round``, backward is the identity of
  the bounded value (the gradient of tanh still flows).
- Quantized values are returned normalised to about ``[-1, 1]`` (divided by ``L // 2``), the scale
  the decoder sees regardless of the level count.
- Index = mixed-radix number with digit i in ``0 .. levels[i]-1`` and the first level as the
  least significant digit, matching the reference implementation (so [8,5,5,5] packs 8 first).
- Computations are float32 even under autocast: a bf16 tanh/round can put a value in the wrong bin.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch
from torch import Tensor, nn


class FSQ(nn.Module):
    """Quantize the channel dimension ``dim`` (default 1, i.e. NCHW latents) of a tensor."""

    # The buffers registered in __init__, declared so the type checker knows they are tensors.
    _levels: Tensor
    _basis: Tensor
    _half: Tensor
    _offset: Tensor
    _shift: Tensor
    _width: Tensor

    def __init__(self, levels: Sequence[int], eps: float = 1e-3) -> None:
        super().__init__()
        levels = [int(level) for level in levels]
        if not levels or min(levels) < 2:
            raise ValueError(f"FSQ levels must be integers >= 2, got {levels}")
        self.levels_list = levels
        self.eps = eps
        levels_float = torch.tensor(levels, dtype=torch.float32)
        basis = torch.cumprod(torch.tensor([1] + levels[:-1], dtype=torch.long), 0)
        half = (levels_float - 1) * (1 - eps) / 2
        offset = torch.where(levels_float % 2 == 0, 0.5, 0.0)
        # Buffers, so .to(device) moves them; persistent=False keeps them out of checkpoints
        # (they follow from the levels, which the config stores).
        self.register_buffer("_levels", levels_float, persistent=False)
        self.register_buffer("_basis", basis, persistent=False)
        self.register_buffer("_half", half, persistent=False)
        self.register_buffer("_offset", offset, persistent=False)
        self.register_buffer("_shift", torch.atanh(offset / half), persistent=False)
        self.register_buffer("_width", torch.floor(levels_float / 2), persistent=False)

    @property
    def dim(self) -> int:
        return len(self.levels_list)

    @property
    def num_codes(self) -> int:
        return math.prod(self.levels_list)

    @property
    def bits(self) -> float:
        return math.log2(self.num_codes)

    # --- shapes: the level axis is moved last internally ---------------------------------
    def _view(self, t: Tensor, channel_dim: int) -> Tensor:
        if t.shape[channel_dim] != self.dim:
            raise ValueError(
                f"expected {self.dim} channels on dim {channel_dim}, got shape {tuple(t.shape)}"
            )
        return t.movedim(channel_dim, -1)

    def bound(self, z: Tensor) -> Tensor:
        """Map unbounded latents (levels last) into the rounding interval of each level."""
        return torch.tanh(z + self._shift) * self._half - self._offset

    def forward(self, z: Tensor, channel_dim: int = 1) -> tuple[Tensor, Tensor]:
        """Return (quantized latents normalised to ~[-1, 1], same shape as z; integer indices)."""
        dtype = z.dtype
        flat_latents = self._view(z.float(), channel_dim)
        bounded = self.bound(flat_latents)
        quantized = bounded + (torch.round(bounded) - bounded).detach()  # straight-through rounding
        indices = self._digits_to_indices(torch.round(bounded).detach())
        return (quantized / self._width).movedim(-1, channel_dim).to(dtype), indices

    def marginal_entropy(self, z: Tensor, channel_dim: int = 1, tau: float = 0.5) -> Tensor:
        """Normalised entropy (0..1) of each level's soft marginal over a batch of latents ``z``.

        Soft assignment of a bounded value b to grid value v: ``softmax(-(b - v)^2 / tau)``,
        averaged over all positions, so the entropy is differentiable. A bonus on it keeps every
        level of every channel in use (MAGVIT-v2's batch-entropy term, without the per-sample
        sharpness part that deterministic rounding makes unnecessary); it also pulls latents out
        of tanh's flat tails, where they lose gradient and information.
        """
        bounded = self.bound(self._view(z.float(), channel_dim)).reshape(-1, self.dim)  # [N, d]
        lmax = int(self._levels.max())
        grid = (
            torch.arange(lmax, device=z.device, dtype=torch.float32) - self._width[:, None]
        )  # [d, Lmax]
        valid = torch.arange(lmax, device=z.device)[None] < self._levels[:, None]
        logits = (-((bounded[:, :, None] - grid[None]) ** 2) / tau).masked_fill(
            ~valid[None], float("-inf")
        )
        marginal = logits.softmax(-1).mean(0)  # [d, Lmax]
        entropy = -(marginal * marginal.clamp_min(1e-12).log()).sum(-1)
        return entropy / self._levels.log()

    # --- codes <-> indices ---------------------------------------------------------------
    def _digits_to_indices(self, rounded: Tensor) -> Tensor:
        # Odd L rounds to -(L-1)/2..(L-1)/2, even L to -L/2..L/2-1: + L//2 gives 0..L-1 for both.
        digits = (rounded + self._width).long()
        return (digits * self._basis).sum(-1)

    def codes_to_indices(self, codes: Tensor, channel_dim: int = 1) -> Tensor:
        """Normalised quantized codes (as returned by forward) -> integer indices."""
        flat_codes = self._view(codes.float(), channel_dim)
        return self._digits_to_indices(torch.round(flat_codes * self._width))

    def indices_to_codes(self, indices: Tensor, channel_dim: int = 1) -> Tensor:
        """Integer indices -> normalised codes; the level axis is inserted at ``channel_dim``."""
        if indices.dtype.is_floating_point:
            raise TypeError("indices must be an integer tensor")
        if indices.numel() and (int(indices.min()) < 0 or int(indices.max()) >= self.num_codes):
            raise ValueError(f"indices outside 0..{self.num_codes - 1}")
        digits = (indices.long().unsqueeze(-1) // self._basis) % self._levels.long()
        codes = (digits.float() - self._width) / self._width
        return codes.movedim(-1, channel_dim)
