"""Parameter counts and training FLOPs per token, from a TransformerConfig alone (no model built).

Design choices:
- Training FLOPs per token = 6 * (active non-embedding parameters + LM head) + attention, with
  attention = 12 * n_layers * n_heads * head_dim * context (QK^T and AV, 2 FLOPs per MAC, x3 for
  forward + backward). The input embedding is a gather and costs nothing.
- ``context`` follows the PaLM / torchtitan / nanoGPT MFU convention by default: every query
  sees ``seq_len`` keys (``min(seq_len, sliding_window)`` with a window; local layers of
  local/global attention ``min(seq_len, local_window)``). ``causal=True`` counts
  only the keys a causal query really sees (about half); document masking lowers real work
  further, which MFU deliberately does not credit.
- "Active" parameters count what one token uses: the router plus top_k experts in an MoE layer,
  one modality group's FFN with MoT. The counts are checked against a built model in the tests.
"""

from __future__ import annotations

from dataclasses import dataclass

from model.transformer import TransformerConfig


@dataclass(frozen=True, kw_only=True)
class ParamCounts:
    total: int
    embedding: int  # input embedding tables (tokens, and image rows/columns when on)
    output: int  # LM head
    non_embedding: int  # total - embedding - output
    active: int  # parameters one token uses (MoE: top_k experts; MoT: one group)
    active_non_embedding: int


def param_counts(cfg: TransformerConfig) -> ParamCounts:
    dim, attn_cfg, head_dim = cfg.dim, cfg.attention, cfg.head_dim
    attn = (
        dim * attn_cfg.n_heads * head_dim
        + 2 * dim * attn_cfg.kv_heads * head_dim
        + attn_cfg.n_heads * head_dim * dim
        + (2 * head_dim if attn_cfg.qk_norm else 0)
    )
    hidden = cfg.ffn.resolved_hidden_dim(dim)
    if cfg.moe.enabled:
        expert_hidden = cfg.moe.hidden_dim or hidden
        ffn_total = dim * cfg.moe.num_experts + cfg.moe.num_experts * 3 * dim * expert_hidden
        ffn_active = dim * cfg.moe.num_experts + cfg.moe.top_k * 3 * dim * expert_hidden
    elif cfg.ffn.modality_groups:
        ffn_total = (max(cfg.ffn.modality_groups) + 1) * 3 * dim * hidden
        ffn_active = 3 * dim * hidden
    else:
        ffn_total = ffn_active = 3 * dim * hidden
    layer_total = attn + ffn_total + 2 * dim
    layer_active = attn + ffn_active + 2 * dim
    out = cfg.vocab_size * dim
    # Row and column embeddings of image codes are input embeddings too (gathers, no FLOPs).
    emb = out + (2 * cfg.max_grid * dim if cfg.grid_embedding else 0)
    non_emb = cfg.n_layers * layer_total + dim
    active_non_emb = cfg.n_layers * layer_active + dim
    return ParamCounts(
        total=emb + out + non_emb,
        embedding=emb,
        output=out,
        non_embedding=non_emb,
        active=emb + out + active_non_emb,
        active_non_embedding=active_non_emb,
    )


def attention_context(cfg: TransformerConfig, seq_len: int, *, causal: bool = False) -> float:
    """Mean number of keys per query that the FLOP count charges for, averaged over the layers
    (local layers of local/global attention see ``local_window`` keys at most)."""
    attention = cfg.attention
    local_layers = sum(attention.is_local(layer) for layer in range(cfg.n_layers))
    full = _window_context(attention.sliding_window or seq_len, seq_len, causal)
    local = _window_context(attention.local_window or seq_len, seq_len, causal)
    return (local_layers * local + (cfg.n_layers - local_layers) * full) / cfg.n_layers


def _window_context(window: int, seq_len: int, causal: bool) -> float:
    if not causal:
        return float(min(window, seq_len))
    if window >= seq_len:
        return (seq_len + 1) / 2
    return (window * (window + 1) / 2 + (seq_len - window) * window) / seq_len


def flops_per_token(cfg: TransformerConfig, seq_len: int, *, causal: bool = False) -> float:
    """Training (forward + backward) FLOPs per token at ``seq_len``, attention included."""
    counts = param_counts(cfg)
    dense = 6 * (counts.active_non_embedding + counts.output)
    attn = (
        12
        * cfg.n_layers
        * cfg.attention.n_heads
        * cfg.head_dim
        * attention_context(cfg, seq_len, causal=causal)
    )
    return float(dense + attn)
