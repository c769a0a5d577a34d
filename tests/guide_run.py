"""docs/own_data.md's CPU try run as the page writes it: its shell lines in page order, by bash,
in a home folder laid out as its step 1 says, every source kind it names included (the image
table in a bucket of the local S3-compatible server of tests/s3_server.py). Shared by the slow
test of tests/test_own_data_guide.py and the guide's timings (tools/bench/guide_timings.py), so
what is timed is what is tested. (tests/ is on pytest's pythonpath: ``import guide_run``.)"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

GUIDE = Path(__file__).resolve().parents[1] / "docs" / "own_data.md"
RECIPES = ("CPU try", "GPU run")

# The page's stand-ins for the reader's own object store, in its `export` lines, and the bucket
# its table is in: the test fills in the local server's endpoint and keys.
ENDPOINT, KEY_ID, SECRET = "https://s3.example.com", "YOUR_KEY_ID", "YOUR_SECRET"
BUCKET = "my-bucket"
CATALOG = "catalog/part-00000.parquet"


def blocks(kind: str) -> list[tuple[str | None, str]]:
    """(recipe or None for both, text) of every fenced block of ``kind``, in page order."""
    out = []
    for body in re.findall(rf"```{kind}\n(.*?)```", GUIDE.read_text(), re.S):
        first = body.splitlines()[0].lstrip("# ").strip() if body.strip() else ""
        out.append((first if first in RECIPES else None, body))
    return out


def recipe_lines(recipe: str = "CPU try") -> list[str]:
    """The recipe's shell lines in page order: continuation lines joined, comments dropped."""
    lines = []
    for label, body in blocks("bash"):
        if label not in (None, recipe):
            continue
        for line in body.replace("\\\n", " ").splitlines():
            line = "" if line.lstrip().startswith("#") else line.split(" #")[0].strip()
            if line:
                lines.append(line)
    return lines


def write_user_configs(home: Path) -> Path:
    """The page's own data config, written where its first line says (``~`` being ``home``);
    returns the config folder (``~/my-configs``)."""
    (body,) = [text for _, text in blocks("yaml")]
    where = body.splitlines()[0].lstrip("# ").strip()
    assert where == "~/my-configs/data/mine.yaml", where
    path = home / where.removeprefix("~/")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(body)
    return home / "my-configs"


def build_corpus(home: Path, scale: int = 1) -> dict[str, bytes]:
    """``~/corpus`` as step 1 lays it out, with every source kind the page names: a Python
    package, docs and man pages as text, captioned photos (one larger than a row at its native
    size), videos (one portrait), interleaved JSONL with its pictures, a Hugging Face
    ``save_to_disk`` folder. Returns the image table for the bucket (``{CATALOG: parquet}``):
    its images are bytes in the table, as a remote table's must be. ``scale`` multiplies the
    number of documents of every source."""
    import io

    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq
    from factories import jpeg_bytes, mp4_bytes

    corpus = home / "corpus"
    package = corpus / "code" / "riverlog"
    for folder in ("src/riverlog", "tests"):
        (package / folder).mkdir(parents=True, exist_ok=True)
    (package / "pyproject.toml").write_text('[project]\nname = "riverlog"\nversion = "0.1"\n')
    (package / "src/riverlog/__init__.py").write_text('"""River levels, logged."""\n')
    for i in range(30 * scale):
        (package / "src/riverlog" / f"gauge{i}.py").write_text(
            f'"""Gauge {i}."""\n\n\ndef level_{i}(reading):\n    return reading * {i} + {i % 7}\n'
        )
    (package / "tests/test_gauges.py").write_text(
        "from riverlog.gauge1 import level_1\n\n\ndef test_one():\n    assert level_1(2) == 3\n"
    )
    notes = corpus / "notes"
    notes.mkdir(parents=True, exist_ok=True)
    for i in range(10 * scale):
        (notes / f"note{i}.txt").write_text(
            f"Note {i}: the river rose {i} feet in the night and the town counted its boats."
        )
        (notes / f"guide{i}.md").write_text(f"# Gauge {i}\n\nRead gauge {i} at dawn; log it.\n")
        (notes / f"boats{i}.rst").write_text(f"Boats {i}\n=======\n\n{i + 2} boats were moored.\n")
        (notes / f"gauge{i}.1.txt").write_text(  # a man page as `man -P cat` prints it
            f"GAUGE{i}(1)    User Commands    GAUGE{i}(1)\n\nNAME\n       gauge{i} - read "
            f"river gauge {i}\n\nSYNOPSIS\n       gauge{i} [-v] [STATION]\n"
        )
    photos = corpus / "photos"
    photos.mkdir(parents=True, exist_ok=True)
    for i in range(1, 12 * scale + 1):
        (photos / f"IMG_{i:04d}.jpg").write_bytes(jpeg_bytes(96, 72, seed=i))
        (photos / f"IMG_{i:04d}.txt").write_text(f"photo number {i} of the trip")
    # 320x240 at 4 px a token is an 80x60 grid, 4,860 tokens: tokenize must fit it to a row.
    (photos / "IMG_9000.jpg").write_bytes(jpeg_bytes(320, 240, seed=9000))
    (photos / "IMG_9000.txt").write_text("the whole valley from the bridge")
    videos = corpus / "videos"
    videos.mkdir(parents=True, exist_ok=True)
    for i in range(4 * scale):
        portrait = i == 0  # a phone held upright
        width, height = (48, 64) if portrait else (64, 48)
        (videos / f"clip{i}.mp4").write_bytes(mp4_bytes(frames=12 + i, w=width, h=height))
        (videos / f"clip{i}.txt").write_text(f"clip {i}: a bar moves across")
    pages = corpus / "pages"
    (pages / "img").mkdir(parents=True, exist_ok=True)
    with open(pages / "pages.jsonl", "w") as out:
        for i in range(8 * scale):
            (pages / "img" / f"p{i}.jpg").write_bytes(jpeg_bytes(64, 48, seed=500 + i))
            texts = [f"Page {i} of the log.", None, f"The bridge at mile {i}."]
            out.write(json.dumps({"texts": texts, "images": [None, f"img/p{i}.jpg", None]}) + "\n")
    datasets.Dataset.from_dict(
        {"text": [f"Wiki article {i}: the river has {i + 3} bridges." for i in range(20 * scale)]}
    ).save_to_disk(str(corpus / "wiki_hf"))
    table = pa.table(
        {
            "image": [jpeg_bytes(80, 60, seed=700 + i) for i in range(10 * scale)],
            "caption": [f"catalog item {i}, a boat" for i in range(10 * scale)],
        }
    )
    buf = io.BytesIO()
    pq.write_table(table, buf, row_group_size=4)
    return {CATALOG: buf.getvalue()}


