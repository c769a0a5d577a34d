"""Token shards checked whole when first read (data/loader/shard_check.py): a shard whose
tar matches its manifest's SHA-256 and whose ids all lie in their ranges is read without
per-document checks; a shard that fails is read and checked document by document, so a bad
document costs that document only. Either way the batches are the same."""

from __future__ import annotations

import hashlib
import json
import shutil

import pytest
import torch
from factories import flip_token_bytes, token_sample_with_id

from data.loader import build_loader
from data.loader.config import LoaderConfig, SourceConfig
from data.vocab import VocabLayout

SOURCES = ("code", "text", "scenes", "digits", "clips", "docs")


@pytest.fixture()
def tokens(tiny_tokens, tmp_path):
    out = tmp_path / "tokens"
    shutil.copytree(tiny_tokens, out)
    return out


def config(tokens, sources=SOURCES, **kw) -> LoaderConfig:
    return LoaderConfig(
        sources=[SourceConfig(name=s, shards=[str(tokens / s)]) for s in sources],
        **{"seq_len": 256, "num_workers": 0, "shuffle_buffer": 8, "mode": "epoch", **kw},
    )


def read_source(tokens, source, **kw):
    """One epoch of one source, one consumer: (documents read, skipped, the stream)."""
    loader = build_loader(config(tokens, (source,), **kw), rank=0, world_size=1, micro_batch=1)
    stream = loader.make_stream(0)
    docs = 0
    while not stream.cursors[0].done:  # one epoch's documents, each read once
        docs += stream.read_next(0) is not None
    return docs, stream.errors, stream


def checked(stream) -> dict[int, bool]:
    """Shard -> whether it passed the whole-shard check (read without per-document checks)."""
    return {si: docs is not None for (_, si), docs in stream._checked.items()}


def batches(tokens, n=12, **kw) -> list[dict]:
    loader = build_loader(
        config(tokens, mode="infinite", **kw), rank=0, world_size=1, micro_batch=2
    )
    it = iter(loader)
    out = [next(it) for _ in range(n)]
    it.close()
    return out


def test_tokenize_records_each_tars_sha256_and_intact_shards_pass_whole(tokens):
    manifest = json.loads((tokens / "manifest.json").read_text())
    for shard in manifest["shards"]:
        assert shard["sha256"] == hashlib.sha256((tokens / shard["path"]).read_bytes()).hexdigest()
    for source in SOURCES:
        docs, skipped, stream = read_source(tokens, source)
        assert docs > 0 and skipped == 0
        assert checked(stream) and all(checked(stream).values()), source
        assert stream.watchdog.current is None  # a check done is not a read that stalls


def test_a_flipped_byte_costs_its_document_only(tokens, capfd):
    intact, _, _ = read_source(tokens, "scenes")
    tar = tokens / "scenes" / "shard-000000.tar"
    key = flip_token_bytes(tar, 3, n=1)  # one byte of one document's ids
    docs, skipped, stream = read_source(tokens, "scenes")
    # the shard no longer matches its digest: read document by document, the bad one skipped
    assert checked(stream)[0] is False
    assert (docs, skipped) == (intact - 1, 1)
    err = capfd.readouterr().err
    assert f"[loader] skipped {tar} sample {key}: its members do not match the SHA-256" in err


def test_an_id_out_of_range_fails_the_whole_shard_check_and_costs_one_document(tokens, capfd):
    intact, _, _ = read_source(tokens, "digits")
    tar = tokens / "digits" / "shard-000000.tar"
    size = VocabLayout.load(tokens / "tokenizers" / "vocab_layout.json").size
    key = token_sample_with_id(tar, 2, size + 7)  # every hash agrees: only the id check finds it
    docs, skipped, stream = read_source(tokens, "digits")
    assert checked(stream)[0] is False
    assert (docs, skipped) == (intact - 1, 1)
    assert f"[loader] skipped {tar} sample {key}: 1 id(s) outside" in capfd.readouterr().err


