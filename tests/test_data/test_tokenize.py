"""earlyfuse-prep tokenize on real raw shards: every document tokenized or rejected, token shards
readable without pickle, spans that decode back, resumable, fingerprints enforced."""

from __future__ import annotations

import errno
import io
import json
import re
import shutil
import signal
import subprocess
import sys

import numpy as np
import pytest

from data.cli import main
from data.layout import parse_image, parse_video
from data.shards.index import read_index
from data.shards.manifest import load_manifest
from data.text_tokenizer import TextTokenizer
from data.tokenize.run import tokenize
from data.vocab import Modality


@pytest.fixture(scope="module")
def tokens(tiny_raw, tiny_tokenizers, tmp_path_factory):
    text, visual = tiny_tokenizers
    out = tmp_path_factory.mktemp("tokens") / "tokens"
    assert (
        main(
            [
                "tokenize",
                "--in",
                str(tiny_raw),
                "--out",
                str(out),
                "--tokenizer",
                str(text),
                "--visual-tokenizer",
                str(visual),
                "--workers",
                "2",
                "--no-progress",
            ]
        )
        == 0
    )
    return out


def load_sample(folder, shard, entry):
    out = {}
    with open(folder / shard["path"], "rb") as f:
        for name, (off, size) in entry["members"].items():
            f.seek(off)
            data = f.read(size)
            out[name] = (
                np.load(io.BytesIO(data), allow_pickle=False)
                if name.endswith(".npy")
                else json.loads(data)
            )
    return out


def test_every_document_is_tokenized_and_spans_decode(tiny_raw, tiny_tokenizers, tokens):
    raw = load_manifest(tiny_raw)
    m = json.loads((tokens / "manifest.json").read_text())
    assert m["totals"]["samples"] + m["totals"]["rejects"] == raw["totals"]["samples"]
    assert m["totals"]["rejects"] == 0
    tok = TextTokenizer.load(tiny_tokenizers[0])
    lay = tok.layout
    seen = set()
    for shard in m["shards"]:
        for e in read_index(tokens / shard["index"]):
            s = load_sample(tokens, shard, e)
            ids, mod, meta = s["ids.npy"], s["mod.npy"], s["json"]
            assert (
                ids.dtype == np.int32
                and mod.dtype == np.uint8
                and len(ids) == len(mod) == meta["tokens"]
            )
            assert ids[0] == tok.bos_id and ids[-1] == tok.eos_id and ids.max() < lay.size
            for sp in meta["spans"]:
                seg = ids[sp["start"] : sp["end"]]
                if sp["type"] == "image":
                    assert parse_image(seg, lay).shape == tuple(sp["grid"])
                    seen.add("image")
                elif sp["type"] == "video":
                    assert (
                        parse_video(seg, lay).shape == tuple(sp["grid"]) and len(sp["times"]) >= 1
                    )
                    seen.add("video")
                else:
                    assert (
                        mod[sp["start"] : sp["end"]]
                        == (Modality.CODE if sp["type"] == "code" else Modality.TEXT)
                    ).all()
                    assert tok.decode(seg.tolist())  # decodes to text
                    seen.add(sp["type"])
    assert seen == {"text", "code", "image", "video"}
    assert (tokens / "tokenizers" / "vocab_layout.json").is_file()
    assert (tokens / "tokenizers" / "visual_tokenizer" / "model.safetensors").is_file()


def test_text_spans_are_the_exact_raw_text(tiny_raw, tiny_tokenizers, tokens):
    from data.shards.reader import iter_docs

    tok = TextTokenizer.load(tiny_tokenizers[0])
    raw_text = {
        d.key: [s["text"] for s in d.doc["segments"] if s["type"] in ("text", "code")]
        for d in iter_docs(tiny_raw, ["code", "text"])
    }
    m = json.loads((tokens / "manifest.json").read_text())
    checked = 0
    for shard in m["shards"]:
        if shard["source"] not in ("code", "text"):
            continue
        for e in read_index(tokens / shard["index"]):
            s = load_sample(tokens, shard, e)
            texts = [
                tok.decode(s["ids.npy"][sp["start"] : sp["end"]].tolist())
                for sp in s["json"]["spans"]
            ]
            assert texts == raw_text[e["key"]]
            checked += 1
    assert checked > 5


