"""Where a loader's shards come from: fsspec URLs and ``pipe:`` commands give the batches local
paths give; raw shards are tokenized in the workers into the ids offline tokenization gives."""

from __future__ import annotations

import shutil

import fsspec
import pytest
import torch
from test_data.test_loader import take

from data.loader import LoaderConfig, SourceConfig, build_loader, store
from data.loader.config import OnlineTokenizeConfig
from data.loader.table_load import load_table

# The options tiny_tokens was tokenized with (tests/conftest.py).
TINY_OPTS = OnlineTokenizeConfig(
    image_max_pixels=32 * 32, video_max_pixels=32 * 32, video_max_tokens=240
)


def cfg(sources, **kw) -> LoaderConfig:
    return LoaderConfig(
        sources=sources, **{"seq_len": 256, "num_workers": 0, "shuffle_buffer": 8, **kw}
    )


def same_batches(a, b) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x.keys() == y.keys()
        for k in x:
            assert torch.equal(x[k], y[k]), k


def test_pipe_commands_give_the_local_batches(tiny_tokens, tmp_path):
    n = len(sorted((tiny_tokens / "code").glob("*.tar")))
    local = [
        SourceConfig(name="code", shards=[str(tiny_tokens / "code")]),
        SourceConfig(name="scenes", shards=[str(tiny_tokens / "scenes")]),
    ]
    piped = [
        SourceConfig(
            name="code", shards=[f"pipe:cat {tiny_tokens}/code/shard-{{000000..{n - 1:06d}}}.tar"]
        ),
        SourceConfig(
            name="scenes",
            shards=[f"pipe:cat {p}" for p in sorted((tiny_tokens / "scenes").glob("*.tar"))],
        ),
    ]
    want = take(build_loader(cfg(local), rank=0, world_size=1, micro_batch=2), 6)
    # Two workers share the node-local cache: each shard is fetched once, by whoever needs it first.
    got = take(
        build_loader(
            cfg(piped, num_workers=2, cache_dir=str(tmp_path / "cache")),
            rank=0,
            world_size=1,
            micro_batch=2,
        ),
        6,
    )
    want_w = take(build_loader(cfg(local, num_workers=2), rank=0, world_size=1, micro_batch=2), 6)
    same_batches(got, want_w)
    assert len(list((tmp_path / "cache").glob("*.tar"))) >= 1
    assert len(want) == 6
    # The same data through another URL kind has the same fingerprint: a state moves between them.
    a = build_loader(cfg(local), rank=0, world_size=1, micro_batch=2)
    b = build_loader(cfg(piped), rank=0, world_size=1, micro_batch=2)
    assert [t.fingerprint for t in a.tables] == [t.fingerprint for t in b.tables]


def test_a_failing_pipe_command_is_named_at_start(tiny_tokens):
    bad = SourceConfig(name="code", shards=[f"pipe:cat {tiny_tokens}/code/no-such-shard.tar"])
    with pytest.raises(ValueError, match="no-such-shard.idx.jsonl.*exited with 1"):
        build_loader(cfg([bad]), rank=0, world_size=1, micro_batch=2)
    with pytest.raises(ValueError, match="must name its shard"):
        store.index_url("pipe:curl -s http://host/shard")
    assert (
        store.index_url("pipe:cat /a/b/shard-000001.tar|zstd -d")
        == "pipe:cat /a/b/shard-000001.idx.jsonl|zstd -d"
    )
    assert (
        store.sibling("pipe:cat '/a/b/shard-000001.tar'", "manifest.json", 1)
        == "pipe:cat '/a/manifest.json'"
    )


@pytest.fixture
def memory_tokens(tiny_tokens):
    """The token folder copied into fsspec's in-memory filesystem (a real fsspec backend)."""
    fs = fsspec.filesystem("memory")
    for p in tiny_tokens.rglob("*"):
        if p.is_file():
            fs.pipe_file(f"/tokens/{p.relative_to(tiny_tokens)}", p.read_bytes())
    yield "memory://tokens"
    fs.rm("/tokens", recursive=True)


