"""Load a trained visual tokenizer (``RUN_DIR/visual_tokenizer/``: safetensors + config.json)."""

from __future__ import annotations

import json
from pathlib import Path

import torch

from data.names import VISUAL_CONFIG_FILE, VISUAL_WEIGHTS_FILE
from data.tokenize.vtok_files import weights_fingerprint
from data.vocab import VocabLayout

__all__ = ["load_visual_tokenizer", "weights_fingerprint"]


def load_visual_tokenizer(
    folder: str | Path, layout: VocabLayout, device: torch.device | str = "cpu"
):
    from safetensors.torch import load_file

    from model.visual_tokenizer import VisualTokenizerConfig

    folder = Path(folder)
    try:
        cfg = VisualTokenizerConfig(**json.loads((folder / VISUAL_CONFIG_FILE).read_text()))
        state = load_file(str(folder / VISUAL_WEIGHTS_FILE))
    except (OSError, ValueError, TypeError) as e:
        raise ValueError(
            f"{folder}: not a visual tokenizer folder (config.json + model.safetensors): {e}"
        ) from None
    if tuple(cfg.levels) != tuple(layout.fsq_levels):
        raise ValueError(
            f"{folder}: FSQ levels {cfg.levels} differ from the vocabulary layout's "
            f"{list(layout.fsq_levels)}; retrain one of them with the same levels"
        )
    model = cfg.build()
    model.load_state_dict(state)
    return model.to(device).eval()
