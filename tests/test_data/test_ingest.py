"""earlyfuse-prep ingest end to end on real files: planted faults, determinism, resume, partitions."""

from __future__ import annotations

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import webdataset as wds
from factories import many_images, png_bytes

from data.cli import EXIT_REJECTS, main
from data.ingest import ingest
from data.shards.index import check_index, read_index
from data.shards.verify import verify


def shard_files(out: Path) -> dict[str, bytes]:
    return {
        str(p.relative_to(out)): p.read_bytes()
        for p in sorted(out.rglob("*"))
        if p.is_file() and ".ingest" not in p.parts and p.name != "manifest.json"
    }


def manifest_without_commands(out: Path) -> dict:
    m = json.loads((out / "manifest.json").read_text())
    m["created_by"].pop("commands")
    return m


def test_planted_faults_are_rejected_and_good_samples_kept(planted_corpus, tmp_path, capsys):
    out = tmp_path / "out"
    args = ["ingest", "--out", str(out), "--no-progress"]
    for s in planted_corpus["sources"]:
        args += ["--source", s]
    assert main(args) == EXIT_REJECTS
    printed = capsys.readouterr().out
    assert "rejected 7 input(s)" in printed

    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    got = {(r["source"], r["path"], r["reason"]) for r in rejects}
    assert got == planted_corpus["expected_rejects"]
    assert all(r["detail"] for r in rejects)

    m = json.loads((out / "manifest.json").read_text())
    assert m["totals"]["samples"] == planted_corpus["good_samples"]
    assert m["totals"]["rejects"] == len(rejects)
    assert sum(m["totals"]["rejects_by_reason"].values()) == len(rejects)

    # Every shard is a plain tar that `tar -tf` lists, and webdataset yields every sample.
    urls = [str(out / s["path"]) for s in m["shards"]]
    for url in urls:
        listed = subprocess.run(
            ["tar", "-tf", url], check=True, capture_output=True, text=True
        ).stdout.split()
        assert listed and all("." in name and ".." not in name for name in listed)
    seen = list(wds.WebDataset(urls, shardshuffle=False))
    assert len(seen) == planted_corpus["good_samples"]
    docs = {s["__key__"]: json.loads(s["json"]) for s in seen}
    video = next(d for d in docs.values() if d["kind"] == "videos")
    assert (
        video["segments"][0]["frames"] == 8
        and video["segments"][1]["text"] == "a white bar moves right"
    )
    inter = next(d for d in docs.values() if d["kind"] == "interleaved")
    assert [s["type"] for s in inter["segments"]] == ["text", "image", "text"]
    assert verify(out)["ok"]


def test_a_python_projects_own_files_beside_its_code_leave_exit_status_0(tmp_path, capsys):
    """A licence, requirements.txt, setup.cfg and the empty py.typed marker are in every Python
    project: as `unknown-type` rejects they made every code tree's ingest exit 3, and a script
    had to pass --allow-rejects, which hides real failures too. pip's `_vendor/` was kept."""
    root = tmp_path / "project"
    (root / "pkg" / "_vendor" / "six").mkdir(parents=True)
    (root / "pkg" / "__init__.py").write_text("")
    (root / "pkg" / "mod.py").write_text("def f():\n    return 1\n")
    (root / "pkg" / "py.typed").write_text("")
    (root / "pkg" / "_vendor" / "six" / "six.py").write_text("PY3 = True\n")
    (root / "pkg-1.0.dist-info").mkdir()  # an installed package's metadata, as site-packages has
    (root / "pkg-1.0.dist-info" / "METADATA").write_text("Name: pkg\n")
    (root / "pkg" / "cli-64.exe").write_bytes(b"MZ\x90\x00")  # setuptools' launchers
    for name in ("LICENSE", "requirements.txt", "setup.cfg"):
        (root / name).write_text("some words\n")
    out = tmp_path / "out"
    argv = ["ingest", "--out", str(out), "--no-progress", "--source", f"code:{root}"]
    assert main(argv) == 0
    printed = capsys.readouterr().out
    assert "not-code 5" in printed and "exit status 0" in printed
    rejects = [json.loads(line) for line in (out / "rejects.jsonl").read_text().splitlines()]
    assert sorted((r["path"], r["reason"]) for r in rejects) == [
        ("LICENSE", "not-code"),
        ("pkg-1.0.dist-info/", "vendored"),
        ("pkg/__init__.py", "empty-document"),
        ("pkg/_vendor/", "vendored"),
        ("pkg/cli-64.exe", "not-code"),
        ("pkg/py.typed", "not-code"),
        ("requirements.txt", "not-code"),
        ("setup.cfg", "not-code"),
    ]
    # A file of a language the source does not know may be code: lost, so exit status 3
    (root / "pkg" / "view.vue").write_text("<template><p>hi</p></template>\n")
    assert main([*argv[:2], str(tmp_path / "again"), *argv[3:]]) == 3
    assert "not-code 5, unknown-type 1" in capsys.readouterr().out