def test_fsspec_urls_give_the_local_batches(tiny_tokens, memory_tokens):
    local = [
        SourceConfig(name="code", shards=[str(tiny_tokens / "code")], weight=2.0),
        SourceConfig(name="clips", shards=[str(tiny_tokens / "clips" / "*.tar")]),
    ]
    remote = [
        SourceConfig(name="code", shards=[f"{memory_tokens}/code"], weight=2.0),  # a folder
        SourceConfig(name="clips", shards=[f"{memory_tokens}/clips/*.tar"]),
    ]  # a glob
    assert len(load_table(remote[0]).shards) == len(load_table(local[0]).shards) > 0
    same_batches(
        take(build_loader(cfg(remote), rank=0, world_size=1, micro_batch=2), 5),
        take(build_loader(cfg(local), rank=0, world_size=1, micro_batch=2), 5),
    )
    with pytest.raises(ValueError, match="memory://tokens/code/nope.tar does not exist"):
        build_loader(
            cfg([SourceConfig(name="x", shards=[f"{memory_tokens}/code/nope.tar"])]),
            rank=0,
            world_size=1,
            micro_batch=2,
        )


def raw_cfg(tiny_raw, tiny_tokens, sources=("code", "scenes", "clips"), **kw) -> LoaderConfig:
    srcs = [SourceConfig(name=s, shards=[str(tiny_raw / s)]) for s in sources]
    return cfg(srcs, tokenizers=str(tiny_tokens / "tokenizers"), tokenize=TINY_OPTS, **kw)


def token_docs(tiny_tokens, source) -> dict[str, torch.Tensor]:
    from data.shards.npy import read_npy

    t = load_table(SourceConfig(name=source, shards=[str(tiny_tokens / source)]))
    out = {}
    for i in range(len(t)):
        offset, size = t.locate_members(i)[5:7]  # of the ids member
        with open(t.shards[t.shard_of(i)], "rb") as f:
            f.seek(offset)
            out[t.key_of(i)] = torch.from_numpy(read_npy(f.read(size)).astype("int64"))
    return out


def test_raw_shards_are_tokenized_in_the_workers_like_offline(tiny_raw, tiny_tokens):
    sources = ("code", "scenes", "clips")
    ld = build_loader(
        raw_cfg(tiny_raw, tiny_tokens, sources, num_workers=2), rank=0, world_size=1, micro_batch=2
    )
    assert [t.kind for t in ld.tables] == ["raw"] * 3
    batches = take(ld, 8)
    offline = {s: token_docs(tiny_tokens, s) for s in sources}
    seen = 0
    for b in batches:
        for r in range(b["input_ids"].shape[0]):
            for j, (s, sample, a, e) in enumerate(b["pieces"][r].tolist()):
                if s < 0:
                    continue
                got = b["input_ids"][r][b["doc_ids"][r] == j]
                assert torch.equal(got, offline[sources[s]][ld.tables[s].keys[sample]][a:e])
                seen += 1
    assert seen > 0
    d = ld.delivered()
    assert d["errors"] == 0 and d["dropped_blocks"] == 0


def test_raw_sources_resume_exactly_and_fit_blocks_to_rows(tiny_raw, tiny_tokens):
    c = raw_cfg(tiny_raw, tiny_tokens, ("scenes", "clips", "code"), num_workers=2, seq_len=96)
    full = take(build_loader(c, rank=0, world_size=1, micro_batch=2), 7)
    ld = build_loader(c, rank=0, world_size=1, micro_batch=2)
    take(ld, 3)
    state = ld.state_dict()
    assert any(
        w["pending"] for w in state["worker_states"].values()
    )  # held-aside docs are re-encoded
    again = build_loader(c, rank=0, world_size=1, micro_batch=2)
    again.load_state_dict(state)
    same_batches(take(again, 4), full[3:])
    # Rows of 96 tokens: raw images are encoded small enough to fit (token shards drop them).
    assert ld.delivered()["dropped_blocks"] == 0
    tok = [SourceConfig(name=s, shards=[str(tiny_tokens / s)]) for s in ("scenes", "clips", "code")]
    with pytest.raises(ValueError, match=r"source clips: 4 of its 4 video blocks .*seq_len=96"):
        build_loader(cfg(tok, seq_len=96), rank=0, world_size=1, micro_batch=2)
    t = build_loader(
        cfg(tok, seq_len=96, allow_block_drops=True), rank=0, world_size=1, micro_batch=2
    )
    batches = take(t, 7)
    d = t.delivered()
    assert d["dropped_blocks"] > 0
    assert d["dropped_by_source"]["clips"]["video"] == d["dropped_blocks"]
    assert int(sum(b["dropped_blocks"].sum() for b in batches)) == d["dropped_blocks"]