def test_a_manifest_without_shard_digests_is_refused(tokens):
    """Tokenize records every tar's SHA-256; a manifest without them is not one it wrote."""
    # Without hash checks the whole-shard id check still runs (no digest needed).
    _, _, stream = read_source(tokens, "scenes", check_hashes=False)
    assert all(checked(stream).values())
    path = tokens / "manifest.json"
    manifest = json.loads(path.read_text())
    for shard in manifest["shards"]:
        del shard["sha256"]
    path.write_text(json.dumps(manifest))
    with pytest.raises(ValueError, match=r"manifest.json lists .* without sha256; .*tokenize"):
        batches(tokens)


def test_shards_shared_by_many_consumers_are_checked_document_by_document(tokens):
    whole = read_source(tokens, "scenes")
    alone = read_source(tokens, "scenes", whole_shard_check_max_consumers=0)
    assert alone[2]._checked == {} and (alone[0], alone[1]) == (whole[0], whole[1])


def test_a_worker_packs_int32_and_the_trainer_gets_the_same_batches(tokens):
    in_process = batches(tokens, n=8)
    with_worker = batches(tokens, n=8, num_workers=1)
    for a, b in zip(in_process, with_worker):
        assert set(a) == set(b)
        for key in a:
            assert b[key].dtype == a[key].dtype, key
            assert torch.equal(a[key], b[key]), key
        # batch_buffer.BATCH_DTYPES: int64 labels (cross-entropy targets), the rest int32
        assert b["input_ids"].dtype == torch.int32 and b["labels"].dtype == torch.int64


def test_a_member_stored_other_than_tokenize_writes_it_is_never_read_from_a_wrong_place():
    """The whole-shard check locates each document's values in the shard's map from its .npy
    header. A member np.load reads but written otherwise (a version 2 header; a Fortran-ordered
    or 2-D array) is not located: the shard goes document by document (np.load copies), never
    read at a guessed offset. A short payload fails the same way."""
    import io

    import numpy as np

    from data.loader.shard_check import check_shard
    from data.shards.token_index import RECORD, TokenIndex

    def shard(version=None, ids=None):
        ids = np.arange(5, dtype="<i4") if ids is None else ids
        mod = np.zeros(5, np.uint8)
        parts, at = [], 0
        record = np.zeros(1, RECORD)
        for name, array in (("ids", ids), ("mod", mod)):
            buf = io.BytesIO()
            np.lib.format.write_array(buf, array, version=version if name == "ids" else None)
            data = buf.getvalue()
            record[name] = (at, len(data))
            parts.append(data)
            at += len(data)
        record["tokens"] = 5
        blob = b"".join(parts)
        index = TokenIndex({}, record, np.zeros((0, 5), np.int64), np.zeros(0, np.uint8))
        return memoryview(blob), index

    def whole(mapped, index):
        return check_shard(mapped, index, shard_sha256="", id_ranges=None, check_hash=False)

    good = whole(*shard())
    assert good is not None
    ids, mod, _ = good.document(0)
    assert ids.tolist() == [0, 1, 2, 3, 4] and mod.tolist() == [0] * 5
    assert whole(*shard(version=(2, 0))) is None
    assert whole(*shard(ids=np.asfortranarray(np.arange(6, dtype="<i4").reshape(2, 3)))) is None
    mapped, index = shard()
    index.records["ids"][0, 1] -= 1  # the index claims one byte fewer than the values need
    assert whole(mapped, index) is None