def test_user_errors_are_one_line_and_exit_code_2_before_any_work(
    tiny_raw, tiny_tokenizers, tmp_path, capsys
):
    """A folder that is not an ingest output, a device torch does not know or this machine does
    not have: one line naming it, exit code 2 (as a bad flag), nothing written. Before: exit code
    1, and a traceback for the device (torch's RuntimeError, or its AssertionError for CUDA)."""
    import torch

    text, visual = tiny_tokenizers
    out = tmp_path / "t"
    args = ["tokenize", "--in", str(tiny_raw), "--out", str(out), "--tokenizer", str(text)]
    args += ["--visual-tokenizer", str(visual), "--no-progress"]
    absent = f"cuda:{torch.cuda.device_count()}"  # one past this machine's GPUs
    segments = json.loads((tiny_raw / "manifest.json").read_text())["totals"]["segments"]
    images, videos = segments["image"], segments["video"]
    for argv, said in [
        (["tokenize", "--in", str(tmp_path), *args[3:]], f"{tmp_path}/manifest.json: no manifest"),
        ([*args, "--device", "gpu0"], "--device 'gpu0': not a device (cpu, cuda, cuda:1, ...)"),
        ([*args[:4], str(tiny_raw), *args[5:]], f"{tiny_raw} is an ingest's output (raw shards)"),
        ([*args, "--device", absent], f"--device {absent}: this machine has "),
        # without a visual tokenizer, a corpus holding images and videos (text alone needs none)
        (args[:-3] + ["--no-progress"], f"{tiny_raw}: {images} image(s) and {videos} video(s)"),
    ]:
        assert main(argv) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"earlyfuse-prep tokenize: error: {said}") and err.count("\n") == 1
        assert not out.exists()


def test_resume_and_refusal(tiny_raw, tiny_tokenizers, tokens, tmp_path):
    text, visual = tiny_tokenizers
    out = tmp_path / "t"
    shutil.copytree(tokens, out)
    victim, other, cut = json.loads((out / "manifest.json").read_text())["shards"][:3]
    before = (out / victim["path"]).read_bytes()
    (out / victim["path"]).unlink()
    index_bin = (out / other["index_bin"]).read_bytes()
    (out / other["index_bin"]).unlink()  # a shard missing a file is redone, not taken as done
    cut_bin = (out / cut["index_bin"]).read_bytes()
    (out / cut["index_bin"]).write_bytes(cut_bin[:100])  # nor one whose index was cut
    args = [
        "tokenize",
        "--in",
        str(tiny_raw),
        "--out",
        str(out),
        "--tokenizer",
        str(text),
        "--visual-tokenizer",
        str(visual),
        "--no-progress",
    ]
    assert main(args) == 0
    assert (out / victim["path"]).read_bytes() == before
    assert (out / other["index_bin"]).read_bytes() == index_bin
    assert (out / cut["index_bin"]).read_bytes() == cut_bin
    # Other options would make other tokens: the folder is refused rather than mixed.
    assert main(args + ["--video-fps", "2"]) == 2


def tokenize_args(tiny_raw, tiny_tokenizers, out) -> list[str]:
    text, visual = tiny_tokenizers
    return ["tokenize", "--in", str(tiny_raw), "--out", str(out), "--tokenizer", str(text)] + [
        "--visual-tokenizer",
        str(visual),
        "--no-progress",
    ]


