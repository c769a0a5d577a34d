"""``earlyfuse-prep tokenize``: raw shards into token shards with both tokenizers."""

from __future__ import annotations

import argparse
from pathlib import Path

from data.cli.common import (
    EXIT_REJECTS,
    _add_engine_flags,
    _engine,
    checked_device,
    command_line,
    out_folder,
    path_or_url,
    positive_int,
)
from data.names import REJECTS_FILE


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
        "`merge`), resumable (rerun the same command, after a kill or once a full disk has room),\n"
        "GPU for images when present.",
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
        type=out_folder,
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
        default=None,
        type=Path,
        metavar="VTOK_DIR",
        help="RUN_DIR/visual_tokenizer of a vtok training run; not needed for a corpus of text "
        "and code alone (one holding images or videos is refused without it, saying how many)",
    )
    p.add_argument(
        "--image-max-pixels",
        type=positive_int,
        default=256 * 256,
        help="pixel budget per image (default 65536)",
    )
    p.add_argument(
        "--video-max-pixels",
        type=positive_int,
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
        default=None,
        help="tokens per video block at most; longer clips are sampled more sparsely (default 4096, "
        "or --doc-budget when given)",
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
    p.add_argument(
        "--doc-budget",
        type=int,
        default=0,
        metavar="N",
        help="tokens a document's videos may share, for a long-context stage whose rows are N "
        "tokens: they share what its text and images leave of N and keep as many frames as their "
        "share allows (a long clip keeps its length); every block also fits N. Text and code are "
        "never cut: a longer file stays one document, packed across rows. A document "
        "whose text and images leave its videos too little is rejected (over-doc-budget). "
        "Default: no per-document bound, each block bounded by --seq-len as above. Raw sources "
        "tokenized by the loader take the same budget as data.doc_budget",
    )
    _add_engine_flags(p)
    p.add_argument(
        "--device",
        default=None,
        help="device of the visual tokenizer (default: cuda if present, else cpu)",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_tokenize, resumes=True)


def cmd_tokenize(a) -> int:
    from data.tokenize.blocks import describe
    from data.tokenize.docs import budgeted_options
    from data.tokenize.run import tokenize

    opts = budgeted_options(
        seq_len=a.seq_len,
        max_block_tokens=a.max_block_tokens,
        doc_budget=a.doc_budget,
        video_max_tokens=a.video_max_tokens,
        image_max_pixels=a.image_max_pixels,
        video_max_pixels=a.video_max_pixels,
        video_fps=a.video_fps,
    )
    m = tokenize(
        a.inp,
        a.out,
        a.tokenizer,
        a.visual_tokenizer,
        opts=opts,
        device=a.device and checked_device(a.device, here=a.engine == "local"),
        progress=not a.no_progress,
        num_partitions=a.num_partitions,
        partition=a.partition,
        engine=_engine(a),
        command=command_line(a),
    )
    if not m["finalized"]:
        print(
            f"tokenize (partition {a.partition} of {a.num_partitions}): wrote {m['written']} "
            f"shard(s); {len(m['missing'])} belong to other partitions; when they have all "
            f"finished, run:\n  earlyfuse-prep merge {a.out}"
        )
        return tokenize_rejects(m["rejects_by_reason"], a.out, "this partition's shards")
    if m["skipped_done"]:  # a resumed run
        print(f"tokenize: wrote {m['written']} shard(s), {m['skipped_done']} already done")
    t = m["totals"]
    print(
        f"{a.out}: {t['samples']} documents, {t['tokens']:,} tokens ("
        + ", ".join(f"{k} {v:,}" for k, v in t["tokens_by_modality"].items() if v)
        + ")"
    )
    for line in describe(m):
        print(line)
    for source in m["sources"]:
        if thinned := source.get("sparse_clips"):
            print(
                f"note: {source['name']}: {thinned['clips']} clip(s) longer than their block "
                f"budget holds at --video-fps {m['options']['video_fps']:g} kept fewer frames "
                f"over their whole length (up to {thinned['widest']:.3g} s apart, e.g. "
                f"{', '.join(thinned['examples'])}); a larger --doc-budget, --video-max-tokens "
                "or --seq-len keeps more"
            )
        if squeezed := source.get("out_of_shape"):
            print(
                f"note: {source['name']}: {squeezed['documents']} document(s) with an image too long "
                f"and thin for the grid (more than max_grid:1), drawn more than twice out of "
                f"shape, e.g. {', '.join(squeezed['examples'])}: crop or split such images"
            )
    return tokenize_rejects(t["rejects_by_reason"], a.out)


def tokenize_rejects(by_reason: dict[str, int], out, where: str = "") -> int:
    """Print the rejected documents (``where``: a partition's, listed once merged); any gives
    EXIT_REJECTS."""
    if not by_reason:
        return 0
    listed = f"listed in {out}/{REJECTS_FILE}" + (" once merged" if where else "")
    print(
        f"rejected {sum(by_reason.values())} document(s){' in ' + where if where else ''}, "
        f"{listed}: " + ", ".join(f"{k} {v}" for k, v in by_reason.items())
    )
    return EXIT_REJECTS
