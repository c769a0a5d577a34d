"""The drawing prompt that earlyfuse-generate --draw and the held-out scene evaluation share."""

from __future__ import annotations

from data.text_tokenizer import TextTokenizer
from data.vocab import Modality
from tools.generate_requests import draw_prompt


def test_draw_prompt_is_what_generate_and_the_scene_evaluation_built(tiny_tokenizers):
    text = TextTokenizer.load(tiny_tokenizers[0])
    layout = text.layout
    caption = "a red circle in the top left cell"
    body = text.encode(caption)
    boi = layout.structure_id("<boi>")
    assert len(body) > 1 and boi >= layout.text_size  # a real caption, a structure token

    ids, modality, unconditional = draw_prompt(body, bos_id=text.bos_id, layout=layout)

    # What tools/generate.py (Generator.draw) and tools/evaluate/scenes.py (draw_image)
    # each wrote out before: <bos> caption <boi>, text then structure, and <bos> <boi>.
    assert ids == [text.bos_id, *body, boi]
    assert modality == [int(Modality.TEXT)] * (1 + len(body)) + [int(Modality.STRUCTURE)]
    assert unconditional == [text.bos_id, boi]
    assert len(modality) == len(ids)
    # The unconditional side is the same request with its caption taken out, nothing else.
    assert unconditional == [ids[0], *ids[1 + len(body) :]]
    assert text.decode(ids[1:-1]) == caption

    # No caption at all: the request is its own unconditional twin.
    empty_ids, empty_modality, empty_unconditional = draw_prompt(
        [], bos_id=text.bos_id, layout=layout
    )
    assert empty_ids == empty_unconditional == [text.bos_id, boi]
    assert empty_modality == [int(Modality.TEXT), int(Modality.STRUCTURE)]


def test_caption_prompt_is_what_generate_and_the_scene_evaluation_built(tiny_tokenizers):
    import numpy as np

    from data.layout import image_tokens
    from tools.generate_requests import caption_prompt

    text = TextTokenizer.load(tiny_tokenizers[0])
    block, bmod = image_tokens(np.arange(6).reshape(2, 3), text.layout)
    body = text.encode("a red")
    for bidirectional in (False, True):
        ids, modality, image_ids = caption_prompt(
            block, bmod, body, bos_id=text.bos_id, bidirectional_images=bidirectional
        )
        # What Generator.caption wrote out before (the scene evaluation's: no text after).
        assert ids == [text.bos_id, *block.tolist(), *body]
        assert modality == [
            int(Modality.TEXT),
            *bmod.tolist(),
            *[int(Modality.TEXT)] * len(body),
        ]
        want = [-1] + [0] * len(block) + [-1] * len(body) if bidirectional else None
        assert image_ids == want
    bare_ids, _, bare_image_ids = caption_prompt(
        block, bmod, [], bos_id=text.bos_id, bidirectional_images=True
    )
    assert bare_ids == [text.bos_id, *block.tolist()]
    assert bare_image_ids == [-1] + [0] * len(block)
