"""Code part: Python standard-library modules copied as they are (`OUT/code/<rel path>.py`).

The stdlib is real, well-written, permissively licensed (PSF) Python that every machine
with Python already has, so the demo needs no download to have a code corpus.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import sysconfig

from tqdm import tqdm

from ._common import in_split, rng_for

# Folders that are not "library code": test suites (huge, repetitive), the IDLE app, demos,
# installed third-party packages (pyenv/venv stdlib dirs contain site-packages), build config.
SKIP_DIRS = {
    "site-packages",
    "dist-packages",
    "test",
    "tests",
    "idlelib",
    "turtledemo",
    "__pycache__",
    "venv",  # the stdlib's venv package: `ingest` takes a folder of that name for a vendored venv
}
MAX_BYTES = 60_000  # one file must not dominate a small corpus
TARGET = 150


def stdlib_dir() -> pathlib.Path:
    return pathlib.Path(sysconfig.get_paths()["stdlib"])


def _is_utf8(path: pathlib.Path) -> bool:
    try:
        path.read_bytes().decode("utf-8")
        return True
    except UnicodeDecodeError:
        return False


def candidates() -> list[pathlib.Path]:
    """All eligible stdlib .py files, relative to the stdlib folder, in a stable sorted order."""
    root = stdlib_dir()
    found = []
    # os.walk with pruning (rglob would descend into site-packages and test/: seconds, not ms);
    # sorted because walk order depends on the file system and our output must not.
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames[:] = sorted(
            d for d in dirnames if d not in SKIP_DIRS and not d.startswith("config-")
        )
        for name in sorted(filenames):
            path = pathlib.Path(dirpath) / name
            # _sysconfigdata* records this machine's build paths: not portable, not interesting.
            if not name.endswith(".py") or name.startswith("_sysconfigdata") or not path.is_file():
                continue
            size = path.stat().st_size
            if size == 0 or size > MAX_BYTES or not _is_utf8(path):
                continue
            found.append(path.relative_to(root))
    found.sort()
    return found


def split_group(rel: pathlib.Path) -> str:
    """What decides a module's split: its top-level package (``email/mime/text.py`` -> ``email``),
    so near-identical siblings (the ``encodings/cp125x.py`` tables) never straddle the split;
    a top-level module is its own group. Its docstring (prose.py) goes the same way."""
    return rel.parts[0] if len(rel.parts) > 1 else rel.name


def build_code(
    out: pathlib.Path, *, seed: int, count: int, progress: bool, split: str = "all"
) -> dict:
    """Copy `count` modules of the split chosen by the seed; bytes unchanged, relative paths kept."""
    root = stdlib_dir()
    pool = [rel for rel in candidates() if in_split(split_group(rel), split)]
    rng = rng_for(seed, "code")
    picked = sorted(rng.choice(len(pool), size=min(count, len(pool)), replace=False).tolist())
    total = 0
    for i in tqdm(picked, desc="code", unit="file", disable=not progress, leave=False):
        dst = out / "code" / pool[i]
        dst.parent.mkdir(parents=True, exist_ok=True)
        shutil.copyfile(root / pool[i], dst)
        total += dst.stat().st_size
    return {"files": len(picked), "bytes": total}
