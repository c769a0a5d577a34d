"""Token shards are verifiable and the loader checks every sample it reads:
256 bytes flipped inside one sample's ids, or an id past the vocabulary with every hash made to
agree, are found by ``earlyfuse-prep verify`` and skipped, counted and named by the loader."""

from __future__ import annotations

import shutil

import pytest
from factories import flip_token_bytes, token_sample_with_id

from data.cli import main as prep_main
from data.loader import build_loader
from data.loader.config import LoaderConfig, SourceConfig
from data.loader.table_load import load_table
from data.shards.verify import verify
from data.token_docs import folder_sources
from data.vocab import VocabLayout


@pytest.fixture()
def tokens(tiny_tokens, tmp_path):
    out = tmp_path / "tokens"
    shutil.copytree(tiny_tokens, out)
    return out


def layout(tokens) -> VocabLayout:
    return VocabLayout.load(tokens / "tokenizers" / "vocab_layout.json")


def read_all(tokens, source, *, check_hashes=True):
    """Every document of one source, one epoch, one consumer: (documents, skipped)."""
    cfg = LoaderConfig(
        sources=[SourceConfig(name=source, shards=[str(tokens / source)])],
        seq_len=256,
        num_workers=0,
        mode="epoch",
        check_hashes=check_hashes,
    )
    loader = build_loader(cfg, rank=0, world_size=1, micro_batch=1)
    stream = loader.make_stream(0)
    docs = 0
    while not stream.cursors[0].done:  # one epoch's documents, each read once
        docs += stream.read_next(0) is not None
    return docs, stream.errors


def test_verify_accepts_an_intact_token_folder(tokens, capsys):
    r = verify(tokens)
    assert r["ok"] and r["format"] == "earlyfuse-token-shards" and r["samples"] > 0
    assert prep_main(["verify", str(tokens)]) == 0
    assert ": OK" in capsys.readouterr().out


def test_verify_finds_tokenizers_and_summaries_that_training_would_trust(tokens, tmp_path):
    """What training reads instead of the shards (the tokenizers/ folder, the manifest's token
    counts and visual blocks) is compared with what the shards hold; each change is named."""
    import json

    def problems(folder):
        r = verify(folder)
        assert not r["ok"]
        return r["problems"]

    for name, change, said in (
        ("no_text", lambda t: (t / "tokenizers/tokenizer.json").unlink(), "cannot load the text"),
        ("no_visual", lambda t: shutil.rmtree(t / "tokenizers/visual_tokenizer"), "no visual_"),
        (
            "cut_visual",
            lambda t: (t / "tokenizers/visual_tokenizer/model.safetensors").write_bytes(b"x"),
            "not the tokenizers the shards were made with (visual tokenizer differs",
        ),
    ):
        copy = tmp_path / name
        shutil.copytree(tokens, copy)
        change(copy)
        assert [said in p for p in problems(copy)] == [True], name
    copy = tmp_path / "summary"
    shutil.copytree(tokens, copy)
    m = json.loads((copy / "manifest.json").read_text())
    shard = next(s for s in m["shards"] if s["blocks"]["image"]["blocks"])
    shard["blocks"]["image"]["longest"] = 3  # would let a row of 3 tokens train on its images
    shard["tokens"]["text"] += 5
    (copy / "manifest.json").write_text(json.dumps(m))
    [said] = problems(copy)
    assert said.startswith(str(copy / shard["index"]))
    assert f"text tokens, the manifest says {shard['tokens']['text']}" in said
    assert "image blocks' longest" in said and "the manifest says 3" in said


def test_a_file_url_names_the_local_folder(tiny_tokens, capsys):
    """``file:///abs/path`` is the folder it names, to the prep commands and the token folder
    readers as to the loader."""
    url = f"file://{tiny_tokens}"
    for argv in (["verify"], ["stats", "--json"]):
        assert prep_main([argv[0], url, *argv[1:]]) == 0
        got = capsys.readouterr().out
        assert prep_main([argv[0], str(tiny_tokens), *argv[1:]]) == 0
        assert got == capsys.readouterr().out and got
    assert verify(url)["ok"] and folder_sources(url) == folder_sources(tiny_tokens)
    got = load_table(SourceConfig(name="code", shards=[f"{url}/code"]))
    assert (
        got.shards
        == load_table(SourceConfig(name="code", shards=[str(tiny_tokens / "code")])).shards
    )


def test_flipped_bytes_in_a_token_sample_are_found_and_skipped(tokens, capfd):
    tar = tokens / "scenes" / "shard-000000.tar"
    intact, _ = read_all(tokens, "scenes")
    key = flip_token_bytes(tar, 3)
    problems = verify(tokens)["problems"]
    assert f"{tar}: SHA-256 differs from the manifest" in problems
    assert f"{tar}: sample {key} does not match its hash" in problems
    assert prep_main(["verify", str(tokens)]) == 1
    capfd.readouterr()
    docs, skipped = read_all(tokens, "scenes")
    assert (docs, skipped) == (intact - 1, 1)
    err = capfd.readouterr().err
    assert f"[loader] skipped {tar} sample {key}: its members do not match the SHA-256" in err
    # Without the hash check the ids are still checked against the vocabulary: still skipped.
    assert read_all(tokens, "scenes", check_hashes=False) == (intact - 1, 1)
    assert "outside their modality's range" in capfd.readouterr().err


