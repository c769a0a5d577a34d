"""``earlyfuse-eval RELEASE --data VAL_TOKENS``: what a released model has learned, measured on
held-out data, per modality and across modalities; docs/evaluation.md explains every figure and
the module of each part. The held-out rows are the run's validation rows (``packing_options``):
figures measured on other rows would not compare with its validation, so settings taken from
DEFAULT_PACKING are named on stderr.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from train.callbacks.run_info import code_identity

EVAL_FILE = "heldout_eval.json"  # in a run folder: earlyfuse-report shows it

EXAMPLES = """\
examples:
  earlyfuse-eval runs/demo/release --data runs/demo/val_tokens --train-data runs/demo/tokens \\
      --scenes runs/demo/val_raw --max-pairs 60 --max-scenes 40 --draw-guidance 2   # make demo's
  earlyfuse-eval releases/x --data val_tokens --max-docs 200 --device cuda
  earlyfuse-eval releases/mine --data tokens/val --train-data tokens   # ingest --val-fraction's split
  earlyfuse-eval releases/mine --data s3://bucket/tokens/val              # any fsspec URL
  earlyfuse-eval releases/mine --data tokens/val --long-context --needle-lengths 2048,4096,8192

what the table says (docs/evaluation.md explains every figure):
  margin = unigram - CE per modality: above 0 the model beats the training tokens' own
    frequencies; structure tokens (<eol>, <eoi>) should cost nearly nothing. bigram: the CE of
    the previous token alone (Witten-Bell): a model at or above it has learned no more than
    what one token of context gives.
  gap = CE of the target after another document's context - after its own (nats per target
    token): near 0, captions ignore their pictures (caption) or pictures their captions (drawing).
  scenes: share of drawn / captioned held-out scenes with the right colour, shape and cell,
    beside chance (scored against another scene) and the visual tokenizer's own ceiling.
  loss by position: CE per position bucket, each over the document stretches that cover it
    whole (stretches: how many); first = the same stretches' CE in the first bucket. Falling
    with position: the model uses its context.
  passkey / frame copy: teacher-forced accuracy of a key's digits (whole keys in brackets) or of
    a repeated frame's codes, per depth of the needle and sequence length, against a control
    without the needle (what guessing gets).
  The held-out data must be made with the release's tokenizers (checked: other tokenizers are
    refused) and never seen in training (ingest --exclude-content-of; --train-data checks it).
"""


# The held-out pass's packing when neither flags, the release nor its run folder give it.
DEFAULT_PACKING = {"seq_len": 2048, "batch_rows": 8, "whole_documents": False}
FLAGS = {
    "seq_len": "--seq-len",
    "batch_rows": "--batch-rows",
    "whole_documents": "--[no-]whole-documents",
}


# The names the ``packing`` record of a release (tools/convert_release.py) gives these settings.
RECORDED = {"seq_len": "seq_len", "batch_rows": "micro_batch", "whole_documents": "whole_documents"}


def packing_options(args, release) -> tuple[dict, dict]:
    """The held-out pass's ``seq_len``, ``batch_rows`` (the run's micro-batch) and
    ``whole_documents``, and where each came from: a flag over the release's ``packing`` (written
    by ``earlyfuse-convert release``) over the same record made from its run folder's
    ``config.yaml``, when that is still there, over DEFAULT_PACKING (``flag``, ``release``, ``run
    folder``, ``default``)."""
    from tools.convert_deepspeed import CheckpointError, load_run_config
    from tools.convert_release import packing
    from train.names import CONFIG_FILE
    from train.release import CONFIG, ReleaseError

    recorded = release.config.get("packing")
    # a record holds two integers and a flag, of the defaults' types
    if recorded is not None and (
        not isinstance(recorded, dict)
        or any(
            type(recorded.get(RECORDED[key])) is not type(value)
            for key, value in DEFAULT_PACKING.items()
        )
    ):
        raise ReleaseError(
            f"{release.path / CONFIG}: bad 'packing' section {recorded!r}: it needs seq_len and "
            "micro_batch (integers) and whole_documents (true or false)"
        )
    run_dir = release.config.get("source", {}).get("run_dir")
    try:
        in_run = packing(load_run_config(Path(run_dir) / CONFIG_FILE), 1) if run_dir else None
    except CheckpointError:  # the run folder is gone or its config unreadable
        in_run = None
    flags = {
        "seq_len": args.seq_len or None,
        "batch_rows": args.batch_rows or None,
        "whole_documents": args.whole_documents,
    }
    layers = (
        ("flag", flags),
        ("release", {key: recorded[name] for key, name in RECORDED.items()} if recorded else {}),
        ("run folder", {key: in_run[name] for key, name in RECORDED.items()} if in_run else {}),
        ("default", DEFAULT_PACKING),
    )
    values: dict = {}
    origin: dict[str, str] = {}
    for key in DEFAULT_PACKING:
        for where, given in layers:
            if given.get(key) is not None:
                values[key], origin[key] = given[key], where
                break
    return values, origin


def defaults_notice(release, values: dict, origin: dict) -> str | None:
    """One line naming the packing settings taken from DEFAULT_PACKING (None: there are none), so
    that figures measured on other rows than the run's validation never pass unnoticed."""
    taken = [key for key in DEFAULT_PACKING if origin[key] == "default"]
    if not taken:
        return None
    shown = ", ".join(
        f"{key} {('on' if values[key] else 'off') if key == 'whole_documents' else values[key]}"
        for key in taken
    )
    run_dir = release.config.get("source", {}).get("run_dir") or "unknown"
    return (
        f"earlyfuse-eval: note: took the defaults {shown}: neither {release.path}/config.json "
        f"('packing') nor its run folder's config.yaml ({run_dir}) gives them, so the held-out "
        f"rows may differ from the run's validation ({', '.join(FLAGS[key] for key in taken)} "
        "sets them)"
    )


