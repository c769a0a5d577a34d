"""Sequence parallelism, DeepSpeed-Ulysses style, for any attention mask.

The P ranks of a sequence-parallel (SP) group work on the same rows; each holds a contiguous
shard of T/P tokens of them. Everything in the model but attention works token by token, so it
runs on the shard unchanged. Around attention, an all-to-all swaps the shard of the sequence for
a share of the heads: every rank then holds all T tokens of H/P query heads, runs the model's own
attention on them, and a second all-to-all swaps back.

Design choices:
- Mask-agnostic. The swap happens between the projections (with QK-norm and RoPE applied on the
  shard) and the attention core, so the core is the model's own: FlexAttention with its BlockMask
  or SDPA with its dense boolean mask, built once for the whole row (``shard_row``). Documents,
  causality, a sliding window and bidirectional image blocks are therefore exact across shard
  boundaries. DeepSpeed's Hugging Face wrapper (``UlyssesSPAttentionHF``) replaces a Flex mask
  with a plain causal one, which would let packed documents attend to each other; this layer
  never touches the mask.
- The row is prepared whole, then sharded (``shard_row``): positions (1D and the M-RoPE t/h/w
  rows and columns), shifted labels and the labels' modalities come from the whole row (the
  loader makes them; missing ones are derived here exactly as ``Transformer.forward`` would),
  and the mask from the whole row's document and image ids; only then is every per-token tensor
  cut into P contiguous shards.
- GQA: KV heads are split across ranks when P divides them. Otherwise each KV head is repeated
  P / gcd(Hkv, P) times first (to lcm(Hkv, P) heads); that keeps every query head with its own
  KV head after the split (with Hkv < P it is the replication Ulysses needs), and the repeat's
  backward sums the copies' gradients. Query heads and the sequence length must be multiples
  of P (``check_sequence_parallel`` says so by name).
- The all-to-all is an autograd Function whose backward is the same all-to-all on the gradient:
  an equal-split exchange is its own transpose. torch.distributed.nn.functional.all_to_all_single
  does the same with gloo, but torch 2.13 deprecates it in favour of a private module
  (``_functional_collectives``); twelve lines of our own depend on neither.
- Loss (``reduce_loss``): sums and counts all-reduced over the group, never means of means.
  Each rank backpropagates its share (its loss times its share of the group's label tokens):
  the shares add up to the row's loss, so the parameter gradients *summed* over the SP group
  are the single-process gradients. The returned value is the group's loss on every rank.
- Decoding with a KV cache is not sequence-parallel (a cache holds the whole sequence).
"""

from __future__ import annotations

import math

import torch
import torch.distributed as dist
from torch import Tensor

from data.vocab import Modality
from model.attention import AttentionMask, build_attention_mask
from model.loss import LossResult
from model.transformer import Transformer, TransformerConfig, positions_from_doc_ids


def sequence_parallel_refusal(*, n_heads: int, seq_len: int | None, degree: int) -> str | None:
    """Why a model or a row cannot be split over ``degree`` ranks, naming the setting; None if
    it can."""
    if degree < 1:
        return f"the sequence-parallel degree must be >= 1, got {degree}"
    if n_heads % degree:
        return (
            f"sequence parallelism over {degree} ranks needs the query heads "
            f"(model.attention.n_heads = {n_heads}) to be a multiple of {degree}"
        )
    if seq_len is not None and seq_len % degree:
        return (
            f"sequence parallelism over {degree} ranks needs the row length "
            f"({seq_len} tokens, data.seq_len) to be a multiple of {degree}"
        )
    return None


def check_sequence_parallel(*, n_heads: int, seq_len: int | None, degree: int) -> None:
    if why := sequence_parallel_refusal(n_heads=n_heads, seq_len=seq_len, degree=degree):
        raise ValueError(why)


def kv_repeats(n_kv_heads: int, degree: int) -> int:
    """How often each KV head is repeated before the split: 1 when ``degree`` divides the KV
    heads, else degree / gcd (lcm(Hkv, P) heads in all)."""
    return degree // math.gcd(n_kv_heads, degree)


