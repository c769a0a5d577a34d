"""``earlyfuse-prep train-text-tokenizer``: the byte-level BPE for text and code."""

from __future__ import annotations

import argparse
from pathlib import Path

from data.cli.common import parse_size


def _add_train_text_tokenizer(sub) -> None:
    p = sub.add_parser(
        "train-text-tokenizer",
        help="train the byte-level BPE for text and code on raw shards",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Train a byte-level BPE (Hugging Face tokenizers) on the text and code segments of\n"
        "raw shard folders. Writes OUT/tokenizer.json, OUT/vocab_layout.json (the id space every\n"
        "later stage and checkpoint uses: text BPE, structure tokens, visual codes) and\n"
        "OUT/text_tokenizer_training.json (what it was trained on).\n\n"
        "The vocabulary is chosen here, once: --vocab-size, --fsq-levels and --max-grid go into\n"
        "vocab_layout.json; train the visual tokenizer with vtok_data.tokenizer=OUT so that its\n"
        "FSQ levels are read from there (tokenize refuses a visual tokenizer whose levels differ).",
        epilog="examples (docs/own_data.md has both recipes whole):\n"
        "  # a CPU try (the demo's vocabulary), then its visual tokenizer\n"
        "  earlyfuse-prep train-text-tokenizer --in shards/ --out tok/ --vocab-size 4096 \\\n"
        "      --fsq-levels 8,6,5 --max-grid 32\n"
        "  earlyfuse-train experiment=vtok_demo 'vtok_data.raw=[shards/]' vtok_data.tokenizer=tok/\n"
        "  # a GPU run (vtok_cpu trains on a source named photos; 'vtok_data.sources=[]': all)\n"
        "  earlyfuse-prep train-text-tokenizer --in shards/ --out tok/ --vocab-size 32000 \\\n"
        "      --weight code=0.4 --max-chars 500M --fsq-levels 8,8,8,5,5,5 --max-grid 64\n"
        "  earlyfuse-train experiment=vtok_cpu 'vtok_data.raw=[shards/]' vtok_data.tokenizer=tok/ \\\n"
        "      'vtok_data.sources=[]'",
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
        help="BPE size incl. its 3 specials (default 32000, for GPU-sized models; 4096 for a CPU "
        "try, whose small model a 32k vocabulary would mostly be embeddings)",
    )
    p.add_argument(
        "--weight",
        action="append",
        default=[],
        metavar="SOURCE=FRACTION",
        help="fraction of the training characters from one source (e.g. code=0.4); "
        "sources not named share the rest by their text's characters (default: all by size). The "
        "characters trained "
        "on are then at most what lets every fraction hold (on a small corpus, less than all of "
        "it); nothing is repeated; the summary says what was used",
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
        help="FSQ levels of the visual tokenizer, fixing the number of visual codes (default "
        "8,5,5,5 = 1,000 codes; the demo's 8,6,5 = 240; 8,8,8,5,5,5 = 64,000 for GPU runs). A "
        "visual tokenizer trained with vtok_data.tokenizer=OUT takes these levels",
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
    try:
        levels = tuple(int(x) for x in a.fsq_levels.split(","))
    except ValueError:
        levels = ()
    if not levels or min(levels) < 2:  # refused here, not by the visual tokenizer's run after
        raise ValueError(
            f"--fsq-levels {a.fsq_levels!r}: expected whole numbers of at least 2 joined by "
            "commas, e.g. 8,5,5,5"
        )
    if a.max_grid < 1:
        raise ValueError(f"--max-grid {a.max_grid}: the largest image side is at least 1 token")
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
    if info["budget_set_by"]:
        print(
            f"  (the --weight shares hold up to about {info['budget_chars']:,} chars, all of "
            f"{info['budget_set_by']} at its share; below --max-chars {a.max_chars:,})"
        )
    for n, src in info["sources"].items():
        print(
            f"  {n:<16} {src['chars_used']:>12,} chars ({src['share']:.1%})"
            + (
                f": all it holds, less than the {src['asked_chars']:,} its weight asked (not repeated)"
                if src["all_of_it"] and weights  # without --weight: all of every source, as asked
                else ""
            )
        )
    print(f"vocabulary layout: text {r['text']}, structure {r['structure']}, visual {r['visual']}")
    if info["vocab_size"] < a.vocab_size:
        # BPE stops when no pair repeats: the layout (and every model over it) uses the real size
        print(
            f"note: {info['vocab_size']} ids, fewer than the {a.vocab_size} asked (--vocab-size): "
            "the text holds no more pairs worth merging; more text gives a larger vocabulary"
        )
    return 0
