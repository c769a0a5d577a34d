"""The visual tokenizer's folder checked and fingerprinted without torch (the parent process of
``tokenize`` and text-only workers never import it; the model is built in the workers), and the
fingerprints of a whole tokenizer folder, as a token manifest records them, and the one comparison
of two such records."""

from __future__ import annotations

import hashlib
import json
import struct
from pathlib import Path

from data.names import VISUAL_CONFIG_FILE as CONFIG
from data.names import VISUAL_TOKENIZER_DIR
from data.names import VISUAL_WEIGHTS_FILE as WEIGHTS
from data.text_tokenizer import TextTokenizer
from data.vocab import VocabLayout

# What a token manifest's ``tokenizers`` entry fingerprints, each as a message names it.
TOKENIZER_PARTS = {
    "text": "text tokenizer",
    "layout": "vocabulary layout",
    "visual": "visual tokenizer",
}


def tokenizer_key(tokenizers: dict) -> str:
    """One string for a manifest's ``tokenizers`` entry (the folder's name left out)."""
    return json.dumps({k: tokenizers[k] for k in TOKENIZER_PARTS}, sort_keys=True)


def tokenizers_differ(theirs: str, mine: str | dict) -> str:
    """How the tokenizers of ``theirs`` (a ``tokenizer_key``) are not ``mine`` (another, or a
    release's fingerprints, which may record only some parts: only those are compared), e.g.
    "text tokenizer, vocabulary layout differ"; "" when they are the same. A visual tokenizer
    one side has none of (tokens of text and code alone) differs from none."""
    ours = json.loads(mine) if isinstance(mine, str) else mine
    other = json.loads(theirs or "{}")
    differ = [
        name
        for k, name in TOKENIZER_PARTS.items()
        if k in ours
        and other.get(k) != ours[k]
        and not (k == "visual" and None in (ours[k], other.get(k)))
    ]
    return f"{', '.join(differ)} differ{'s' if len(differ) == 1 else ''}" if differ else ""


def weights_fingerprint(folder: str | Path) -> str:
    digest = hashlib.sha256()
    for name in (CONFIG, WEIGHTS):
        with open(Path(folder) / name, "rb") as f:
            while chunk := f.read(1 << 20):
                digest.update(chunk)
    return digest.hexdigest()[:16]


def has_visual_tokenizer(folder: str | Path) -> bool:
    """Whether a tokenizer folder holds a visual tokenizer: it has visual_tokenizer/ (a folder
    without one is of text and code alone, wherever it lies). The one rule that the folder's
    fingerprints and the files its release copies (train/release.py) follow."""
    return (Path(folder) / VISUAL_TOKENIZER_DIR).is_dir()


def folder_fingerprints(folder: str | Path) -> dict:
    """The ``tokenizers`` entry a token manifest would carry for this tokenizer folder; its
    ``visual`` is None for a folder without visual_tokenizer/ (tokens of text and code alone)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(
            f"data.tokenizers: {folder} is not a tokenizer folder (it should hold "
            "tokenizer.json, vocab_layout.json and visual_tokenizer/, like a token folder's "
            "tokenizers/)"
        )
    text = TextTokenizer.load(folder)
    visual = folder / VISUAL_TOKENIZER_DIR
    return {
        "text": text.fingerprint(),
        "layout": text.layout.fingerprint(),
        "visual": weights_fingerprint(visual) if has_visual_tokenizer(folder) else None,
    }


def check_visual_tokenizer(folder: str | Path, layout: VocabLayout) -> dict:
    """The folder's config, after checking that both files are there and readable and that its
    FSQ levels are the layout's; ValueError naming the folder and the problem otherwise."""
    folder = Path(folder)
    try:
        cfg = json.loads((folder / CONFIG).read_text())
        with open(folder / WEIGHTS, "rb") as f:
            (length,) = struct.unpack("<Q", f.read(8))
            header = json.loads(f.read(length))
        if not isinstance(cfg, dict) or not isinstance(header, dict):
            raise ValueError("unexpected contents")
    except (OSError, ValueError, struct.error) as e:
        raise ValueError(
            f"{folder}: not a visual tokenizer folder ({CONFIG} + {WEIGHTS}): {e}"
        ) from None
    levels = cfg.get("levels")
    if levels is None or tuple(levels) != tuple(layout.fsq_levels):
        raise ValueError(
            f"{folder}: FSQ levels {levels} differ from the vocabulary layout's "
            f"{list(layout.fsq_levels)}; retrain one of them with the same levels"
        )
    return cfg
