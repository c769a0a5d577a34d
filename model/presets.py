"""Model presets: the YAML files in configs/model/, read without Hydra.

``configs/model/NAME.yaml`` is the one place a preset is written. A training run gets it through
Hydra (``model=NAME``); everything else (``python -m train.memory``, the GPU benchmark, tests,
the parameter counts in the docs) reads the same file here, so the two can never drift apart.

Design choices:
- A plain ``yaml.safe_load`` onto ``TransformerConfig``: no Hydra in model/ (only the entry
  points see it), and the dataclass rejects a misspelt key just as the Hydra schema does (a
  test checks that both readings agree field by field).
- A preset holds the architecture, not the vocabulary: a run takes the sizes from its
  ``vocab_layout.json`` (``with_layout``). To count parameters outside a run each preset has a
  reference layout, the one it is meant for: ``debug`` the tests' tiny vocabulary, ``demo`` the
  vocabulary ``make demo`` builds, every other preset the early-fusion vocabulary of a real run.
- ``markdown_table()`` is the preset table of docs/model.md; a test checks that the table and
  every parameter count written in the docs and config comments match these files.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from data.vocab import VocabLayout
from model.flops import flops_per_token, param_counts
from model.transformer import TransformerConfig

PRESET_DIR = Path(__file__).resolve().parents[1] / "configs" / "model"

# The tests' tiny vocabulary: 512 text ids, FSQ [8,5,5,5] = 1,000 codes, grids up to 16 (1,550 ids).
DEBUG_LAYOUT = VocabLayout(text_size=512, fsq_levels=(8, 5, 5, 5), max_grid=16)
# What `make demo` builds (--vocab-size 4096 --max-grid 32 --fsq-levels 8,6,5): 4,406 ids.
DEMO_LAYOUT = VocabLayout(text_size=4096, fsq_levels=(8, 6, 5), max_grid=32)
# A real early-fusion run: 32k text ids, FSQ [8,8,8,5,5,5] = 64,000 codes, grids to 64 (96,902 ids).
GPU_LAYOUT = VocabLayout(text_size=32768, fsq_levels=(8, 8, 8, 5, 5, 5), max_grid=64)
REFERENCE_LAYOUTS = {"debug": DEBUG_LAYOUT, "demo": DEMO_LAYOUT}


def preset_names() -> list[str]:
    """Every preset, smallest first (by parameters with its reference layout)."""
    names = [path.stem for path in PRESET_DIR.glob("*.yaml")]
    return sorted(names, key=lambda name: param_counts(preset(name)).total)


def reference_layout(name: str) -> VocabLayout:
    """The vocabulary a preset is meant for (see the module docstring)."""
    return REFERENCE_LAYOUTS.get(name, GPU_LAYOUT)


def preset(name: str, layout: VocabLayout | None = None, **overrides) -> TransformerConfig:
    """``configs/model/NAME.yaml`` for ``layout`` (default: its reference layout), with top-level
    fields replaced (``preset("debug", n_layers=4)``)."""
    import yaml  # PyYAML: Hydra's own YAML reader, a dependency of ours (docs/dependencies.md)

    path = PRESET_DIR / f"{name}.yaml"
    if not path.is_file():
        known = sorted(preset_path.stem for preset_path in PRESET_DIR.glob("*.yaml"))
        raise KeyError(f"unknown model preset {name!r}; choose from {known} ({PRESET_DIR})")
    fields = yaml.safe_load(path.read_text()) or {}
    try:
        cfg = TransformerConfig(**fields)
    except TypeError as e:
        raise ValueError(f"{path}: {e}") from None
    cfg = cfg.with_layout(layout or reference_layout(name))
    return dataclasses.replace(cfg, **overrides) if overrides else cfg


def mrope_sections(head_dim: int) -> list[int]:
    """Qwen2-VL's t:h:w = 2:3:3 split of the head_dim/2 rotary frequencies."""
    half = head_dim // 2
    time_freqs = half // 4
    height_freqs = (half - time_freqs) // 2
    return [time_freqs, height_freqs, half - time_freqs - height_freqs]


def count_text(n: int) -> str:
    """How the docs write a parameter count: 0.3M, 2.1M, 124M, 1.37B."""
    if n >= 1e9:
        return f"{n / 1e9:.2f}B"
    if n >= 1e7:
        return f"{n / 1e6:.0f}M"
    return f"{n / 1e6:.1f}M"


def markdown_table() -> str:
    """The preset table of docs/model.md (between its ``presets:begin``/``end`` markers)."""
    rows = [
        "| preset | dim | layers | heads/KV | head_dim | FFN | vocab | params | non-emb. "
        "| GFLOP/tok @2048 | @4096 |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for name in preset_names():
        cfg = preset(name)
        counts = param_counts(cfg)
        rows.append(
            f"| `{name}` | {cfg.dim} | {cfg.n_layers} | {cfg.attention.n_heads}/"
            f"{cfg.attention.kv_heads} | {cfg.head_dim} | {cfg.ffn.resolved_hidden_dim(cfg.dim)} "
            f"| {cfg.vocab_size:,} | {count_text(counts.total)} "
            f"| {count_text(counts.non_embedding)} | {flops_per_token(cfg, 2048) / 1e9:.3g} "
            f"| {flops_per_token(cfg, 4096) / 1e9:.3g} |"
        )
    return "\n".join(rows) + "\n"
