"""``earlyfuse-prep passkey``: passkey training documents (data/passkey.py) as a text table."""

from __future__ import annotations

from pathlib import Path


def _pair(text: str, what: str) -> tuple[int, int]:
    """``"5"`` -> (5, 5); ``"20,200"`` -> (20, 200); a clear error naming the flag otherwise."""
    try:
        values = [int(part) for part in text.split(",")]
    except ValueError:
        raise ValueError(f"{what} {text!r}: give N or MIN,MAX (whole numbers)") from None
    if len(values) not in (1, 2):
        raise ValueError(f"{what} {text!r}: give N or MIN,MAX")
    return values[0], values[-1]


def _add_passkey(sub) -> None:
    what = (
        "write passkey documents (a number hidden in a filler, asked for at the end) as a "
        "JSONL text table for `ingest text:FILE`: the task a long-context stage learns and "
        "`earlyfuse-eval --needle` asks"
    )
    p = sub.add_parser("passkey", help=what, description=what + " (docs/long_context.md)")
    p.add_argument("--out", required=True, type=Path, help="the JSONL file to write")
    p.add_argument("--count", type=int, required=True, help="documents to write")
    p.add_argument(
        "--sentences",
        default="20,200",
        metavar="MIN,MAX",
        help="filler sentences per document, drawn uniformly (about 6 tokens each with the "
        "demo's BPE; default 20,200); one number for a fixed length",
    )
    p.add_argument(
        "--digits",
        default="5,7",
        metavar="MIN,MAX",
        help="digits of each key, drawn uniformly (default 5,7; earlyfuse-eval asks 5 by default)",
    )
    p.add_argument(
        "--seed", type=int, default=0, help="the draws of fillers, keys and places (default 0)"
    )
    p.set_defaults(func=cmd_passkey)


def cmd_passkey(a) -> int:
    from data.passkey import write_passkey_documents

    shortest, longest = _pair(a.sentences, "--sentences")
    digits = _pair(a.digits, "--digits")
    if a.count < 1:
        raise ValueError(f"--count {a.count}: give at least 1")
    written = write_passkey_documents(
        a.out,
        a.count,
        seed=a.seed,
        min_sentences=shortest,
        max_sentences=longest,
        digits=digits,
    )
    print(
        f"{a.out}: {written} passkey documents, {shortest}-{longest} filler sentences, keys of "
        f"{'-'.join(map(str, sorted(set(digits))))} digits (seed {a.seed})"
    )
    return 0
