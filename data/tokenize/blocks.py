"""The visual blocks of a tokenized document, as a token shard's index records them (``blocks``).

Written by ``earlyfuse-prep tokenize`` (data/tokenize/run.py) for every token document, and
computed the same way by the loader for raw shards it tokenizes itself (data/loader/stream.py):
a library module, so that the loader never imports the tokenize command.
"""

from __future__ import annotations


def visual_blocks(spans: list[dict]) -> list[list[int]]:
    """[start, end, t, h, w] of each image/video block (t = 0 for an image): what a packer needs
    to keep blocks whole, and M-RoPE positions, from the index alone."""
    out = []
    for span in spans:
        if span["type"] == "image":
            out.append([span["start"], span["end"], 0, *span["grid"]])
        elif span["type"] == "video":
            out.append([span["start"], span["end"], *span["grid"]])
    return out