def test_raw_sources_need_tokenizers_and_infinite_mode(tiny_raw, tiny_tokens, tiny_tokenizers):
    src = [SourceConfig(name="code", shards=[str(tiny_raw / "code")])]
    with pytest.raises(ValueError, match="raw shards.*set data.tokenizers"):
        build_loader(cfg(src), rank=0, world_size=1, micro_batch=2)
    after_tokens = [SourceConfig(name="scenes", shards=[str(tiny_tokens / "scenes")]), *src]
    with pytest.raises(ValueError, match="source code holds raw shards.*set data.tokenizers"):
        build_loader(cfg(after_tokens), rank=0, world_size=1, micro_batch=2)
    # a folder without visual_tokenizer/ (a text tokenizer's, or text-only tokens' tokenizers/)
    no_visual = cfg(src, tokenizers=str(tiny_tokenizers[0]))
    with pytest.raises(ValueError, match=r"raw shards.*set data.tokenizers.*visual_tokenizer/\)"):
        build_loader(no_visual, rank=0, world_size=1, micro_batch=2)
    with pytest.raises(ValueError, match="epoch mode.*raw shards do not have"):
        build_loader(
            raw_cfg(tiny_raw, tiny_tokens, ("code",), mode="epoch"),
            rank=0,
            world_size=1,
            micro_batch=2,
        )
    # A token source made with other tokenizers than data.tokenizers is refused by name, saying
    # which of them differs (the comparison a release makes before scoring token shards).
    other = tiny_tokens.parent / "other_tok"
    shutil.copytree(tiny_tokens / "tokenizers", other, dirs_exist_ok=True)
    from safetensors.torch import load_file, save_file

    w = load_file(str(other / "visual_tokenizer" / "model.safetensors"))
    save_file(
        {k: v + 1 for k, v in w.items()}, str(other / "visual_tokenizer" / "model.safetensors")
    )
    tok = [SourceConfig(name="code", shards=[str(tiny_tokens / "code")])]
    refusal = r"source code was tokenized with other tokenizers .*: visual tokenizer differs\)"
    with pytest.raises(ValueError, match=refusal):
        build_loader(cfg(tok, tokenizers=str(other)), rank=0, world_size=1, micro_batch=2)


def test_sources_of_text_alone_first_leave_no_two_visual_tokenizers_through(tiny_tokens, tmp_path):
    """Tokens of text alone (manifest ``visual`` null) mix with image tokens, but the first
    source with a visual tokenizer sets it for the others: compared with a text-only source
    alone, a second visual tokenizer got through."""
    import json

    def with_visual(name, visual):
        folder = tmp_path / name
        shutil.copytree(tiny_tokens, folder)
        manifest = json.loads((folder / "manifest.json").read_text())
        manifest["tokenizers"]["visual"] = visual
        (folder / "manifest.json").write_text(json.dumps(manifest))
        return folder

    text_only, other = with_visual("text_only", None), with_visual("other", "0123456789abcdef")
    srcs = [
        SourceConfig(name="notes", shards=[str(text_only / "text")]),
        SourceConfig(name="code", shards=[str(tiny_tokens / "code")]),
    ]
    build_loader(cfg(srcs), rank=0, world_size=1, micro_batch=2)  # text alone, then images
    srcs.append(SourceConfig(name="scenes", shards=[str(other / "scenes")]))
    refusal = r"source scenes was tokenized with other tokenizers than source code's .*: visual"
    with pytest.raises(ValueError, match=refusal):
        build_loader(cfg(srcs), rank=0, world_size=1, micro_batch=2)


