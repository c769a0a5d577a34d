"""Shared fixtures: tiny configs and a packed mixed-modality batch built the way the loader packs."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data.layout import image_tokens
from data.vocab import Modality, VocabLayout
from model.attention import AttentionConfig
from model.layers import FFNConfig
from model.rope import LayoutTracker, RopeConfig
from model.transformer import TransformerConfig

LAYOUT = VocabLayout(text_size=512, fsq_levels=(8, 5, 5, 5), max_grid=16)


def tiny_config(**overrides) -> TransformerConfig:
    """dim 32, 2 layers, 4 heads over 2 KV heads, head_dim 8; fp32 on CPU."""
    attention = overrides.pop("attention", AttentionConfig(n_heads=4, n_kv_heads=2))
    cfg = TransformerConfig(
        dim=32,
        n_layers=overrides.pop("n_layers", 2),  # before the checks that count layers
        attention=attention,
        ffn=FFNConfig(hidden_dim=64),
        rope=overrides.pop("rope", RopeConfig()),
    )
    return dataclasses.replace(cfg.with_layout(LAYOUT), **overrides)


def image_doc(h: int, w: int, g: torch.Generator, caption: int = 3) -> tuple[list[int], list[int]]:
    """A caption, then an image block built by the real layout code (data.layout)."""
    ids = torch.randint(3, LAYOUT.text_size, (caption,), generator=g).tolist()
    codes = torch.randint(0, LAYOUT.num_codes, (h, w), generator=g).numpy()
    block, mods = image_tokens(codes, LAYOUT)
    return ids + block.tolist(), [int(Modality.TEXT)] * caption + [int(m) for m in mods]


def text_doc(n: int, modality: Modality, g: torch.Generator) -> tuple[list[int], list[int]]:
    return torch.randint(3, LAYOUT.text_size, (n,), generator=g).tolist(), [int(modality)] * n


def pack(docs: list[tuple[list[int], list[int]]], seq_len: int, image_blocks: bool = True) -> dict:
    """One packed row: documents back to back, positions reset per document, labels shifted
    inside each document (-100 at a document's last token and on padding), padding doc id -1."""
    ids, mods, labels, doc_ids, pos, thw, img = [], [], [], [], [], [], []
    n_img = 0
    for d, (toks, ms) in enumerate(docs):
        ids += toks
        mods += ms
        labels += toks[1:] + [-100]
        doc_ids += [d] * len(toks)
        pos += list(range(len(toks)))
        thw += LayoutTracker.positions(toks, LAYOUT).tolist()
        in_img = False
        for t in toks:  # image_ids: the tokens from <boi> to <eoi> form one block
            if t == LAYOUT.structure_id("<boi>"):
                in_img = True
            img.append(n_img if in_img else -1)
            if t == LAYOUT.structure_id("<eoi>"):
                in_img, n_img = False, n_img + 1
    pad = seq_len - len(ids)
    assert pad >= 0, "documents do not fit"
    ids += [0] * pad
    mods += [int(Modality.TEXT)] * pad
    labels += [-100] * pad
    doc_ids += [-1] * pad
    pos += list(range(pad))
    thw += [[p, p, p] for p in range(pad)]
    img += [-1] * pad
    t = lambda x: torch.tensor([x], dtype=torch.long)  # noqa: E731
    return {
        "input_ids": t(ids),
        "labels": t(labels),
        "modality": t(mods),
        "position_ids": t(pos),
        "position_thw": t(thw),
        "doc_ids": t(doc_ids),
        "image_ids": t(img),
        "num_real_tokens": torch.tensor(seq_len - pad),
    }


def cat_rows(rows: list[dict]) -> dict:
    return {
        k: torch.cat([r[k] for r in rows]) if r0.dim() else torch.stack([r[k] for r in rows])
        for k, r0 in rows[0].items()
    }


@pytest.fixture
def mixed_batch():
    """Two packed rows of 64 with text, code and captioned-image documents and padding."""
    g = torch.Generator().manual_seed(0)
    row0 = pack(
        [text_doc(20, Modality.TEXT, g), image_doc(3, 4, g), text_doc(14, Modality.CODE, g)], 64
    )
    row1 = pack(
        [
            image_doc(2, 5, g, caption=5),
            text_doc(18, Modality.CODE, g),
            text_doc(10, Modality.TEXT, g),
        ],
        64,
    )
    return cat_rows([row0, row1])


@pytest.fixture
def kit():
    """The helpers above, for tests (test modules cannot import conftest under importlib mode)."""
    import types

    return types.SimpleNamespace(
        layout=LAYOUT,
        tiny_config=tiny_config,
        image_doc=image_doc,
        text_doc=text_doc,
        pack=pack,
        cat_rows=cat_rows,
    )


@pytest.fixture
def one_thread():
    """Tiny models run fastest on one thread, and far more predictably on a shared machine
    (two cores shared with other jobs made 2-thread runs of the overfit test 20x slower)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)
