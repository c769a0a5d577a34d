"""Prep and the loader against a real S3-compatible server (moto's, started here on loopback,
behind a proxy that fails every Nth request): ingest writes to s3://, tokenize reads and writes
s3://, the loader reads s3:// token shards; the bytes are the local runs' bytes."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

pytest.importorskip("moto")
pytest.importorskip("s3fs")

from s3_server import s3_with_bucket  # noqa: E402
from test_data.test_loader import take  # noqa: E402
from test_data.test_loader_sources import cfg, same_batches  # noqa: E402

from data.ingest import ingest  # noqa: E402
from data.loader import SourceConfig, build_loader  # noqa: E402
from data.tokenize.run import tokenize  # noqa: E402


@pytest.fixture(scope="module")
def s3():
    with s3_with_bucket() as server:
        yield server


@pytest.fixture
def fs(s3):
    import fsspec

    fs = fsspec.filesystem("s3")
    fs.invalidate_cache()
    return fs


def remote_files(fs, url: str, skip: str) -> dict[str, bytes]:
    root = url[len("s3://") :]
    names = [n for n in fs.find(root) if f"/{skip}/" not in n]
    return {n[len(root) + 1 :]: fs.cat_file(n) for n in names}


def local_files(folder: Path, skip: str) -> dict[str, bytes]:
    return {
        str(p.relative_to(folder)): p.read_bytes()
        for p in folder.rglob("*")
        if p.is_file() and skip not in p.parts
    }


def comparable(files: dict[str, bytes], *drop: tuple[str, str]) -> dict[str, bytes]:
    """The manifest without the fields that name the command or the input's location."""
    m = json.loads(files["manifest.json"])
    for section, key in drop:
        m[section].pop(key)
    return {**files, "manifest.json": json.dumps(m, sort_keys=True).encode()}


def test_ingest_then_tokenize_through_a_flaky_s3(
    s3, fs, planted_corpus, tiny_tokenizers, tmp_path, monkeypatch
):
    local_raw, local_tok = tmp_path / "raw", tmp_path / "tok"
    ingest(local_raw, planted_corpus["sources"], shard_max_samples=2)
    tokenize(local_raw, local_tok, *tiny_tokenizers)

    # botocore would retry the 500s by itself; with one attempt, prep's own retries do it.
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")
    s3.proxy.fail_every, before = 6, s3.proxy.failed
    s = ingest("s3://bucket/raw", planted_corpus["sources"], shard_max_samples=2, workers=2)
    m = tokenize("s3://bucket/raw", "s3://bucket/tok", *tiny_tokenizers, workers=2)
    s3.proxy.fail_every = 0
    assert s["finalized"] and m["finalized"]
    assert s3.proxy.failed > before  # the server did fail requests, and the jobs succeeded

    got = comparable(remote_files(fs, "s3://bucket/raw", ".ingest"), ("created_by", "commands"))
    want = comparable(local_files(local_raw, ".ingest"), ("created_by", "commands"))
    assert got == want
    got = comparable(remote_files(fs, "s3://bucket/tok", ".tokenize"), ("inputs", "raw"))
    want = comparable(local_files(local_tok, ".tokenize"), ("inputs", "raw"))
    assert got == want
    # From the bucket into a local folder: the same files, the downloaded raw shards not left in it
    from_s3 = tmp_path / "tok_from_s3"
    tokenize("s3://bucket/raw", from_s3, *tiny_tokenizers)
    assert comparable(local_files(from_s3, ".tokenize"), ("inputs", "raw")) == want

    # A rerun finds every shard done through one listing and rewrites nothing.
    again = ingest("s3://bucket/raw", planted_corpus["sources"], shard_max_samples=2)
    assert again["written"] == 0 and again["finalized"]


def test_the_ingest_command_writes_a_validation_split_to_a_bucket(s3, fs, planted_corpus, capsys):
    """`earlyfuse-prep ingest --out s3://... --val-fraction F` as a user types it: the summary
    names where the split went, and the exit status says rejects (not a crash after writing)."""
    from data.cli import EXIT_REJECTS, main

    argv = ["ingest", "--out", "s3://bucket/cli_split", "--val-fraction", "0.5", "--no-progress"]
    for source in planted_corpus["sources"]:
        argv += ["--source", source]
    assert main(argv) == EXIT_REJECTS
    out = capsys.readouterr().out
    assert "in s3://bucket/cli_split/val/<source>/; training data in s3://bucket/cli_split/" in out
    m = json.loads(fs.cat_file("bucket/cli_split/manifest.json"))
    held = sum(s["samples"] for s in m["sources"] if s["name"].startswith("val/"))
    assert held and f"by key hash): {held} samples" in out


@pytest.mark.parametrize("source", ["text:s3://bucket/gone.parquet", "wds:s3://nobucket/tars"])
def test_a_source_url_with_nothing_there_is_named_as_missing(s3, source):
    """Not "ingest reads .parquet tables" for a .parquet that is not there: the URL is named as
    missing, with what to check."""
    from data.sources import parse_sources

    with pytest.raises(ValueError, match=r"s3://\S+ does not exist \(no object or prefix there"):
        parse_sources([source])