def documents(tables, what: str, progress: bool):
    """Every document of ``tables`` in index order, under a progress bar named ``what``."""
    from tqdm import tqdm

    from data.token_docs import iter_documents

    total = sum(len(table) for table in tables)
    return tqdm(iter_documents(tables), total=total, desc=what, unit=" docs", disable=not progress)


def overlap(val_tables, train_tables, *, progress: bool = False) -> dict:
    """Held-out documents whose ids equal a training document's, and the first 5 pairs' keys."""
    seen = {d.content_hash(): d.key for d in documents(train_tables, "training hashes", progress)}
    by_source: dict[str, int] = {}
    checked, examples = 0, list[str]()
    for doc in documents(val_tables, "held-out hashes", progress):
        checked += 1
        if (twin := seen.get(doc.content_hash())) is not None:
            by_source[doc.source] = by_source.get(doc.source, 0) + 1
            examples += [f"{doc.key} = {twin}"] if len(examples) < 5 else []
    found = sum(by_source.values())
    return {"checked": checked, "documents": found, "by_source": by_source, "examples": examples}


def evaluate(args) -> dict:
    import torch

    from data.cli.common import checked_device
    from data.token_docs import source_tables
    from data.unigram import Unigram
    from tools.evaluate.bigram import Bigram
    from tools.evaluate.heldout import Heldout, heldout_losses, token_byte_lengths
    from tools.evaluate.pair_dependence import dependence_gaps, find_pair
    from tools.evaluate.position import bucket_edges, position_losses
    from tools.generate_requests import Generator
    from train.release import Release

    started = time.perf_counter()
    device = torch.device(checked_device(args.device))  # before the release and data are read
    rel = Release(args.release)
    if rel.task != "lm":
        raise ValueError(f"{rel.path}: a {rel.task} release; earlyfuse-eval takes a language model")
    val = source_tables(args.data)
    rel.check_token_tables(val, "--data")
    for table in val:
        if differ := rel.budget_differences(table):
            print(
                f"WARNING: --data: source {table.name} was tokenized with other block budgets "
                f"than the release's training data ({'; '.join(differ)}): its images and videos "
                "are at sizes the model did not train on, and its figures do not compare with "
                f"the run's. Tokenize it as the training data was: {rel.tokenize_command()}",
                file=sys.stderr,
                flush=True,
            )
    out: dict = {"release": str(rel.path), "step": rel.step, "data": str(args.data)}
    out["evaluated_by"] = code_identity()  # figures change meaning with the code that made them
    packing, origin = packing_options(args, rel)
    out.update(packing)
    out["packing_from"] = origin
    notice = defaults_notice(rel, packing, origin)
    if notice:
        print(notice, file=sys.stderr, flush=True)
    needles = args.needle or args.long_context
    needle_shape = needle_options(args, packing["seq_len"]) if needles else None  # fail first
    if args.scenes and args.max_scenes != 0:  # the drawings' settings too, not after the rest
        from model.generate import SamplingConfig, check_guidance

        try:
            SamplingConfig(temperature=args.draw_temperature)
        except ValueError as e:
            raise ValueError(f"--draw-temperature: {e}") from None
        try:
            check_guidance(args.draw_guidance)
        except ValueError as e:
            raise ValueError(f"--draw-{e}") from None
    positions = args.position_loss or args.long_context
    edges = bucket_edges(packing["seq_len"], args.position_first_bucket) if positions else None
    progress = not args.no_progress
    gen = Generator(rel, device)  # the model and tokenizers, as earlyfuse-generate loads them
    run = Heldout(gen.model, val, device, **packing, max_docs=args.max_docs, progress=progress)
    say = (lambda *a: print(*a, file=sys.stderr, flush=True)) if args.verbose else (lambda *a: 0)
    unigram = bigram = None
    if args.train_data:
        train = source_tables(args.train_data)
        rel.check_token_tables(train, "--train-data")
        out["train_data"] = str(args.train_data)
        say("overlap with the training documents ...")
        out["overlap"] = overlap(val, train, progress=progress)
        say("unigram baseline ...")
        unigram = Unigram.from_tables(train, rel.vocab_layout, progress=progress)
        say("bigram baseline ...")
        bigram = Bigram.from_tables(train, rel.vocab_layout)
    say("held-out losses ...")
    out["heldout"] = heldout_losses(run, token_byte_lengths(gen.text), unigram, bigram)
    pairs: list = []
    per_group: Counter = Counter()  # pairs taken per (source, direction)
    too_long: Counter = Counter()  # per source: pairs a row of seq_len does not hold
    for doc in documents(val, "pairs", progress) if args.max_pairs else ():
        pair = find_pair(doc.source, doc.key, doc.ids, doc.modality, doc.blocks)
        if pair is not None and len(doc.ids) > packing["seq_len"]:
            too_long[pair.source] += 1  # scored alone, at positions past the rows of the table
        elif pair is not None and per_group[pair.source, pair.direction] < args.max_pairs:
            per_group[pair.source, pair.direction] += 1
            pairs.append(pair)
    if too_long:
        out["dependence_left_out"] = dict(sorted(too_long.items()))
    if pairs:
        say("dependence ...")
        out["dependence"] = dependence_gaps(run.model, pairs, device, progress=progress)
    if args.scenes and args.max_scenes != 0:
        from tools.evaluate.scenes import evaluate_scenes, load_scenes

        say("scenes ...")
        out["scenes"] = evaluate_scenes(
            gen,
            load_scenes(args.scenes),
            limit=args.max_scenes or 0,
            draw_temperature=args.draw_temperature,
            draw_guidance=args.draw_guidance,
            train_data=args.train_data,
            progress=progress,
        )
    if edges is not None:
        say("loss by position ...")
        out["position_loss"] = position_losses(run, edges)
    if needle_shape is not None:
        from tools.evaluate.needle import frame_copy_table, passkey_table

        say("needles ...")
        lengths, depths = needle_shape
        shape = {"lengths": lengths, "depths": depths, "trials": args.needle_trials}
        from model.attention import RowsTooLong

        try:
            out["passkey"] = passkey_table(run, gen.text, digits=args.needle_digits, **shape)
            out["frame_copy"] = frame_copy_table(run, gen.text, **shape)
        except RowsTooLong as e:  # the rows are the needles' lengths, not --seq-len's
            raise ValueError(f"--needle-lengths {','.join(map(str, lengths))}: {e}") from None
    out["seconds"] = round(time.perf_counter() - started, 1)
    return out


