"""``data.whole_documents``: a document that fits a row is never split across rows (long-context
stages); one that does not fit what is left of a row starts a later row, and one longer than a
row is still split. Checked on documents packed in order (``pack_documents``); the loader's
streams run the same loop (tests/test_data/test_pack_kernel.py)."""

from __future__ import annotations

from types import SimpleNamespace

import numpy as np

from data.loader import pack_documents

SEQ = 64
LENGTHS = [40, 30, 64, 10, 50, 100, 20, 45, 5, 63, 33]  # one longer than a row (100)


def pieces_by_doc(whole: bool) -> tuple[dict[int, list[tuple[int, int]]], int]:
    """sample -> its pieces (start, end) over all rows, and the rows packed. Each token's id is
    1000 x its document's number + its position in the document, so a row's ids say which
    document each of its pieces is of and where it lies."""
    docs = [
        SimpleNamespace(
            ids=1000 * sample + np.arange(length, dtype=np.int32),
            modality=np.zeros(length, np.uint8),
            blocks=[],
        )
        for sample, length in enumerate(LENGTHS)
    ]
    found: dict[int, list[tuple[int, int]]] = {}
    rows = 0
    for batch in pack_documents(docs, SEQ, whole_documents=whole):
        rows += 1
        real = int(batch["num_real_tokens"])
        assert real <= SEQ
        ids, doc_ids = batch["input_ids"][0, :real].numpy(), batch["doc_ids"][0, :real].numpy()
        for piece in np.unique(doc_ids):
            tokens = ids[doc_ids == piece]
            sample, start = divmod(int(tokens[0]), 1000)
            found.setdefault(sample, []).append((start, start + len(tokens)))
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