def test_a_bucket_that_does_not_exist_is_named_with_the_url(s3, planted_corpus, capsys):
    from data.cli import main

    argv = ["ingest", "--out", "s3://nobucket/raw", "--no-progress", "--source"]
    assert main(argv + [planted_corpus["sources"][0]]) == 2
    err = capsys.readouterr().err
    assert "error: s3://nobucket/raw/" in err and "bucket does not exist" in err
    assert main(["stats", "s3://nobucket/raw"]) == 2  # read: not "run merge"
    said = "s3://nobucket/raw/manifest.json: no manifest (nothing is at s3://nobucket/raw: check"
    assert said in capsys.readouterr().err


def test_the_loader_reads_s3_token_shards_through_failures(s3, fs, tiny_tokens):
    fs.put(str(tiny_tokens), "bucket/tiny_tokens", recursive=True)
    local = [SourceConfig(name="code", shards=[str(tiny_tokens / "code")], weight=2.0)]
    local.append(SourceConfig(name="clips", shards=[str(tiny_tokens / "clips" / "*.tar")]))
    remote = [SourceConfig(name="code", shards=["s3://bucket/tiny_tokens/code"], weight=2.0)]
    remote.append(SourceConfig(name="clips", shards=["s3://bucket/tiny_tokens/clips/*.tar"]))
    s3.proxy.fail_every, before = 5, s3.proxy.failed
    try:
        got = take(build_loader(cfg(remote), rank=0, world_size=1, micro_batch=2), 5)
    finally:
        s3.proxy.fail_every = 0
    assert s3.proxy.failed > before
    same_batches(got, take(build_loader(cfg(local), rank=0, world_size=1, micro_batch=2), 5))
    assert "AWS_MAX_ATTEMPTS" not in os.environ


def test_parquet_hugging_face_and_wds_sources_read_from_s3(
    s3, fs, planted_corpus, tmp_path, monkeypatch
):
    pa = pytest.importorskip("pyarrow")
    pq = pytest.importorskip("pyarrow.parquet")
    datasets = pytest.importorskip("datasets")
    from factories import jpeg_bytes

    images = pa.table(
        {
            "image": [jpeg_bytes(seed=i) for i in range(6)] + [None],
            "caption": [f"noise {i}" for i in range(7)],
        }
    )
    pq.write_table(images, tmp_path / "laion.parquet", row_group_size=3)
    paths = pa.table({"image": ["pics/a.jpg"], "caption": ["a path"]})
    pq.write_table(paths, tmp_path / "paths.parquet")
    datasets.Dataset.from_dict({"text": ["one", "two", "three"]}).save_to_disk(
        str(tmp_path / "hf_text")
    )
    for name in ("laion.parquet", "paths.parquet"):
        fs.put_file(str(tmp_path / name), f"bucket/in/{name}")
    fs.put(str(tmp_path / "hf_text"), "bucket/in/hf_text", recursive=True)
    wds_dir = planted_corpus["root"] / "wds"  # img2dataset-style tar: a duplicate, an unsafe key
    fs.put(str(wds_dir), "bucket/in/wds", recursive=True)

    local, remote = tmp_path / "local", tmp_path / "remote"
    ingest(
        local,
        [f"images:{tmp_path / 'laion.parquet'}", f"text:{tmp_path / 'hf_text'}", f"wds:{wds_dir}"],
    )
    monkeypatch.setenv("AWS_MAX_ATTEMPTS", "1")  # prep's own retries, as above
    s3.proxy.fail_every, before = 6, s3.proxy.failed
    try:
        s = ingest(
            remote,
            [
                "images:s3://bucket/in/laion.parquet",
                "text:s3://bucket/in/hf_text",
                "wds:s3://bucket/in/wds",
            ],
            workers=2,
        )
    finally:
        s3.proxy.fail_every = 0
    assert s3.proxy.failed > before
    assert s["manifest"]["totals"]["samples"] == 6 + 3 + 2
    assert s["manifest"]["totals"]["rejects_by_reason"] == {
        "bad-record": 1,
        "duplicate-key": 1,
        "unsafe-name": 1,
    }
    assert local_files(remote, ".ingest").keys() == local_files(local, ".ingest").keys()
    for name, data in local_files(local, ".ingest").items():
        if name != "manifest.json":  # it names the sources' paths
            assert local_files(remote, ".ingest")[name] == data, name
    # Media paths relative to a remote table are never fetched one by one: a reject, named.
    monkeypatch.delenv("AWS_MAX_ATTEMPTS")
    s = ingest(tmp_path / "paths", ["images:s3://bucket/in/paths.parquet"])
    assert s["manifest"]["totals"]["rejects_by_reason"] == {"missing-media": 1}