def test_an_id_past_the_vocabulary_is_found_and_skipped(tokens, capfd):
    tar = tokens / "digits" / "shard-000000.tar"
    intact, _ = read_all(tokens, "digits")
    size = layout(tokens).size
    key = token_sample_with_id(tar, 2, size + 7)
    assert verify(tokens)["problems"] == [
        f"{tar}: {key}: 1 id(s) outside their modality's range, the first: token 0 id "
        f"{size + 7} as text (range 0..{layout(tokens).text_size - 1})"  # its <|bos|>
    ]
    capfd.readouterr()
    assert read_all(tokens, "digits") == (intact - 1, 1)
    assert f"[loader] skipped {tar} sample {key}: 1 id(s) outside" in capfd.readouterr().err


@pytest.mark.parametrize("dtype", ["int32", "int64"])  # token shards / the raw path's arrays
def test_check_ids_finds_each_kind_of_bad_token(dtype):
    import numpy as np

    from data.loader.sample_check import check_ids

    # text and code [0, 2048), structure [2048, 3000), image and video codes [3000, 4000)
    ranges = np.array([[0, 2048], [0, 2048], [3000, 4000], [3000, 4000], [2048, 3000]])
    mod_dtype = "uint8" if dtype == "int32" else "int64"
    good_ids, good_mod = [1, 3500, 2050, 5], [0, 2, 4, 1]
    check_ids(np.array(good_ids, dtype), np.array(good_mod, mod_dtype), ranges)
    cases = [
        ([1, 3500, 2050, 2100], good_mod, "token 3 id 2100 as code"),
        ([-1, 3500, 2050, 5], good_mod, "token 0 id -1 as text"),  # int64 once wrapped to 0
        ([1, 4000, 2050, 5], good_mod, "token 1 id 4000 as image"),
        ([1, 3500, 2050, 5], [0, 2, 4, 9], "token 3: modality 9"),
        ([1, 2, 3, 3001], [0, 0, 0, 1], "token 3 id 3001 as code"),  # text/code only
    ]
    for ids, mod, message in cases:
        with pytest.raises(ValueError, match=message):
            check_ids(np.array(ids, dtype), np.array(mod, mod_dtype), ranges)


def test_the_token_document_readers_refuse_raw_shards(tiny_raw):
    """Whole documents are read from token shards only: a raw source is an error naming it, from
    the tables of a folder and from the document reader (not each document left out as
    unreadable)."""
    from data.token_docs import iter_documents, source_tables

    source = folder_sources(tiny_raw)[0]
    refused = f"source {source.name}: raw shards; tokenize them"
    with pytest.raises(ValueError, match=refused):
        source_tables(tiny_raw)
    with pytest.raises(ValueError, match=refused):
        next(iter_documents([load_table(source)]))


def test_a_missing_or_empty_folder_is_named_as_such(tmp_path):
    """A mistyped --data path says that nothing is there, not that shards are missing."""
    with pytest.raises(ValueError, match=rf"{tmp_path / 'nope'}: no such folder, or an empty one"):
        folder_sources(tmp_path / "nope")
    with pytest.raises(ValueError, match="empty one; ingest --val-fraction writes it"):
        folder_sources(tmp_path / "tokens" / "val")
    with pytest.raises(ValueError, match="empty one$"):  # a name that only ends in "val"
        folder_sources(tmp_path / "tokens" / "interval")
    (tmp_path / "docs").mkdir()
    (tmp_path / "docs" / "notes.txt").write_text("not a shard")
    with pytest.raises(ValueError, match="no shards here or in a folder directly below"):
        folder_sources(tmp_path)


def test_stats_of_the_held_out_folder_points_to_the_folder_that_describes_it(tokens, capsys):
    """TOKENS/val has no manifest of its own (TOKENS's lists its sources as val/NAME): stats says
    where to look instead of only that there is no manifest."""
    (tokens / "val" / "code").mkdir(parents=True)
    assert prep_main(["stats", str(tokens / "val")]) != 0
    err = capsys.readouterr().err
    assert (
        f"the held-out split is described by {tokens}'s, as its val/ sources: give {tokens}" in err
    )
    for not_held_out, said in (("code", "not an ingest output"), ("interval", "nothing is at")):
        (tokens / not_held_out).mkdir(exist_ok=True)  # a source's shards; an empty folder
        assert prep_main(["stats", str(tokens / not_held_out)]) != 0
        assert said in capsys.readouterr().err


def test_documents_behind_a_damaged_binary_index_are_left_out_and_named(tokens):
    """A cut .idx.bin: the start-up and held-out passes leave its documents out, each named by
    its shard and number (the index that would name its key is the damage), instead of raising
    from the handler that names them."""
    from data.token_docs import iter_documents

    source = folder_sources(tokens)[0]
    table = load_table(source)
    index_bin = next(tokens.glob(f"{source.name}/*.idx.bin"))
    index_bin.write_bytes(index_bin.read_bytes()[:16])
    skipped: list = []
    kept = list(iter_documents([table], skipped=skipped))
    assert skipped and len(kept) + len(skipped) == len(table)
    assert all(
        key.startswith("#") and str(index_bin.with_suffix("").with_suffix(".tar")) in key
        for _, key, _ in skipped
    )
