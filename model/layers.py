"""Small building blocks: RMSNorm, the SwiGLU feed-forward, and modality-routed FFNs (MoT).

Design choices:
- No biases anywhere; RMSNorm computes in float32 and casts back (bf16 sums of squares lose
  the small-norm tail that QK-norm and the final norm exist to control).
- SwiGLU hidden size defaults to 8/3 * dim rounded up to ``multiple_of`` (Llama), so the
  parameter count matches a 4 * dim GELU MLP.
- Mixture of transformers, feed-forward part only: ``modality_groups[m]`` names the FFN that
  tokens of ``Modality`` m use (e.g. ``[0, 0, 1, 1, 1]``: text+code share one, image, video and
  structure share another). Routing is by the modality id of the *input* token, so it is
  known at generation time; there is no router and no auxiliary loss. Every group's FFN runs
  every step (on zero rows if no token of it is present), so every parameter always gets a
  gradient: DeepSpeed ZeRO-3 and DDP never see an unused parameter.
- Every FFN takes ``(x, modality)`` and returns ``(y, stats)`` (stats is None except for MoE),
  so a block does not care which kind it holds.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import cast

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data.vocab import Modality

NUM_MODALITIES = len(Modality)


@dataclass(kw_only=True)
class FFNConfig:
    hidden_dim: int = 0  # 0: 8/3 * dim rounded up to multiple_of
    multiple_of: int = 64
    # Mixture of transformers: FFN index per Modality id (TEXT, CODE, IMAGE, VIDEO, STRUCTURE).
    # Empty: one FFN shared by all modalities.
    modality_groups: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.modality_groups = [int(group) for group in self.modality_groups]
        groups = self.modality_groups
        if groups and (
            len(groups) != NUM_MODALITIES
            or min(groups) < 0
            or sorted(set(groups)) != list(range(max(groups) + 1))
        ):
            raise ValueError(
                f"model.ffn.modality_groups needs one FFN index per modality ({NUM_MODALITIES}), "
                f"using every index 0..max, got {groups}"
            )

    def resolved_hidden_dim(self, dim: int) -> int:
        if self.hidden_dim:
            return self.hidden_dim
        hidden = int(8 * dim / 3)
        return self.multiple_of * ((hidden + self.multiple_of - 1) // self.multiple_of)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float = 1e-5) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: Tensor) -> Tensor:
        x_float = x.float()
        x_float = x_float * torch.rsqrt(x_float.pow(2).mean(-1, keepdim=True) + self.eps)
        return (x_float * self.weight.float()).to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


class SwiGLU(nn.Module):
    """w2(silu(w1 x) * w3 x)."""

    def __init__(self, dim: int, hidden_dim: int) -> None:
        super().__init__()
        self.w1 = nn.Linear(dim, hidden_dim, bias=False)
        self.w3 = nn.Linear(dim, hidden_dim, bias=False)
        self.w2 = nn.Linear(hidden_dim, dim, bias=False)

    def forward(self, x: Tensor) -> Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))

    def init_weights(self, std: float, out_std: float) -> None:
        for projection in (self.w1, self.w3):
            nn.init.trunc_normal_(projection.weight, std=std, a=-3 * std, b=3 * std)
        nn.init.trunc_normal_(self.w2.weight, std=out_std, a=-3 * out_std, b=3 * out_std)


class FeedForward(nn.Module):
    """The dense FFN: one SwiGLU for every token."""

    def __init__(self, dim: int, cfg: FFNConfig) -> None:
        super().__init__()
        self.mlp = SwiGLU(dim, cfg.resolved_hidden_dim(dim))

    def forward(self, x: Tensor, modality: Tensor | None = None) -> tuple[Tensor, None]:
        return self.mlp(x), None

    def init_weights(self, std: float, out_std: float) -> None:
        self.mlp.init_weights(std, out_std)


class ModalityFFN(nn.Module):
    """Mixture of transformers (FFN only): one SwiGLU per modality group, routed by modality id."""

    def __init__(self, dim: int, cfg: FFNConfig) -> None:
        super().__init__()
        hidden = cfg.resolved_hidden_dim(dim)
        self.experts = nn.ModuleList(
            SwiGLU(dim, hidden) for _ in range(max(cfg.modality_groups) + 1)
        )
        # A plain tuple, not a buffer: a buffer built on the meta device would come back as garbage.
        self.groups = tuple(cfg.modality_groups)
        self._table: dict[torch.device, Tensor] = {}

    def forward(self, x: Tensor, modality: Tensor | None = None) -> tuple[Tensor, None]:
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        if modality is None:
            modality = torch.zeros(flat.shape[0], dtype=torch.long, device=x.device)
        group = self.group_of_table(x.device)[modality.reshape(-1)]
        out = torch.zeros_like(flat)
        for group_id, expert in enumerate(self.experts):
            rows = (group == group_id).nonzero().squeeze(1)
            out = out.index_copy(0, rows, expert(flat.index_select(0, rows)))
        return out.reshape(shape), None

    def group_of_table(self, device: torch.device) -> Tensor:
        if device not in self._table:
            self._table[device] = torch.tensor(self.groups, dtype=torch.long, device=device)
        return self._table[device]

    def init_weights(self, std: float, out_std: float) -> None:
        for expert in cast("list[SwiGLU]", self.experts):
            expert.init_weights(std, out_std)
