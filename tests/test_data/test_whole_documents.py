"""``data.whole_documents``: a document that fits a row is never split across rows (long-context
stages); one that does not fit what is left of a row starts a later row, and one longer than a
row is still split. The compiled loop packs the same rows (tests/test_data/test_pack_kernel.py)."""

from __future__ import annotations

import numpy as np

from data.loader.packer import Doc, Packer, units_of

SEQ = 64
LENGTHS = [40, 30, 64, 10, 50, 100, 20, 45, 5, 63, 33]  # one longer than a row (100)


def pieces_by_doc(whole: bool) -> tuple[dict[int, list[tuple[int, int]]], int]:
    """sample -> its pieces (start, end) over all rows, and the rows packed."""
    docs = iter(
        Doc(
            source=0,
            sample=index,
            epoch=0,
            length=length,
            units=units_of(length, []),
            ids=np.arange(length, dtype=np.int32) + 10,
            mod=np.zeros(length, np.uint8),
        )
        for index, length in enumerate(LENGTHS)
    )
    packer = Packer(SEQ, pad_id=0, max_pending=4, whole_documents=whole)
    found: dict[int, list[tuple[int, int]]] = {}
    rows = 0
    while (row := packer.pack(lambda: next(docs, None))) is not None:
        rows += 1
        assert row.real <= SEQ
        for _, sample, start, end in row.pieces:
            found.setdefault(sample, []).append((start, end))
    return found, rows


def test_documents_that_fit_a_row_are_never_split():
    whole, whole_rows = pieces_by_doc(True)
    split, split_rows = pieces_by_doc(False)
    for sample, length in enumerate(LENGTHS):
        assert sum(end - start for start, end in whole[sample]) == length  # nothing lost
        if length <= SEQ:
            assert whole[sample] == [(0, length)], (sample, whole[sample])
    assert len(whole[LENGTHS.index(100)]) > 1  # longer than a row: split as before
    # Without the option the same documents are split at row ends, in fewer rows.
    assert any(len(split[s]) > 1 for s, n in enumerate(LENGTHS) if n <= SEQ)
    assert split_rows <= whole_rows