def test_a_token_shard_that_cannot_be_written_is_named(tiny_raw, tiny_tokenizers, tmp_path):
    """Before: ``error: [Errno 27] File too large`` (a full disk: ``[Errno 28] No space left on
    device``), no file named. ``ulimit -f`` in a subprocess stands in for the full disk."""
    limit = 2048

    def limit_file_size() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    out = tmp_path / "t"
    run = subprocess.run(
        [sys.executable, "-m", "data.cli", *tokenize_args(tiny_raw, tiny_tokenizers, out)],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
    )
    assert run.returncode == 1 and len(run.stderr.splitlines()) == 1, run.stderr
    said = (
        rf"earlyfuse-prep tokenize: error: {out}/\w+/shard-\d+\.tar\.tmp: cannot be written: the "
        rf"file reached this process's file-size limit \(ulimit -f: {limit} bytes\)\. Raise the "
        "limit, then run the same command again: it resumes, keeping what it finished\n"
    )
    assert re.fullmatch(said, run.stderr), run.stderr
    assert not (out / "manifest.json").exists() and not list(out.rglob("*.tmp"))


def test_a_tokenizer_copy_cut_short_is_one_line_and_leaves_no_half_copy(
    tiny_raw, tiny_tokenizers, tokens, tmp_path, monkeypatch, capsys
):
    """The disk filling while the tokenizers are copied into TOKEN_DIR/tokenizers/. Before: the
    repr of copytree's shutil.Error (a list of tuples), and a model.safetensors cut short under
    its final name. Now: one line naming the file; no tokenizers/ until the copy is whole, and a
    finished folder's copy is left as it was."""
    copy = shutil.copyfile

    def disk_fills(src, dst, **kwargs):
        if str(dst).endswith("model.safetensors"):
            with open(dst, "wb") as f:
                f.write(open(src, "rb").read(1000))
            raise OSError(errno.ENOSPC, "No space left on device", str(src), None, str(dst))
        return copy(src, dst, **kwargs)

    finished, cut = tmp_path / "finished", tmp_path / "cut"
    shutil.copytree(tokens, finished)
    shutil.copytree(tokens, cut)
    (cut / "manifest.json").unlink()
    shutil.rmtree(cut / "tokenizers")
    monkeypatch.setattr(shutil, "copyfile", disk_fills)
    for out in (finished, cut):
        assert main(tokenize_args(tiny_raw, tiny_tokenizers, out)) == 1
        said = f"{out}/tokenizers.partial/visual_tokenizer/model.safetensors: cannot be written"
        assert capsys.readouterr().err == (
            f"earlyfuse-prep tokenize: error: {said}: the disk is full. Free space on it, then "
            "run the same command again: it resumes, keeping what it finished\n"
        )
    assert not (cut / "tokenizers").exists() and not (cut / "tokenizers.partial").exists()
    assert sorted(p.name for p in finished.iterdir()) == sorted(p.name for p in tokens.iterdir())
    for path in (tokens / "tokenizers").rglob("*"):
        if path.is_file():
            assert (finished / path.relative_to(tokens)).read_bytes() == path.read_bytes()

    monkeypatch.undo()
    assert main(tokenize_args(tiny_raw, tiny_tokenizers, cut)) == 0
    capsys.readouterr()
    assert sorted(str(p.relative_to(cut)) for p in cut.rglob("*")) == sorted(
        str(p.relative_to(tokens)) for p in tokens.rglob("*")
    )
    assert (cut / "manifest.json").read_text() == (tokens / "manifest.json").read_text()


def test_a_folder_holding_token_shards_of_no_recorded_run_is_refused(
    tiny_raw, tiny_tokenizers, tmp_path
):
    from data.tokenize.shard_job import binary_index_name

    out = tmp_path / "t"
    (out / "other").mkdir(parents=True)
    (out / "other" / "shard-000000.tar").write_bytes(b"another run's shard")
    with pytest.raises(ValueError, match=r"this tokenize does not write.*other/shard-000000"):
        tokenize(tiny_raw, out, *tiny_tokenizers)
    # what a run killed before its first record leaves of its own files is no stray
    shutil.rmtree(out / "other")
    shard = json.loads((tiny_raw / "manifest.json").read_text())["shards"][0]
    (out / f"{shard['path']}.tmp").parent.mkdir(parents=True)
    (out / f"{shard['path']}.tmp").write_bytes(b"cut")
    (out / f"{binary_index_name(shard['index'])}.4242.tmp").write_bytes(b"cut")
    assert tokenize(tiny_raw, out, *tiny_tokenizers)["finalized"]


