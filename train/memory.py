"""Expected GPU memory and tokens per step of a training setup: the numbers beside each GPU preset
in docs/training.md, and ``python -m train.memory`` for any other setup.

Model states, per parameter (DeepSpeed bf16 mode with fp32 master weights, AdamW):
bf16 weights 2 B + bf16 gradients 2 B + fp32 gradient accumulation 4 B + fp32 master weights 4 B
+ Adam moments 8 B = 20 B. ZeRO-1 partitions the optimizer states (master weights and moments,
12 B) over the ranks, ZeRO-2 also the gradients, ZeRO-3 also the weights. Activations per token
and layer, bf16, attention through SDPA/FlashAttention (no T x T scores kept): the block's
saved tensors, about ``2 * (6 * dim + 2 * kv_dim + 5 * ffn_hidden)`` bytes (Korthikanti et al.'s
accounting with SwiGLU and GQA, dropout off); with activation checkpointing every layer only
each layer's input (``2 * dim``) plus one layer's activations. The fused chunked CE keeps one
[chunk, V] float32 block instead of the [tokens, V] logits. An estimate (+-25 %): allocator
fragmentation, the CUDA context (~0.5 GiB) and communication buffers come on top.

Long rows (docs/long_context.md, "Memory model"):
- Sequence parallelism of degree P (``sequence_parallel``) gives each rank T/P tokens of every
  row: the activations and the CE's hidden states divide by P (around the attention core a rank
  holds all T tokens of H/P heads: the same bytes). ZeRO partitions over all DP x SP ranks
  (``world_size``); the tokens per step count each row once (W / P replicas).
- The attention mask is built for the whole row on every rank and kept for the step. A
  FlexAttention BlockMask (``mask="flex"``, CUDA's default) holds four [B, T/128, T/128] int32
  index tensors (partial and full blocks, by key and by query) per mask: 16 MiB per row at 128k,
  1 GiB at 1M. SDPA's dense boolean mask (``mask="sdpa"``) is [B, T, T] bytes: 16 GiB at 128k.
  Local/global attention keeps a second mask for its local layers.
- Activation checkpointing keeps each layer's input plus one layer's activations at a time.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

GIB = 2**30


@dataclass
class MemoryEstimate:
    params: int
    states_gib: float
    activations_gib: float
    logits_gib: float
    tokens_per_step: int
    mask_gib: float = 0.0

    @property
    def total_gib(self) -> float:
        return self.states_gib + self.activations_gib + self.logits_gib + self.mask_gib


BLOCK = 128  # FlexAttention's default block size (both sides)


def mask_bytes(seq_len: int, *, micro_batch: int = 1, mask: str = "flex") -> int:
    """Bytes of one attention mask for ``micro_batch`` rows of ``seq_len`` tokens: four
    [B, n, n] int32 BlockMask index tensors with n = ceil(T / 128) ("flex"; the [B, n] block
    counts are negligible), or the dense [B, T, T] boolean SDPA mask ("sdpa")."""
    if mask == "flex":
        blocks = -(-seq_len // BLOCK)
        return micro_batch * 4 * blocks * blocks * 4
    if mask == "sdpa":
        return micro_batch * seq_len * seq_len
    raise ValueError(f"mask must be flex or sdpa, got {mask!r}")


def estimate(
    cfg,
    *,
    micro_batch: int,
    seq_len: int,
    grad_accum: int = 1,
    world_size: int = 1,
    zero_stage: int = 0,
    act_ckpt: bool = False,
    sequence_parallel: int = 1,
    mask: str = "flex",
) -> MemoryEstimate:
    """Per-GPU memory of ``cfg`` (a TransformerConfig) under the given parallel setup.
    ``world_size``: all ranks (data parallel x ``sequence_parallel``); ``mask``: how the
    attention mask is held, "flex" (a BlockMask, CUDA's default) or "sdpa" (dense)."""
    from model.sequence_parallel import check_sequence_parallel

    # the model's and the row's split, as a run checks them; then the ranks'
    check_sequence_parallel(
        n_heads=cfg.attention.n_heads, seq_len=seq_len, degree=sequence_parallel
    )
    if world_size % sequence_parallel:
        raise ValueError(
            f"sequence_parallel={sequence_parallel} must divide the world size ({world_size})"
        )
    num_params = _param_count(cfg)
    shards = max(1, world_size)
    # bf16 weights; bf16 + fp32 grads; master + moments
    weights, grads, optim = 2.0 * num_params, 6.0 * num_params, 12.0 * num_params
    if zero_stage >= 1:
        optim /= shards
    if zero_stage >= 2:
        grads /= shards
    if zero_stage >= 3:
        weights /= shards
    hidden = cfg.ffn.resolved_hidden_dim(cfg.dim)
    kv_dim = cfg.attention.kv_heads * cfg.head_dim
    per_layer_token = 2 * (6 * cfg.dim + 2 * kv_dim + 5 * hidden)
    tokens = micro_batch * seq_len // sequence_parallel  # this rank's share of the rows
    if act_ckpt:
        act = tokens * (cfg.n_layers * 2 * cfg.dim + per_layer_token)
    else:
        act = tokens * cfg.n_layers * per_layer_token
    chunk = cfg.loss.chunk_size or tokens
    logits = 4.0 * min(chunk, tokens) * cfg.vocab_size * 2  # the chunk's logits and its gradient
    # Documents are masked per row (the batch dimension is kept); local layers add a mask.
    masks = 2 if cfg.attention.local_window else 1
    mask_total = masks * mask_bytes(seq_len, micro_batch=micro_batch, mask=mask)
    return MemoryEstimate(
        params=num_params,
        states_gib=(weights + grads + optim) / GIB,
        activations_gib=act / GIB,
        logits_gib=logits / GIB,
        tokens_per_step=micro_batch * seq_len * grad_accum * (shards // sequence_parallel),
        mask_gib=mask_total / GIB,
    )


def is_out_of_memory(error: BaseException) -> bool:
    """Did an allocation fail? CUDA's allocator raises ``torch.OutOfMemoryError``; the CPU's
    raises a RuntimeError that says it could not allocate, or the model a MemoryError for rows
    whose dense mask cannot fit (model.attention.RowsTooLong). The benchmarks of long rows report
    these as "OOM at N" and go on (tools/bench/bench_gpu.py, bench_block_mask.py)."""
    import torch  # here only: the estimates above need no torch

    if isinstance(error, (torch.OutOfMemoryError, MemoryError)):  # MemoryError: RowsTooLong
        return True
    text = str(error)
    return isinstance(error, RuntimeError) and (
        "out of memory" in text or "can't allocate memory" in text
    )


def _param_count(cfg) -> int:
    dim, head_dim = cfg.dim, cfg.head_dim
    q_dim, kv_dim = cfg.attention.n_heads * head_dim, cfg.attention.kv_heads * head_dim
    hidden = cfg.ffn.resolved_hidden_dim(dim)
    per_layer = (
        dim * q_dim
        + 2 * dim * kv_dim
        + q_dim * dim
        + 3 * dim * hidden
        + 2 * dim
        + (2 * head_dim if cfg.attention.qk_norm else 0)
    )
    return cfg.n_layers * per_layer + 2 * cfg.vocab_size * dim + dim


def main(argv=None) -> None:
    from data.cli.common import positive_int
    from model.presets import preset

    parser = argparse.ArgumentParser(
        description="Expected per-GPU memory and tokens per step of a model preset."
    )
    parser.add_argument(
        "preset", help="a model preset (configs/model/): debug, demo, 125m, 350m, 1b"
    )
    parser.add_argument(
        "--micro-batch", type=positive_int, default=8, help="rows per GPU per micro-step"
    )
    parser.add_argument("--seq-len", type=positive_int, default=2048)
    parser.add_argument(
        "--grad-accum",
        type=positive_int,
        default=1,
        help="micro-steps per optimizer step (default 1; the GPU presets' train.grad_accum is 4)",
    )
    parser.add_argument(
        "--gpus", type=positive_int, default=1, help="all ranks: data x sequence parallel"
    )
    parser.add_argument("--sp", type=positive_int, default=1, help="sequence-parallel degree")
    parser.add_argument(
        "--mask", choices=("flex", "sdpa"), default="flex", help="BlockMask or dense mask"
    )
    parser.add_argument("--zero", type=int, choices=[0, 1, 2, 3], default=1)
    parser.add_argument("--act-ckpt", action="store_true")
    args = parser.parse_args(argv)
    try:
        cfg = preset(args.preset)
    except KeyError as err:
        parser.error(str(err.args[0]))
    try:
        result = estimate(
            cfg,
            micro_batch=args.micro_batch,
            seq_len=args.seq_len,
            grad_accum=args.grad_accum,
            world_size=args.gpus,
            zero_stage=args.zero,
            act_ckpt=args.act_ckpt,
            sequence_parallel=args.sp,
            mask=args.mask,
        )
    except ValueError as err:
        parser.error(f"{args.preset}: {err}")
    print(
        f"{args.preset}: {result.params / 1e6:.0f}M parameters; per GPU: "
        f"model states {result.states_gib:.1f} GiB, "
        f"activations {result.activations_gib:.1f} GiB, "
        f"CE chunk {result.logits_gib:.2f} GiB, "
        f"attention mask {result.mask_gib:.3f} GiB, "
        f"total ~{result.total_gib:.1f} GiB; "
        f"{result.tokens_per_step:,} tokens per step"
        + (f" (sequence parallel {args.sp})" if args.sp > 1 else "")
    )


if __name__ == "__main__":
    main()
