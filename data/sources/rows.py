"""Rows of JSONL and CSV tables, with every malformed row reported at the line it starts on.

Design choices:
- CSV is parsed with Python's ``csv`` module in strict mode, so a quote that is never closed,
  or text after a closing quote, is an error rather than a silently merged field. A malformed
  record is reported (``bad-row``, naming its first line) and parsing starts again on the line
  after that first line: one stray quote costs its own row, never the rows it would swallow.
  A quoted field over ``csv.field_size_limit()`` characters (128 KiB) is such an error too,
  which also bounds how far an unclosed quote is read before the rows after it are recovered.
- A row with more or fewer fields than the header is a ``bad-row`` (a comma inside an unquoted
  caption would otherwise cut the caption at the comma and drop the rest).
- A blank line (empty or only whitespace) in a JSONL or CSV table holds no document; it is
  listed as a ``blank-line`` reject naming its line, so every line of a table is accounted for.
"""

from __future__ import annotations

import csv
import json
import math
import re
from collections import deque
from collections.abc import Iterator
from pathlib import Path

from data.media import binary_detail, wide_codec
from data.schema import Reject

BLANK_LINE = "blank-line"
BAD_ROW = "bad-row"


def blank_line(label: str) -> Reject:
    return Reject(label, BLANK_LINE, "a blank line: no record")


NOT_UTF8 = re.compile("[\udc80-\udcff]")  # the bytes surrogateescape kept of invalid UTF-8


def refuse_wide(head: bytes, path: Path | str) -> None:
    """A table (JSONL, CSV) is read as UTF-8, line by line: one in UTF-16 or UTF-32 (Windows
    PowerShell 5 writes UTF-16 by default), by its byte order mark or its first ``head`` bytes'
    NULs, is refused whole, as its lines split between bytes."""
    fix = "save the table as UTF-8 (PowerShell: Out-File -Encoding utf8; iconv -f UTF-16 -t UTF-8)"
    if codec := wide_codec(head):
        raise ValueError(f"{path}: {codec.upper()} (its byte order mark says so), not UTF-8: {fix}")
    if (binary_detail(head) or "").startswith("NUL bytes between the letters"):
        raise ValueError(
            f"{path}: UTF-16 without a byte order mark (NULs between the letters): {fix}"
        )


def _not_json(name: str) -> float:
    # Python writes NaN and Infinity, which JSON has not: a shard holding them is no JSON to
    # other readers (JavaScript's JSON.parse, Go, serde_json)
    raise ValueError(f"{name} is not a JSON value")


_HUGE = re.compile(rb"[eE]\+?\d{3}|\d{309}")  # an exponent of 100 or more, or 309 digits


def _finite(text: str) -> float:
    # 1e400 is JSON, but no float: Python would write it back as Infinity
    value = float(text)
    if math.isinf(value):
        raise ValueError(f"{text} is beyond a float's range")
    return value


def parse_record(raw: bytes, label: str, repair: bool = False) -> dict | Reject:
    """A JSON line's object; with ``repair`` (--repair-utf8) bytes that are not UTF-8 become
    U+FFFD, as in text files."""
    try:
        # json.loads strips a byte order mark from bytes, not from str: strip it here too
        text = raw.decode("utf-8", "replace").removeprefix("\ufeff") if repair else raw
        # the float hook only where a number may pass a float's range: it costs a Python call
        # a float, and a table row holds many
        huge = _HUGE.search(raw) is not None
        rec = json.loads(text, parse_constant=_not_json, parse_float=_finite if huge else None)
    except UnicodeDecodeError as e:
        return Reject(label, "not-utf8", f"invalid UTF-8 in JSON line at byte {e.start}")
    except ValueError as e:
        return Reject(label, "bad-record", f"not valid JSON ({e})")
    if not isinstance(rec, dict):
        return Reject(label, "bad-record", "a JSON line must be an object")
    return rec