def test_a_visual_tokenizer_folder_is_checked_by_its_one_loader(tiny_tokenizers, tmp_path):
    """What every caller loads a visual tokenizer with (tokenize, the loader, a release): a byte
    changed against its recorded sha256, a tensor of NaN and a tensor the network does not have
    are refused by one error type (a ValueError), naming the file."""
    from safetensors.torch import load_file, save_file

    from data.shards.index import file_sha256
    from data.tokenize.visual import VisualTokenizerError, load_visual_tokenizer

    layout = TextTokenizer.load(tiny_tokenizers[0]).layout
    folder = tmp_path / "visual_tokenizer"
    shutil.copytree(tiny_tokenizers[1], folder)
    weights = folder / "model.safetensors"
    digests = {name: file_sha256(folder / name) for name in ("config.json", "model.safetensors")}
    load_visual_tokenizer(folder, layout, sha256=digests)  # intact
    state = load_file(str(weights))
    name = sorted(state)[0]
    save_file({**state, name: state[name].clone().fill_(float("nan"))}, str(weights))
    with pytest.raises(VisualTokenizerError, match="model.safetensors: sha256 differs"):
        load_visual_tokenizer(folder, layout, sha256=digests)
    with pytest.raises(
        VisualTokenizerError, match=rf"model.safetensors: tensor '{name}' holds NaN"
    ):
        load_visual_tokenizer(folder, layout)
    save_file({**state, "extra.weight": state[name].clone()}, str(weights))
    with pytest.raises(
        ValueError, match=r"(?s)model.safetensors: its tensors do not fit .*extra\.weight"
    ):
        load_visual_tokenizer(folder, layout)


def test_a_raw_shard_changed_after_ingest_is_refused(tiny_raw, tiny_tokenizers, tmp_path, capsys):
    """A raw index that lost a line (its document would be left out without a word), or a tar
    with a byte flipped (a document tokenized changed, unsaid): tokenize refuses, naming it, as
    verify would."""
    text, visual = tiny_tokenizers
    for part in ("index", "path"):
        raw = shutil.copytree(tiny_raw, tmp_path / part)
        damaged = raw / json.loads((raw / "manifest.json").read_text())["shards"][0][part]
        if part == "index":
            damaged.write_text("".join(damaged.read_text().splitlines(keepends=True)[:-1]))
        else:
            data = bytearray(damaged.read_bytes())
            data[1000] ^= 1  # a byte of the tar: its whole-file hash changes
            damaged.write_bytes(bytes(data))
        out = str(tmp_path / f"t_{part}")
        argv = ["tokenize", "--in", str(raw), "--out", out, "--tokenizer", str(text)]
        assert main([*argv, "--visual-tokenizer", str(visual), "--no-progress"]) == 2
        said = "index" if part == "index" else "shard"
        assert f"{damaged}: not the {said} ingest wrote" in capsys.readouterr().err


