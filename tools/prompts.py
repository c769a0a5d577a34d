"""The prompt that asks the model for a drawing, shared by ``earlyfuse-generate --draw``
(tools/generate_requests.py) and the held-out scene evaluation (tools/evaluate/scenes.py): the
caption as the token shards hold it, ``<bos> caption <boi>``, and the same request without its
caption, ``<bos> <boi>``, which classifier-free guidance contrasts it with. One function, so
that what the command draws and what the evaluation scores are asked for the same way.
"""

from __future__ import annotations

from dataclasses import dataclass

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
