"""``code:PATH`` — a source tree; one document per source file, language from the extension.

Skipped, each with a reject line: vendored/generated/hidden folders (one line per folder, not
per file inside), files whose extension is not a known language, minified or generated files (by
name, e.g. ``.min.js``, or by a line over 1,000 bytes outside Markdown, reST and TeX), files over
``max_code_bytes``, binaries (a NUL byte, unless a UTF-16 byte order mark opens the file) and
empty files. Files are UTF-8, or UTF-16 by their byte order mark; a Python file is read in the
coding its PEP 263 line declares (``# -*- coding: latin-1 -*-``), as Python itself reads it.
"""

from __future__ import annotations

import io
import tokenize
from collections.abc import Iterator
from pathlib import Path

from data.media import binary_detail, wide_codec
from data.schema import Reject, Sample
from data.sources.base import Item, Part, Source, read_file, stat_size, unstatable

LANGS = {
    ".py": "python",
    ".pyi": "python",
    ".pyw": "python",
    ".c": "c",
    ".h": "c",
    ".cc": "cpp",
    ".cpp": "cpp",
    ".cxx": "cpp",
    ".hpp": "cpp",
    ".hh": "cpp",
    ".cu": "cuda",
    ".rs": "rust",
    ".go": "go",
    ".java": "java",
    ".kt": "kotlin",
    ".scala": "scala",
    ".js": "javascript",
    ".mjs": "javascript",
    ".jsx": "javascript",
    ".ts": "typescript",
    ".tsx": "typescript",
    ".rb": "ruby",
    ".php": "php",
    ".cs": "csharp",
    ".swift": "swift",
    ".m": "objective-c",
    ".sh": "shell",
    ".bash": "shell",
    ".zsh": "shell",
    ".pl": "perl",
    ".lua": "lua",
    ".r": "r",
    ".jl": "julia",
    ".hs": "haskell",
    ".ml": "ocaml",
    ".ex": "elixir",
    ".erl": "erlang",
    ".clj": "clojure",
    ".sql": "sql",
    ".html": "html",
    ".css": "css",
    ".scss": "css",
    ".toml": "toml",
    ".yaml": "yaml",
    ".yml": "yaml",
    ".json": "json",
    ".xml": "xml",
    ".md": "markdown",
    ".markdown": "markdown",
    ".rst": "rst",
    ".tex": "tex",
    ".cmake": "cmake",
    ".mk": "make",
    ".proto": "protobuf",
    ".zig": "zig",
    ".dart": "dart",
    ".f90": "fortran",
    ".vim": "vim",
    ".ps1": "powershell",
    ".bat": "batch",
}
NAMED_LANGS = {
    "Makefile": "make",
    "GNUmakefile": "make",
    "makefile": "make",
    "Dockerfile": "dockerfile",
    "Containerfile": "dockerfile",
    "CMakeLists.txt": "cmake",
}
# A script without an extension (a package's bin/ folder) says its language in its first line
SHEBANG_LANGS = {
    "python": "python", "python3": "python", "sh": "shell", "bash": "shell", "zsh": "shell",
    "dash": "shell", "perl": "perl", "ruby": "ruby", "node": "javascript", "lua": "lua",
    "Rscript": "r", "julia": "julia", "php": "php",
}  # fmt: skip
VENDORED_DIRS = {
    "node_modules",
    "vendor",
    "_vendor",  # pip's, setuptools' and botocore's copies of their dependencies
    "vendored",
    "_vendored",
    "third_party",
    "third-party",
    "thirdparty",
    "site-packages",
    "dist-packages",
    "__pycache__",
    "venv",
    "bower_components",
    "Pods",
}
# Files every code tree holds beside its code, which no language takes: licences, notes, package
# metadata, data and assets. Left out as `not-code`, which alone does not make ingest exit 3;
# any other file of no known language is `unknown-type` (it may be code of a language LANGS lacks).
NOT_CODE_STEMS = {
    "license", "licence", "copying", "notice", "authors", "contributors", "changelog", "changes",
    "history", "readme", "requirements", "codeowners",
}  # fmt: skip
NOT_CODE_SUFFIXES = {
    ".txt", ".cfg", ".ini", ".in", ".typed", ".lock", ".sum", ".csv", ".tsv", ".log", ".pdf",
    ".png", ".jpg", ".jpeg", ".gif", ".bmp", ".ico", ".webp", ".svg", ".ttf", ".otf", ".woff",
    ".woff2", ".eot", ".mp3", ".wav", ".mp4", ".zip", ".gz", ".tar", ".whl", ".jar", ".pyc",
    ".so", ".dll", ".dylib", ".pyd", ".exe", ".o", ".a", ".class", ".npy", ".npz", ".pkl",
    ".parquet", ".db", ".bin",
}  # fmt: skip
GENERATED_SUFFIXES = (".min.js", ".min.css", ".pb.go", "_pb2.py", ".bundle.js")
# A minified or generated file whatever its name: a line longer than this (bytes). People write
# no such lines of code; bundles, minified assets and generated tables do (StarCoder's filter
# uses 1,000). Not applied to prose markup, where a paragraph is often one line.
MAX_LINE_CHARS = 1000


