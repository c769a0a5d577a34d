"""The README and docs/ link only inside the repository, and every such link resolves: a link
to a file outside the checkout works in one workspace and is dead in every clone."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
LINK = re.compile(r"\]\(([^)\s]+)\)")


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_links_stay_inside_the_repository_and_resolve(page):
    for target in LINK.findall(page.read_text()):
        if target.startswith(("http://", "https://", "mailto:", "#")):
            continue
        path = (page.parent / target.split("#")[0]).resolve()
        assert path.is_relative_to(ROOT), f"{page.name}: {target} points outside the repository"
        assert path.exists(), f"{page.name}: {target} does not exist"


# A repository path written in backticks (`data/loader/stream.py`, `configs/model/`) in the docs
# or in a docstring must name a file or folder that exists: a renamed module otherwise leaves
# readers at a dead end. Metric names (`data/skipped`, `train/loss`) have no file suffix and no
# trailing slash, so they are not taken for paths; placeholders (`NAME`, `<kind>`, `*`) are skipped.
TOP_FOLDERS = ("data/", "model/", "train/", "tools/", "tests/", "configs/", "docs/", ".ci/")
SUFFIXES = (".py", ".md", ".yaml", ".yml", ".json", ".sh", ".toml")
BACKTICKED = re.compile(r"`([^`\s]+)`")
PLACEHOLDER = re.compile(r"[*{}<>$…]|\b[A-Z][A-Z_]{2,}\b")


def repository_paths(text: str):
    for token in BACKTICKED.findall(text):
        path = token.split("#")[0].split("::")[0].rstrip(",.:;")
        if not path.startswith(TOP_FOLDERS) or PLACEHOLDER.search(path):
            continue
        if path.endswith(SUFFIXES) or path.endswith("/"):
            yield path


def docstrings(path: Path):
    tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Module | ast.ClassDef | ast.FunctionDef | ast.AsyncFunctionDef):
            text = ast.get_docstring(node)
            if text:
                yield text


def test_repository_paths_in_docs_and_docstrings_exist():
    missing = []
    for page in PAGES:
        missing += [
            f"{page.name}: {p}"
            for p in repository_paths(page.read_text())
            if not (ROOT / p).exists()
        ]
    for package in ("data", "model", "train", "tools"):
        for module in sorted((ROOT / package).rglob("*.py")):
            for text in docstrings(module):
                missing += [
                    f"{module.relative_to(ROOT)}: {p}"
                    for p in repository_paths(text)
                    if not (ROOT / p).exists()
                ]
    assert not missing, "paths that do not exist:\n" + "\n".join(missing)


# The docs describe the code as it is; which issue asked for a change, and what the code did
# before it, belong to git. Another project's issue is fine when the line links it (its
# `/issues/N` or `/pull/N` URL), so a reader can follow it outside this repository.
PROJECT_ISSUE = re.compile(r"\b[Ii]ssues? #?(\d+)|(?<![\w/&#])#(\d+)\b")


def issue_citations(text: str):
    for number, line in enumerate(text.splitlines(), 1):
        for match in PROJECT_ISSUE.finditer(line):
            cited = match.group(1) or match.group(2)
            if not re.search(rf"https?://\S+/(issues|pull)/{cited}\b", line):
                yield f"{number}: {line.strip()}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: p.name)
def test_docs_name_no_project_issue(page):
    found = list(issue_citations(page.read_text()))
    assert not found, f"{page.name} names a project issue:\n" + "\n".join(found)


def test_an_issue_citation_is_found_unless_the_line_links_it():
    # The numbers are formatted in so that this file passes test_style's own check of tests.
    first, second = 16, 28
    text = (
        f"the false stagnation of issue {first}\n"
        f"issues {first} and {second}\n"
        "as asked in #12 here\n"
        "decord issues #208 (https://github.com/dmlc/decord/issues/208)\n"
        "see [the demo](benchmarks.md#the-demo-held-out), colour #ff0000\n"
    )
    assert [line.split(":")[0] for line in issue_citations(text)] == ["1", "2", "3"]