def test_short_pipe_output_is_an_error_never_cached(tiny_tokens, tmp_path):
    """A command that exits 0 with less than the index's bytes (curl without -f writing an error
    page): the read fails naming it, the sample is skipped and counted, nothing is cached."""
    script = tmp_path / "fetch.sh"
    script.write_text('#!/bin/sh\ncase "$1" in *.tar) head -c 700 "$1";; *) cat "$1";; esac\n')
    script.chmod(0o755)
    tars = sorted((tiny_tokens / "code").glob("*.tar"))
    files = store.ShardFiles(str(tmp_path / "cache"))
    with pytest.raises(FileNotFoundError, match="wrote 700 bytes, its index needs at least"):
        files.fetch(f"pipe:{script} {tars[0]}", min_bytes=tars[0].stat().st_size - 1024)
    assert not list((tmp_path / "cache").glob("*.tar")) and not list(
        (tmp_path / "cache").glob("*.part*")
    )
    src = SourceConfig(name="code", shards=[f"pipe:{script} {t}" for t in tars])
    ld = build_loader(
        cfg([src], max_consecutive_errors=3, cache_dir=str(tmp_path / "cache")),
        rank=0,
        world_size=1,
        micro_batch=1,
    )
    with pytest.raises(RuntimeError, match="3 unreadable samples in a row.*wrote 700 bytes"):
        ld.make_stream(0).next_batch()  # each skipped and counted, then the run stops


def test_data_unreadable_is_one_line_also_from_a_loader_worker():
    """Run out of readable samples, the loader stops the run with DataUnreadable; a DataLoader
    worker's copy of it, re-raised by torch in the trainer's process, begins with the worker's
    traceback: earlyfuse-train and earlyfuse-prep preview print its last line only."""
    from torch._utils import ExceptionWrapper

    from data.loader.config import DataUnreadable

    said = "16 unreadable samples in a row, the last code shard-000000.tar k: read failed"
    try:
        raise DataUnreadable(said)
    except DataUnreadable:
        wrapped = ExceptionWrapper(where="in DataLoader worker process 0")
    with pytest.raises(DataUnreadable) as raised:
        wrapped.reraise()
    assert "Traceback" in str(raised.value) and raised.value.last_line() == said
    assert DataUnreadable(said).last_line() == said


def test_remote_reads_are_retried_then_fail_as_oserror(memory_tokens):
    files = store.ShardFiles()
    url = f"{memory_tokens}/code/shard-000000.tar"
    assert len(files.read(url, 0, 512)) == 512
    fsspec.filesystem("memory").rm("/tokens/code/shard-000000.tar")
    files._drop(url)
    with pytest.raises(OSError, match="read failed 3 times"):
        files.read(url, 0, 512)


def test_a_storage_that_stops_answering_is_waited_for_then_given_up(
    memory_tokens, monkeypatch, capsys
):
    """An outage of a few seconds skipped 16 samples in a row and stopped a run: a read now
    waits up to store.PATIENCE for the storage (said once), then gives up; the next reads
    within FAILED_FOR fail after their own retries, without a wait each. On a fake clock that
    moves only when the code sleeps."""
    import time

    files = store.ShardFiles()
    url = f"{memory_tokens}/code/shard-000000.tar"
    real_get, calls, clock = files.get, [], [1000.0]

    def down_for(n):
        def get(u):
            calls.append(u)
            if len(calls) <= n:
                raise ConnectionError("connection refused")
            return real_get(u)

        return get

    monkeypatch.setattr(time, "monotonic", lambda: clock[0])
    monkeypatch.setattr(time, "sleep", lambda seconds: clock.__setitem__(0, clock[0] + seconds))
    monkeypatch.setattr(files, "get", down_for(7))  # three rounds of retries fail, then it answers
    assert len(files.read(url, 0, 512)) == 512
    assert capsys.readouterr().err.count("the storage does not answer") == 1
    calls.clear()
    start = clock[0]
    monkeypatch.setattr(files, "get", down_for(10**9))  # down for good
    with pytest.raises(OSError, match="read failed 3 times"):
        files.read(url, 0, 512)
    assert store.PATIENCE <= clock[0] - start < store.PATIENCE + 10
    assert "waiting up to" in capsys.readouterr().err
    waited, start = len(calls), clock[0]
    with pytest.raises(OSError, match="read failed 3 times"):
        files.read(url, 0, 512)
    assert len(calls) == waited + store.RETRIES  # given up on a moment ago: no second wait
    assert clock[0] - start < 1


