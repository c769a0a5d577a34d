"""Load a trained visual tokenizer (``RUN_DIR/visual_tokenizer/``: safetensors + config.json).

The one loader of such a folder: ``earlyfuse-prep tokenize``, the loader's online tokenizer and
a release (``Release.visual_tokenizer``, which passes the sha256 it recorded) all call
``load_visual_tokenizer``, so every caller gets the same checks and one error type.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from data.names import VISUAL_CONFIG_FILE, VISUAL_WEIGHTS_FILE
from data.shards.index import file_sha256
from data.tokenize.vtok_files import weights_fingerprint
from data.vocab import VocabLayout

__all__ = ["VisualTokenizerError", "load_visual_tokenizer", "weights_fingerprint"]


class VisualTokenizerError(ValueError):
    """A visual tokenizer folder that cannot be used; the message names the folder or file."""


def load_visual_tokenizer(
    folder: str | Path,
    layout: VocabLayout | None,
    device: torch.device | str = "cpu",
    *,
    sha256: dict[str, str] | None = None,
):
    """The FSQ autoencoder in ``folder``, in eval mode on ``device``, after checking that both
    files are there and readable, that they match ``sha256`` (file name -> digest, as a release
    records them; a corrupted byte inside safetensors would load without complaint), that the
    FSQ levels are ``layout``'s (when given), and that the tensors are the ones the config's
    network has, with its shapes, and finite. A ``VisualTokenizerError`` otherwise."""
    from model.visual_tokenizer import VisualTokenizerConfig
    from model.weights import load_safetensors, nonfinite_tensor

    folder = Path(folder)
    config_path, weights_path = folder / VISUAL_CONFIG_FILE, folder / VISUAL_WEIGHTS_FILE
    for path in (config_path, weights_path):
        if not path.is_file():
            raise VisualTokenizerError(
                f"{path}: missing; {folder} is not a visual tokenizer folder "
                f"({VISUAL_CONFIG_FILE} + {VISUAL_WEIGHTS_FILE})"
            )
    for name, digest in (sha256 or {}).items():
        if file_sha256(folder / name) != digest:
            raise VisualTokenizerError(
                f"{folder / name}: sha256 differs from the one recorded for it; the file is "
                "corrupted or was changed after it was written"
            )
    try:
        cfg = VisualTokenizerConfig(**json.loads(config_path.read_text()))
    except (OSError, ValueError, TypeError) as e:
        raise VisualTokenizerError(
            f"{config_path}: unreadable visual tokenizer config ({e})"
        ) from None
    if layout is not None and tuple(cfg.levels) != tuple(layout.fsq_levels):
        raise VisualTokenizerError(
            f"{folder}: FSQ levels {cfg.levels} differ from the vocabulary layout's "
            f"{list(layout.fsq_levels)}; retrain one of them with the same levels"
        )
    state = load_safetensors(weights_path, VisualTokenizerError)
    if (bad := nonfinite_tensor(state)) is not None:
        raise VisualTokenizerError(
            f"{weights_path}: tensor {bad!r} holds NaN or Inf values (the run diverged?)"
        )
    model = cfg.build()
    try:  # strict: names and shapes as the config's network has them
        model.load_state_dict(state)
    except RuntimeError as e:
        raise VisualTokenizerError(
            f"{weights_path}: its tensors do not fit the network {VISUAL_CONFIG_FILE} describes "
            f"({e})"
        ) from None
    return model.to(device).eval()