def upload(files: dict[str, bytes]) -> None:
    """Put ``files`` in the page's bucket of the running server (tests/s3_server.py)."""
    import fsspec

    fs = fsspec.filesystem("s3")
    for rel, data in files.items():
        fs.pipe_file(f"{BUCKET}/{rel}", data)


def fill_in(line: str, server_env: dict[str, str]) -> str:
    """An `export` line of the page with the server's endpoint and keys in place of the
    reader's."""
    return (
        line.replace(ENDPOINT, server_env["AWS_ENDPOINT_URL_S3"])
        .replace(KEY_ID, server_env["AWS_ACCESS_KEY_ID"])
        .replace(SECRET, server_env["AWS_SECRET_ACCESS_KEY"])
    )


def shell_env(home: Path, threads: str | None) -> dict[str, str]:
    """The environment of the page's commands: ``~`` is ``home``, the commands are this
    interpreter's; ``threads`` sets ``OMP_NUM_THREADS`` (None: as this process has it)."""
    env = {
        **os.environ,
        "HOME": str(home),
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
    }
    if threads is not None:
        env["OMP_NUM_THREADS"] = threads
    return env


def run_recipe(
    home: Path,
    server_env: dict[str, str],
    *,
    extra: dict[str, str],
    run: Callable[[str, str, dict[str, str]], str] | None = None,
    threads: str | None = "1",
) -> dict[str, str]:
    """Run the CPU try's lines in ``home``, each by bash after the page's `export` lines so far
    (filled in); ``extra`` appends text to a line holding its key (``train.steps=4`` to a
    training run: Hydra takes a key's last value). ``run(line, script, env)`` runs one line and
    returns its output (the default asserts exit status 0). ``threads``: as in ``shell_env``
    (one thread a process by default, as the suite runs on shared cores). Returns each
    command's output by its first word."""
    env, exports, said = shell_env(home, threads), [], {}
    run = run or _run_checked
    for line in recipe_lines("CPU try"):
        if line.startswith("export "):
            exports.append(fill_in(line, server_env))
            continue
        if "runs/mine/config.yaml" in line and not (home / "runs/mine").exists():
            continue  # the preview of a run's config, before there is a run
        line += next((more for key, more in extra.items() if f" {key} " in f"{line} "), "")
        said[line.split()[0]] = run(line, "\n".join([*exports, line]), env)
    return said


def _run_checked(line: str, script: str, env: dict[str, str]) -> str:
    done = subprocess.run(
        ["bash", "-c", script], cwd=env["HOME"], env=env, capture_output=True, text=True
    )
    assert done.returncode == 0, f"{line}\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout
