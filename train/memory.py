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
    n = _param_count(cfg)
    w = max(1, world_size)
    weights, grads, optim = (
        2.0 * n,
        6.0 * n,
        12.0 * n,
    )  # bf16 weights; bf16 + fp32 grads; master + moments
    if zero_stage >= 1:
        optim /= w
    if zero_stage >= 2:
        grads /= w
    if zero_stage >= 3:
        weights /= w
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
        params=n,
        states_gib=(weights + grads + optim) / GIB,
        activations_gib=act / GIB,
        logits_gib=logits / GIB,
        tokens_per_step=tokens * grad_accum * w,
    )


def _param_count(cfg) -> int:
    d, hd = cfg.dim, cfg.head_dim
    q, kv = cfg.attention.n_heads * hd, cfg.attention.kv_heads * hd
    hidden = cfg.ffn.resolved_hidden_dim(d)
    per_layer = (
        d * q
        + 2 * d * kv
        + q * d
        + 3 * d * hidden
        + 2 * d
        + (2 * hd if cfg.attention.qk_norm else 0)
    )
    return cfg.n_layers * per_layer + 2 * cfg.vocab_size * d + d


def main(argv=None) -> None:
    from model.presets import preset

    ap = argparse.ArgumentParser(
        description="Expected per-GPU memory and tokens per step of a model preset."
    )
    ap.add_argument("preset", help="a model preset (configs/model/): debug, demo, 125m, 350m, 1b")
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--seq-len", type=int, default=2048)
    ap.add_argument("--grad-accum", type=int, default=1)
    ap.add_argument("--gpus", type=int, default=1)
    ap.add_argument("--zero", type=int, default=1)
    ap.add_argument("--act-ckpt", action="store_true")
    a = ap.parse_args(argv)
    e = estimate(
        preset(a.preset),
        micro_batch=a.micro_batch,
        seq_len=a.seq_len,
        grad_accum=a.grad_accum,
        world_size=a.gpus,
        zero_stage=a.zero,
        act_ckpt=a.act_ckpt,
    )
    print(
        f"{a.preset}: {e.params / 1e6:.0f}M parameters; per GPU: model states {e.states_gib:.1f} GiB, "
        f"activations {e.activations_gib:.1f} GiB, CE chunk {e.logits_gib:.2f} GiB, total ~{e.total_gib:.1f} GiB; "
        f"{e.tokens_per_step:,} tokens per step"
    )


if __name__ == "__main__":
    main()
