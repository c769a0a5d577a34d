"""Every command that takes a shard folder takes its fsspec URL too: ``earlyfuse-prep verify``,
``stats`` and ``preview`` and ``earlyfuse-eval`` on a real S3-compatible server (moto's, on
loopback: tests/s3_server.py) say what they say of the local folder. ``earlyfuse-eval --data
TOKENS/val`` evaluates the held-out split where ``ingest --val-fraction`` puts it, a source per
folder."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("moto")
pytest.importorskip("s3fs")

from s3_server import s3_with_bucket  # noqa: E402

from data.cli import main as prep  # noqa: E402
from data.ingest import ingest  # noqa: E402
from data.tokenize.encoder import TokenizeOptions  # noqa: E402
from data.tokenize.run import tokenize  # noqa: E402
from tools.evaluate import main as eval_main  # noqa: E402


@pytest.fixture(scope="module")
def s3():
    with s3_with_bucket() as server:
        yield server


@pytest.fixture(scope="module")
def split(tiny_corpus, tiny_tokenizers, tmp_path_factory):
    """Raw shards and token shards with a held-out split (``--val-fraction``): scenes and prose."""
    root = tmp_path_factory.mktemp("split")
    sources = [f"images:{tiny_corpus / 'scenes' / 'scenes.jsonl'}", f"text:{tiny_corpus / 'text'}"]
    assert ingest(root / "raw", sources, val_fraction=0.3)["finalized"]
    opts = TokenizeOptions(image_max_pixels=32 * 32)
    tokenize(root / "raw", root / "tokens", *tiny_tokenizers, opts=opts)
    return root


@pytest.fixture(scope="module")
def remote(s3, split):
    import fsspec

    fs = fsspec.filesystem("s3")
    for name in ("raw", "tokens"):
        fs.put(str(split / name), f"bucket/{name}", recursive=True)
    return fs


def said(capsys, argv: list[str]) -> tuple[int, str, str]:
    code = prep(argv)
    got = capsys.readouterr()
    return code, got.out, got.err


@pytest.mark.parametrize("folder", ["raw", "tokens"])
def test_verify_and_stats_read_a_bucket_as_a_folder(remote, split, folder, capsys):
    url, local = f"s3://bucket/{folder}", str(split / folder)
    code, out, _ = said(capsys, ["verify", url])
    assert code == 0 and out.startswith(f"{url}: ") and out.rstrip().endswith("OK")
    assert out.replace(url, local) == said(capsys, ["verify", local])[1]
    code, out, _ = said(capsys, ["stats", url, "--json"])
    assert code == 0
    got, want = json.loads(out), json.loads(said(capsys, ["stats", local, "--json"])[1])
    assert got.pop("folder") == url and want.pop("folder") == local
    assert got == want


def test_stats_of_a_token_folder_per_source_and_modality(split, capsys):
    code, out, _ = said(capsys, ["stats", str(split / "tokens"), "--json"])
    assert code == 0
    stats = json.loads(out)
    manifest = json.loads((split / "tokens" / "manifest.json").read_text())
    by_name = {s["name"]: s for s in stats["sources"]}
    assert set(by_name) == {"scenes", "val/scenes", "text", "val/text"}
    for source in manifest["sources"]:
        mine = by_name[source["name"]]
        assert mine["documents"] == source["samples"]
        assert mine["tokens"] == source["tokens"]
        for m in ("image", "video"):
            assert mine["blocks"][m]["blocks"] == source["blocks"][m]["blocks"]
            assert mine["blocks"][m]["longest"] == source["blocks"][m]["longest"]
    assert by_name["scenes"]["documents_with"]["image"] == by_name["scenes"]["documents"]
    text = said(capsys, ["stats", str(split / "tokens")])[1]
    assert "token shards" in text and "val/scenes" in text and "images (longest)" in text


def test_verify_names_the_object_a_problem_is_in(remote, split, capsys):
    manifest = json.loads((split / "tokens" / "manifest.json").read_text())
    shard = manifest["shards"][0]["path"]
    data = bytearray(remote.cat_file(f"bucket/tokens/{shard}"))
    data[600] ^= 0xFF  # inside the first sample's members
    remote.pipe_file(f"bucket/bad/{shard}", bytes(data))
    for rel in remote.find("bucket/tokens"):
        if not rel.endswith(shard):
            remote.copy(rel, rel.replace("bucket/tokens", "bucket/bad", 1))
    remote.invalidate_cache()
    code, out, _ = said(capsys, ["verify", "s3://bucket/bad"])
    assert code == 1
    assert f"s3://bucket/bad/{shard}: SHA-256 differs from the manifest" in out
    assert "/tmp" not in out  # named by its URL, never by the downloaded copy


def test_preview_reads_a_bucket(remote, split, capsys):
    argv = ["preview", "--seq-len", "256", "--rows", "2", "--source", "scenes"]
    code, out, _ = said(capsys, [*argv[:1], "s3://bucket/tokens", *argv[1:]])
    assert code == 0 and "row 0:" in out
    assert out == said(capsys, [*argv[:1], str(split / "tokens"), *argv[1:]])[1]


def test_eval_takes_the_held_out_split_locally_and_in_a_bucket(
    remote, split, debug_release, tmp_path, capsys
):
    local, url = tmp_path / "local.json", tmp_path / "s3.json"
    args = ["--train-data", str(split / "tokens"), "--max-pairs", "4"]
    assert (
        eval_main(
            [
                str(debug_release),
                "--data",
                str(split / "tokens" / "val"),
                "--out",
                str(local),
                *args,
            ]
        )
        == 0
    )
    err = capsys.readouterr().err
    assert "held-out" in err and "unigram" in err  # progress bars, on stderr
    ev = json.loads(local.read_text())
    assert set(ev["heldout"]["sources"]) == {"scenes", "text"}  # a source per folder of val/
    val_docs = sum(
        s["samples"]
        for s in json.loads((split / "tokens" / "manifest.json").read_text())["sources"]
        if s["name"].startswith("val/")
    )
    assert sum(ev["heldout"]["documents"].values()) == val_docs
    assert (
        eval_main(
            [
                str(debug_release),
                "--data",
                "s3://bucket/tokens/val",
                "--out",
                str(url),
                *args,
                "--no-progress",
            ]
        )
        == 0
    )
    assert "held-out" not in capsys.readouterr().err
    assert json.loads(url.read_text())["heldout"] == ev["heldout"]
