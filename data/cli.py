"""``earlyfuse-prep``: the data-preparation command line (see README, "Data preparation").

Exit status: 0 done; 1 a fatal error (message on stderr); 2 bad usage; 3 ``ingest`` finished
but rejected some inputs (each listed in DIR/rejects.jsonl) — pass ``--allow-rejects`` to get 0;
``verify`` exits 1 when it finds a problem.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path

from data.names import REJECTS_FILE

EXIT_REJECTS = 3

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?i?b?)?\s*$", re.I)
_UNITS = {
    "": 1,
    "b": 1,
    "k": 10**3,
    "kb": 10**3,
    "kib": 2**10,
    "m": 10**6,
    "mb": 10**6,
    "mib": 2**20,
    "g": 10**9,
    "gb": 10**9,
    "gib": 2**30,
    "t": 10**12,
    "tb": 10**12,
    "tib": 2**40,
}


def parse_size(text: str) -> int:
    """'256MB' -> 256000000, '4MiB' -> 4194304, '0' -> 0 (no limit)."""
    m = _SIZE.match(text)
    unit = (m.group(2) or "").lower() if m else None
    if not m or unit not in _UNITS:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 256MB, 4MiB, 1G)")
    return int(float(m.group(1)) * _UNITS[unit])


def path_or_url(text: str) -> Path | str:
    """A local folder (Path) or an fsspec URL kept as text (``Path`` would fold ``s3://``)."""
    return text if "://" in text and not text.startswith("file://") else Path(text)


def _add_engine_flags(p) -> None:
    """--engine and --ray-address, shared by ingest and tokenize (see docs/scaling.md)."""
    p.add_argument(
        "--engine",
        choices=("local", "ray"),
        default="local",
        help="where the shard jobs run: local worker processes (default) or a Ray cluster "
        "(pip install 'earlyfuse[ray]'; every node must see the inputs and --out)",
    )
    p.add_argument(
        "--ray-address",
        default=None,
        metavar="ADDR",
        help="the Ray cluster to join (default: $RAY_ADDRESS, else a local Ray for this command)",
    )


def _engine(a):
    from data.engine import EngineConfig

    # On ray, --workers bounds the CPU actors; its default (1) means "one per cluster CPU".
    workers = a.workers if a.engine == "local" or a.workers > 1 else 0
    return EngineConfig(kind=a.engine, workers=workers, address=a.ray_address)


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
        "                    save_to_disk folder, local or s3://... (columns: docs/scaling.md)\n\n"
        "example:\n"
        "  earlyfuse-prep ingest --out shards/ --workers 8 --shard-size 256MB \\\n"
        "      --source code:~/src/cpython/Lib --source images:coco/captions.jsonl\n\n"
        "exit status: 0 done, 3 done with rejects (see rejects.jsonl), 1 error, 2 usage",
    )
    p.add_argument(
        "--out",
        required=True,
        type=path_or_url,
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
    p.add_argument("--workers", type=int, default=1, help="parallel worker processes (default 1)")
    p.add_argument(
        "--val-fraction",
        type=float,
        default=0.0,
        metavar="F",
        help="hold out about this fraction of every source for validation, chosen by a hash of "
        "each sample's key (stable across reruns and added inputs): written to DIR/val/<source>/ "
        "(default 0: no split)",
    )
    p.add_argument(
        "--num-partitions",
        type=int,
        default=1,
        metavar="P",
        help="split the shards across P independent runs (e.g. a Slurm array)",
    )
    p.add_argument(
        "--partition",
        type=int,
        default=0,
        metavar="I",
        help="which of the P partitions this run writes (0-based)",
    )
    _add_engine_flags(p)
    p.add_argument(
        "--max-image-pixels",
        type=int,
        default=64_000_000,
        metavar="N",
        help="reject images whose header claims more pixels, before decoding (default 64M)",
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
        help="reject larger text files (default 16MiB)",
    )
    p.add_argument(
        "--repair-utf8",
        action="store_true",
        help="keep text that is not valid UTF-8, bad bytes replaced by U+FFFD (default: reject it)",
    )
    p.add_argument(
        "--follow-links-outside",
        action="store_true",
        help="read files through symlinks that lead out of a source's folder (default: each "
        "is rejected as link-outside-source; links inside it are followed)",
    )
    p.add_argument(
        "--allow-rejects", action="store_true", help="exit 0 even when some inputs were rejected"
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
    p.add_argument("--no-progress", action="store_true", help="no progress bars")
    p.set_defaults(func=cmd_ingest)


def cmd_ingest(a) -> int:
    from data.ingest import command_line, ingest
    from data.shards.stats import describe_uncaptioned, human_bytes, media_without_text
    from data.sources import Limits

    limits = Limits(
        max_image_pixels=a.max_image_pixels,
        max_video_seconds=a.max_video_seconds,
        max_text_bytes=a.max_text_bytes,
        max_code_bytes=a.max_code_bytes,
        repair_utf8=a.repair_utf8,
        follow_links_outside=a.follow_links_outside,
    )
    s = ingest(
        a.out,
        a.source,
        limits=limits,
        shard_max_bytes=a.shard_size,
        shard_max_samples=a.shard_samples,
        workers=a.workers,
        num_partitions=a.num_partitions,
        partition=a.partition,
        progress=not a.no_progress,
        command=command_line(),
        engine=_engine(a),
        val_fraction=a.val_fraction,
        exclude_content_of=a.exclude_content_of,
    )
    part = f" (partition {a.partition} of {a.num_partitions})" if a.num_partitions > 1 else ""
    print(f"ingest{part}: wrote {s['written']} shard(s), {s['skipped_done']} already done")
    if not s["finalized"]:
        print(
            f"{len(s['missing'])} shard(s) belong to other partitions; when they have all finished, run:\n"
            f"  earlyfuse-prep merge {a.out}"
        )
        return 0
    t = s["manifest"]["totals"]
    print(
        f"{a.out}: {t['samples']} samples in {t['shards']} shards ({human_bytes(t['bytes'])}); "
        f"segments: " + ", ".join(f"{k} {v}" for k, v in t["segments"].items() if v)
    )
    if a.val_fraction:
        held = sum(x["samples"] for x in s["manifest"]["sources"] if x["name"].startswith("val/"))
        print(
            f"validation split (--val-fraction {a.val_fraction:g}, by key hash): {held} samples "
            f"in {a.out / 'val'}/<source>/; training data in {a.out}/<source>/"
        )
    said = describe_uncaptioned(media_without_text(a.out))
    if said:
        print(said)
    if t["rejects"]:
        print(
            f"rejected {t['rejects']} input(s), listed in {a.out}/{REJECTS_FILE}: "
            + ", ".join(f"{k} {v}" for k, v in t["rejects_by_reason"].items())
        )
        return 0 if a.allow_rejects else EXIT_REJECTS
    print("rejected: none")
    return 0


def _add_merge(sub) -> None:
    p = sub.add_parser(
        "merge",
        help="join the shards written by partitioned ingest or tokenize runs into one manifest",
        description="After every `ingest` (or `tokenize`) `--num-partitions P --partition I` run "
        "has written into DIR (a shared folder, or copied together), write DIR/manifest.json and "
        "DIR/rejects.jsonl. Fails, naming them, if partitions are missing.",
    )
    p.add_argument("dir", type=path_or_url, help="the folder (or fsspec URL) of every partition")
    p.set_defaults(func=cmd_merge)


def cmd_merge(a) -> int:
    from data.ingest.run import finalize_folder
    from data.shards.manifest import merge, missing_shards
    from data.shards.storage import Folder
    from data.tokenize.run import STATE_DIR, merge_tokens

    folder = Folder(a.dir)
    if folder.sizes(STATE_DIR):
        m = merge_tokens(a.dir)
        t = m["totals"]
        print(f"{a.dir}: merged {len(m['shards'])} token shards, {t['samples']} documents")
        return 0
    if folder.remote:  # what `merge` does, through the storage layer
        records = folder.records(".ingest")
        if (
            not records
            or missing_shards(records)
            or len({r["fingerprint"] for r in records.values()}) > 1
        ):
            raise ValueError(f"{a.dir}: partitions are missing or differ; rerun them, then merge")
        m = finalize_folder(folder, records)
    else:
        m = merge(a.dir)
    t = m["totals"]
    print(f"{a.dir}: merged {t['shards']} shards, {t['samples']} samples, {t['rejects']} rejects")
    return 0


def _add_stats(sub) -> None:
    p = sub.add_parser(
        "stats", help="samples, bytes, modalities, media sizes and reject reasons of a shard folder"
    )
    p.add_argument("dir", type=Path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_stats)


def cmd_stats(a) -> int:
    from data.shards.stats import collect_stats, format_stats

    s = collect_stats(a.dir)
    print(json.dumps(s, indent=1) if a.json else format_stats(s))
    return 0


def _add_verify(sub) -> None:
    p = sub.add_parser(
        "verify",
        help="re-hash shards against the manifest, check every index against its tar and every "
        "sample (raw folders: documents against the schema; token folders: ids within the "
        "vocabulary)",
    )
    p.add_argument("dir", type=Path)
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.set_defaults(func=cmd_verify)


def cmd_verify(a) -> int:
    from data.shards.verify import format_verify, verify

    r = verify(a.dir, progress=not a.json)
    print(json.dumps(r, indent=1) if a.json else format_verify(r))
    return 0 if r["ok"] else 1


def _add_index(sub) -> None:
    p = sub.add_parser(
        "index",
        help="write the loader's binary index (SHARD.idx.bin) beside every shard of a token "
        "folder made before binary indexes, and each shard's block summary into its manifest "
        "(a loader then starts without reading any index; without this it builds them into "
        "its cache on first use)",
    )
    p.add_argument("dir", type=Path, help="a token folder (earlyfuse-prep tokenize --out)")
    p.set_defaults(func=cmd_index)


def cmd_index(a) -> int:
    from data.shards.token_index import index_folder

    r = index_folder(a.dir)
    print(f"{r['folder']}: {r['written']} of {r['shards']} binary indexes written")
    return 0


def _add_demo_corpus(sub) -> None:
    p = sub.add_parser(
        "demo-corpus",
        help="build the small real demo corpus offline (code, prose, photos, scenes, clips)",
    )
    p.add_argument("--out", required=True, type=Path)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument(
        "--scale", type=float, default=1.0, help="multiply every part's size (default 1.0)"
    )
    p.add_argument(
        "--split",
        choices=["all", "train", "heldout"],
        default="all",
        help="which share of the real material (modules, docstrings, help topics, photos, digits): "
        "train and heldout never share an item; build a held-out corpus with --split heldout "
        "and another --seed (default all)",
    )
    p.add_argument(
        "--scenes",
        type=int,
        default=None,
        metavar="N",
        help="N generated scenes, and N drawings (caption then picture), whatever --scale",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_demo_corpus)


def cmd_demo_corpus(a) -> int:
    from data.demo_corpus import build
    from data.shards.stats import human_bytes

    s = build(
        a.out,
        seed=a.seed,
        scale=a.scale,
        progress=not a.no_progress,
        split=a.split,
        scene_count=a.scenes,
    )
    print(
        f"{a.out}: demo corpus, {s['files']} files, {human_bytes(s['bytes'])} in {s['seconds']} s "
        f"(seed {s['seed']}, scale {s['scale']:g}, split {s['split']}); see {a.out / 'README.md'}"
    )
    for name, part in s["parts"].items():
        counts = ", ".join(f"{v} {k}" for k, v in part.items() if k != "bytes")
        print(f"  {name:<12} {human_bytes(part['bytes']):>10}  {counts}")
    return 0


def _add_train_text_tokenizer(sub) -> None:
    p = sub.add_parser(
        "train-text-tokenizer",
        help="train the byte-level BPE for text and code on raw shards",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a byte-level BPE (Hugging Face tokenizers) on the text and code segments of\n"
        "raw shard folders. Writes OUT/tokenizer.json, OUT/vocab_layout.json (the id space every\n"
        "later stage and checkpoint uses: text BPE, structure tokens, visual codes) and\n"
        "OUT/text_tokenizer_training.json (what it was trained on).",
        epilog="example:\n  earlyfuse-prep train-text-tokenizer --in shards/ --out tok/ --vocab-size 32000 \\\n"
        "      --weight code=0.4 --max-chars 500M --fsq-levels 8,8,8,5,5,5",
    )
    p.add_argument(
        "--in",
        dest="inputs",
        action="append",
        required=True,
        type=Path,
        metavar="RAW_DIR",
        help="a raw shard folder (repeatable)",
    )
    p.add_argument("--out", required=True, type=Path, help="tokenizer folder to write")
    p.add_argument(
        "--vocab-size",
        type=int,
        default=32000,
        help="BPE size incl. its 3 specials (default 32000)",
    )
    p.add_argument(
        "--weight",
        action="append",
        default=[],
        metavar="SOURCE=FRACTION",
        help="fraction of the training characters from one source (e.g. code=0.4); "
        "sources not named share the rest by size (default: all by size). A source smaller than "
        "its fraction gives all it holds, once (never repeated); the summary says what was used",
    )
    p.add_argument(
        "--max-chars",
        type=parse_size,
        default=parse_size("100M"),
        metavar="N",
        help="characters to train on in all (default 100M)",
    )
    p.add_argument(
        "--fsq-levels",
        default="8,5,5,5",
        help="FSQ levels of the visual tokenizer, fixing the number of visual codes (default 8,5,5,5)",
    )
    p.add_argument(
        "--max-grid", type=int, default=64, help="largest image side in tokens (default 64)"
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_train_text_tokenizer)


def cmd_train_text_tokenizer(a) -> int:
    from data.train_text_tokenizer import train_text_tokenizer

    weights = {}
    for w in a.weight:
        name, _, val = w.partition("=")
        try:
            weights[name] = float(val)
        except ValueError:
            raise ValueError(f"--weight {w!r}: expected SOURCE=FRACTION, e.g. code=0.4") from None
    levels = tuple(int(x) for x in a.fsq_levels.split(","))
    info = train_text_tokenizer(
        a.inputs,
        a.out,
        vocab_size=a.vocab_size,
        weights=weights,
        max_chars=a.max_chars,
        fsq_levels=levels,
        max_grid=a.max_grid,
        progress=not a.no_progress,
    )
    r = info["layout"]
    print(
        f"{a.out}: BPE of {info['vocab_size']} ids trained on {sum(info['chars_used'].values()):,} chars:"
    )
    for n, src in info["sources"].items():
        print(
            f"  {n:<16} {src['chars_used']:>12,} chars ({src['share']:.1%})"
            + (
                f": all it holds, less than the {src['asked_chars']:,} its weight asked (not repeated)"
                if src["all_of_it"]
                else ""
            )
        )
    print(f"vocabulary layout: text {r['text']}, structure {r['structure']}, visual {r['visual']}")
    return 0


def _add_tokenize(sub) -> None:
    p = sub.add_parser(
        "tokenize",
        help="turn raw shards into token shards (ids, modality, spans) with both tokenizers",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Tokenize every document of a raw shard folder: text and code with the BPE, images\n"
        "and videos with the visual tokenizer, laid out as <boi> <h=H> <w=W> rows <eol> ... <eoi>.\n"
        "Writes one token shard per raw shard (KEY.ids.npy int32, KEY.mod.npy uint8, KEY.json spans),\n"
        "indexes, manifest.json, rejects.jsonl, and a copy of the tokenizers in OUT/tokenizers/.\n"
        "Parallel (--workers, or --engine ray), partitionable (--num-partitions/--partition, then\n"
        "`merge`), resumable (rerun the same command), GPU for images when present.",
        epilog="example:\n  earlyfuse-prep tokenize --in shards/ --out tokens/ --tokenizer tok/ \\\n"
        "      --visual-tokenizer runs/vtok_cpu/visual_tokenizer --workers 8",
    )
    p.add_argument(
        "--in",
        dest="inp",
        required=True,
        type=path_or_url,
        metavar="RAW_DIR",
        help="raw shard folder, or an fsspec URL (s3://bucket/shards)",
    )
    p.add_argument(
        "--out",
        required=True,
        type=path_or_url,
        metavar="TOKEN_DIR",
        help="token folder to write, or an fsspec URL",
    )
    p.add_argument(
        "--tokenizer",
        required=True,
        type=Path,
        metavar="TOK_DIR",
        help="folder of train-text-tokenizer (tokenizer.json + vocab_layout.json)",
    )
    p.add_argument(
        "--visual-tokenizer",
        required=True,
        type=Path,
        metavar="VTOK_DIR",
        help="RUN_DIR/visual_tokenizer of a vtok training run",
    )
    p.add_argument(
        "--image-max-pixels",
        type=int,
        default=256 * 256,
        help="pixel budget per image (default 65536)",
    )
    p.add_argument(
        "--video-max-pixels",
        type=int,
        default=128 * 128,
        help="pixel budget per video frame (default 16384)",
    )
    p.add_argument(
        "--video-fps",
        type=float,
        default=4.0,
        help="frames sampled per second of video (default 4)",
    )
    p.add_argument(
        "--video-max-tokens",
        type=int,
        default=4096,
        help="tokens per video block at most; longer clips are sampled more sparsely (default 4096)",
    )
    p.add_argument(
        "--seq-len",
        type=int,
        default=0,
        metavar="N",
        help="the row length of the training runs (data.seq_len): every image and video block is "
        "made to fit N tokens (images downscaled; videos fewer frames, then smaller frames), so the "
        "loader never drops one. Default: no bound beyond the budgets above; the summary then "
        "says which data.seq_len the blocks need",
    )
    p.add_argument(
        "--max-block-tokens",
        type=int,
        default=0,
        metavar="N",
        help="bound blocks to N tokens (e.g. half a row, for tighter packing); with --seq-len "
        "the smaller of the two",
    )
    p.add_argument("--workers", type=int, default=1, help="parallel worker processes (default 1)")
    p.add_argument(
        "--num-partitions",
        type=int,
        default=1,
        metavar="P",
        help="split the shards across P independent runs (e.g. a Slurm array), then `merge`",
    )
    p.add_argument(
        "--partition",
        type=int,
        default=0,
        metavar="I",
        help="which of the P partitions this run tokenizes (0-based)",
    )
    _add_engine_flags(p)
    p.add_argument(
        "--device",
        default=None,
        help="device of the visual tokenizer (default: cuda if present, else cpu)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_tokenize)


def cmd_tokenize(a) -> int:
    from data.tokenize.blocks import describe
    from data.tokenize.docs import TokenizeOptions
    from data.tokenize.run import tokenize

    caps = [n for n in (a.seq_len, a.max_block_tokens) if n]
    if any(n < 8 for n in caps):
        raise ValueError("--seq-len / --max-block-tokens: a visual block needs at least 8 tokens")
    opts = TokenizeOptions(
        image_max_pixels=a.image_max_pixels,
        video_max_pixels=a.video_max_pixels,
        video_fps=a.video_fps,
        video_max_tokens=a.video_max_tokens,
        max_block_tokens=min(caps) if caps else 0,
    )
    m = tokenize(
        a.inp,
        a.out,
        a.tokenizer,
        a.visual_tokenizer,
        opts=opts,
        device=a.device,
        progress=not a.no_progress,
        num_partitions=a.num_partitions,
        partition=a.partition,
        engine=_engine(a),
    )
    if not m["finalized"]:
        print(
            f"tokenize (partition {a.partition} of {a.num_partitions}): wrote {m['written']} "
            f"shard(s); {len(m['missing'])} belong to other partitions; when they have all "
            f"finished, run:\n  earlyfuse-prep merge {a.out}"
        )
        return 0
    t = m["totals"]
    print(
        f"{a.out}: {t['samples']} documents, {t['tokens']:,} tokens ("
        + ", ".join(f"{k} {v:,}" for k, v in t["tokens_by_modality"].items() if v)
        + ")"
    )
    for line in describe(m):
        print(line)
    if t["rejects"]:
        print(
            f"rejected {t['rejects']} document(s), listed in {a.out}/{REJECTS_FILE}: "
            + ", ".join(f"{k} {v}" for k, v in t["rejects_by_reason"].items())
        )
        return EXIT_REJECTS
    return 0


def _add_preview(sub) -> None:
    p = sub.add_parser(
        "preview",
        help="show a few packed rows of token shards, modalities coloured (text or PNG)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pack a few rows from a token folder exactly as the training loader does and\n"
        "show them: each piece (document run) with text and code decoded and visual blocks\n"
        "summarised; --png draws one band per row, a cell per token coloured by modality,\n"
        "and decodes the rows' images beside it.",
        epilog="examples:\n  earlyfuse-prep preview runs/demo/tokens --seq-len 512 --rows 3 --png rows.png\n"
        "  earlyfuse-prep preview --config runs/demo/lm/config.yaml --rows 8   # the run's own mix",
    )
    p.add_argument(
        "tokens",
        type=Path,
        nargs="?",
        metavar="TOKEN_DIR",
        help="a token folder (default with --config: the folder of its first source)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="YAML",
        help="draw rows as a run would: its sources, weights, seq_len and seed, from a run's "
        "config.yaml (RUN_DIR/config.yaml) or a data config (configs/data/*.yaml)",
    )
    p.add_argument(
        "--source",
        action="append",
        default=None,
        help="only these sources (repeatable; default all)",
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="row length (default: --config's, else 2048)"
    )
    p.add_argument("--rows", type=int, default=2)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--png", type=Path, default=None, help="also render the rows to this PNG")
    p.set_defaults(func=cmd_preview)


def cmd_preview(a) -> int:
    from data.loader.preview import preview

    print(
        preview(
            a.tokens,
            sources=a.source,
            seq_len=a.seq_len,
            n_rows=a.rows,
            seed=a.seed,
            png=a.png,
            config=a.config,
        )
    )
    return 0


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="earlyfuse-prep",
        description="earlyfuse data preparation: raw corpora -> shards -> tokenizers -> token shards.",
    )
    sub = p.add_subparsers(dest="command", required=True, metavar="COMMAND")
    for add in (
        _add_ingest,
        _add_merge,
        _add_stats,
        _add_verify,
        _add_index,
        _add_demo_corpus,
        _add_train_text_tokenizer,
        _add_tokenize,
        _add_preview,
    ):
        add(sub)
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.func(args)
    except KeyboardInterrupt:
        print("interrupted; rerun the same command to resume", file=sys.stderr)
        return 130
    except (ValueError, OSError) as e:
        print(f"earlyfuse-prep {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
