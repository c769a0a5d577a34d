"""Token documents, tokenize options, and the text-only path: everything of tokenize that needs
no torch.

A worker whose chunk of documents holds no image or video encodes it here, with the BPE alone,
so text and code corpora never import torch nor load the visual tokenizer (seconds of imports
and a model build that a text worker would pay for nothing). The result is the same, id for id
and span for span, as ``DocEncoder.encode_chunk`` (tests/test_data/test_tokenize_engines.py
checks it): ``<|bos|> segment … <|eos|>``, text and code as BPE ids.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, field

import numpy as np

from data.vocab import Modality

VISUAL_TYPES = ("image", "video")


@dataclass(frozen=True)
class TokenizeOptions:
    image_max_pixels: int = 256 * 256
    video_max_pixels: int = 128 * 128  # per frame
    video_fps: float = 4.0
    video_max_tokens: int = 4096  # a video block never exceeds this many tokens
    image_batch: int = 32
    # No image or video block longer than this (0: no bound beyond the budgets above): the row
    # length of the training runs (``--seq-len``). Images are made smaller to fit; videos keep
    # fewer frames (down to two latent frames), then smaller frames, then one frame.
    max_block_tokens: int = 0
    # Tokens one document may take (0: no bound beyond the blocks' own): a document's videos
    # share what its text, its images and <|bos|>/<|eos|> leave of it, each keeping as many frames
    # as its share allows (long-context stages: a long clip keeps its length up to the row).
    doc_budget: int = 0

    def record(self) -> dict:
        """The options as fingerprints and manifests record them: every field."""
        return asdict(self)


# The options that shape blocks (the rest, such as image_batch, change no token), and
# earlyfuse-prep tokenize's flag for each
BLOCK_OPTIONS = {
    "image_max_pixels": "--image-max-pixels",
    "video_max_pixels": "--video-max-pixels",
    "video_fps": "--video-fps",
    "video_max_tokens": "--video-max-tokens",
    "max_block_tokens": "--max-block-tokens",
    "doc_budget": "--doc-budget",
}


def number(value) -> str:
    """A budget as a flag takes it: 1048576, not ``:g``'s 1.04858e+06; 4 for 4.0, 2.5 kept."""
    return str(int(value)) if float(value).is_integer() else str(value)


def block_flags(recorded: dict, keys=tuple(BLOCK_OPTIONS)) -> str:
    """The tokenize flags that give the block budgets ``recorded`` (a manifest's options; those
    of ``keys`` that are set), as the command line takes them."""
    return " ".join(f"{BLOCK_OPTIONS[k]} {number(recorded[k])}" for k in keys if recorded.get(k))


@dataclass
class TokenDoc:
    key: str
    ids: np.ndarray  # int32 [n]
    modality: np.ndarray  # uint8 [n]
    spans: list[dict] = field(default_factory=list)
    source: str = ""


def budgeted_options(
    *,
    seq_len: int = 0,
    max_block_tokens: int = 0,
    doc_budget: int = 0,
    video_max_tokens: int | None = None,
    names: tuple[str, str, str] = ("--seq-len", "--max-block-tokens", "--doc-budget"),
    **media,
) -> TokenizeOptions:
    """The options that ``earlyfuse-prep tokenize``'s flags and the loader's ``data.seq_len``,
    ``data.doc_budget`` and ``data.tokenize`` both become, so that a raw document tokenized
    online gets the ids tokenize gives it. No visual block is longer than the least of
    ``seq_len``, ``max_block_tokens`` and ``doc_budget`` (those set; 0 is unset); a video block
    at most ``video_max_tokens``, by default ``doc_budget`` (a long stage's clip keeps its
    length up to its document's budget), else 4,096. ``names``: how the caller calls the three
    budgets, for the error. ``media``: the other fields of ``TokenizeOptions``."""
    caps = [n for n in (seq_len, max_block_tokens, doc_budget) if n]
    for name, value in zip(names, (seq_len, max_block_tokens, doc_budget)):
        if value and value < 8:
            raise ValueError(f"{name} {value}: a visual block needs at least 8 tokens")
    return TokenizeOptions(
        **media,
        video_max_tokens=(doc_budget or 4096) if video_max_tokens is None else video_max_tokens,
        max_block_tokens=min(caps) if caps else 0,
        doc_budget=doc_budget,
    )


def tokens_by_modality(doc: TokenDoc) -> dict[str, int]:
    counts = np.bincount(doc.modality, minlength=len(Modality))
    return {modality.name.lower(): int(counts[modality]) for modality in Modality}


def has_visual(raw_docs) -> bool:
    return any(
        seg["type"] in VISUAL_TYPES for raw_doc in raw_docs for seg in raw_doc.doc["segments"]
    )


def encode_text_chunk(text, raw_docs) -> list[TokenDoc]:
    """Documents of text and code only (``has_visual`` is False), in order; one
    ``encode_batch`` call for the whole chunk (the tokenizer's parallel path)."""
    pieces = [
        seg["text"]
        for raw_doc in raw_docs
        for seg in raw_doc.doc["segments"]
        if seg["type"] in ("text", "code")
    ]
    encoded = iter(text.encode_batch(pieces) if pieces else [])
    out = []
    for raw_doc in raw_docs:
        ids: list[int] = [text.bos_id]
        mods: list[int] = [int(Modality.TEXT)]
        spans = []
        for seg in raw_doc.doc["segments"]:
            piece = next(encoded)
            mod = int(Modality.TEXT if seg["type"] == "text" else Modality.CODE)
            span: dict = {"type": seg["type"]}
            if seg.get("role"):
                span["role"] = seg["role"]
            span.update(start=len(ids), end=len(ids) + len(piece))
            ids.extend(piece)
            mods.extend([mod] * len(piece))
            spans.append(span)
        ids.append(text.eos_id)
        mods.append(int(Modality.TEXT))
        out.append(
            TokenDoc(
                raw_doc.key,
                np.asarray(ids, dtype=np.int32),
                np.asarray(mods, dtype=np.uint8),
                spans,
                raw_doc.doc.get("source", ""),
            )
        )
    return out
