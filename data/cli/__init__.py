"""``earlyfuse-prep``: the data-preparation command line (see README, "Data preparation").

Exit status: 0 done; 2 a user error: a bad flag, or an input, folder or value that cannot be
used (one line on stderr names the file and the problem); 1 the machine failed under a command
that could have run (a full disk, an I/O error; a file that could not be written is named, with
what stopped it and what to do, after which ``ingest``, ``tokenize`` and ``merge`` resume); 3
``ingest``, ``tokenize`` or ``merge`` finished but rejected some inputs (a partition's run: its
own shards', the last to finish the folder's; each listed in DIR/rejects.jsonl once merged; those
that held nothing to keep, ``schema.LOSSLESS_REASONS``, do not count) — pass ``--allow-rejects``
to get 0; ``verify`` exits 1 when it finds a problem; 141 (128 + SIGPIPE), silently, when the
reader of stdout closes it early (``stats DIR | head``); 130 after Ctrl-C and 143 after SIGTERM,
the workers stopped and the finished shards kept (rerun the same command to resume).
"""

from __future__ import annotations

import argparse
import re
import signal
import sys

from data.cli.common import (
    EXIT_REJECTS,
    USER_ERRORS,
    os_error_line,
    parse_size,
    path_or_url,
    reader_left,
)
from data.cli.demo_corpus import _add_demo_corpus
from data.cli.ingest import _add_ingest, _add_merge
from data.cli.passkey import _add_passkey
from data.cli.preview import _add_preview
from data.cli.shards import _add_stats, _add_verify
from data.cli.text_tokenizer import _add_train_text_tokenizer
from data.cli.tokenize import _add_tokenize
from data.schema import name_not_utf8
from data.signal_handlers import handled

__all__ = ["EXIT_REJECTS", "build_parser", "main", "parse_size", "path_or_url"]


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
        _add_demo_corpus,
        _add_passkey,
        _add_train_text_tokenizer,
        _add_tokenize,
        _add_preview,
    ):
        add(sub)
    return p


class Terminated(KeyboardInterrupt):
    """SIGTERM (a scheduler's, a `kill`): stopped as Ctrl-C stops it, workers and all."""


def _terminate(signum, frame) -> None:
    raise Terminated


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    for arg in argv:  # a path in another encoding: the records and manifests hold the command
        if why := name_not_utf8(arg):
            print(f"earlyfuse-prep: an argument is not UTF-8: {why}", file=sys.stderr)
            return 2
    args = build_parser().parse_args(argv)
    args.argv = list(argv)  # what ingest and tokenize record as their command
    try:
        with handled(signal.SIGTERM, _terminate):
            return args.func(args)
    except KeyboardInterrupt as e:
        how, code = ("terminated", 143) if isinstance(e, Terminated) else ("interrupted", 130)
        print(f"{how}; rerun the same command to resume", file=sys.stderr)
        return code
    except BrokenPipeError:
        return reader_left()
    except (ValueError, OSError) as e:
        # a file that could not be written is named with what to do (a write on a full disk
        # says only "[Errno 28] No space left on device")
        resumes = getattr(args, "resumes", False)  # set by the commands that keep finished work
        written = os_error_line(e, resumes) if isinstance(e, OSError) else None
        # One line (a YAML or JSON parser's message spans several): only the line breaks and the
        # indentation around them go, so a file name keeps its own spaces and tabs.
        said = re.sub(r"\s*[\r\n]\s*", " ", written or str(e).strip())
        print(f"earlyfuse-prep {args.command}: error: {said}", file=sys.stderr)
        return 2 if isinstance(e, USER_ERRORS) else 1
