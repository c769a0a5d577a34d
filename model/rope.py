"""Rotary position embeddings: 1D RoPE and multimodal M-RoPE (t, h, w sections).

Design choices:
- "rotate half" layout (frequency j rotates dims j and j + head_dim/2), as Llama/Qwen in Hugging
  Face do, so a release maps onto a Qwen3-style checkpoint without permuting q/k weights.
- Local/global attention may give the local layers their own base (``local_theta``): the model
  then keeps two tables, each computed once per forward and shared by its layers.
- cos/sin are computed once per forward from the position tensors and shared by every layer;
  the inverse frequencies are recomputed on the fly (head_dim/2 numbers) instead of living in a
  buffer, so a model built on the meta device or under ZeRO-3 init needs no buffer fix-up.
- M-RoPE (Qwen2-VL): the head_dim/2 frequencies are split into contiguous sections; section
  s rotates by position component s of (t, h, w). With t = h = w it is exactly 1D RoPE, so text
  behaves the same whether M-RoPE is on or off (tested).
- ``LayoutTracker`` is the one place that defines the (t, h, w) positions of a token stream, for
  the packer and for generation: outside a visual block t = h = w = p (p counts up by one per
  token); inside a block whose first grid token sits at 1D position s, a token at row r, column c
  of frame f gets (s + f, s + r, s + c), where ``<eol>`` occupies column W of its row and
  ``<frame>`` sits at (s + f, s, s); after the block p resumes at 1 + the largest component used.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch
from torch import Tensor

from data.vocab import Modality, VocabLayout


@dataclass(kw_only=True)
class RopeConfig:
    theta: float = 10_000.0
    # RoPE base of the local layers with local/global attention (``attention.local_window``);
    # ``theta`` stays the global layers'. Gemma 3: local 10k, global 1M. 0: ``theta`` everywhere.
    local_theta: float = 0.0
    # Number of rotary frequencies driven by t, h and w; must sum to head_dim // 2.
    # Empty: plain 1D RoPE from position_ids.
    mrope_sections: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.mrope_sections = [int(section) for section in self.mrope_sections]
        if self.mrope_sections and (len(self.mrope_sections) != 3 or min(self.mrope_sections) < 0):
            raise ValueError(
                f"model.rope.mrope_sections must be 3 non-negative ints (t, h, w), got {self.mrope_sections}"
            )
        if self.theta <= 0:
            raise ValueError(f"model.rope.theta must be positive, got {self.theta}")
        if self.local_theta < 0:
            raise ValueError(
                f"model.rope.local_theta must be >= 0 (0: model.rope.theta), got {self.local_theta}"
            )


class RotaryEmbedding(torch.nn.Module):
    """Turns position ids into (cos, sin) of shape [B, T, head_dim], float32."""

    def __init__(self, head_dim: int, cfg: RopeConfig, *, theta: float | None = None) -> None:
        """``theta``: this table's base when not ``cfg.theta`` (the local layers' table)."""
        super().__init__()
        if head_dim % 2:
            raise ValueError(f"RoPE needs an even head_dim, got {head_dim}")
        if cfg.mrope_sections and sum(cfg.mrope_sections) != head_dim // 2:
            raise ValueError(
                f"model.rope.mrope_sections {cfg.mrope_sections} must sum to head_dim // 2 = {head_dim // 2}"
            )
        self.head_dim = head_dim
        self.theta = theta if theta is not None else cfg.theta
        self.sections = tuple(cfg.mrope_sections)

    def inv_freq(self, device: torch.device) -> Tensor:
        exponent = (
            torch.arange(0, self.head_dim, 2, device=device, dtype=torch.float64) / self.head_dim
        )
        return (1.0 / (self.theta**exponent)).float()

    def forward(
        self, position_ids: Tensor, position_thw: Tensor | None = None
    ) -> tuple[Tensor, Tensor]:
        inv_freq = self.inv_freq(position_ids.device)  # [hd/2]
        if self.sections and position_thw is not None:
            # Pick, per frequency, the position component of its section: [B, T, hd/2].
            # Made on the device (a tensor of the sections copied from the host would make the
            # host wait for the device at every forward)
            which = torch.cat(
                [
                    torch.full((size,), part, dtype=torch.long, device=position_ids.device)
                    for part, size in enumerate(self.sections)
                ]
            )
            pos = position_thw.float().index_select(-1, which)
            angles = pos * inv_freq
        else:
            angles = position_ids.float()[..., None] * inv_freq
        emb = torch.cat([angles, angles], dim=-1)
        return emb.cos(), emb.sin()


def apply_rotary(x: Tensor, cos: Tensor, sin: Tensor) -> Tensor:
    """x: [B, H, T, hd]; cos/sin: [B, T, hd]. Computed in float32, returned in x's dtype."""
    x_float = x.float()
    half = x_float.shape[-1] // 2
    rotated = torch.cat([-x_float[..., half:], x_float[..., :half]], dim=-1)
    out = x_float * cos[:, None] + rotated * sin[:, None]
    return out.to(x.dtype)


