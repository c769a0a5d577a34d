"""Source kinds for ``earlyfuse-prep ingest --source [NAME=]KIND:PATH``."""

from __future__ import annotations

import re
from pathlib import Path

from data.schema import sanitize_key
from data.sources.base import Item, Limits, Source, SourceSpec
from data.sources.captioned import ImagesSource, VideosSource
from data.sources.code import CodeSource
from data.sources.interleaved import InterleavedSource
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
    """Parse ``[NAME=]KIND:PATH`` arguments; names default to the path's stem. Two sources of one
    name are an error naming both (a silent rename would put one under a name nobody gave)."""
    specs: list[SourceSpec] = []
    used: dict[str, str] = {}  # name -> the --source that has it
    for arg in args:
        m = _SPEC.match(arg)
        if not m or m["kind"] not in KINDS:
            raise ValueError(
                f"--source {arg!r}: expected [NAME=]KIND:PATH with KIND one of " + ", ".join(KINDS)
            )
        path = Path(m["path"]).expanduser()
        if not path.exists():
            raise ValueError(f"--source {arg!r}: {path} does not exist")
        name = m["name"] or sanitize_key(
            path.resolve().stem if path.is_file() else path.resolve().name
        )
        if name in used:
            how = "" if m["name"] else " (from its path)"
            raise ValueError(
                f"--source {arg!r}: the name {name!r}{how} is also the name of --source "
                f"{used[name]!r}; give each its own name, e.g. --source "
                f"{name}2={m['kind']}:{m['path']} ({path.resolve()} and "
                f"{Path(used[name].split(':', 1)[1]).expanduser().resolve()})"
            )
        used[name] = arg
        specs.append(SourceSpec(m["kind"], str(path.resolve()), name))
    return specs


def build_source(spec: SourceSpec, limits: Limits) -> Source:
    return KINDS[spec.kind](spec, limits)


__all__ = ["KINDS", "Item", "Limits", "Source", "SourceSpec", "build_source", "parse_sources"]
