"""Model presets, from a CPU debug size to about 1B parameters, as plain factory functions.

Design choices:
- Each preset is a function returning a fresh ``TransformerConfig`` for a given vocabulary
  layout (the run's ``vocab_layout.json``); without one it uses a typical layout of its size.
  Hydra YAMLs in configs/model/ mirror these field by field.
- Shapes follow Llama 3.2 / OLMo 2 practice: head_dim 64, GQA with 4 query heads per KV head
  from ``base`` up, SwiGLU hidden ~ 8/3 * dim (4 * dim at 1B), rope theta 500k beyond debug sizes.
- QK-norm and z-loss stay on (the defaults) in every preset; M-RoPE is off (1D RoPE, as Emu3);
  ``mrope_sections(head_dim)`` gives the Qwen2-VL split to switch it on.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

from data.vocab import VocabLayout
from model.attention import AttentionConfig
from model.layers import FFNConfig
from model.rope import RopeConfig
from model.transformer import TransformerConfig

DEBUG_LAYOUT = VocabLayout(text_size=512, fsq_levels=(8, 5, 5, 5), max_grid=16)  # 1,550 ids
SMALL_LAYOUT = VocabLayout(text_size=4096, fsq_levels=(8, 5, 5, 5), max_grid=32)  # 5,166 ids
LARGE_LAYOUT = VocabLayout(
    text_size=32768, fsq_levels=(8, 8, 8, 5, 5, 5), max_grid=64
)  # 96,902 ids


def mrope_sections(head_dim: int) -> list[int]:
    """Qwen2-VL's t:h:w = 2:3:3 split of the head_dim/2 rotary frequencies."""
    half = head_dim // 2
    t = half // 4
    h = (half - t) // 2
    return [t, h, half - t - h]


def _make(
    layout: VocabLayout,
    *,
    dim: int,
    n_layers: int,
    n_heads: int,
    n_kv_heads: int,
    hidden_dim: int = 0,
    theta: float = 500_000.0,
) -> TransformerConfig:
    return TransformerConfig(
        dim=dim,
        n_layers=n_layers,
        attention=AttentionConfig(n_heads=n_heads, n_kv_heads=n_kv_heads),
        rope=RopeConfig(theta=theta),
        ffn=FFNConfig(hidden_dim=hidden_dim),
    ).with_layout(layout)


def debug(layout: VocabLayout | None = None) -> TransformerConfig:
    """0.30M parameters (0.10M outside the embeddings): unit tests and CPU smoke runs."""
    return _make(
        layout or DEBUG_LAYOUT, dim=64, n_layers=2, n_heads=4, n_kv_heads=2, theta=10_000.0
    )


def small(layout: VocabLayout | None = None) -> TransformerConfig:
    """5.6M parameters (3.0M outside the embeddings): CPU demo training."""
    return _make(
        layout or SMALL_LAYOUT, dim=256, n_layers=4, n_heads=4, n_kv_heads=2, theta=10_000.0
    )


def gpu_125m(layout: VocabLayout | None = None) -> TransformerConfig:
    """124M parameters outside the embeddings (273M with the 97k vocabulary, untied): one GPU."""
    return _make(
        layout or LARGE_LAYOUT, dim=768, n_layers=18, n_heads=12, n_kv_heads=4, hidden_dim=2304
    )


def gpu_350m(layout: VocabLayout | None = None) -> TransformerConfig:
    """344M parameters outside the embeddings (592M with the 97k vocabulary)."""
    return _make(
        layout or LARGE_LAYOUT, dim=1280, n_layers=20, n_heads=20, n_kv_heads=4, hidden_dim=3456
    )


def base(layout: VocabLayout | None = None) -> TransformerConfig:
    """224M parameters with the 97k vocabulary (76M outside the embeddings): one GPU."""
    return _make(
        layout or LARGE_LAYOUT, dim=768, n_layers=12, n_heads=12, n_kv_heads=4, hidden_dim=2048
    )


def medium(layout: VocabLayout | None = None) -> TransformerConfig:
    """469M parameters (271M outside the embeddings)."""
    return _make(
        layout or LARGE_LAYOUT, dim=1024, n_layers=24, n_heads=16, n_kv_heads=4, hidden_dim=2816
    )


def one_b(layout: VocabLayout | None = None) -> TransformerConfig:
    """1.37B parameters (0.97B outside the embeddings): the Llama-3.2-1B shape."""
    return _make(
        layout or LARGE_LAYOUT, dim=2048, n_layers=16, n_heads=32, n_kv_heads=8, hidden_dim=8192
    )


PRESETS: dict[str, Callable[..., TransformerConfig]] = {
    "debug": debug,
    "small": small,
    "base": base,
    "medium": medium,
    "125m": gpu_125m,
    "350m": gpu_350m,
    "1b": one_b,
}


def preset(name: str, layout: VocabLayout | None = None, **overrides) -> TransformerConfig:
    """A preset by name, with top-level fields replaced (``preset("debug", n_layers=4)``)."""
    if name not in PRESETS:
        raise KeyError(f"unknown model preset {name!r}; choose from {sorted(PRESETS)}")
    return dataclasses.replace(PRESETS[name](layout), **overrides)
