"""Learned mixture of experts: a token-choice top-k router over SwiGLU experts.

Design choices:
- Softmax router in float32, top-k, the k weights renormalised to sum to 1 (Mixtral/OLMoE);
  ``normalize_top_k=False`` keeps the raw softmax weights (Switch/GShard).
- Load-balance loss (Switch, generalised to top-k): ``E * sum_e f_e * P_e`` with f_e the share of
  the N*k assignments that chose expert e (before dropping) and P_e its mean router probability;
  1.0 when perfectly balanced. Router z-loss (ST-MoE): mean of logsumexp(router logits)^2.
  Both are returned per layer; the model multiplies them by their coefficients.
- Capacity (training only): each expert takes at most ceil(capacity_factor * N * k / E)
  assignments; first choices of all tokens are served before second choices (GShard priority),
  in token order. A dropped assignment contributes zero (the residual stream carries the token)
  and is counted. In eval and generation nothing is dropped, so a token's output never depends on
  the rest of the batch (which is what lets KV-cache decoding equal full recomputation).
- Expert load is counted per modality ([num_modalities, E] assignments), so the monitors can
  see an expert captured by one modality.
- Dispatch is a loop over experts with index_select / index_add: simple and exact; every expert
  runs every step (zero rows if unused) so all parameters always receive a gradient.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import NamedTuple, cast

import torch
from torch import Tensor, nn

from model.layers import NUM_MODALITIES, SwiGLU


@dataclass(kw_only=True)
class MoEConfig:
    num_experts: int = 0  # 0: no MoE (dense or modality-routed FFN)
    top_k: int = 2
    hidden_dim: int = 0  # per expert; 0: the FFN's hidden size
    capacity_factor: float = 1.25  # <= 0: no capacity limit
    normalize_top_k: bool = True
    load_balance_coef: float = 0.01
    router_z_coef: float = 0.001

    def __post_init__(self) -> None:
        if self.num_experts < 0 or (self.num_experts and not 1 <= self.top_k <= self.num_experts):
            raise ValueError(
                f"model.moe.top_k ({self.top_k}) must be in 1..num_experts ({self.num_experts})"
            )

    @property
    def enabled(self) -> bool:
        return self.num_experts > 0


class MoEStats(NamedTuple):  # a NamedTuple so DeepSpeed ZeRO-3 sees its tensors
    load_balance: Tensor  # scalar, differentiable
    router_z: Tensor  # scalar, differentiable
    expert_load: Tensor  # [num_modalities, E] assignments (before dropping), float
    dropped: Tensor  # scalar, assignments dropped by the capacity limit


class MoE(nn.Module):
    def __init__(self, dim: int, hidden_dim: int, cfg: MoEConfig) -> None:
        super().__init__()
        self.cfg = cfg
        self.router = nn.Linear(dim, cfg.num_experts, bias=False)
        self.experts = nn.ModuleList(
            SwiGLU(dim, cfg.hidden_dim or hidden_dim) for _ in range(cfg.num_experts)
        )

    def forward(self, x: Tensor, modality: Tensor | None = None) -> tuple[Tensor, MoEStats]:
        cfg, num_experts, top_k = self.cfg, self.cfg.num_experts, self.cfg.top_k
        shape = x.shape
        flat = x.reshape(-1, shape[-1])
        num_tokens = flat.shape[0]
        logits = self.router(flat).float()  # [N, E]
        probs = logits.softmax(-1)
        top_p, top_e = probs.topk(top_k, dim=-1)  # [N, k]
        if cfg.normalize_top_k:
            top_p = top_p / top_p.sum(-1, keepdim=True)

        # Slot-major order: all first choices, then all second choices, ...
        expert = top_e.t().reshape(-1)  # [k*N]
        weight = top_p.t().reshape(-1)
        token = torch.arange(num_tokens, device=x.device).repeat(top_k)
        keep = torch.ones_like(expert, dtype=torch.bool)
        if self.training and cfg.capacity_factor > 0:
            capacity = math.ceil(cfg.capacity_factor * num_tokens * top_k / num_experts)
            onehot = torch.nn.functional.one_hot(expert, num_experts)
            rank_in_expert = (onehot.cumsum(0) * onehot).sum(-1) - 1
            keep = rank_in_expert < capacity

        out = torch.zeros_like(flat)
        for expert_id, mlp in enumerate(self.experts):
            sel = ((expert == expert_id) & keep).nonzero().squeeze(1)
            tok = token.index_select(0, sel)
            gate = weight.index_select(0, sel)[:, None].to(x.dtype)
            expert_out = mlp(flat.index_select(0, tok)) * gate
            out = out.index_add(0, tok, expert_out)

        counts = torch.bincount(expert, minlength=num_experts).float()
        load_balance = num_experts * ((counts / (num_tokens * top_k)) * probs.mean(0)).sum()
        router_z = torch.logsumexp(logits, -1).pow(2).mean()
        with torch.no_grad():
            mod = (
                modality.reshape(-1)
                if modality is not None
                else torch.zeros(num_tokens, dtype=torch.long, device=x.device)
            )
            mod = mod.repeat(top_k)
            expert_load = torch.bincount(
                mod * num_experts + expert, minlength=NUM_MODALITIES * num_experts
            )
            expert_load = expert_load.float().view(NUM_MODALITIES, num_experts)
            dropped = (~keep).sum().float()
        return out.reshape(shape), MoEStats(load_balance, router_z, expert_load, dropped)

    def init_weights(self, std: float, out_std: float) -> None:
        nn.init.trunc_normal_(self.router.weight, std=std, a=-3 * std, b=3 * std)
        for expert in cast("list[SwiGLU]", self.experts):
            expert.init_weights(std, out_std)
