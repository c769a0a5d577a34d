"""``earlyfuse-prep ingest`` and ``merge``: raw corpora into raw shards, partitions into one manifest."""

from __future__ import annotations

import argparse
import math
from pathlib import Path

from data.cli.common import (
    EXIT_REJECTS,
    _add_engine_flags,
    _engine,
    command_line,
    out_folder,
    parse_size,
    path_or_url,
)
from data.ingest.plan import MIN_VAL_DOCS
from data.media import MAX_IMAGE_PIXELS
from data.names import REJECTS_FILE
from data.schema import LOSSLESS_REASONS

# Fewer held-out documents than this and a source's validation figures (its CE, its margin over
# the unigram baseline) rest on a handful of files: noise, not a measurement.


def _add_ingest(sub) -> None:
    p = sub.add_parser(
        "ingest",
        help="turn raw corpora into raw shards (tar + index), manifest.json and rejects.jsonl",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Turn raw corpora into webdataset shards: DIR/<source>/shard-NNNNNN.tar with an index\n"
        "each (.idx.jsonl), DIR/manifest.json and DIR/rejects.jsonl (every input that did not become a\n"
        "sample, with its reason). Deterministic, parallel, resumable after a kill (rerun the same\n"
        "command), and partitionable across machines (--num-partitions/--partition, then `merge`).",
        epilog="source kinds (--source [NAME=]KIND:PATH, repeatable; NAME defaults to PATH's stem):\n"
        '  text:PATH         .txt/.md/.rst files (one document each) or .jsonl with a "text" field\n'
        "  code:PATH         a source tree: one document per file, language from the extension;\n"
        "                    vendored/hidden folders, binaries, minified and huge files are rejected\n"
        "  images:PATH       a folder of images (captions from NAME.txt/NAME.json sidecars or a\n"
        "                    captions.jsonl/.csv with file,caption) or a .jsonl/.csv with image,caption\n"
        "  videos:PATH       the same for videos (column video)\n"
        '  interleaved:PATH  OBELICS-style .jsonl ({"texts": [...], "images": [...]}) or\n'
        '                    {"segments": [...]}, media paths relative to the file\n'
        "  wds:PATH          existing webdataset .tar shards in img2dataset layout (KEY.jpg + KEY.txt/json)\n"
        "  text, images, videos and interleaved also take a .parquet table or a Hugging Face\n"
        "                    save_to_disk folder, local or s3://...: text needs a text column;\n"
        "                    images/videos an image/video column (bytes, paths or {bytes, path}),\n"
        "                    optional caption, id; interleaved aligned texts/images list columns\n"
        "  a table's media paths must stay inside the table's folder (else each such row is\n"
        "                    rejected as outside-tree; --allow-outside-paths reads them)\n"
        "  every line of a JSONL/CSV table is a sample or a reject naming its line: a CSV row\n"
        "                    whose fields do not match the header or whose quote is never closed\n"
        "                    is bad-row, a blank line blank-line (docs/formats.md lists reasons)\n"
        "  a wds tar cut short or damaged keeps the samples before the break and is listed as\n"
        "                    truncated-tar or corrupt-tar, saying where and what was lost\n\n"
        "example:\n"
        "  earlyfuse-prep ingest --out shards/ --workers 8 --shard-size 256MB \\\n"
        "      --source code:~/src/cpython/Lib --source images:coco/captions.jsonl\n\n"
        "exit status: 0 done, 3 done with rejects that lost content (see rejects.jsonl), 2 a bad\n"
        "flag, input or folder (one line names it), 1 the machine failed (a full disk, an I/O\n"
        "error; one line names the file it could not write: once that is fixed, rerun the same\n"
        "command to resume), 130 or 143 stopped by Ctrl-C or SIGTERM (rerun the same command to\n"
        "resume)",
    )
    p.add_argument(
        "--out",
        required=True,
        type=out_folder,
        help="output folder (created; reused to resume), or an fsspec URL (s3://bucket/shards)",
    )
    p.add_argument(
        "--source",
        action="append",
        required=True,
        metavar="[NAME=]KIND:PATH",
        help="an input corpus; repeat for several",
    )
    p.add_argument(
        "--shard-size",
        type=parse_size,
        default=parse_size("256MB"),
        metavar="SIZE",
        help="target shard size in input bytes, e.g. 256MB (default), 0 = no limit",
    )
    p.add_argument(
        "--shard-samples",
        type=int,
        default=0,
        metavar="N",
        help="at most N samples per shard (default 0 = no limit)",
    )
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="hold out about this fraction of every source for validation, chosen by a hash of "
        "each sample's key (stable across reruns and added inputs): written to DIR/val/<source>/ "
        f"(default 0: no split). A source with fewer than {MIN_VAL_DOCS} held-out documents is "
        "warned about",
    )
    _add_engine_flags(p)
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=MAX_IMAGE_PIXELS,
        metavar="N",
        help="reject images whose header claims more pixels, before decoding (default 64M; "
        "above 178,956,970, Pillow's own limit, images are still refused)",
    )
    p.add_argument(
        "--max-video-seconds",
        type=float,
        default=600.0,
        metavar="S",
        help="reject longer videos (default 600)",
    )
    p.add_argument(
        "--max-code-bytes",
        type=parse_size,
        default=parse_size("1MiB"),
        metavar="SIZE",
        help="reject larger source files (default 1MiB)",
    )
    p.add_argument(
        "--max-text-bytes",
        type=parse_size,
        default=parse_size("16MiB"),
        metavar="SIZE",
        help="reject a document with more text: a file, a table's row, a JSONL line, an "
        "interleaved page's texts together (default 16MiB)",
    )
    p.add_argument(
        "--repair-utf8",
        action="store_true",
        help="keep text that is not valid UTF-8, bad bytes replaced by U+FFFD: files, caption files "
        "and table rows (default: reject it)",
    )
    p.add_argument(
        "--follow-links-outside",
        action="store_true",
        help="read files through symlinks that lead out of a source's folder (default: each "
        "is rejected as link-outside-source; links inside it are followed)",
    )
    p.add_argument(
        "--allow-outside-paths",
        action="store_true",
        help="read media paths that a table (JSONL, CSV, parquet, Hugging Face folder) gives "
        "outside its own folder, through '..' or as an absolute path (default: each such row is "
        "rejected as outside-tree)",
    )
    p.add_argument(
        "--allow-rejects",
        action="store_true",
        help="exit 0 even when some inputs were rejected (rejects that held nothing to keep, "
        f"{', '.join(sorted(LOSSLESS_REASONS))}, never make it exit 3)",
    )
    p.add_argument(
        "--exclude-content-of",
        action="append",
        default=[],
        type=Path,
        metavar="RAW_DIR",
        help="a raw shard folder (repeatable), e.g. the training set when ingesting a held-out set: "
        "a document that repeats one of its documents, media files or texts of 200+ characters is "
        "rejected as duplicate-of-excluded (content hashes: docs/formats.md)",
    )
    p.add_argument(
        "--dedupe",
        action="store_true",
        help="leave out every document whose whole content (texts and media bytes, in order) "
        "repeats an earlier one's, each listed in rejects.jsonl as duplicate (the first training "
        "copy is kept; `stats` counts duplicates without it). Needs a local --out",
    )
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_ingest, resumes=True)