class LayoutTracker:
    """Walks one token stream and knows, per token, its (t, h, w) position and modality.

    Push tokens one at a time (generation) or call ``positions`` on a whole document (packing,
    tests). Text ids inherit the last text-like modality (TEXT or CODE: the
    BPE is shared, so only the caller knows which; ``text_modality`` sets the start).
    """

    def __init__(self, layout: VocabLayout, text_modality: int = Modality.TEXT) -> None:
        self.layout = layout
        sid = layout.structure_id
        self.boi, self.eoi, self.eol = sid("<boi>"), sid("<eoi>"), sid("<eol>")
        self.bov, self.eov, self.frame_id = sid("<bov>"), sid("<eov>"), sid("<frame>")
        self.h_first, self.w_first = sid("<h=1>"), sid("<w=1>")
        self.text_modality = int(text_modality)
        self.p = 0  # next 1D position outside a grid
        self.block: str | None = None  # None, "image" or "video"
        self.start: int | None = None  # s: 1D position of the block's first grid token
        self.width = 0
        self.row = self.col = self.frame = 0
        self.max_used = -1

    def _grid_start(self) -> int:
        if self.start is None:
            self.start = self.p
        return self.start

    def push(self, tok: int) -> tuple[tuple[int, int, int], int]:
        """Returns ((t, h, w), modality) of ``tok`` and advances the state."""
        layout = self.layout
        tok = int(tok)
        if tok in (self.boi, self.bov):
            self.block = "image" if tok == self.boi else "video"
            self.start, self.width, self.row, self.col, self.frame = (
                None,
                0,
                0,
                0,
                -1 if tok == self.bov else 0,
            )
            return self._flat(), Modality.STRUCTURE
        if self.block is not None and self.h_first <= tok < self.h_first + layout.max_grid:
            return self._flat(), Modality.STRUCTURE
        if self.block is not None and self.w_first <= tok < self.w_first + layout.max_grid:
            self.width = tok - self.w_first + 1
            return self._flat(), Modality.STRUCTURE
        if tok in (self.eoi, self.eov):
            self.block, self.start = None, None
            self.p = max(self.p, self.max_used + 1)
            return self._flat(), Modality.STRUCTURE
        if self.block is not None and (
            tok == self.frame_id or tok == self.eol or layout.is_code(tok)
        ):
            grid_start = self._grid_start()
            if tok == self.frame_id:
                self.frame, self.row, self.col = self.frame + 1, 0, 0
                return self._grid(grid_start, 0, 0), Modality.STRUCTURE
            if tok == self.eol:
                pos = self._grid(grid_start, self.row, max(self.col, self.width))
                self.row, self.col = self.row + 1, 0
                return pos, Modality.STRUCTURE
            pos = self._grid(grid_start, self.row, self.col)
            self.col += 1
            return pos, Modality.IMAGE if self.block == "image" else Modality.VIDEO
        if layout.structure_offset <= tok < layout.visual_offset or layout.is_code(tok):
            return (
                self._flat(),
                Modality.STRUCTURE if tok < layout.visual_offset else Modality.IMAGE,
            )
        return self._flat(), self.text_modality

    def _flat(self) -> tuple[int, int, int]:
        position = self.p
        self.p += 1
        self.max_used = max(self.max_used, position)
        return (position, position, position)

    def _grid(self, s: int, r: int, c: int) -> tuple[int, int, int]:
        pos = (s + max(self.frame, 0), s + r, s + c)
        self.max_used = max(self.max_used, *pos)
        return pos

    @classmethod
    def positions(cls, ids, layout: VocabLayout) -> Tensor:
        """(t, h, w) positions of one document, [T, 3] long."""
        tracker = cls(layout)
        return torch.tensor(
            [tracker.push(int(token))[0] for token in ids], dtype=torch.long
        ).reshape(-1, 3)
