"""Source kinds for ``earlyfuse-prep ingest --source [NAME=]KIND:PATH``."""

from __future__ import annotations

import re
from pathlib import Path

from data.schema import sanitize_key
from data.shards.storage import is_remote
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

_SPEC = re.compile(r"^(?:(?P<name>[A-Za-z0-9_-]+)=)?(?P<kind>[a-z]+):(?P<path>.+)$")


def parse_sources(args: list[str]) -> list[SourceSpec]:
    """Parse ``[NAME=]KIND:PATH`` arguments; names default to the path's stem, made unique."""
    specs: list[SourceSpec] = []
    used: set[str] = set()
    for arg in args:
        m = _SPEC.match(arg)
        if not m or m["kind"] not in KINDS:
            raise ValueError(
                f"--source {arg!r}: expected [NAME=]KIND:PATH with KIND one of " + ", ".join(KINDS)
            )
        if is_remote(m["path"]):
            specs.append(_remote_spec(arg, m["kind"], m["path"], m["name"], used))
            continue
        path = Path(m["path"]).expanduser()
        if not path.exists():
            raise ValueError(f"--source {arg!r}: {path} does not exist")
        name = m["name"]
        if name and name in used:
            raise ValueError(f"--source {arg!r}: the name {name!r} is already taken")
        if not name:
            base = sanitize_key(path.resolve().stem if path.is_file() else path.resolve().name)
            name, n = base, 2
            while name in used:
                name, n = f"{base}_{n}", n + 1
        used.add(name)
        specs.append(SourceSpec(m["kind"], str(path.resolve()), name))
    return specs


def _remote_spec(arg: str, kind: str, url: str, name: str | None, used: set[str]) -> SourceSpec:
    """A source in object storage: parquet tables, Hugging Face folders and webdataset tars
    are read there."""
    readable = kind == "wds" or (
        kind in ("text", "images", "videos", "interleaved") and is_table(url)
    )
    if not readable:
        raise ValueError(
            f"--source {arg!r}: from object storage ingest reads .parquet tables and Hugging "
            "Face dataset folders (kinds text, images, videos, interleaved) and webdataset "
            "tars (wds); copy other inputs to a local folder first"
        )
    if name and name in used:
        raise ValueError(f"--source {arg!r}: the name {name!r} is already taken")
    if not name:
        stem = url.rstrip("/").rsplit("/", 1)[-1]
        base = sanitize_key(stem.removesuffix(".parquet").removesuffix(".tar"))
        name, n = base, 2
        while name in used:
            name, n = f"{base}_{n}", n + 1
    used.add(name)
    return SourceSpec(kind, url.rstrip("/"), name)


def build_source(spec: SourceSpec, limits: Limits) -> Source:
    return KINDS[spec.kind](spec, limits)


__all__ = ["KINDS", "Item", "Limits", "Source", "SourceSpec", "build_source", "parse_sources"]
