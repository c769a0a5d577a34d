"""The raw sample schema: one document = an ordered list of typed segments (docs/formats.md).

Design choices:
- A sample is ``KEY.json`` plus its media members ``KEY.img0.jpg``, ``KEY.vid0.mp4``, … holding
  the original bytes; keys are ASCII ``[A-Za-z0-9_-]`` so they never contain a dot (webdataset
  groups members by the text before the first dot) and can never escape the output folder.
- Every input ends as a ``Sample`` in a shard or as a ``Reject`` with a reason code from
  ``REASONS``: nothing is dropped silently.
- JSON is written canonically (sorted keys, no spaces) so equal inputs give equal bytes.
"""

from __future__ import annotations

import hashlib
import json
import re
from dataclasses import dataclass, field

SEGMENT_TYPES = ("text", "code", "image", "video")
MEDIA_PREFIX = {"image": "img", "video": "vid"}

# Reason codes a reject can carry, with what they mean (printed by `earlyfuse-prep stats`).
REASONS = {
    "bad-record": "a JSONL/CSV record that is not valid JSON or lacks a required field, or a "
    "caption (a table's, a sidecar's, a tar's) that is an object or a list, not text",
    "bad-row": "a CSV row with more or fewer fields than its header, or a quote never closed",
    "blank-line": "a blank line in a JSONL or CSV table (no record; listed so every line counts)",
    "binary-file": "a file of a code or text folder, or a caption sidecar, that holds binary data",
    "duplicate-key": "a sample key that an earlier input already used",
    "duplicate": "a document whose whole content repeats an earlier one's (ingest --dedupe)",
    "duplicate-of-excluded": "content (document, media file or long text) that a folder given "
    "to --exclude-content-of already holds",
    "empty-document": "a document with no content (empty text, no segments)",
    "long-line": "a code file with a line over 1,000 characters: most often minified or generated, "
    "but it may be a hand-written file holding data (so it counts as lost)",
    "link-outside-source": "a symlink that leads out of the source's folder (--follow-links-outside reads it)",
    "link-inside-source": "a symlinked folder that leads to another folder of the same source (or "
    "back to one holding it): not entered, its files are read where they are",
    "over-doc-budget": "a document whose text and images leave its videos too little of "
    "tokenize's --doc-budget",
    "outside-tree": "a media path a table gives that leads out of the table's folder ('..', "
    "an absolute path; --allow-outside-paths reads it)",
    "missing-media": "a referenced image or video file that does not exist or is remote",
    "not-utf8": "text that is not valid UTF-8 (use --repair-utf8 to keep it with U+FFFD)",
    "pixel-limit": "an image whose header claims more pixels than --max-image-pixels",
    "too-large": "a file, or a document's text, over the size limit of its kind",
    "truncated-tar": "an input tar cut short (inside a member, its header or before the end blocks)",
    "corrupt-tar": "an input tar with a damaged member header, or data after its end blocks",
    "corrupt-table": "a parquet row that cannot be read: its row group is damaged (each of its "
    "rows is listed; the table's other row groups are kept)",
    "truncated-image": "an image whose data ends early",
    "undecodable-video": "a video that decord cannot open or decode",
    "unknown-type": "a file whose extension the source kind does not take",
    "not-code": "a file of a code tree that is no code (a licence, requirements.txt, setup.cfg, "
    "py.typed, an icon, a font): left out, as a tree's vendored folders",
    "unreadable-file": "a file that cannot be read (permissions, a broken link or one that loops, "
    "I/O error), that is no regular file (a named pipe, never opened; a tar's link member), or "
    "whose sidecar caption cannot be read; a folder that cannot be listed",
    "unreadable-image": "bytes that no supported image decoder recognises",
    "unsafe-name": "a name that would escape the output folder, is not a valid key, or is not "
    "UTF-8 (a file name in another encoding: rename it, e.g. convmv -f latin1 -t utf-8)",
    "vendored": "a vendored, generated or hidden directory or file, skipped as a whole",
    "video-too-long": "a video longer than --max-video-seconds",
    "empty-video": "a zero-byte video file",
}

# Reasons that lose nothing a user would keep: a folder or file skipped by policy, a document or
# line with no content, a repeat the user asked to leave out. Listed like every reject, but on
# their own they do not make ingest exit 3: every code tree has an empty __init__.py, and a
# LICENSE, a requirements.txt or a py.typed beside its code.
LOSSLESS_REASONS = frozenset(
    {
        "vendored",
        "not-code",
        "link-inside-source",
        "empty-document",
        "blank-line",
        "duplicate",
        "duplicate-of-excluded",
    }
)

_KEY_OK = re.compile(r"^[A-Za-z0-9_-]+$")
_KEY_BAD_CHARS = re.compile(r"[^A-Za-z0-9_-]")
MAX_KEY_CHARS = 160


def sanitize_key(text: str) -> str:
    """Map any relative path or id onto the key alphabet (ids that collide become duplicate-key
    rejects; paths that collide are told apart by ``Source.path_key``).
    A name with characters outside ASCII also keeps 8 hex digits of its SHA-256: 照片1.jpg and
    图片1.jpg would both be ``1_jpg`` (and every all-Chinese name of a folder ``jpg``), each
    after the first a duplicate-key reject.
    A key over ``MAX_KEY_CHARS`` keeps its start and a digest of the whole: a tar member's name
    (source, key, extension) must fit the 255 bytes a file name may have, for ``tar -x``."""
    key = _KEY_BAD_CHARS.sub("_", text).strip("_") or "_"
    if len(key) > MAX_KEY_CHARS:
        return f"{key[: MAX_KEY_CHARS - 9]}-{path_digest(text)}"
    return key if text.isascii() else f"{key}-{path_digest(text)}"