def test_a_partition_exits_as_its_own_rejects_say_and_so_does_merge(tmp_path, capsys):
    """A Slurm array task whose shards lost inputs exits 3 whether or not it finished last."""
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "a.png").write_bytes(png_bytes())
    (pics / "b.png").write_bytes(png_bytes()[:60])  # its header reads, its pixels do not
    out = tmp_path / "out"
    argv = ["ingest", "--out", str(out), "--shard-samples", "1", "--no-progress"]
    argv += ["--source", f"images:{pics}", "--num-partitions", "2", "--partition"]
    assert main([*argv, "1"]) == EXIT_REJECTS  # b.png's shard; not the last to finish
    said = capsys.readouterr().out
    assert "rejected 1 input(s) in this partition's shards, listed in" in said
    assert "rejects.jsonl once merged: truncated-image 1" in said
    assert main([*argv, "0"]) == EXIT_REJECTS  # the last: the folder's rejects
    (out / "manifest.json").unlink()
    assert main(["merge", str(out)]) == EXIT_REJECTS
    assert "merged 1 shards, 1 samples, 1 rejects" in capsys.readouterr().out
    assert main(["merge", str(out), "--allow-rejects"]) == 0


def test_the_summary_counts_the_shards_it_wrote_not_those_all_rejected(tmp_path, capsys):
    """A planned shard whose every input is rejected when read (a truncated picture) writes no
    file; the summary said "wrote 2 shard(s)" over a folder of 1, on the rerun "2 already done"."""
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "a.png").write_bytes(png_bytes())
    (pics / "b.png").write_bytes(png_bytes()[:60])  # its header reads, its pixels do not
    argv = ["ingest", "--out", str(tmp_path / "out"), "--shard-samples", "1", "--no-progress"]
    argv += ["--source", f"images:{pics}"]
    assert main(argv) == EXIT_REJECTS
    said = "1 planned held only rejects\n"  # so the counts add up to the plan's 2
    assert f"wrote 1 shard(s), 0 already done, {said}" in capsys.readouterr().out
    assert len(list((tmp_path / "out").rglob("*.tar"))) == 1
    assert main(argv) == EXIT_REJECTS
    assert f"wrote 0 shard(s), 1 already done, {said}" in capsys.readouterr().out
    (pics / "a.png").unlink()  # every input rejected: nothing written, and the summary says so
    argv[2] = str(tmp_path / "none")
    assert main(argv) == EXIT_REJECTS
    assert "0 samples in 0 shards (0 B); segments: none\n" in capsys.readouterr().out


def test_same_inputs_give_identical_shards_for_any_worker_count(planted_corpus, tmp_path):
    a, b = tmp_path / "a", tmp_path / "b"
    ingest(a, planted_corpus["sources"], shard_max_samples=1, workers=1)
    ingest(b, planted_corpus["sources"], shard_max_samples=1, workers=2)
    assert shard_files(a) == shard_files(b)
    assert manifest_without_commands(a) == manifest_without_commands(b)


def test_partitions_then_merge_equal_a_single_run(planted_corpus, tmp_path, capsys):
    single, parts = tmp_path / "single", tmp_path / "parts"
    ingest(single, planted_corpus["sources"], shard_max_samples=1)
    for i in (0, 1):
        s = ingest(
            parts, planted_corpus["sources"], shard_max_samples=1, num_partitions=3, partition=i
        )
        assert not s["finalized"] and s["missing"]
    with pytest.raises(ValueError, match=r"partitions \[2\] of --num-partitions 3"):
        from data.ingest.run import merge

        merge(parts)
    s = ingest(parts, planted_corpus["sources"], shard_max_samples=1, num_partitions=3, partition=2)
    assert s["finalized"]  # the last partition to finish writes the manifest
    assert shard_files(parts) == shard_files(single)
    assert manifest_without_commands(parts) == manifest_without_commands(single)
    assert main(["merge", str(parts)]) == EXIT_REJECTS  # the corpus's planted faults