def test_the_headers_of_a_shards_members_are_read_at_once_as_one_by_one(tokens):
    """``npy_layouts`` (every member of a shard at once, each distinct header template parsed
    once) gives what ``npy_layout`` gives member by member, on real token shards and on
    lengths of every number of digits; a member of another kind fails the whole call."""
    import io

    import numpy as np

    from data.shards.npy import npy_layout, npy_layouts
    from data.shards.token_index import TokenIndex

    tar = tokens / "code" / "shard-000000.tar"
    shard = np.fromfile(tar, np.uint8)
    records = TokenIndex.open(tar.with_suffix(".idx.bin")).records
    for field in ("ids", "mod"):
        at, size = records[field][:, 0], records[field][:, 1]
        dtype, lengths, starts = npy_layouts(shard, at, size)
        one_by_one = [npy_layout(memoryview(shard)[a : a + n]) for a, n in zip(at, size)]
        assert {layout[0] for layout in one_by_one} == {dtype}
        assert (
            lengths.tolist() == [layout[1] for layout in one_by_one] == records["tokens"].tolist()
        )
        assert starts.tolist() == [a + layout[2] for a, layout in zip(at, one_by_one)]
    members, at, size = [], [], []
    for n in (0, 7, 10, 99, 1000, 123456, 2048, 5):
        data = io.BytesIO()
        np.save(data, np.arange(n, dtype="<i4"))
        at.append(sum(len(m) for m in members))
        members.append(data.getvalue())
        size.append(len(members[-1]))
    buffer = np.frombuffer(b"".join(members), np.uint8)
    _, lengths, _ = npy_layouts(buffer, np.asarray(at), np.asarray(size))
    assert lengths.tolist() == [0, 7, 10, 99, 1000, 123456, 2048, 5]
    data = io.BytesIO()
    np.save(data, np.arange(3, dtype="<i8"))  # another dtype among them
    mixed = np.frombuffer(b"".join(members) + data.getvalue(), np.uint8)
    other = np.asarray([*size, len(data.getvalue())])
    assert npy_layouts(mixed, np.asarray([*at, len(buffer)]), other) is None


def test_the_compiled_id_check_finds_every_kind_of_bad_token():
    """``first_bad_document`` checks ids in place, document by document: a negative id, an id
    past its modality's range, a modality past the layout, in text or visual documents."""
    import numpy as np

    from data.loader.sample_check import _text_below
    from data.loader.shard_check import first_bad_document

    ranges = np.asarray([[0, 100], [0, 100], [120, 200], [120, 200], [100, 120]], np.int64)
    good_ids, good_mod = [5, 99, 0, 150, 110, 7], [0, 1, 1, 2, 4, 0]
    cases = {
        "good": (good_ids, good_mod, -1),
        "negative id": ([5, -1, 0], [0, 0, 0], 1),
        "text id past the text": ([5, 100, 0], [0, 0, 0], 1),
        "visual id below the codes": ([5, 119, 0], [0, 2, 0], 1),
        "modality past the layout": ([5, 6, 0], [0, 5, 0], 1),
    }
    for name, (ids, mod, want) in cases.items():
        docs = [(good_ids, good_mod), (ids, mod), (good_ids, good_mod)]
        blob, ids_at, mod_at = b"", [], []
        for doc_ids, doc_mod in docs:
            ids_at.append(len(blob))
            blob += np.asarray(doc_ids, "<i4").tobytes()
            mod_at.append(len(blob))
            blob += np.asarray(doc_mod, np.uint8).tobytes()
            blob += b"\0" * (-len(blob) % 4)  # the next ids aligned, as in a tar
        lengths = np.asarray([len(doc_ids) for doc_ids, _ in docs], np.int64)
        for below in (_text_below(ranges), -1):  # the two maxima first, and token by token
            got = first_bad_document(
                np.frombuffer(blob, np.uint8),
                np.asarray(ids_at, np.int64),
                np.asarray(mod_at, np.int64),
                lengths,
                ranges,
                below,
            )
            assert got == want, (name, below)


def test_the_next_shard_is_checked_ahead_in_a_thread(tokens, monkeypatch):
    """While a consumer reads a shard, the next shard of its epoch order is checked in a thread
    of its own (stream.ConsumerStream._check_ahead), so the stream does not stop for the check
    when it gets there; each shard is still checked once, and every document read as before."""
    import threading

    from data.loader import stream as stream_module

    checked_in: list[str] = []
    real_check = stream_module.check_shard

    def check_and_note_the_thread(*args, **kwargs):
        checked_in.append(threading.current_thread().name)
        return real_check(*args, **kwargs)

    intact = read_source(tokens, "scenes")
    monkeypatch.setattr(stream_module, "check_shard", check_and_note_the_thread)
    docs, skipped, stream = read_source(tokens, "scenes")
    assert (docs, skipped) == (intact[0], intact[1]) and len(checked(stream)) == 2
    assert all(checked(stream).values()) and not stream._ahead
    assert checked_in[0] == threading.current_thread().name  # the first: when it is first read
    assert len(checked_in) == 2 and checked_in[1].startswith("earlyfuse-shard-check")
