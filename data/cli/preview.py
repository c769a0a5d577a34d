"""``earlyfuse-prep preview``: a few packed rows of token shards, as the loader packs them."""

from __future__ import annotations

import argparse
from pathlib import Path

from data.cli.common import path_or_url


def _add_preview(sub) -> None:
    p = sub.add_parser(
        "preview",
        help="show a few packed rows of token shards, modalities coloured (text or PNG)",
        formatter_class=argparse.RawDescriptionHelpFormatter,
        description="Pack a few rows from a token folder exactly as the training loader does and\n"
        "show them: each piece (document run) with text and code decoded and visual blocks\n"
        "summarised; --png draws one band per row, a cell per token coloured by modality,\n"
        "and decodes the rows' images and clips (first and last frames) beside it.",
        epilog="examples:\n  earlyfuse-prep preview runs/demo/tokens --seq-len 512 --rows 3 --png rows.png\n"
        "  earlyfuse-prep preview --config runs/demo/lm/config.yaml --rows 8   # the run's own mix",
    )
    p.add_argument(
        "tokens",
        type=path_or_url,
        nargs="?",
        metavar="TOKEN_DIR",
        help="a token folder or its fsspec URL (default with --config: the folder of its first "
        "source)",
    )
    p.add_argument(
        "--config",
        type=Path,
        default=None,
        metavar="YAML",
        help="draw rows as a run would: its sources, weights, seq_len, seed and every other "
        "loader field it sets (tokenizers too), from a run's config.yaml (RUN_DIR/config.yaml) "
        "or a data config (configs/data/*.yaml)",
    )
    p.add_argument(
        "--source",
        action="append",
        default=None,
        help="only these sources (repeatable; default: all but the held-out val/ ones)",
    )
    p.add_argument(
        "--seq-len", type=int, default=None, help="row length (default: --config's, else 2048)"
    )
    p.add_argument("--rows", type=int, default=2, help="rows to show (default 2)")
    p.add_argument(
        "--seed", type=int, default=0, help="the loader's data.seed (default 0; --config's wins)"
    )
    p.add_argument("--png", type=Path, default=None, help="also render the rows to this PNG")
    p.set_defaults(func=cmd_preview)


def cmd_preview(a) -> int:
    from data.loader.config import DataUnreadable
    from data.loader.preview import preview

    try:
        shown = preview(
            a.tokens,
            sources=a.source,
            seq_len=a.seq_len,
            n_rows=a.rows,
            seed=a.seed,
            png=a.png,
            config=a.config,
        )
    except DataUnreadable as e:  # each skipped sample was named: the end is one line (exit 1)
        raise OSError(e.last_line()) from None
    print(shown)
    return 0
