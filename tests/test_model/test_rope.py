"""RoPE and M-RoPE, and the (t, h, w) layout of a token stream."""

from __future__ import annotations

import dataclasses

import pytest
import torch

from data.vocab import Modality
from model.rope import LayoutTracker, RopeConfig, RotaryEmbedding, apply_rotary

pytestmark = pytest.mark.usefixtures("one_thread")


def test_mrope_with_equal_thw_is_1d_rope():
    pos = torch.randint(0, 5000, (2, 17))
    one = RotaryEmbedding(16, RopeConfig(theta=10_000.0))
    multi = RotaryEmbedding(16, RopeConfig(theta=10_000.0, mrope_sections=[2, 3, 3]))
    c1, s1 = one(pos)
    c3, s3 = multi(pos, pos[..., None].expand(2, 17, 3))
    assert torch.equal(c1, c3) and torch.equal(s1, s3)


def test_mrope_model_with_equal_thw_equals_1d_model(kit, mixed_batch):
    torch.manual_seed(0)
    cfg = kit.tiny_config()
    plain = cfg.build().eval()
    mrope = dataclasses.replace(cfg, rope=RopeConfig(mrope_sections=[2, 1, 1])).build().eval()
    mrope.load_state_dict(plain.state_dict())
    b = mixed_batch
    with torch.no_grad():
        a = plain(b["input_ids"], position_ids=b["position_ids"], doc_ids=b["doc_ids"])
        same = b["position_ids"][..., None].expand(-1, -1, 3)
        m = mrope(
            b["input_ids"], position_ids=b["position_ids"], position_thw=same, doc_ids=b["doc_ids"]
        )
        grid = mrope(
            b["input_ids"],
            position_ids=b["position_ids"],
            position_thw=b["position_thw"],
            doc_ids=b["doc_ids"],
        )
    assert torch.equal(a, m)
    assert (a - grid).abs().max() > 1e-4  # real (t, h, w) positions do change image tokens


def test_rotary_is_relative():
    """q.k after RoPE depends only on the position difference."""
    rope = RotaryEmbedding(8, RopeConfig())
    q, k = torch.randn(1, 1, 1, 8), torch.randn(1, 1, 1, 8)

    def score(pq, pk):
        cq, sq = rope(torch.tensor([[pq]]))
        ck, sk = rope(torch.tensor([[pk]]))
        return (apply_rotary(q, cq, sq) * apply_rotary(k, ck, sk)).sum()

    torch.testing.assert_close(score(7, 3), score(104, 100))
    assert not torch.allclose(score(7, 3), score(7, 4))


def test_mrope_sections_must_fill_head_dim():
    with pytest.raises(ValueError, match="sum to head_dim"):
        RotaryEmbedding(16, RopeConfig(mrope_sections=[2, 2, 2]))


def test_layout_positions_of_an_image(kit):
    L = kit.layout
    sid = L.structure_id
    h2, w3 = L.size_ids(2, 3)
    c = L.code_id(0)
    ids = [
        7,
        8,
        sid("<boi>"),
        h2,
        w3,
        c,
        c,
        c,
        sid("<eol>"),
        c,
        c,
        c,
        sid("<eol>"),
        sid("<eoi>"),
        9,
    ]
    tr = LayoutTracker(L)
    out = [tr.push(t) for t in ids]
    pos = [p for p, _ in out]
    mods = [int(m) for _, m in out]
    s = 5  # the first grid token follows text(2) + <boi> <h> <w>
    assert pos[:5] == [(i, i, i) for i in range(5)]
    assert pos[5:9] == [(s, s, s), (s, s, s + 1), (s, s, s + 2), (s, s, s + 3)]
    assert pos[9:13] == [(s, s + 1, s), (s, s + 1, s + 1), (s, s + 1, s + 2), (s, s + 1, s + 3)]
    assert pos[13] == (s + 4, s + 4, s + 4) and pos[14] == (
        s + 5,
        s + 5,
        s + 5,
    )  # resume past the grid
    assert mods == [0, 0] + [int(Modality.STRUCTURE)] * 3 + [2, 2, 2, 4, 2, 2, 2, 4, 4, 0]
    assert LayoutTracker.positions(ids, L).shape == (15, 3)


def test_layout_positions_of_a_video(kit):
    L = kit.layout
    sid = L.structure_id
    h1, w2 = L.size_ids(1, 2)
    c = L.code_id(1)
    ids = [
        sid("<bov>"),
        h1,
        w2,
        sid("<frame>"),
        c,
        c,
        sid("<eol>"),
        sid("<frame>"),
        c,
        c,
        sid("<eol>"),
        sid("<eov>"),
    ]
    tr = LayoutTracker(L)
    out = [tr.push(t) for t in ids]
    s = 3
    assert [p for p, _ in out][3:11] == [
        (s, s, s),
        (s, s, s),
        (s, s, s + 1),
        (s, s, s + 2),
        (s + 1, s, s),
        (s + 1, s, s),
        (s + 1, s, s + 1),
        (s + 1, s, s + 2),
    ]
    assert int(out[4][1]) == Modality.VIDEO