class _AllToAll(torch.autograd.Function):
    """Chunk j of dim 0 goes to rank j; chunk j of the result came from rank j."""

    @staticmethod
    def forward(ctx, chunks: Tensor, group) -> Tensor:
        ctx.group = group
        return _exchange(chunks, group)

    @staticmethod
    def backward(ctx, grad: Tensor):
        return _exchange(grad, ctx.group), None


def _exchange(chunks: Tensor, group) -> Tensor:
    chunks = chunks.contiguous()
    received = torch.empty_like(chunks)
    dist.all_to_all_single(received, chunks, group=group)
    return received


class UlyssesAttention:
    """The two all-to-alls of one SP group; ``Attention`` calls them around its core. A plain
    object, not a module: it adds nothing to the state dict, so checkpoints do not depend on the
    SP degree."""

    def __init__(self, group) -> None:
        self.group = group
        self.degree = dist.get_world_size(group)

    def scatter_heads(self, q: Tensor, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        """q [B, H, T/P, hd], k and v [B, Hkv, T/P, hd] -> [B, H/P, T, hd] and [B, Hkv'/P, T, hd]."""
        check_sequence_parallel(n_heads=q.shape[1], seq_len=None, degree=self.degree)
        repeats = kv_repeats(k.shape[1], self.degree)
        if repeats > 1:
            k, v = k.repeat_interleave(repeats, dim=1), v.repeat_interleave(repeats, dim=1)
        return self._to_heads(q), self._to_heads(k), self._to_heads(v)

    def gather_heads(self, out: Tensor) -> Tensor:
        """[B, H/P, T, hd] -> [B, H, T/P, hd]: each rank's heads back to its own tokens."""
        if self.degree == 1:
            return out
        batch, local_heads, seq_len, head_dim = out.shape
        shard = seq_len // self.degree
        # Chunk j: this rank's heads for the tokens of rank j.
        chunks = out.reshape(batch, local_heads, self.degree, shard, head_dim).permute(
            2, 0, 1, 3, 4
        )
        received = _AllToAll.apply(chunks, self.group)  # chunk j: heads of rank j, my tokens
        return received.transpose(0, 1).reshape(batch, self.degree * local_heads, shard, head_dim)

    def _to_heads(self, x: Tensor) -> Tensor:
        if self.degree == 1:
            return x
        batch, heads, shard, head_dim = x.shape
        local_heads = heads // self.degree
        # Chunk j: the heads rank j will own, for this rank's tokens.
        chunks = x.reshape(batch, self.degree, local_heads, shard, head_dim).transpose(0, 1)
        received = _AllToAll.apply(chunks, self.group)  # chunk j: my heads, tokens of rank j
        return received.permute(1, 2, 0, 3, 4).reshape(
            batch, local_heads, self.degree * shard, head_dim
        )


def apply_sequence_parallel(model: Transformer, group) -> None:
    """Make every attention layer of ``model`` sequence-parallel over ``group`` (None: undo).
    Parameters and the state dict are untouched."""
    layer = None if group is None else UlyssesAttention(group)
    if layer is not None:
        check_sequence_parallel(
            n_heads=model.cfg.attention.n_heads, seq_len=None, degree=layer.degree
        )
    for block in model.blocks():
        block.attention.sequence_parallel = layer


def shard_row(
    batch: dict[str, Tensor], cfg: TransformerConfig, *, rank: int, degree: int
) -> dict[str, Tensor | AttentionMask]:
    """This rank's shard of a batch of whole rows, for ``model(**shard)``.

    Fields the model would derive from the row (modality, positions from document ids, the
    labels' modalities) are derived on the whole row first; the attention mask is built from the
    whole row's document and image ids and passed as ``mask``. Every per-token tensor ([B, T]
    or [B, T, ...]) is then cut to tokens [rank * T/P, (rank + 1) * T/P); anything else (such
    as the count of real tokens) is passed through."""
    input_ids = batch["input_ids"]
    batch_size, seq_len = input_ids.shape
    check_sequence_parallel(n_heads=cfg.attention.n_heads, seq_len=seq_len, degree=degree)
    if not 0 <= rank < degree:
        raise ValueError(f"rank {rank} is outside a sequence-parallel group of {degree}")
    whole = {key: value for key, value in batch.items() if value is not None}
    if "modality" not in whole:
        whole["modality"] = torch.full_like(input_ids, int(Modality.TEXT))
    if "position_ids" not in whole:
        doc_ids = whole.get("doc_ids")
        whole["position_ids"] = (
            positions_from_doc_ids(doc_ids)
            if doc_ids is not None
            else torch.arange(seq_len, device=input_ids.device).expand(batch_size, seq_len)
        )
    if "labels" in whole and "label_modality" not in whole:
        modality = whole["modality"]
        whole["label_modality"] = torch.cat([modality[:, 1:], modality[:, -1:]], dim=1)
    mask = build_attention_mask(
        batch_size,
        seq_len,
        input_ids.device,
        doc_ids=whole.get("doc_ids"),
        image_ids=whole.get("image_ids"),
        sliding_window=cfg.attention.sliding_window,
        local_window=cfg.attention.local_window,
        bidirectional_images=cfg.attention.bidirectional_images,
        backend=cfg.attention.backend,
    )
    shard = seq_len // degree
    start = rank * shard
    out: dict[str, Tensor | AttentionMask] = {}
    for key, value in whole.items():
        per_token = value.dim() >= 2 and tuple(value.shape[:2]) == (batch_size, seq_len)
        out[key] = value[:, start : start + shard] if per_token else value
    out["mask"] = mask
    return out


def reduce_loss(result: LossResult, group) -> LossResult:
    """One rank's LossResult -> the SP group's, from sums and counts.

    ``loss`` has the value of the group's loss (label-token weighted) on every rank and the
    gradient of this rank's share of it, so gradients summed over the group are the whole
    row's. The other fields are the group's totals (per-modality sums and counts, label
    tokens) and means over all its label tokens (``ce``, ``z_loss``, ``aux_loss``). MoE's
    load-balance and router z-loss are statistics of each shard's tokens (their losses are
    weighted by label tokens like the rest, their monitors averaged over the group): close to,
    not equal to, the single-process values."""
    local_tokens = result.num_tokens.to(torch.float64)
    scalars = torch.stack(
        [
            local_tokens,
            result.loss.detach().double() * local_tokens,
            result.ce.double() * local_tokens,
            result.z_loss.double() * local_tokens,
            result.aux_loss.double() * local_tokens,
            result.moe_load_balance.double(),
            result.moe_router_z.double(),
            result.moe_dropped.double(),
        ]
    )
    per_modality = (
        result.ce_sum,
        result.count,
        result.logz_sum,
        result.hidden_norm_sum,
        result.logit_gap_sum,
    )
    packed = torch.cat([scalars] + [values.double() for values in per_modality])
    dist.all_reduce(packed, group=group)
    expert_load = result.moe_expert_load
    if expert_load is not None:
        expert_load = expert_load.detach().clone()
        dist.all_reduce(expert_load, group=group)
    degree = dist.get_world_size(group)
    total_tokens = packed[0].clamp(min=1)
    share = result.loss * (local_tokens / total_tokens).to(result.loss.dtype)
    group_loss = (packed[1] / total_tokens).to(result.loss.dtype)
    sums = packed[len(scalars) :].split([values.numel() for values in per_modality])
    return LossResult(
        loss=share + (group_loss - share).detach(),
        ce=(packed[2] / total_tokens).float(),
        z_loss=(packed[3] / total_tokens).float(),
        aux_loss=(packed[4] / total_tokens).float(),
        num_tokens=packed[0].round().to(result.num_tokens.dtype),
        ce_sum=sums[0].to(result.ce_sum.dtype),
        count=sums[1].round().to(result.count.dtype),
        logz_sum=sums[2].to(result.logz_sum.dtype),
        hidden_norm_sum=sums[3].to(result.hidden_norm_sum.dtype),
        logit_gap_sum=sums[4].to(result.logit_gap_sum.dtype),
        moe_load_balance=(packed[5] / degree).float(),
        moe_router_z=(packed[6] / degree).float(),
        moe_dropped=packed[7].to(result.moe_dropped.dtype),
        moe_expert_load=expert_load,
    )
