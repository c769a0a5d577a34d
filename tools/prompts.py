"""The prompts that ask the model for a drawing or a caption, shared by ``earlyfuse-generate``
(tools/generate_requests.py) and the held-out scene evaluation (tools/evaluate/scenes.py), so
that what the command produces and what the evaluation scores are asked for the same way.

- A drawing: the caption as the token shards hold it, ``<bos> caption <boi>``, and the same
  request without its caption, ``<bos> <boi>``, which classifier-free guidance contrasts it with.
- A caption: ``<bos> [image block] [text]``, and for a model trained with bidirectional image
  blocks the image ids that let the block see itself both ways, as in training.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from data.vocab import Modality, VocabLayout


@dataclass(frozen=True)
class DrawPrompt:
    ids: list[int]  # <bos> caption <boi>
    modality: list[int]  # text for <bos> and the caption, structure for <boi>
    # <bos> <boi>: the request without its caption (the unconditional side of guidance)
    unconditional: list[int]


def draw_prompt(caption_ids: list[int], *, bos_id: int, layout: VocabLayout) -> DrawPrompt:
    """The drawing prompt for a caption's text ids (``TextTokenizer.encode``; no specials)."""
    boi = layout.structure_id("<boi>")
    ids = [bos_id, *caption_ids, boi]
    modality = [int(Modality.TEXT)] * (len(ids) - 1) + [int(Modality.STRUCTURE)]
    return DrawPrompt(ids=ids, modality=modality, unconditional=[bos_id, boi])


@dataclass(frozen=True)
class CaptionPrompt:
    ids: list[int]  # <bos> [image block] [text]
    modality: list[int]
    image_ids: list[int] | None  # 0 on the block, -1 elsewhere; None for causal-only models


def caption_prompt(
    block: np.ndarray,
    block_modality: np.ndarray,
    text_ids: list[int],
    *,
    bos_id: int,
    bidirectional_images: bool,
) -> CaptionPrompt:
    """The caption prompt for an image block (``data.layout.image_tokens``) and the text ids
    that follow it (empty for a bare caption)."""
    ids = [bos_id, *block.tolist(), *text_ids]
    text = int(Modality.TEXT)
    modality = [text, *block_modality.tolist(), *[text] * len(text_ids)]
    image_ids = None
    if bidirectional_images:
        image_ids = [-1] + [0] * len(block) + [-1] * len(text_ids)
    return CaptionPrompt(ids=ids, modality=modality, image_ids=image_ids)