def test_the_pipe_cache_evicts_the_least_recently_used(tiny_tokens, tmp_path):
    import os

    tars = sorted(tiny_tokens.rglob("*.tar"))[:3]
    files = store.ShardFiles(str(tmp_path), cache_limit_gb=0)
    got = [files.fetch(f"pipe:cat {t}") for t in tars[:2]]
    os.utime(got[0], (1, 1))  # long unused
    files.fetch(f"pipe:cat {tars[2]}")  # over the limit: the oldest goes, this minute's stay
    assert not got[0].exists() and got[1].exists()


def test_a_raw_json_of_another_schema_is_a_reject_not_a_dead_worker(tiny_tokens):
    import io

    from data.loader.online import OnlineTokenizer

    tok = OnlineTokenizer(LoaderConfig(tokenizers=str(tiny_tokens / "tokenizers"), seq_len=256))
    for body in (b"[1, 2]", b'{"segments": [{"type": "image"}]}', b"{not json"):
        doc, why = tok.encode("k", {"json": [0, len(body)]}, "x.tar", io.BytesIO(body))
        assert doc is None and why.startswith("k.json")


def test_a_glob_inside_a_pipe_command_is_refused_at_start(tiny_tokens):
    assert len(list((tiny_tokens / "scenes").glob("*.tar"))) == 2
    src = SourceConfig(name="scenes", shards=[f"pipe:cat {tiny_tokens}/scenes/*.tar"])
    with pytest.raises(ValueError, match="pipe: command must print one shard: no glob"):
        build_loader(cfg([src]), rank=0, world_size=1, micro_batch=1)


def test_a_failed_fetch_is_not_repeated_for_every_sample(tiny_tokens, tmp_path):
    log = tmp_path / "calls"
    script = tmp_path / "fetch.sh"
    script.write_text(
        f'#!/bin/sh\necho "$1" >> {log}\ncase "$1" in *.tar) exit 1;; *) cat "$1";; esac\n'
    )
    script.chmod(0o755)
    tar = sorted((tiny_tokens / "code").glob("*.tar"))[0]
    src = SourceConfig(name="code", shards=[f"pipe:{script} {tar}"])
    ld = build_loader(
        cfg([src], max_consecutive_errors=5, cache_dir=str(tmp_path / "c")),
        rank=0,
        world_size=1,
        micro_batch=1,
    )
    with pytest.raises(RuntimeError, match="5 unreadable samples in a row.*exited with 1"):
        ld.make_stream(0).next_batch()
    assert sum(line.strip().endswith(".tar") for line in log.read_text().splitlines()) == 1