def csv_records(path: Path) -> Iterator[tuple[int, list[str] | str]]:
    """(line number where it starts, fields) of every record of a CSV file, or (line number,
    why the record starting there is malformed). A blank line is the record ``[]``."""
    pending: deque[tuple[int, str]] = deque()  # lines to parse again after a malformed record
    taken: list[tuple[int, str]] = []  # the lines of the record being parsed

    # utf-8-sig: a leading byte order mark (Excel's "CSV UTF-8") is not part of the header;
    # surrogateescape: a byte that is not UTF-8 costs its row (read_table), not the table
    with open(path, "rb") as raw:
        refuse_wide(raw.read(4096), path)
    with open(path, newline="", encoding="utf-8-sig", errors="surrogateescape") as f:
        numbered = enumerate(f, 1)

        def feed() -> Iterator[str]:
            while True:
                got = pending.popleft() if pending else next(numbered, None)
                if got is None:
                    return
                taken.append(got)
                yield got[1]

        while True:
            reader = csv.reader(feed(), strict=True)
            try:
                for fields in reader:
                    first = taken[0][0]
                    taken.clear()
                    yield first, fields
                return
            except csv.Error as e:
                first, again = taken[0][0], taken[1:]
                taken.clear()
                pending.extendleft(reversed(again))
                yield first, _csv_problem(str(e), len(again) + 1)


def _csv_problem(error: str, lines: int) -> str:
    """What a ``csv.Error`` means for the person who wrote the file."""
    if "unexpected end of data" in error:
        return "a quote opened in this row is never closed (the file ends inside it)"
    if "field larger than field limit" in error and lines == 1:  # no quote ran on
        return (
            f"a field of over {csv.field_size_limit():,} characters: too long for a CSV table "
            "(it bounds how far a quote never closed can run); give such a table as JSONL"
        )
    if "field larger than field limit" in error:
        return (
            f"a field runs over {csv.field_size_limit()} characters ({lines} lines): a quote "
            "opened in this row is probably never closed"
        )
    if "expected after" in error:
        return (
            f"text follows a closing quote ({error}; the row runs over {lines} line(s)): a quote "
            "opened in this row is never closed, or a quote inside a field is not doubled"
        )
    return error


def read_table(
    path: Path, need: tuple[str, ...] = (), repair: bool = False
) -> Iterator[tuple[int, dict | Reject]]:
    """(line number, record) of a JSONL or CSV table; a bad JSON line, a malformed CSV row or a
    blank line yields a Reject. A CSV's first record is its header; a malformed header, or one
    without any of the columns in ``need``, is an error naming the file (no row could be read
    against it), as for a parquet table. ``repair`` (--repair-utf8): a row's bytes that are not
    UTF-8 become U+FFFD instead of rejecting it."""
    if path.suffix.lower() == ".csv":
        header: list[str] | None = None
        for lineno, fields in csv_records(path):
            label = f"{path.name}:{lineno}"
            if repair and not isinstance(fields, str) and header is not None:
                fields = [NOT_UTF8.sub("\ufffd", field) for field in fields]
            if not isinstance(fields, str) and any(map(NOT_UTF8.search, fields)):
                if header is None:
                    raise ValueError(f"{label}: the header row is not valid UTF-8")
                yield lineno, Reject(label, "not-utf8", "invalid UTF-8: save the table as UTF-8")
                continue
            if header is None:
                if isinstance(fields, str):
                    raise ValueError(f"{label}: the header row is malformed: {fields}")
                fields = [field.strip() for field in fields]  # "image, caption" by hand
                if fields and need and not set(need) & set(fields):
                    other = (
                        " (semicolons: save it comma-separated)"
                        if ";" in fields[0]
                        else " (tabs: save it comma-separated)"
                        if "\t" in fields[0]
                        else " (column names are lower case)"
                        if set(need) & {field.strip().lower() for field in fields}
                        else ""
                    )
                    raise ValueError(
                        f"{label}: no {' or '.join(map(repr, need))} column in the header "
                        f"({', '.join(fields)}){other}"
                    )
                if fields:
                    header = fields
                else:
                    yield lineno, blank_line(label)
                continue
            if isinstance(fields, str):
                yield lineno, Reject(label, BAD_ROW, fields)
            elif not any(field.strip() for field in fields):  # a spreadsheet's empty row: ,,,
                yield lineno, blank_line(label)
            elif len(fields) != len(header):
                yield (
                    lineno,
                    Reject(
                        label,
                        BAD_ROW,
                        f"{len(fields)} field{'s' if len(fields) != 1 else ''}, the header has "
                        f"{len(header)} ({', '.join(header)}); a field holding a comma must be "
                        'quoted ("...")',
                    ),
                )
            else:  # a spreadsheet's unnamed empty columns (image,caption,,) are no field
                yield lineno, {k: v for k, v in zip(header, fields, strict=True) if k or v}
        return
    with open(path, "rb") as f:
        refuse_wide(f.read(4096), path)
        f.seek(0)
        for lineno, line in enumerate(f, 1):
            label = f"{path.name}:{lineno}"
            yield lineno, parse_record(line, label, repair) if line.strip() else blank_line(label)