def path_digest(text: str) -> str:
    """8 hex digits of ``text``'s SHA-256: what tells apart names that map onto one key."""
    return hashlib.sha256(text.encode("utf-8", "surrogatepass")).hexdigest()[:8]


def shown_name(text: str) -> str:
    """``text`` with the bytes of a file name that are not UTF-8 (Python keeps them as surrogate
    escapes) written as ``\\xNN``: printable, and storable in UTF-8 JSON."""
    try:
        return text.encode("utf-8", "surrogateescape").decode("utf-8", "backslashreplace")
    except UnicodeEncodeError:  # a surrogate that no undecodable byte made
        return text.encode("utf-8", "backslashreplace").decode("utf-8")


def name_not_utf8(name: str) -> str | None:
    """Why a file or member name cannot be recorded (its bytes are not UTF-8), if so."""
    try:
        name.encode("utf-8")
        return None
    except UnicodeEncodeError:
        return (
            f"the name '{shown_name(name)}' is not UTF-8 (bytes of another encoding, shown as "
            "\\xNN): rename it, e.g. convmv -f latin1 -t utf-8"
        )


def is_valid_key(key: str) -> bool:
    return bool(_KEY_OK.match(key))


# Control characters in a corpus (a log's colour codes, a terminal capture) are shown as
# Unicode's control pictures (ESC as U+241B), never sent to the user's terminal; tab and newline
# are kept: they are what text and code look like. C1 controls (U+009B is a CSI to some
# terminals) and bidi overrides, which reorder what follows, are shown escaped.
SHOWN_CONTROLS: dict[int, int | str] = {
    **{c: 0x2400 + c for c in range(32) if c not in (9, 10)},
    127: 0x2421,
    **{c: f"\\x{c:02x}" for c in range(0x80, 0xA0)},
    **{c: f"\\u{c:04x}" for c in [*range(0x202A, 0x202F), *range(0x2066, 0x206A)]},
}


# A file name on one line: its tabs and newlines shown as pictures too (a reject's path in stats)
NAME_CONTROLS: dict[int, int | str] = {**SHOWN_CONTROLS, 9: 0x2409, 10: 0x240A}


def on_terminal(text: str) -> str:
    """A name from the corpus (a reject's path, a duplicate's key) as it may reach a terminal."""
    return text.translate(NAME_CONTROLS)


def unsafe_name_reason(name: str) -> str | None:
    """Why a member/key name taken from an input could escape the output folder, if it could."""
    if not name:
        return "empty name"
    if why := name_not_utf8(name):
        return why
    if name.startswith(("/", "\\")) or re.match(r"^[A-Za-z]:", name):
        return f"absolute path {name!r}"
    parts = re.split(r"[/\\]", name)
    if any(part == ".." for part in parts):
        return f"parent-directory component in {name!r}"
    if "\x00" in name:
        return "NUL byte in name"
    return None


@dataclass(frozen=True)
class Reject:
    """An input that did not become a sample, and why."""

    path: str  # the input file (and member or line, when there is one)
    reason: str  # a key of REASONS
    detail: str = ""
    key: str | None = None
    source: str | None = None

    def __post_init__(self) -> None:
        if self.reason not in REASONS:
            raise ValueError(f"unknown reject reason {self.reason!r}")

    def to_dict(self) -> dict:
        record = {
            "path": shown_name(self.path),
            "reason": self.reason,
            "detail": shown_name(self.detail),
        }
        if self.key is not None:
            record["key"] = self.key
        if self.source is not None:
            record["source"] = self.source
        return record


@dataclass
class Sample:
    """One document ready for a shard: its JSON and its media members, in segment order."""

    key: str
    doc: dict
    media: list[tuple[str, bytes]] = field(default_factory=list)  # ("img0.jpg", bytes)

    def members(self) -> list[tuple[str, bytes]]:
        """(member suffix, bytes) in the order they go into the tar: the JSON first."""
        return [("json", canonical_json(self.doc))] + list(self.media)

    def segment_types(self) -> list[str]:
        """Types of the raw document's segments (or of a token document's spans)."""
        return [seg["type"] for seg in self.doc.get("segments", self.doc.get("spans", []))]


def canonical_json(obj) -> bytes:
    return json.dumps(obj, ensure_ascii=False, sort_keys=True, separators=(",", ":")).encode(
        "utf-8"
    )


def validate_doc(doc: dict, member_names: set[str]) -> str | None:
    """Why a document read back from a shard breaks the schema, or None when it is valid."""
    segs = doc.get("segments")
    if not isinstance(segs, list) or not segs:
        return "no segments"
    for index, seg in enumerate(segs):
        kind = seg.get("type") if isinstance(seg, dict) else None
        if kind not in SEGMENT_TYPES:
            return f"segment {index}: unknown type {kind!r}"
        if kind in ("text", "code") and not isinstance(seg.get("text"), str):
            return f"segment {index}: {kind} without text"
        if kind in MEDIA_PREFIX and seg.get("member") not in member_names:
            return f"segment {index}: member {seg.get('member')!r} missing from the sample"
    return None