def needle_options(args, seq_len: int) -> tuple[list[int], tuple[float, ...]]:
    """The needle tables' lengths (default: the row length, 2x and 4x it) and depths, checked."""
    from tools.evaluate.needle import DEPTHS, parse_list

    lengths = (
        parse_list(args.needle_lengths, int, "--needle-lengths")
        if args.needle_lengths
        else [seq_len, 2 * seq_len, 4 * seq_len]
    )
    depths = (
        tuple(parse_list(args.needle_depths, float, "--needle-depths"))
        if args.needle_depths
        else DEPTHS
    )
    if min(lengths) < 1:
        raise ValueError(f"--needle-lengths {args.needle_lengths}: lengths must be positive")
    if not all(0.0 <= depth <= 1.0 for depth in depths):
        raise ValueError(f"--needle-depths {args.needle_depths}: depths are fractions in [0, 1]")
    if args.needle_trials < 1 or args.needle_digits < 1:
        raise ValueError("--needle-trials and --needle-digits must be at least 1")
    return lengths, depths


def build_parser() -> argparse.ArgumentParser:
    from data.cli.common import out_file, positive_int

    def count(text: str) -> int:  # 0 or more: 0 skips that part
        if text.strip() == "0":
            return 0
        try:
            return positive_int(text)
        except argparse.ArgumentTypeError:
            raise argparse.ArgumentTypeError(f"{text!r} is not a count (give 0 or more)") from None

    pair = argparse.ArgumentParser(
        prog="earlyfuse-eval",
        description="Evaluate a release on held-out token shards: per-modality CE, bits per byte, "
        "unigram baseline and margin; the cross-modal dependence gap in both directions; drawing "
        "and captioning of held-out scenes scored from pixels. Prints a table; --out writes the "
        "figures as JSON too.",
        epilog=EXAMPLES,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    pair.add_argument(
        "release", metavar="RELEASE", help="a release folder (earlyfuse-convert release)"
    )
    pair.add_argument(
        "--data",
        required=True,
        metavar="VAL_TOKENS",
        help="held-out token shards, a folder or an fsspec URL: a token folder (one source per "
        "sub-folder with shards), the held-out split ingest --val-fraction put under it "
        "(TOKENS/val), or one source's folder",
    )
    pair.add_argument(
        "--train-data",
        metavar="TRAIN_TOKENS",
        help="the training token folder (or URL): unigram baseline, and a check that no held-out "
        "document is a training document",
    )
    pair.add_argument(
        "--scenes",
        action="append",
        default=[],
        metavar="PATH",
        help="held-out scenes of the demo corpus, drawn and captioned and scored from pixels "
        "(repeatable): a raw shard folder (the held-out ingest output: scenes that ingest kept "
        "out as duplicates of training documents are not scored) or a scene table "
        "(scenes.jsonl, drawings.jsonl)",
    )
    pair.add_argument("--out", metavar="JSON", type=out_file, help="write the figures here")
    pair.add_argument(
        "--seq-len",
        type=positive_int,
        default=0,
        help="row length (default: the release's packing, else its run folder's data.seq_len, "
        "else 2048)",
    )
    pair.add_argument(
        "--batch-rows",
        type=positive_int,
        default=0,
        help="rows per forward pass (default: the release's packing, else its run folder's "
        "train.micro_batch, else 8)",
    )
    pair.add_argument(
        "--whole-documents",
        action=argparse.BooleanOptionalAction,
        default=None,
        help="pack the held-out rows with documents that fit a row kept whole (never split across "
        "rows), as data.whole_documents does (default: the release's packing, else its run "
        "folder's data.whole_documents, else off)",
    )
    pair.add_argument(
        "--max-docs",
        type=positive_int,
        default=0,
        help="first N documents per source (default: all)",
    )
    # 0 pairs or scenes: none (that part is skipped), as a count of 0 reads
    pair.add_argument(
        "--max-pairs",
        type=count,
        default=200,
        help="pair documents per source and direction (default 200; 0: no dependence table)",
    )
    pair.add_argument(
        "--max-scenes",
        type=count,
        default=None,
        help="--scenes: the first N single-shape scenes (default: all; 0: none)",
    )
    pair.add_argument(
        "--draw-temperature",
        type=float,
        default=0.7,
        help="sampling temperature of the drawings (seeded per scene; 0 = greedy; default 0.7)",
    )
    pair.add_argument(
        "--draw-guidance",
        type=float,
        default=1.0,
        help="classifier-free guidance of the drawings: log-probabilities after the caption pushed "
        "away from those after no caption by this factor (1 = off; docs/evaluation.md)",
    )
    long = pair.add_argument_group(
        "long context (docs/evaluation.md#long-context-is-the-context-used)",
        "Whether the model uses what it read long before: the loss by token position, and "
        "needle tests as depth x length tables of teacher-forced accuracy against a control.",
    )
    long.add_argument(
        "--position-loss",
        action="store_true",
        help="mean CE per position bucket (0-F, F-2F, 2F-4F, ... up to --seq-len) and modality on "
        "the held-out rows, each bucket over the document stretches that cover it whole",
    )
    long.add_argument(
        "--needle",
        action="store_true",
        help="passkey (a random number at depth d of a repeated filler, asked for at the end; "
        "digits scored teacher-forced, against the same prompt without the number) and frame copy "
        "(a held-out video frame at depth d repeated as the last frame; its codes scored, against "
        "another frame at depth d)",
    )
    long.add_argument("--long-context", action="store_true", help="both of the above")
    long.add_argument(
        "--position-first-bucket",
        type=int,
        metavar="F",
        help="end of the first position bucket, inside the row; each next twice as long (default 64)",
    )
    long.add_argument(
        "--needle-lengths",
        metavar="N,N,...",
        help="sequence lengths of the needle tables (default: the row length, 2x and 4x it); "
        "attention's cost grows with the square of the length: mind it on a CPU",
    )
    long.add_argument(
        "--needle-depths",
        metavar="D,D,...",
        help="depths of the needle, fractions of the sequence (default 0,0.25,0.5,0.75,1)",
    )
    long.add_argument(
        "--needle-trials",
        type=int,
        metavar="K",
        help="keys (and video frames) per cell of the needle tables (default 8)",
    )
    long.add_argument(
        "--needle-digits",
        type=int,
        metavar="K",
        help="digits of each pass key (default 5)",
    )
    pair.add_argument("--device", default="cpu", help="cpu (default), cuda, cuda:1, ...")
    pair.add_argument("--verbose", action="store_true", help="say which part runs")
    pair.add_argument(
        "--no-progress", action="store_true", help="no progress bars (they go to stderr)"
    )
    pair.add_argument(
        "--no-table", action="store_true", help="do not print the table (--out has the figures)"
    )
    return pair


# The options that shape one table, and their defaults (given without it: refused, not ignored)
TABLE_OPTIONS: dict[str, dict[str, int | None]] = {
    "--needle": {
        "needle_lengths": None,
        "needle_depths": None,
        "needle_trials": 8,
        "needle_digits": 5,
    },
    "--position-loss": {"position_first_bucket": 64},
}


def main(argv: list[str] | None = None) -> int:
    from data.cli.common import USER_ERRORS, with_folder
    from data.shards.storage import write_atomic
    from tools.evaluate.table import dropped_warning, format_eval

    parser = build_parser()
    args = parser.parse_args(argv)
    if args.no_table and not args.out:
        parser.error("--no-table needs --out FILE (the figures would go nowhere)")
    if args.max_scenes is not None and not args.scenes:
        parser.error("--max-scenes applies only with --scenes")
    for table, shaping in TABLE_OPTIONS.items():
        given = [f"--{key.replace('_', '-')}" for key in shaping if getattr(args, key) is not None]
        if given and not (getattr(args, table[2:].replace("-", "_")) or args.long_context):
            verb = "applies" if len(given) == 1 else "apply"
            parser.error(f"{', '.join(given)} {verb} only with {table} or --long-context")
        for key, default in shaping.items():
            if getattr(args, key) is None:
                setattr(args, key, default)
    try:
        ev = evaluate(args)
    except (ValueError, OSError) as e:  # ReleaseError is a ValueError naming the file
        print(f"earlyfuse-eval: error: {e}", file=sys.stderr)
        return 2 if isinstance(e, USER_ERRORS) else 1  # as earlyfuse-prep decides
    unwritten = None
    if args.out:  # whole or not at all: a full disk leaves an earlier file as it was, not emptied
        try:
            write_atomic(with_folder(args.out), (json.dumps(ev, indent=1) + "\n").encode())
        except OSError as e:
            unwritten = e
    if not args.no_table:  # printed all the same: the evaluation is not lost with the file
        print(format_eval(ev))
    elif warning := dropped_warning(ev):
        print(warning, file=sys.stderr)
    if unwritten is not None:
        said = f"{args.out} could not be written ({unwritten.strerror or unwritten})"
        print(f"earlyfuse-eval: error: {said}; a file there before is unchanged", file=sys.stderr)
        return 2 if isinstance(unwritten, USER_ERRORS) else 1
    if args.out:
        print(f"wrote {args.out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