def cmd_ingest(a) -> int:
    from data.ingest import ingest
    from data.shards.stats import describe_uncaptioned, human_bytes, media_without_text
    from data.sources import Limits

    limits = Limits(
        max_image_pixels=a.max_image_pixels,
        max_video_seconds=a.max_video_seconds,
        max_text_bytes=a.max_text_bytes,
        max_code_bytes=a.max_code_bytes,
        repair_utf8=a.repair_utf8,
        follow_links_outside=a.follow_links_outside,
        allow_outside_paths=a.allow_outside_paths,
    )
    s = ingest(
        a.out,
        a.source,
        limits=limits,
        shard_max_bytes=a.shard_size,
        shard_max_samples=a.shard_samples,
        workers=a.workers or 1,
        num_partitions=a.num_partitions,
        partition=a.partition,
        progress=not a.no_progress,
        command=command_line(a),
        engine=_engine(a),
        val_fraction=a.val_fraction,
        exclude_content_of=a.exclude_content_of,
        dedupe=a.dedupe,
    )
    part = f" (partition {a.partition} of {a.num_partitions})" if a.num_partitions > 1 else ""
    empty = f", {s['only_rejects']} planned held only rejects" if s["only_rejects"] else ""
    print(f"ingest{part}: wrote {s['written']} shard(s), {s['skipped_done']} already done{empty}")
    if not s["finalized"]:
        print(
            f"{len(s['missing'])} shard(s) belong to other partitions; when they have all finished, run:\n"
            f"  earlyfuse-prep merge {a.out}"
        )
        return said_rejects(
            s["rejects_by_reason"], a.out, a.allow_rejects, "this partition's shards"
        )
    t = s["manifest"]["totals"]
    print(
        f"{a.out}: {t['samples']} samples in {t['shards']} shards ({human_bytes(t['bytes'])}); "
        f"segments: " + (", ".join(f"{k} {v}" for k, v in t["segments"].items() if v) or "none")
    )
    if a.val_fraction:
        held = sum(x["samples"] for x in s["manifest"]["sources"] if x["name"].startswith("val/"))
        print(
            f"validation split (--val-fraction {a.val_fraction:g}, by key hash): {held} samples "
            f"in {a.out}/val/<source>/; training data in {a.out}/<source>/"
        )
        for line in thin_validation(s["manifest"]["sources"], s["val_fraction_needed"]):
            print(line)
    said = describe_uncaptioned(media_without_text(a.out))
    if said:
        print(said)
    samples: dict[str, list] = {}  # source -> [samples, rejects, kind], its held-out part too
    for source in s["manifest"]["sources"]:
        row = samples.setdefault(source["name"].removeprefix("val/"), [0, 0, source["kind"]])
        row[0] += source["samples"]
        row[1] += source.get("rejects", 0)
    for name, (kept, rejected, kind) in samples.items():
        if not kept and rejected:  # code: pointed at a folder of photos, say
            print(
                f"warning: source {name} ({kind}) gave no document: all {rejected} of its inputs "
                f"were rejected ({a.out}/{REJECTS_FILE}); is it a source of another kind?"
            )
    if not t["rejects"]:
        print("rejected: none")
    return said_rejects(t["rejects_by_reason"], a.out, a.allow_rejects)


