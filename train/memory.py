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

    @property
    def total_gib(self) -> float:
        return self.states_gib + self.activations_gib + self.logits_gib


def estimate(
    cfg,
    *,
    micro_batch: int,
    seq_len: int,
    grad_accum: int = 1,
    world_size: int = 1,
    zero_stage: int = 0,
    act_ckpt: bool = False,
) -> MemoryEstimate:
    """Per-GPU memory of ``cfg`` (a TransformerConfig) under the given parallel setup."""
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
    tokens = micro_batch * seq_len
    if act_ckpt:
        act = tokens * (cfg.n_layers * 2 * cfg.dim + per_layer_token)
    else:
        act = tokens * cfg.n_layers * per_layer_token
    chunk = cfg.loss.chunk_size or tokens
    logits = 4.0 * min(chunk, tokens) * cfg.vocab_size * 2  # the chunk's logits and its gradient
    return MemoryEstimate(
        params=num_params,
        states_gib=(weights + grads + optim) / GIB,
        activations_gib=act / GIB,
        logits_gib=logits / GIB,
        tokens_per_step=tokens * grad_accum * shards,
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
    from model.presets import preset

    parser = argparse.ArgumentParser(
        description="Expected per-GPU memory and tokens per step of a model preset."
    )
    parser.add_argument(
        "preset", help="a model preset (configs/model/): debug, demo, 125m, 350m, 1b"
    )
    parser.add_argument("--micro-batch", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument("--grad-accum", type=int, default=1)
    parser.add_argument("--gpus", type=int, default=1)
    parser.add_argument("--zero", type=int, default=1)
    parser.add_argument("--act-ckpt", action="store_true")
    args = parser.parse_args(argv)
    result = estimate(
        preset(args.preset),
        micro_batch=args.micro_batch,
        seq_len=args.seq_len,
        grad_accum=args.grad_accum,
        world_size=args.gpus,
        zero_stage=args.zero,
        act_ckpt=args.act_ckpt,
    )
    print(
        f"{args.preset}: {result.params / 1e6:.0f}M parameters; per GPU: "
        f"model states {result.states_gib:.1f} GiB, "
        f"activations {result.activations_gib:.1f} GiB, "
        f"CE chunk {result.logits_gib:.2f} GiB, "
        f"total ~{result.total_gib:.1f} GiB; "
        f"{result.tokens_per_step:,} tokens per step"
    )


if __name__ == "__main__":
    main()
