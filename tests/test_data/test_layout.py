"""Visual blocks in the sequence and back: round trips and strict parsing."""

from __future__ import annotations

import json

import numpy as np
import pytest

from data.layout import (
    image_block_len,
    image_tokens,
    parse_image,
    parse_video,
    video_block_len,
    video_tokens,
)
from data.vocab import Modality, VocabLayout

LAY = VocabLayout(text_size=1000, fsq_levels=(8, 5, 5, 5), max_grid=16)


def test_image_round_trip_and_shape():
    codes = np.random.default_rng(0).integers(0, LAY.num_codes, (3, 5))
    ids, mod = image_tokens(codes, LAY)
    assert len(ids) == image_block_len(3, 5)
    assert ids[0] == LAY.structure_id("<boi>") and ids[-1] == LAY.structure_id("<eoi>")
    assert (mod == Modality.IMAGE).sum() == 15 and (mod == Modality.STRUCTURE).sum() == len(
        ids
    ) - 15
    np.testing.assert_array_equal(parse_image(ids, LAY), codes)


def test_video_round_trip():
    codes = np.random.default_rng(1).integers(0, LAY.num_codes, (4, 2, 3))
    ids, mod = video_tokens(codes, LAY)
    assert len(ids) == video_block_len(4, 2, 3) and (mod == Modality.VIDEO).sum() == 24
    np.testing.assert_array_equal(parse_video(ids, LAY), codes)


def test_malformed_blocks_name_the_position():
    ids, _ = image_tokens(np.zeros((2, 2), int), LAY)
    bad = ids.copy()
    bad[4] = LAY.structure_id("<eol>")  # a row cut short
    with pytest.raises(ValueError, match="position 4: expected a code"):
        parse_image(bad, LAY)
    with pytest.raises(ValueError, match="ends early"):
        parse_image(ids[:-1], LAY)
    with pytest.raises(ValueError, match="after the end"):
        parse_image(np.concatenate([ids, [3]]), LAY)
    with pytest.raises(ValueError):
        image_tokens(np.full((2, 2), LAY.num_codes), LAY)
    with pytest.raises(ValueError):
        image_tokens(np.zeros((17, 2), int), LAY)  # beyond max_grid


def test_layout_ranges_and_persistence(tmp_path):
    assert LAY.visual_offset == 1000 + len(LAY.structure) and LAY.size == LAY.visual_offset + 1000
    LAY.save(tmp_path / "l.json")
    assert VocabLayout.load(tmp_path / "l.json") == LAY
    assert VocabLayout.load(tmp_path / "l.json").fingerprint() == LAY.fingerprint()
    # A layout without its version is not one this code saved: refused naming the file.
    record = json.loads((tmp_path / "l.json").read_text())
    del record["version"]
    (tmp_path / "old.json").write_text(json.dumps(record))
    with pytest.raises(ValueError, match=r"old.json: not a readable vocabulary layout .*version"):
        VocabLayout.load(tmp_path / "old.json")