def test_merge_of_a_url_names_the_missing_partitions_as_a_local_merge_does(tmp_path):
    from data.ingest.run import merge
    from data.shards.storage import Folder

    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(3):
        (notes / f"n{i}.txt").write_text(f"note number {i}")
    url = f"memory://merge-{tmp_path.name}"
    for part in (0, 1):
        ingest(url, [f"text:{notes}"], shard_max_samples=1, num_partitions=3, partition=part)
    with pytest.raises(ValueError, match=r"partitions \[2\] of --num-partitions 3"):
        merge(url)
    s = ingest(url, [f"text:{notes}"], shard_max_samples=1, num_partitions=3, partition=2)
    folder = Folder(url)
    manifest = folder.read_bytes("manifest.json")
    folder.fs.rm(f"{folder.root}/manifest.json")
    assert s["finalized"] and main(["merge", url]) == 0
    assert folder.read_bytes("manifest.json") == manifest
    folder.fs.rm(folder.root, recursive=True)


def test_changed_inputs_refuse_to_mix_into_an_existing_output(planted_corpus, tmp_path):
    out = tmp_path / "out"
    ingest(out, planted_corpus["sources"])
    (planted_corpus["root"] / "text" / "new.txt").write_text("a new file")
    # the plan hashes every reject's wording too: an upgrade that rewords one is another plan
    with pytest.raises(ValueError, match="different ingest .*or another earlyfuse version"):
        ingest(out, planted_corpus["sources"])


def test_an_edited_sidecar_caption_is_another_ingest_not_a_stale_one(tmp_path):
    """A caption fixed after an ingest (the same size: "teh" -> "the") made the rerun find every
    shard done and keep the old caption: the sidecars' bytes are in the plan, as a table's are."""
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "cat.png").write_bytes(png_bytes())
    (pics / "cat.txt").write_text("teh cat")
    ingest(tmp_path / "out", [f"images:{pics}"])
    ingest(tmp_path / "out", [f"images:{pics}"])  # unchanged: done already
    (pics / "cat.txt").write_text("the cat")
    with pytest.raises(ValueError, match="different ingest"):
        ingest(tmp_path / "out", [f"images:{pics}"])


def test_a_sidecar_caption_in_capitals_is_read(tmp_path):
    """A camera's IMG_0001.JPG comes with IMG_0001.TXT: the caption was neither read nor listed
    (looked up as .txt), and the picture kept uncaptioned. Beside the lower case name the other
    is a duplicate-key naming the one read."""
    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "IMG_0001.JPG").write_bytes(png_bytes())
    (pics / "IMG_0001.TXT").write_text("a red square")
    (pics / "b.png").write_bytes(png_bytes())
    (pics / "b.JSON").write_text(json.dumps({"caption": "a blue one"}))
    (pics / "b.json").write_text(json.dumps({"caption": "another"}))
    out = tmp_path / "out"
    assert main(["ingest", "--out", str(out), "--no-progress", "--source", f"images:{pics}"]) == 3
    captions = {
        sample["__key__"]: [seg.get("text") for seg in sample["json"]["segments"] if "text" in seg]
        for sample in wds.WebDataset(str(next(out.rglob("*.tar"))), shardshuffle=False).decode()
    }
    assert captions == {"pics-IMG_0001_JPG": ["a red square"], "pics-b_png": ["another"]}
    (reject,) = [json.loads(x) for x in (out / "rejects.jsonl").read_text().splitlines()]
    assert (reject["path"], reject["reason"]) == ("b.JSON", "duplicate-key")
    assert reject["detail"] == "a second .json caption of b: b.json is read"


def test_a_folder_holding_shards_of_no_recorded_run_is_refused(planted_corpus, tmp_path):
    """Shards copied in, or left by a run whose records were deleted, would be mixed with this
    run's (the loader globs every shard of a source folder): refused, naming them."""
    out = tmp_path / "out"
    (out / "photos").mkdir(parents=True)
    (out / "photos" / "shard-000000.tar").write_bytes(b"another run's shard")
    with pytest.raises(ValueError, match=r"1 file\(s\) that this ingest does not write.*photos/"):
        ingest(out, planted_corpus["sources"])
    assert sorted(p.name for p in out.rglob("*")) == ["photos", "shard-000000.tar"]


def test_an_out_where_a_file_stands_is_refused_before_any_work(planted_corpus, tmp_path, capsys):
    """Before: the inputs were planned, then mkdir's "[Errno 17] File exists" (or "Not a
    directory" for a folder under the file), exit code 1."""
    (tmp_path / "notes.txt").write_text("a file")
    for out in (tmp_path / "notes.txt", tmp_path / "notes.txt" / "shards"):
        with pytest.raises(SystemExit) as exit_info:
            main(["ingest", "--out", str(out), "--source", planted_corpus["sources"][0]])
        assert exit_info.value.code == 2
        said = f"argument --out: {out}: {tmp_path / 'notes.txt'} is a file, not a folder"
        assert said in capsys.readouterr().err


