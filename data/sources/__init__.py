"""Source kinds for ``earlyfuse-prep ingest --source [NAME=]KIND:PATH``."""

from __future__ import annotations

import re
from pathlib import Path

from data.names import TOKENIZERS_DIR
from data.schema import path_digest, sanitize_key
from data.shards.storage import filesystem, is_remote, retried
from data.sources.base import Item, Limits, Source, SourceSpec
from data.sources.captioned import ImagesSource, VideosSource
from data.sources.code import CodeSource
from data.sources.interleaved import InterleavedSource
from data.sources.tables import is_table
from data.sources.text import TextSource
from data.sources.wds import WdsSource

KINDS: dict[str, type[Source]] = {
    "text": TextSource,
    "code": CodeSource,
    "images": ImagesSource,
    "videos": VideosSource,
    "interleaved": InterleavedSource,
    "wds": WdsSource,
}

_SPEC = re.compile(r"^(?:(?P<name>[A-Za-z0-9_-]+)=)?(?P<kind>[a-z]+):(?P<path>.+)$", re.DOTALL)


# Folders an ingest or tokenize output holds beside its sources' folders
RESERVED_NAMES = {"val": "the held-out split (--val-fraction)", TOKENIZERS_DIR: "the tokenizers"}


# A source's name starts every key and member name of its shards: with a key (at most
# MAX_KEY_CHARS) and an extension, a member's name stays within the 255 bytes of a file name.
MAX_SOURCE_NAME = 64


def source_name(arg: str, given: str | None, stem: str) -> str:
    """The name given to a --source (refused when too long), or one made from its path's last
    part (shortened, with a digest of the whole, when too long)."""
    if given:
        if len(given) > MAX_SOURCE_NAME:
            raise ValueError(
                f"--source {arg!r}: the name {given!r} is longer than {MAX_SOURCE_NAME} characters"
            )
        return given
    name = sanitize_key(stem)
    if len(name) > MAX_SOURCE_NAME:
        name = f"{name[: MAX_SOURCE_NAME - 9]}-{path_digest(stem)}"
    return name


def parse_sources(args: list[str]) -> list[SourceSpec]:
    """Parse ``[NAME=]KIND:PATH`` arguments; names default to the path's stem. Two sources of one
    name are an error naming both (a silent rename would put one under a name nobody gave)."""
    specs: list[SourceSpec] = []
    used: dict[str, str] = {}  # name -> the --source that has it
    for arg in args:
        match = _SPEC.match(arg)
        if not match or match["kind"] not in KINDS:
            raise ValueError(
                f"--source {arg!r}: expected [NAME=]KIND:PATH with KIND one of " + ", ".join(KINDS)
            )
        if is_remote(match["path"]):
            specs.append(_remote_spec(arg, match["kind"], match["path"], match["name"], used))
            continue
        path = Path(match["path"]).expanduser()
        if not path.exists():
            raise ValueError(f"--source {arg!r}: {path} does not exist")
        tables = (".jsonl", ".csv", ".parquet")
        if (
            match["kind"] in ("images", "videos")
            and path.is_file()
            and path.suffix.lower() not in tables
        ):
            raise ValueError(  # a user's slip, said as one: not a reject of the file
                f"--source {arg!r}: {match['kind']} takes a folder (put {path.name} in a folder of "
                "its own, with its caption beside it), a .jsonl/.csv/.parquet table or a Hugging "
                "Face dataset folder"
            )
        name = source_name(
            arg, match["name"], path.resolve().stem if path.is_file() else path.resolve().name
        )
        if name in used:
            how = "" if match["name"] else " (from its path)"
            raise ValueError(
                f"--source {arg!r}: the name {name!r}{how} is also the name of --source "
                f"{used[name]!r}; give each its own name, e.g. --source "
                f"{name}2={match['kind']}:{match['path']} ({path.resolve()} and "
                f"{Path(used[name].split(':', 1)[1]).expanduser().resolve()})"
            )
        used[name] = arg
        specs.append(SourceSpec(match["kind"], str(path.resolve()), name))
    for arg, spec in zip(args, specs, strict=True):
        if why := RESERVED_NAMES.get(spec.name):  # a source's shards would land in that folder
            raise ValueError(
                f"--source {arg!r}: the name {spec.name!r} is the folder of {why} in the output; "
                f"give the source another name, e.g. --source {spec.name}_data={arg.split('=', 1)[-1]}"
            )
    return specs


def _remote_spec(
    arg: str, kind: str, url: str, name: str | None, used: dict[str, str]
) -> SourceSpec:
    """A source in object storage: parquet tables, Hugging Face folders and webdataset tars
    are read there."""
    fs, inner = filesystem(url)
    if not retried(url, lambda: fs.exists(inner)):
        raise ValueError(
            f"--source {arg!r}: {url} does not exist (no object or prefix there: check the URL, "
            "and that the endpoint and keys are those of its bucket)"
        )
    readable = kind == "wds" or (
        kind in ("text", "images", "videos", "interleaved") and is_table(url)
    )
    if not readable:
        raise ValueError(
            f"--source {arg!r}: from object storage ingest reads .parquet tables and Hugging "
            "Face dataset folders (kinds text, images, videos, interleaved) and webdataset "
            "tars (wds); copy other inputs to a local folder first"
        )
    stem = url.rstrip("/").rsplit("/", 1)[-1]
    name = source_name(arg, name, stem.removesuffix(".parquet").removesuffix(".tar"))
    if name in used:  # never a silent rename, as for local sources
        raise ValueError(
            f"--source {arg!r}: the name {name!r} is also the name of --source {used[name]!r}; "
            f"give each its own name, e.g. --source {name}2={kind}:{url}"
        )
    used[name] = arg
    return SourceSpec(kind, url.rstrip("/"), name)


def build_source(spec: SourceSpec, limits: Limits) -> Source:
    return KINDS[spec.kind](spec, limits)


__all__ = ["KINDS", "Item", "Limits", "Source", "SourceSpec", "build_source", "parse_sources"]