def longest_line(raw: bytes) -> int:
    """Characters in the file's longest line; lines end at LF, CRLF or a lone CR (an old Mac
    file), and a line counts characters, not bytes (a CJK comment is 3 bytes a character)."""
    lines = (raw.replace(b"\r", b"\n") if b"\r" in raw else raw).split(b"\n")
    longest = max(map(len, lines))
    if longest <= MAX_LINE_CHARS:  # bytes bound characters: most files stop here
        return longest
    return max(len(line.decode("utf-8", "replace")) for line in lines if len(line) > MAX_LINE_CHARS)


PROSE_LANGS = {"markdown", "rst", "tex"}
# What to do with a kind of file users' trees often hold that no language here reads
NO_LANGUAGE_HINTS = {
    ".ipynb": " (a Jupyter notebook: its JSON holds outputs too; convert it to a script first, "
    "e.g. `jupyter nbconvert --to script` or `jupytext --to py`)",
}


def skip_dir(name: str) -> str | None:
    if name.startswith("."):
        return f"hidden folder {name!r} skipped"
    if name in VENDORED_DIRS or name.endswith((".egg-info", ".dist-info")):
        return f"vendored folder {name!r} skipped"
    return None


def language(name: str) -> str | None:
    known = NAMED_LANGS.get(name) or LANGS.get(Path(name).suffix.lower())
    if known is None and name.startswith("Dockerfile.") and name != "Dockerfile.dockerignore":
        return "dockerfile"  # Dockerfile.dev, Dockerfile.cuda (a Dockerfile.md is Markdown)
    return known


def shebang_language(path: Path) -> str | None:
    """The language a ``#!`` line names (``#!/usr/bin/env python3``, ``#!/bin/sh -e``), or None."""
    try:
        with open(path, "rb") as f:
            first = f.readline(256)
    except OSError:
        return None
    if not first.startswith(b"#!"):
        return None
    words = first[2:].decode("utf-8", "replace").split()
    if words and words[0].endswith("/env"):
        words = [word for word in words[1:] if not word.startswith("-")]
    program = words[0].rsplit("/", 1)[-1] if words else ""
    return SHEBANG_LANGS.get(program) or SHEBANG_LANGS.get(program.rstrip("0123456789."))


def not_code(name: str) -> bool:
    """A file of no language that no one would call code (``not_code("LICENSE-MIT")``)."""
    stem = name.split(".")[0].split("-")[0].lower()
    return stem in NOT_CODE_STEMS or Path(name).suffix.lower() in NOT_CODE_SUFFIXES


class CodeSource(Source):
    kind = "code"

    def items(self) -> Iterator[Item]:
        for got in self.walk_files(skip_dir):
            if isinstance(got, Item):
                yield got
                continue
            key, label, path = got
            name = path.name
            size = stat_size(path)
            lang = language(name)
            if lang is None and not Path(name).suffix and size is not None:
                lang = shebang_language(path)
            if size is None:
                yield self.rejected_item(key, label, "unreadable-file", unstatable(path))
            elif name.endswith(GENERATED_SUFFIXES):
                yield self.rejected_item(key, label, "vendored", "minified or generated file")
            elif lang is None:
                yield self.rejected_item(
                    key,
                    label,
                    "not-code" if not_code(name) else "unknown-type",
                    f"no known language for {Path(name).suffix or name!r}"
                    + NO_LANGUAGE_HINTS.get(Path(name).suffix.lower(), ""),
                )
            elif size > self.limits.max_code_bytes:
                yield self.rejected_item(
                    key,
                    label,
                    "too-large",
                    f"{size} B > limit {self.limits.max_code_bytes} B (--max-code-bytes)",
                )
            else:
                yield Item(key, label, ("file", str(path), label, lang), size)

    def load(self, item: Item) -> Sample | Reject:
        _, path, label, lang = item.ref
        raw = read_file(Path(path), label)
        if isinstance(raw, Reject):
            return self.reject(raw.path, raw.reason, raw.detail, item.key)
        if lang == "python":
            raw = python_as_utf8(raw)
        if why := binary_detail(raw):
            return self.reject(label, "binary-file", why, item.key)
        if lang not in PROSE_LANGS and (longest := longest_line(raw)) > MAX_LINE_CHARS:
            detail = (
                f"minified or generated? a line of {longest:,} characters (over {MAX_LINE_CHARS:,})"
            )
            return self.reject(label, "long-line", detail, item.key)
        part = Part("code", raw, path=label, lang=lang)
        return self.assemble(item.key, [part], {}, {"path": label}, label)


def python_as_utf8(raw: bytes) -> bytes:
    """A Python file's bytes in UTF-8, decoded from the coding its PEP 263 line declares.
    Without a declaration, or where the bytes are not in the declared coding, they are left as
    they are for the one UTF-8 check every text goes through (``--repair-utf8`` applies there)."""
    if wide_codec(raw):
        return raw
    try:
        coding, _ = tokenize.detect_encoding(io.BytesIO(raw).readline)
    except SyntaxError:
        return raw
    if coding in ("utf-8", "utf-8-sig"):
        return raw
    try:
        return raw.decode(coding).encode("utf-8")
    except UnicodeDecodeError:
        return raw  # not the coding it declares: the UTF-8 check rejects or repairs it