def test_partition_and_shard_flags_out_of_range_are_refused_before_any_work(
    planted_corpus, tmp_path, capsys
):
    args = ["ingest", "--out", str(tmp_path / "out"), "--source", planted_corpus["sources"][0]]
    with pytest.raises(SystemExit) as exit_info:
        main(args + ["--num-partitions", "0"])
    assert exit_info.value.code == 2
    assert "--num-partitions: 0 is not a count" in capsys.readouterr().err
    assert main(args + ["--shard-samples", "-3"]) == 2
    assert "--shard-samples -3: give 0 (no limit) or more" in capsys.readouterr().err
    # checked before planning: an empty source (which planning refuses) is never listed
    (tmp_path / "empty").mkdir()
    empty = ["ingest", "--out", str(tmp_path / "out"), "--source", f"text:{tmp_path / 'empty'}"]
    assert main(empty + ["--num-partitions", "2", "--partition", "5"]) == 2
    assert "--partition 5 is outside 0..1" in capsys.readouterr().err
    assert not (tmp_path / "out").exists()


def test_killed_ingest_resumes_to_the_same_output(tmp_path):
    many_images(tmp_path / "imgs", 160)
    ref, out = tmp_path / "ref", tmp_path / "out"

    def cmd(o: Path) -> list[str]:
        return [
            sys.executable,
            "-m",
            "data.cli",
            "ingest",
            "--out",
            str(o),
            "--no-progress",
            "--source",
            f"images:{tmp_path / 'imgs'}",
            "--shard-samples",
            "1",
        ]

    subprocess.run(cmd(ref), check=True, capture_output=True)
    total = len(json.loads((ref / "manifest.json").read_text())["shards"])

    proc = subprocess.Popen(cmd(out), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    records = out / ".ingest"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if records.is_dir() and len(list(records.glob("shard-*.json"))) >= 5:
            break
        time.sleep(0.001)
    os.kill(proc.pid, signal.SIGKILL)
    proc.wait()
    done = len(list(records.glob("shard-*.json")))
    assert 5 <= done < total, f"the kill came at {done}/{total} shards, not mid-way"
    assert not (out / "manifest.json").exists()

    # Damage two finished shards the way a crash could: a record cut short, a tar gone.
    recs = sorted(records.glob("shard-*.json"))
    recs[0].write_text(recs[0].read_text()[:20])
    (out / json.loads(recs[1].read_text())["tar"]).unlink()

    subprocess.run(cmd(out), check=True, capture_output=True)
    assert shard_files(out) == shard_files(ref)
    assert manifest_without_commands(out) == manifest_without_commands(ref)
    assert not list(out.rglob("*.tmp"))


def test_verify_catches_a_flipped_byte_and_a_lying_index(planted_corpus, tmp_path):
    out = tmp_path / "out"
    ingest(out, planted_corpus["sources"])
    m = json.loads((out / "manifest.json").read_text())
    shard = next(s for s in m["shards"] if s["source"] == "images")
    tar = out / shard["path"]
    data = bytearray(tar.read_bytes())
    off, size = read_index(out / shard["index"])[0]["members"]["json"]
    data[off + 5] ^= 0x20
    tar.write_bytes(bytes(data))
    r = verify(out)
    assert not r["ok"]
    assert any("SHA-256" in p for p in r["problems"])
    assert any("does not match its hash" in p for p in r["problems"])
    assert main(["verify", str(out)]) == 1

    entries = read_index(out / shard["index"])
    entries[0]["members"]["json"][0] += 512
    assert check_index(tar, entries)


def test_verify_and_stats_name_an_index_line_that_is_not_an_entry(planted_corpus, tmp_path, capsys):
    """A damaged index (a line of valid JSON that is not an index entry) is a problem verify
    lists, naming the file and line, and an error of stats: never a traceback."""
    out = tmp_path / "out"
    ingest(out, planted_corpus["sources"])
    shard = json.loads((out / "manifest.json").read_text())["shards"][0]
    with open(out / shard["index"], "a") as index:
        index.write('{"x": 1}\n')
    lines = len((out / shard["index"]).read_text().splitlines())
    r = verify(out)
    assert (
        f"{out / shard['index']}:{lines}: not an index entry (no key, members, sha256, types)"
        in (r["problems"])
    )
    capsys.readouterr()
    assert main(["stats", str(out)]) == 2
    assert f"{shard['index']}:{lines}: not an index entry" in capsys.readouterr().err


def test_stats_into_a_closed_pipe_ends_quietly(planted_corpus, tmp_path):
    """`earlyfuse-prep stats DIR | head`: a reader that leaves early is no error to report."""
    out = tmp_path / "out"
    ingest(out, planted_corpus["sources"], workers=1)
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first line is written
    proc = subprocess.run(
        [sys.executable, "-m", "data.cli", "stats", str(out)],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
    )
    os.close(write_end)
    assert proc.stderr == ""
    assert proc.returncode == 128 + signal.SIGPIPE


def test_ingest_reads_its_own_shards_back_through_wds_kind(planted_corpus, tmp_path):
    """Our shards are valid input for `wds:`: image samples round-trip through a second ingest."""
    first, second = tmp_path / "first", tmp_path / "second"
    ingest(first, planted_corpus["sources"])
    s = ingest(second, [f"wds:{first / 'wds'}"])
    assert s["manifest"]["totals"]["samples"] == 2
    assert s["manifest"]["totals"]["rejects"] == 0
    docs = [
        json.loads(x["json"])
        for x in wds.WebDataset(
            [str(p) for p in (second / "wds").glob("*.tar")], shardshuffle=False
        )
    ]
    assert sorted(d["segments"][1]["text"] for d in docs) == ["first", "second"]


def test_images_without_captions_are_counted_in_the_summary_and_stats(
    tmp_path, capsys, tiny_tokenizers
):
    from factories import png_bytes

    pics = tmp_path / "pics"
    pics.mkdir()
    (pics / "a.png").write_bytes(png_bytes())
    (pics / "a.txt").write_text("a red rectangle")
    (pics / "b.png").write_bytes(png_bytes(colour=(0, 0, 200)))  # no caption file
    out = tmp_path / "out"
    assert main(["ingest", "--out", str(out), "--no-progress", "--source", f"images:{pics}"]) == 0
    said = capsys.readouterr().out
    assert "without a caption or any text: pics: 1 image (kept as media-only documents)" in said
    assert main(["stats", str(out)]) == 0
    assert "without a caption or any text: pics: 1 image" in capsys.readouterr().out
    assert main(["stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["media_without_text"] == {"pics": {"image": 1, "video": 0}}
    # Tokenized, b.png is <|bos|> image <|eos|>: two text tokens, and no text
    tok, vtok = tiny_tokenizers
    tokens = tmp_path / "tokens"
    argv = ["tokenize", "--in", str(out), "--out", str(tokens), "--no-progress"]
    assert main([*argv, "--tokenizer", str(tok), "--visual-tokenizer", str(vtok)]) == 0
    capsys.readouterr()
    assert main(["stats", str(tokens), "--json"]) == 0
    (pics_stats,) = json.loads(capsys.readouterr().out)["sources"]
    assert pics_stats["documents_with"] == {
        "text": 1,
        "code": 0,
        "image": 2,
        "video": 0,
        "structure": 2,
    }


def test_animated_images_are_counted_as_tokenized_by_their_first_frame(tmp_path, capsys):
    """An animated GIF or WebP is one image (its first frame is tokenized): its segment says how
    many frames it had and stats counts such images, naming examples."""
    from PIL import Image

    pics = tmp_path / "pics"
    pics.mkdir()
    frames = [Image.new("RGB", (24, 16), (40 * i, 0, 0)) for i in range(3)]
    frames[0].save(pics / "spin.gif", save_all=True, append_images=frames[1:], duration=50)
    frames[0].save(pics / "spin.webp", save_all=True, append_images=frames[1:2], duration=50)
    frames[0].save(pics / "still.gif")
    out = tmp_path / "out"
    assert main(["ingest", "--out", str(out), "--no-progress", "--source", f"images:{pics}"]) == 0
    docs = {
        json.loads(x["json"])["origin"]["path"]: json.loads(x["json"])["segments"][0]
        for x in wds.WebDataset([str(p) for p in out.rglob("*.tar")], shardshuffle=False)
    }
    assert docs["spin.gif"]["animation_frames"] == 3
    assert docs["spin.webp"]["animation_frames"] == 2
    assert "animation_frames" not in docs["still.gif"]
    capsys.readouterr()
    assert main(["stats", str(out)]) == 0
    said = capsys.readouterr().out
    assert "animated images: 2, tokenized as their first frame" in said
    assert "pics:pics-spin_gif (3 frames)" in said
    assert main(["stats", str(out), "--json"]) == 0
    stats = json.loads(capsys.readouterr().out)
    assert stats["animated_images"]["images"] == 2
    assert stats["images"]["width"]["count"] == 3 and stats["videos"]["frames"]["count"] == 0


def test_the_plan_and_its_fingerprint_record_every_flag_defaults_included(tmp_path):
    """No flag is left out of the plan when it has its default: each one's value is written,
    so a plan reads the same whatever flags existed when it was made."""
    from data.ingest.plan import make_plan
    from data.sources.base import Limits, SourceSpec
    from data.tokenize.docs import TokenizeOptions

    notes = tmp_path / "notes"
    notes.mkdir()
    (notes / "a.txt").write_text("a note")
    spec = SourceSpec("text", str(notes), "notes")
    plan = make_plan([spec], Limits(), shard_max_bytes=0, shard_max_samples=8, progress=False)
    described = plan.describe()
    assert described["val_fraction"] == 0.0 and described["dedupe"] is False
    assert described["limits"]["follow_links_outside"] is False
    linked = make_plan(
        [spec],
        Limits(follow_links_outside=True),
        shard_max_bytes=0,
        shard_max_samples=8,
        progress=False,
    )
    assert linked.fingerprint != plan.fingerprint
    assert TokenizeOptions().record() == {
        "image_max_pixels": 256 * 256,
        "video_max_pixels": 128 * 128,
        "video_fps": 4.0,
        "video_max_tokens": 4096,
        "image_batch": 32,
        "max_block_tokens": 0,
        "doc_budget": 0,
    }


def test_val_fraction_holds_out_a_stable_split_by_key_hash(tmp_path, tiny_tokenizers):
    from data.ingest.plan import in_validation
    from data.loader import LoaderConfig, SourceConfig, build_loader
    from data.tokenize.run import tokenize

    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(60):
        (notes / f"n{i:03d}.txt").write_text(f"note number {i}: " + "words " * (i % 7 + 3))

    def split(out):
        assert main(["ingest", "--out", str(out), "--no-progress", "--val-fraction", "0.25",
                     "--source", f"text:{notes}"]) == 0  # fmt: skip
        m = json.loads((out / "manifest.json").read_text())
        keys = {}
        for sh in m["shards"]:
            for e in read_index(out / sh["index"]):
                keys[e["key"]] = sh["source"]
        return m, keys

    m, keys = split(tmp_path / "a")
    assert {s["name"] for s in m["sources"]} == {"notes", "val/notes"}
    assert all((tmp_path / "a" / sh["path"]).parts[-3] == "val" for sh in m["shards"]
               if sh["source"] == "val/notes")  # fmt: skip
    val = {k for k, s in keys.items() if s == "val/notes"}
    assert len(keys) == 60 and 5 <= len(val) <= 25  # about a quarter
    assert val == {k for k in keys if in_validation(k, 0.25)}
    # Stable: more inputs never move a sample to the other side.
    for i in range(60, 90):
        (notes / f"n{i:03d}.txt").write_text(f"a later note {i}")
    _, more = split(tmp_path / "b")
    assert {k for k, s in more.items() if s == "val/notes"} >= val
    assert {k for k, s in more.items() if s == "notes"} >= set(keys) - val
    # Tokenized as usual; DIR/val is the validation side, DIR/<source> training only.
    text, visual = tiny_tokenizers
    tokenize(tmp_path / "a", tmp_path / "tok", text, visual)
    cfg = LoaderConfig(
        sources=[SourceConfig(name="notes", shards=[str(tmp_path / "tok" / "notes")])],
        validation=[SourceConfig(name="heldout", shards=[str(tmp_path / "tok" / "val")])],
        seq_len=64,
        num_workers=0,
    )
    train = build_loader(cfg, rank=0, world_size=1, micro_batch=1)
    held = build_loader(cfg, rank=0, world_size=1, micro_batch=1, validation=True)
    assert len(train.tables[0]) == 60 - len(val) and len(held.tables[0]) == len(val)


def test_an_out_inside_a_source_is_refused_before_anything_is_written(tmp_path):
    """`cd code && ingest --out shards --source code:.` wrote its shards into the source, and the
    documented rerun then read them as inputs and refused the output as another ingest's."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "mod.py").write_text("X = 1\n")
    with pytest.raises(ValueError, match=r"--out .*shards is inside the folder of --source code"):
        ingest(code / "shards", [f"code:{code}"])
    assert not (code / "shards").exists()


def test_rejects_that_hold_nothing_do_not_make_exit_3(tmp_path, capsys):
    """A code tree's empty __init__.py and its .git folder are listed as rejects, but nothing with
    content was lost: exit 0. A binary file in the tree is a loss: exit 3."""
    tree = tmp_path / "pkg"
    (tree / ".git").mkdir(parents=True)
    (tree / ".git" / "HEAD").write_text("ref: refs/heads/main\n")
    (tree / "__init__.py").write_text("")
    (tree / "mod.py").write_text("def f():\n    return 1\n")
    argv = ["ingest", "--no-progress", "--source", f"code:{tree}"]
    assert main([*argv, "--out", str(tmp_path / "a")]) == 0
    said = capsys.readouterr().out
    assert (
        "empty-document 1" in said and "vendored 1" in said and "none of them loses content" in said
    )
    (tree / "blob.py").write_bytes(b"\x00\x01binary\x00" * 8)
    assert main([*argv, "--out", str(tmp_path / "b")]) == EXIT_REJECTS
    assert "binary-file 1" in capsys.readouterr().out


def test_stats_gives_a_phone_photos_size_as_shown(tmp_path, capsys):
    """A portrait phone photo is stored 40x20 with EXIF orientation 6: stats says 20 wide, 40
    high, as it is shown and tokenized; the shard keeps the stored size and the orientation."""
    import io

    from PIL import Image

    pics = tmp_path / "pics"
    pics.mkdir()
    exif = Image.Exif()
    exif[0x0112] = 6
    buf = io.BytesIO()
    Image.new("RGB", (40, 20), (200, 0, 0)).save(buf, "JPEG", exif=exif)
    (pics / "phone.jpg").write_bytes(buf.getvalue())
    out = tmp_path / "out"
    assert main(["ingest", "--out", str(out), "--no-progress", "--source", f"images:{pics}"]) == 0
    capsys.readouterr()
    assert main(["stats", str(out), "--json"]) == 0
    images = json.loads(capsys.readouterr().out)["images"]
    assert (images["width"]["max"], images["height"]["max"]) == (20, 40)
    (entry,) = read_index(next(out.glob("pics/*.idx.jsonl")))
    assert {k: entry["media"][0][k] for k in ("width", "height", "orientation")} == {
        "width": 40,
        "height": 20,
        "orientation": 6,
    }


def test_held_out_rejects_count_with_their_training_source(tmp_path, capsys):
    """With --val-fraction, rejects.jsonl lists every reject under its training source: the
    manifest (and so stats) counts them there too, none under val/<source>."""
    notes = tmp_path / "notes"
    notes.mkdir()
    for n in range(12):
        (notes / f"good{n}.txt").write_text(f"note number {n}\n")
        (notes / f"bad{n}.txt").write_bytes(b"\xff\xfe\x00bad" + bytes([n]))
    out = tmp_path / "out"
    argv = ["ingest", "--out", str(out), "--no-progress", "--val-fraction", "0.5"]
    assert main([*argv, "--source", f"text:{notes}"]) == EXIT_REJECTS
    capsys.readouterr()
    sources = json.loads((out / "manifest.json").read_text())["sources"]
    rejects = {s["name"]: s["rejects"] for s in sources}
    assert rejects == {"notes": 12, "val/notes": 0}


def test_a_raw_tar_cut_after_ingest_is_said_to_be_cut(tmp_path, capsys):
    """A raw shard truncated after ingest (a copy cut short): reading it says the tar is cut
    short at which document, not that its JSON is invalid."""
    from data.shards.reader import iter_docs

    notes = tmp_path / "notes"
    notes.mkdir()
    for n in range(20):
        (notes / f"n{n}.txt").write_text(f"note {n} " * 50)
    out = tmp_path / "out"
    assert main(["ingest", "--out", str(out), "--no-progress", "--source", f"text:{notes}"]) == 0
    (tar,) = out.glob("notes/*.tar")
    tar.write_bytes(tar.read_bytes()[: tar.stat().st_size // 2])
    with pytest.raises(
        ValueError, match=r"shard-000000\.tar: cut short: member notes-n\w+\.json lies at"
    ):
        list(iter_docs(out))


def test_a_terminated_ingest_says_how_to_resume(tmp_path):
    """SIGTERM (a scheduler's, a plain `kill`) stops ingest as Ctrl-C does: its workers stopped,
    one line saying how to go on, exit 143; the same command then finishes the folder."""
    many_images(tmp_path / "imgs", 80)
    cmd = [sys.executable, "-m", "data.cli", "ingest", "--out", str(tmp_path / "out")]
    cmd += ["--no-progress", "--workers", "2", "--shard-samples", "1"]
    cmd += ["--source", f"images:{tmp_path / 'imgs'}"]
    proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True)
    records = tmp_path / "out" / ".ingest"
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline and proc.poll() is None:
        if records.is_dir() and len(list(records.glob("shard-*.json"))) >= 3:
            break
        time.sleep(0.005)
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=60)
    assert (proc.returncode, err) == (143, "terminated; rerun the same command to resume\n")
    assert subprocess.run(cmd, capture_output=True).returncode == 0


def limited_file_size(limit: int):
    """A subprocess's preexec_fn: files of at most ``limit`` bytes (``ulimit -f``); a write past
    it fails with EFBIG, as a full disk fails with ENOSPC (SIGXFSZ ignored, as a shell's
    ``trap '' XFSZ`` would)."""

    def limit_file_size() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    return limit_file_size


def test_a_shard_that_cannot_be_written_is_named_and_the_same_command_resumes(tmp_path):
    """Before: ``error: [Errno 27] File too large`` (a full disk: ``[Errno 28] No space left on
    device``), no file named, nothing said about what to do."""
    notes = tmp_path / "notes"
    notes.mkdir()
    for i in range(4):
        (notes / f"n{i}.txt").write_text(f"note {i}\n")
    (notes / "long.txt").write_text("a long paragraph of prose. " * 1500)  # 40 KB
    cmd = [sys.executable, "-m", "data.cli", "ingest", "--no-progress", "--shard-samples", "1"]
    cmd += ["--source", f"text:{notes}", "--out"]
    ref, out = tmp_path / "ref", tmp_path / "out"
    subprocess.run([*cmd, str(ref)], check=True, capture_output=True)

    limit = 16384
    run = subprocess.run(
        [*cmd, str(out)], capture_output=True, text=True, preexec_fn=limited_file_size(limit)
    )
    lines = run.stderr.splitlines()
    assert run.returncode == 1 and len(lines) == 1, run.stderr
    shards = json.loads((ref / "manifest.json").read_text())["shards"]
    shard = max(shards, key=lambda entry: entry["bytes"])["path"]  # long.txt's
    assert lines[0] == (
        f"earlyfuse-prep ingest: error: {out / shard}.tmp: cannot be written: the file reached "
        f"this process's file-size limit (ulimit -f: {limit} bytes). Raise the limit, then run "
        "the same command again: it resumes, keeping what it finished"
    )
    assert not (out / "manifest.json").exists() and not list(out.rglob("*.tmp"))

    subprocess.run([*cmd, str(out)], check=True, capture_output=True)
    assert shard_files(out) == shard_files(ref)
    assert manifest_without_commands(out) == manifest_without_commands(ref)


def test_a_full_disk_is_said_in_one_line_naming_the_file(tmp_path, monkeypatch, capsys):
    """ENOSPC (a write into a full file system names no file) is said as the file-size limit
    is: the file, "the disk is full", what to do, and that the same command resumes."""
    from data.shards import writer

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "a.txt").write_text("a note\n")
    write = writer._HashingFile.write

    def full(self, b) -> int:
        if self.nbytes + len(b) > 1024:
            raise OSError(errno.ENOSPC, "No space left on device")
        return write(self, b)

    monkeypatch.setattr(writer._HashingFile, "write", full)
    out = tmp_path / "out"
    args = ["ingest", "--out", str(out), "--no-progress", "--source", f"text:{tmp_path / 'notes'}"]
    assert main(args) == 1
    assert capsys.readouterr().err == (
        f"earlyfuse-prep ingest: error: {out / 'notes' / 'shard-000000.tar.tmp'}: cannot be "
        "written: the disk is full. Free space on it, then run the same command again: it "
        "resumes, keeping what it finished\n"
    )


def test_stats_shows_control_characters_in_names_as_pictures(tmp_path, capsys):
    """A reject's path comes from someone else's corpus: an escape sequence in a file name (one
    that sets the terminal's title) or a newline must not reach the terminal as it is."""
    code = tmp_path / "code"
    code.mkdir()
    (code / "\x1b]0;pwned\x07title.pyx").write_text("x")
    (code / "bad\nname.vue").write_text("x")
    (code / "ok.py").write_text("x = 1\n")
    out = tmp_path / "out"
    main(["ingest", "--out", str(out), "--no-progress", "--source", f"code:{code}"])
    capsys.readouterr()
    assert main(["stats", str(out)]) == 0
    said = capsys.readouterr().out
    assert "\x1b" not in said and "\x07" not in said
    assert "code:\u241b]0;pwned\u2407title.pyx" in said and "code:bad\u240aname.vue" in said