def said_rejects(by_reason: dict[str, int], out, allow: bool, where: str = "") -> int:
    """Print the rejects (``where``: a partition's, listed in rejects.jsonl once merged) and
    return the exit status they give: EXIT_REJECTS when some lost content, unless
    --allow-rejects."""
    if not by_reason:
        return 0
    listed = f"listed in {out}/{REJECTS_FILE}" + (" once merged" if where else "")
    print(
        f"rejected {sum(by_reason.values())} input(s){' in ' + where if where else ''}, {listed}: "
        + ", ".join(f"{k} {v}" for k, v in by_reason.items())
    )
    lost = sum(n for why, n in by_reason.items() if why not in LOSSLESS_REASONS)
    if not lost:
        print(
            "none of them loses content (skipped by policy: hidden, vendored or not-code "
            "files, folder links read where they lead; empty; duplicates left out as "
            "asked): exit status 0"
        )
    return 0 if allow or not lost else EXIT_REJECTS


def _rounded_up(fraction: float) -> float:
    """``fraction`` rounded up to two significant digits (0.00213 -> 0.0022)."""
    scale = 10 ** (1 - math.floor(math.log10(fraction)))
    return math.ceil(fraction * scale) / scale


def thin_validation(sources: list[dict], needed: dict[str, float | None]) -> list[str]:
    """A warning per source whose validation split has fewer than ``MIN_VAL_DOCS`` documents;
    ``needed``: per source, the --val-fraction that holds out that many (the split goes by each
    key's hash, so not simply their share of the source's documents)."""
    counts: dict[str, list[int]] = {}
    for source in sources:
        name = source["name"].removeprefix("val/")
        counts.setdefault(name, [0, 0])[source["name"].startswith("val/")] += source["samples"]
    out = []
    for name, (train, held) in sorted(counts.items()):
        if held >= MIN_VAL_DOCS:
            continue
        total = train + held
        need = needed.get(name)
        out.append(
            f"warning: validation holds {held} of {total} {name} document(s) (fewer than "
            f"{MIN_VAL_DOCS}): its validation figures would rest on {held or 'no'} document(s). "
            + (
                f"--val-fraction {_rounded_up(need):g} holds out {MIN_VAL_DOCS} or more of them "
                "(the split goes by each document's hash), or hold out a set of your own."
                if need is not None and need < 0.5
                else "The source is too small to split: hold out a set of your own for it."
            )
        )
    return out


def _add_merge(sub) -> None:
    p = sub.add_parser(
        "merge",
        help="join the shards written by partitioned ingest or tokenize runs into one manifest",
        description="After every `ingest` (or `tokenize`) `--num-partitions P --partition I` run "
        "has written into DIR (a shared folder, or copied together), write DIR/manifest.json and "
        "DIR/rejects.jsonl. Fails, naming them, if partitions are missing.",
    )
    p.add_argument("dir", type=path_or_url, help="the folder (or fsspec URL) of every partition")
    p.add_argument(
        "--allow-rejects",
        action="store_true",
        help="exit 0 even when the partitions rejected inputs (as ingest's flag; tokenize's "
        "rejects always give 3)",
    )
    p.set_defaults(func=cmd_merge, resumes=True)


def cmd_merge(a) -> int:
    from data.cli.tokenize import tokenize_rejects
    from data.ingest.run import merge
    from data.shards.storage import Folder
    from data.tokenize.run import merge_tokens
    from data.tokenize.shard_job import STATE_DIR

    if Folder(a.dir).sizes(STATE_DIR):
        m = merge_tokens(a.dir)
        t = m["totals"]
        print(f"{a.dir}: merged {len(m['shards'])} token shards, {t['samples']} documents")
        return tokenize_rejects(t["rejects_by_reason"], a.dir)
    m = merge(a.dir)
    t = m["totals"]
    print(f"{a.dir}: merged {t['shards']} shards, {t['samples']} samples, {t['rejects']} rejects")
    return said_rejects(t["rejects_by_reason"], a.dir, a.allow_rejects)