def test_a_state_with_the_fingerprint_of_local_shards_only_is_refused(tiny_tokens):
    """A source has one fingerprint, wherever its shards live; the one of an older earlyfuse
    (the tars' names, sizes and index hashes and the token manifest's tokenizers entry whole)
    is another data's to this one."""
    import hashlib
    import json
    from pathlib import Path

    from data.shards.index import index_path_for

    srcs = [SourceConfig(name=s, shards=[str(tiny_tokens / s)]) for s in ("code", "scenes")]
    ld = build_loader(cfg(srcs), rank=0, world_size=1, micro_batch=2)
    take(ld, 2)
    st = ld.state_dict()
    tokenizers = json.loads((tiny_tokens / "manifest.json").read_text())["tokenizers"]
    parts = []
    for t in ld.tables:
        h = hashlib.sha256()
        for tar in map(Path, t.shards):
            h.update(
                f"{tar.name}\0{tar.stat().st_size}\0".encode()
                + hashlib.sha256(index_path_for(tar).read_bytes()).digest()
            )
        parts.append(
            (
                t.name,
                h.hexdigest()[:16],
                hashlib.sha256(json.dumps(tokenizers, sort_keys=True).encode()).hexdigest()[:16],
            )
        )
    old = {**st, "fingerprint": hashlib.sha256(json.dumps(parts).encode()).hexdigest()[:16]}
    assert old["fingerprint"] != st["fingerprint"]
    again = build_loader(cfg(srcs), rank=0, world_size=1, micro_batch=2)
    with pytest.raises(ValueError, match=rf"fingerprint {old['fingerprint']} != "):
        again.load_state_dict(old)
    again.load_state_dict(st)


def test_a_tokenizer_that_cannot_be_built_stops_the_loader_skipping_nothing(
    tiny_raw, tiny_tokens, tmp_path, capsys
):
    """Raw sources: a visual tokenizer of other FSQ levels than the layout, or no tokenizer
    folder (a PackedLoader built without build_loader's check), stops the loader at its first
    raw document with the reason; it is no bad sample to skip and count."""
    import json

    from data.loader import PackedLoader

    tokenizers = tmp_path / "tokenizers"
    shutil.copytree(tiny_tokens / "tokenizers", tokenizers)
    vtok_config = tokenizers / "visual_tokenizer" / "config.json"
    vtok_config.write_text(json.dumps({**json.loads(vtok_config.read_text()), "levels": [5, 5]}))
    text = [SourceConfig(name="text", shards=[str(tiny_raw / "text")])]
    other = build_loader(cfg(text, tokenizers=str(tokenizers)), rank=0, world_size=1, micro_batch=1)
    with pytest.raises(ValueError, match=r"visual_tokenizer: FSQ levels \[5, 5\] differ"):
        take(other, 1)
    tables = [load_table(text[0])]
    unset = PackedLoader(cfg(text), tables, rank=0, world_size=1, micro_batch=1, pad_id=0)
    with pytest.raises(ValueError, match="data.tokenizers, which is unset"):
        take(unset, 1)
    assert "skipped" not in capsys.readouterr().err


def test_a_shard_listed_twice_is_refused(tiny_tokens):
    """A folder and a glob inside it, or one folder in two sources: every document would be
    read twice as often as its weight says; refused at start, naming the shard."""
    text = tiny_tokens / "text"
    twice = [SourceConfig(name="text", shards=[str(text), str(text / "*.tar")])]
    with pytest.raises(
        ValueError, match=r"shard .*text/shard-\d+\.tar is listed twice \(sources text and text\)"
    ):
        build_loader(LoaderConfig(sources=twice, seq_len=256), rank=0, world_size=1, micro_batch=1)
    two = [SourceConfig(name=name, shards=[str(text)]) for name in ("a", "b")]
    with pytest.raises(ValueError, match=r"listed twice \(sources a and b\)"):
        build_loader(LoaderConfig(sources=two, seq_len=256), rank=0, world_size=1, micro_batch=1)


def test_a_later_loader_over_the_runs_tables_needs_no_layout_file(tiny_tokens, tmp_path):
    """The monitors' probes build their loader mid-run over the run's tables: with the token
    folder moved since the start, its vocab_layout.json was read again and the run stopped,
    telling the user to set data.tokenizers (the layout had been read at start)."""
    from data.loader.sample_check import attach_id_ranges

    tokens = tmp_path / "tokens"
    shutil.copytree(tiny_tokens, tokens)
    cfg = LoaderConfig(sources=[SourceConfig(name="text", shards=[str(tokens / "text")])])
    tables = [load_table(cfg.sources[0])]
    attach_id_ranges(cfg, tables)
    ranges = tables[0].id_ranges
    shutil.rmtree(tokens)
    attach_id_ranges(cfg, tables)  # the run's tables keep what they read
    assert tables[0].id_ranges is ranges