def test_a_hand_written_raw_folder_missing_a_field_is_named(
    tiny_raw, tiny_tokenizers, tmp_path, capsys
):
    """Raw folders written by other tools: a manifest shard entry without a field every reader
    takes, or a document naming a member its index line does not list, are one line naming
    the file and the field (both were KeyError tracebacks)."""
    import hashlib

    text, visual = tiny_tokenizers
    raw = shutil.copytree(tiny_raw, tmp_path / "raw")
    m = json.loads((raw / "manifest.json").read_text())
    del m["shards"][0]["index_sha256"]
    (raw / "manifest.json").write_text(json.dumps(m))
    argv = ["--in", str(raw), "--tokenizer", str(text), "--visual-tokenizer", str(visual)]
    assert main(["tokenize", *argv, "--out", str(tmp_path / "t"), "--no-progress"]) == 2
    said = f"{raw / 'manifest.json'}: shards[0] ({m['shards'][0]['path']}) has no index_sha256"
    assert said in capsys.readouterr().err
    assert main(["verify", str(raw)]) == 2 and said in capsys.readouterr().err

    raw = shutil.copytree(tiny_raw, tmp_path / "raw2")
    m = json.loads((raw / "manifest.json").read_text())
    shard = next(s for s in m["shards"] if s["segments"].get("image"))
    index = raw / shard["index"]
    lines = [json.loads(line) for line in index.read_text().splitlines()]
    entry = next(e for e in lines if "image" in e["types"])
    member = next(k for k in entry["members"] if k != "json")
    del entry["members"][member]
    index.write_text("".join(json.dumps(e) + "\n" for e in lines))
    shard["index_sha256"] = hashlib.sha256(index.read_bytes()).hexdigest()
    (raw / "manifest.json").write_text(json.dumps(m))
    argv[1] = str(raw)
    code = main(["tokenize", *argv, "--out", str(tmp_path / "t2"), "--no-progress"])
    printed = capsys.readouterr()
    assert "Traceback" not in printed.err and code == 3  # that document rejected, the rest kept
    said = f"sample {entry['key']} names a member {member!r} that its index line's"
    assert said in (tmp_path / "t2" / "rejects.jsonl").read_text()

    # Partitioned (a Slurm array): the task whose shards lost that document exits 3 although
    # another finishes after it; the last exits by the folder's rejects.
    bad = m["shards"].index(shard) % 2
    argv += ["--out", str(tmp_path / "t3"), "--no-progress", "--num-partitions", "2"]
    assert main(["tokenize", *argv, "--partition", str(bad)]) == 3
    said = "rejected 1 document(s) in this partition's shards, listed in"
    assert said in capsys.readouterr().out
    assert main(["tokenize", *argv, "--partition", str(1 - bad)]) == 3


def test_images_too_long_and_thin_for_the_grid_are_counted_and_named(
    tiny_tokenizers, tmp_path, capsys
):
    """A 4000x3 strip has no grid of its shape (at most max_grid tokens a side): it is drawn
    squeezed to max_grid:1, which tokenize says, per source, with examples (it was silent)."""
    from PIL import Image

    from data.ingest import ingest

    pics = tmp_path / "pics"
    pics.mkdir()
    Image.new("RGB", (4000, 3), "red").save(pics / "strip.png")
    Image.new("RGB", (40, 30), "blue").save(pics / "photo.png")
    ingest(tmp_path / "raw", [f"pics=images:{pics}"])
    text, visual = tiny_tokenizers
    argv = ["tokenize", "--in", str(tmp_path / "raw"), "--out", str(tmp_path / "tok")]
    assert main([*argv, "--tokenizer", str(text), "--visual-tokenizer", str(visual)]) == 0
    assert "note: pics: 1 document(s) with an image too long and thin" in capsys.readouterr().out
    (source,) = json.loads((tmp_path / "tok" / "manifest.json").read_text())["sources"]
    assert source["out_of_shape"] == {"documents": 1, "examples": ["pics-strip_png"]}


def test_clips_a_small_budget_thins_are_said(tiny_raw, tiny_tokenizers, tmp_path, capsys):
    """A clip longer than its budget holds at --video-fps keeps fewer frames over its whole
    length: the summary says how many and how far apart (only the JSON spans had shown it)."""
    from data.tokenize.shard_job import widest_gap

    assert widest_gap([{"type": "text"}, {"type": "video", "times": [0.0, 0.25, 2.0]}]) == 1.75
    text, visual = tiny_tokenizers
    args = ["tokenize", "--in", str(tiny_raw), "--out", str(tmp_path / "t"), "--no-progress"]
    args += ["--tokenizer", str(text), "--visual-tokenizer", str(visual)]
    assert main([*args, "--video-max-tokens", "60"]) == 0
    said = [line for line in capsys.readouterr().out.splitlines() if "kept fewer frames" in line]
    assert len(said) == 1 and said[0].startswith("note: clips: "), said
    assert "at --video-fps 4 kept fewer frames over their whole length (up to " in said[0]
