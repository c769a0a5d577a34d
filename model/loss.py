"""The language-model loss: chunked cross-entropy over the full vocabulary, with monitors.

Design choices:
- Labels are already shifted: ``labels[b, i]`` is the token predicted at position i (-100 to
  ignore). Every position goes through the output head and an ignored one is weighted 0: picking
  the label positions out first (``nonzero``) would make a shape that depends on the data, which
  waits for the device and breaks a compiled graph. The cost is the head's work on the ignored
  positions (padding, and image tokens when bidirectional images leave them unlabelled). Eager
  on the CPU, where nothing waits, only the label positions go through it.
- CE and z-loss are one fused, chunked op (``chunked_linear_cross_entropy``): for each chunk of
  label tokens, logits = h @ W^T are made in the compute dtype and upcast to float32 one chunk
  at a time; log Z, the target logit and the monitors' reductions are read off that chunk, and
  (when a gradient is needed) the chunk's gradient w.r.t. h and W is formed right there and the
  chunk is freed (Liger-style fused linear cross-entropy). Peak memory is one [chunk, V] float32
  block instead of [N, V]; there is no second pass over the logits and no recomputation in
  backward, which only scales the stored gradients by the incoming scalar.
- The differentiable output is the scalar ``mean(CE) + z_coef * mean(logZ^2)`` (PaLM z-loss)
  over the label tokens, a sum weighted per token (``1 / labels`` on a label, 0 elsewhere): the
  count stays on the device; per-token CE and log Z come out detached, for the monitors.
- Per-modality sums and counts (never means) so monitors can reduce them across ranks exactly.
  A label's modality is the modality of the *target* token (``label_modality``, by default the
  next position's ``modality``).
- "Final hidden norm" is the L2 norm of the residual stream before the final RMSNorm (after
  it, the norm is fixed by the norm's weight and says nothing about growth).
- The LM head is a module (``OutputHead``) whose forward *is* the loss: DeepSpeed ZeRO-3 gathers a
  partitioned weight when its module's forward runs, so the weight is never used outside it.
- Logit gap: per label token, mean logit over the visual-code slice minus mean logit over the
  text slice (Chameleon's symptom of modality competition), summed per modality.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from data.vocab import MODALITY_NAMES
from model.layers import NUM_MODALITIES


@dataclass(kw_only=True)
class LossConfig:
    z_loss_coef: float = 1e-5
    chunk_size: int = 1024  # label tokens per CE chunk; 0: unchunked reference path
    ignore_index: int = -100

    def __post_init__(self) -> None:
        for key in ("chunk_size", "z_loss_coef"):
            if getattr(self, key) < 0:
                raise ValueError(f"model.loss.{key} must be >= 0, got {getattr(self, key)}")


class LossResult(NamedTuple):
    """What the model's forward returns. ``loss`` carries the graph; everything else is detached.
    Per-modality tensors are indexed by ``data.vocab.Modality``. A NamedTuple, not a dataclass:
    DeepSpeed ZeRO-3 finds the tensors in a NamedTuple and hooks ``loss`` so that the head's
    partitioned weight is gathered again before its backward (with a dataclass it is not, and
    backward fails)."""

    loss: Tensor  # scalar: ce + z_loss_coef * z_loss + aux_loss
    ce: Tensor  # scalar: mean CE over label tokens
    z_loss: Tensor  # scalar: mean logZ^2 over label tokens
    aux_loss: Tensor  # scalar: MoE losses with their coefficients (0 without MoE)
    num_tokens: Tensor  # scalar long: label tokens
    ce_sum: Tensor  # [M] float: CE summed per modality
    # [M] long: label tokens per modality. The field shadows tuple.count, which nothing here calls.
    count: Tensor  # type: ignore[assignment]
    logz_sum: Tensor  # [M] float: log Z summed per modality
    hidden_norm_sum: Tensor  # [M] float: final hidden norm summed per modality
    logit_gap_sum: Tensor  # [M] float: (mean code logit - mean text logit) summed per modality
    moe_load_balance: Tensor  # scalar: mean over MoE layers (0 without MoE)
    moe_router_z: Tensor  # scalar: mean over MoE layers
    moe_dropped: Tensor  # scalar: assignments dropped by capacity, all layers
    moe_expert_load: Tensor | None = None  # [L_moe, M, E] assignments per layer and modality

    def detach(self) -> LossResult:
        return LossResult._make(
            value.detach() if isinstance(value, Tensor) else value for value in self
        )

    def modality_means(self) -> dict[str, float]:
        """``loss/<modality>`` for modalities present in this batch (syncs; for logging only)."""
        count = self.count.clamp(min=1).float()
        ce_means = (self.ce_sum / count).tolist()
        return {
            f"loss/{name}": ce_means[i]
            for i, name in enumerate(MODALITY_NAMES)
            if int(self.count[i]) > 0
        }


class _ChunkedLinearCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, h, weight, targets, token_scale, z_coef, chunk_size, text_end, visual_start):
        num_tokens, vocab_size = h.shape[0], weight.shape[0]
        need_grad = ctx.needs_input_grad[0] or ctx.needs_input_grad[1]
        ce_per_token = torch.empty(num_tokens, dtype=torch.float32, device=h.device)
        lse = torch.empty_like(ce_per_token)
        gap = torch.zeros_like(ce_per_token)
        grad_h = torch.empty_like(h) if need_grad else None
        grad_w = (
            torch.zeros(weight.shape, dtype=torch.float32, device=h.device) if need_grad else None
        )
        for start in range(0, num_tokens, chunk_size):
            hidden_chunk = h[start : start + chunk_size]
            target_chunk = targets[start : start + chunk_size]
            ce_scale = token_scale[start : start + chunk_size]
            logits = (hidden_chunk @ weight.t()).float()  # [n, V], the only big buffer
            target_logit = logits.gather(1, target_chunk[:, None]).squeeze(1)
            if visual_start < vocab_size and text_end > 0:
                gap[start : start + chunk_size] = logits[:, visual_start:].mean(-1) - logits[
                    :, :text_end
                ].mean(-1)
            # log-sum-exp in place (torch.logsumexp would allocate a second [n, V] buffer):
            # afterwards ``logits`` holds exp(logit - max), then the softmax.
            row_max = logits.amax(dim=-1)
            sumexp = logits.sub_(row_max[:, None]).exp_().sum(-1)
            lse_c = row_max + sumexp.log()
            ce_per_token[start : start + chunk_size] = lse_c - target_logit
            lse[start : start + chunk_size] = lse_c
            if need_grad:
                assert grad_h is not None and grad_w is not None  # allocated when need_grad
                # per token, with s its scale: d/dlogits s * [(lse - logit_t) + z_coef * lse^2]
                #   = s * (1 + 2 z_coef lse) * softmax - s * onehot(t)
                grad_logits = logits.mul_(
                    (ce_scale * (1.0 + 2.0 * z_coef * lse_c) / sumexp)[:, None]
                )
                grad_logits.scatter_add_(1, target_chunk[:, None], -ce_scale[:, None])
                grad_logits = grad_logits.to(h.dtype)
                grad_h[start : start + chunk_size] = grad_logits @ weight
                if hidden_chunk.dtype == torch.float32:
                    grad_w.addmm_(grad_logits.t(), hidden_chunk)  # no [V, D] temporary
                else:
                    grad_w += (grad_logits.t() @ hidden_chunk).float()
            logits = grad_logits = None  # free this chunk before the next one is made
        loss = (token_scale * (ce_per_token + z_coef * lse.pow(2))).sum()
        if grad_w is not None:
            ctx.save_for_backward(grad_h, grad_w.to(weight.dtype))
        ctx.mark_non_differentiable(ce_per_token, lse, gap)
        return loss, ce_per_token, lse, gap

    @staticmethod
    def backward(ctx, grad_loss, *_unused):
        # The gradients were formed in forward; scale them in place (a copy of grad_w would be
        # one more [V, D] buffer at the peak). Hence a second backward must not reuse them.
        if getattr(ctx, "consumed", False):
            raise RuntimeError("chunked_linear_cross_entropy supports a single backward pass")
        ctx.consumed = True
        grad_h, grad_w = ctx.saved_tensors
        return (
            grad_h.mul_(grad_loss.to(grad_h.dtype)),
            grad_w.mul_(grad_loss.to(grad_w.dtype)),
            None,
            None,
            None,
            None,
            None,
            None,
        )


def chunked_linear_cross_entropy(
    h: Tensor,
    weight: Tensor,
    targets: Tensor,
    *,
    z_loss_coef: float = 0.0,
    chunk_size: int = 1024,
    text_end: int = 0,
    visual_start: int | None = None,
    token_scale: Tensor | None = None,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """h [N, D], weight [V, D], targets [N] -> (mean CE + z_coef * mean lse^2, ce [N], lse [N], gap [N]).

    ``token_scale`` [N] float32: each token's weight in the loss (default ``1 / N`` each: the
    mean); a token of weight 0 contributes nothing, to the loss or to the gradients.
    ``chunk_size`` 0 runs the plain, unchunked autograd reference (same results)."""
    num_tokens, vocab_size = h.shape[0], weight.shape[0]
    visual_start = vocab_size if visual_start is None else visual_start
    if token_scale is None:
        token_scale = torch.full(
            (num_tokens,), 1.0 / max(num_tokens, 1), dtype=torch.float32, device=h.device
        )
    if chunk_size <= 0:
        logits = (h @ weight.t()).float()
        lse = torch.logsumexp(logits, -1)
        ce_per_token = F.cross_entropy(logits, targets, reduction="none")
        loss = (token_scale * (ce_per_token + z_loss_coef * lse.pow(2))).sum()
        with torch.no_grad():
            gap = torch.zeros_like(ce_per_token)
            if visual_start < vocab_size and text_end > 0:
                gap = logits[:, visual_start:].mean(-1) - logits[:, :text_end].mean(-1)
        return loss, ce_per_token.detach(), lse.detach(), gap
    return _ChunkedLinearCE.apply(
        h, weight, targets, token_scale, z_loss_coef, chunk_size, text_end, visual_start
    )


def lm_loss(
    final: Tensor,
    residual: Tensor,
    weight: Tensor,
    labels: Tensor,
    label_modality: Tensor,
    cfg: LossConfig,
    *,
    text_end: int,
    visual_start: int,
    moe: dict[str, Tensor] | None = None,
) -> LossResult:
    """final: normed hidden [B, T, D]; residual: pre-norm hidden (for the norm monitor)."""
    dim = final.shape[-1]
    flat = labels.reshape(-1)
    hidden, residual = final.reshape(-1, dim), residual.reshape(-1, dim)
    label_mods = label_modality.reshape(-1).long()
    if final.device.type == "cpu" and not torch.compiler.is_compiling():
        # Eager on the CPU nothing waits for a read-back: only the label positions go through
        # the head (the same values; the compiled tests compare the two ways)
        keep = (flat != cfg.ignore_index).nonzero().squeeze(1)
        flat, hidden, residual, label_mods = (
            tensor.index_select(0, keep) for tensor in (flat, hidden, residual, label_mods)
        )
    # Every position, ignored ones weighted 0 (no nonzero(): no data-dependent shape, no sync)
    is_label = flat != cfg.ignore_index
    num_labels = is_label.sum()
    weight_of = is_label.float()
    token_scale = weight_of / num_labels.clamp(min=1).float()
    targets = torch.where(is_label, flat, torch.zeros_like(flat))
    loss, ce_per_token, lse, gap = chunked_linear_cross_entropy(
        hidden,
        weight,
        targets,
        z_loss_coef=cfg.z_loss_coef,
        chunk_size=cfg.chunk_size,
        text_end=text_end,
        visual_start=visual_start,
        token_scale=token_scale,
    )
    with torch.no_grad():
        hnorm = residual.float().norm(dim=-1)

        def per_mod(x: Tensor) -> Tensor:
            return torch.zeros(NUM_MODALITIES, dtype=torch.float32, device=x.device).index_add_(
                0, label_mods, x.float() * weight_of
            )

        # scatter, not bincount: bincount's length depends on the data (a read-back)
        count = torch.zeros(NUM_MODALITIES, dtype=torch.long, device=flat.device).index_add_(
            0, label_mods, is_label.long()
        )
        ce_mean = (ce_per_token * token_scale).sum()
        z_mean = (lse.pow(2) * token_scale).sum()
    zero = loss.new_zeros(())
    moe = moe or {}
    aux = moe.get("aux_loss", zero)
    return LossResult(
        loss=loss + aux,
        ce=ce_mean,
        z_loss=z_mean,
        aux_loss=aux.detach(),
        num_tokens=num_labels,
        ce_sum=per_mod(ce_per_token),
        count=count,
        logz_sum=per_mod(lse),
        hidden_norm_sum=per_mod(hnorm),
        logit_gap_sum=per_mod(gap),
        moe_load_balance=moe.get("load_balance", zero).detach(),
        moe_router_z=moe.get("router_z", zero).detach(),
        moe_dropped=moe.get("dropped", zero).detach(),
        moe_expert_load=moe.get("expert_load"),
    )


class OutputHead(nn.Module):
    """The untied LM head (state-dict key ``output.weight``, like an nn.Linear). With labels its
    forward returns the LossResult; without, float32 logits (``logits``)."""

    def __init__(
        self, dim: int, vocab_size: int, cfg: LossConfig, *, text_end: int, visual_start: int
    ) -> None:
        super().__init__()
        self.cfg, self.text_end, self.visual_start = cfg, text_end, visual_start
        self.weight = nn.Parameter(torch.empty(vocab_size, dim))

    def forward(
        self,
        final: Tensor,
        residual: Tensor | None = None,
        labels: Tensor | None = None,
        label_modality: Tensor | None = None,
        moe: dict[str, Tensor] | None = None,
    ) -> LossResult | Tensor:
        if labels is None:
            return self.logits(final)
        if residual is None or label_modality is None:
            raise ValueError("a loss needs the pre-norm residual and the labels' modalities")
        return lm_loss(
            final,
            residual,
            self.weight,
            labels,
            label_modality,
            self.cfg,
            text_end=self.text_end,
            visual_start=self.visual_start,
            moe=moe,
        )

    def logits(self, final: Tensor) -> Tensor:
        """Float32 logits [..., V] of final-normed hidden states [..., D]: an evaluation that
        scores a few positions of a long row passes those positions only."""
        return F.linear(final, self.weight).float()
