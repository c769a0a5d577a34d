"""`build()`: run every part of the demo corpus into a staging folder, then move it into place.

Staging makes a build all-or-nothing (a killed build never leaves a half corpus that the
ingest step would happily read) and lets a rebuild at another scale drop files that the
old one made. An existing `out` is replaced only if it is empty or a demo corpus itself
(its README starts with the marker); anything else is refused before any work is done.
"""

from __future__ import annotations

import os
import pathlib
import shutil
import time
from typing import Any

from tqdm import tqdm

from . import clips, digits, interleaved, scenes, stdlib_code, wds
from ._common import SPLITS, scaled
from .photos import available, build_photos
from .prose import build_text
from .readme import MARKER, build_readme


def _is_demo_corpus(path: pathlib.Path) -> bool:
    readme = path / "README.md"
    return readme.is_file() and readme.read_text(encoding="utf-8", errors="replace").startswith(
        MARKER
    )


def _check_target(out: pathlib.Path) -> None:
    if out.exists() and not (out.is_dir() and (not any(out.iterdir()) or _is_demo_corpus(out))):
        raise FileExistsError(
            f"{out} exists and is not a demo corpus; choose an empty or new folder"
        )


def build(
    out: pathlib.Path,
    *,
    seed: int = 0,
    scale: float = 1.0,
    progress: bool = True,
    split: str = "all",
    scene_count: int | None = None,
) -> dict:
    """Build the demo corpus into `out`; return a summary: files and bytes per part.

    `scale` multiplies every generated or sampled count (code files, digits, scenes, clips,
    documents, shard samples); photos are always all present. Item i of a part depends only
    on (seed, i), so a small corpus is a prefix of a larger one with the same seed.

    `split` divides the real material (standard-library modules and their docstrings, pydoc
    topics, photos and the clips made from them, handwritten digits) by a fixed hash of each
    item's group (`_common.in_split`): `train` and `heldout` never share an item, `all` has both.
    Generated parts (scenes, motion clips, interleaved documents, the wds shard) differ by
    `seed`: build a held-out corpus with `split="heldout"` and another seed than training.
    `scene_count` sets the number of scenes (and as many drawings: caption-then-picture scenes)
    whatever the scale, for a held-out set large enough to score generation on.
    """
    if scale <= 0:
        raise ValueError(f"scale must be positive, got {scale}")
    if split not in SPLITS:
        raise ValueError(f"split must be one of {SPLITS}, got {split!r}")
    out = pathlib.Path(out)
    _check_target(out)
    stage = out.parent / f".{out.name}.partial-{os.getpid()}"
    shutil.rmtree(stage, ignore_errors=True)
    stage.mkdir(parents=True)
    started = time.perf_counter()
    try:
        parts: dict[str, dict] = {}
        steps = tqdm(total=8, desc="demo corpus", unit="part", disable=not progress)

        def done(name: str, summary: dict) -> None:
            parts[name] = summary
            steps.set_postfix_str(name)
            steps.update()

        done(
            "code",
            stdlib_code.build_code(
                stage,
                seed=seed,
                count=scaled(stdlib_code.TARGET, scale),
                progress=progress,
                split=split,
            ),
        )
        done("text", build_text(stage, seed=seed, scale=scale, split=split))
        done("photos", build_photos(stage, split))
        done(
            "digits",
            digits.build_digits(
                stage,
                seed=seed,
                count=scaled(digits.TARGET, scale),
                progress=progress,
                split=split,
            ),
        )
        # At least 4 scenes / clips, so that galleries, shards and every clip kind exist.
        n_scenes = scene_count if scene_count is not None else scaled(scenes.TARGET, scale, 4)
        scene_summary, scene_rows = scenes.build_scenes(
            stage, seed=seed, count=n_scenes, progress=progress, drawings=n_scenes
        )
        done("scenes", scene_summary)
        clip_summary, clip_rows = clips.build_clips(
            stage, seed=seed, count=scaled(clips.TARGET, scale, 4), progress=progress, split=split
        )
        done("clips", clip_summary)
        photos = [p for p, _ in available(split)]
        done(
            "interleaved",
            interleaved.build_interleaved(
                stage,
                seed=seed,
                count=scaled(interleaved.TARGET, scale, 4),
                scenes=scene_rows,
                photos=photos,
                clips=clip_rows,
            ),
        )
        done(
            "wds",
            wds.build_wds(stage, seed=seed, count=scaled(wds.TARGET, scale, 2), scenes=scene_rows),
        )
        steps.close()

        summary: dict[str, Any] = {"seed": seed, "scale": scale, "split": split, "parts": parts}
        summary["files"] = sum(1 for p in stage.rglob("*") if p.is_file()) + 1  # + README.md
        summary["bytes"] = sum(p.stat().st_size for p in stage.rglob("*") if p.is_file())
        readme_bytes = build_readme(stage, summary, photos)
        parts["readme"] = {"files": 1, "bytes": readme_bytes}
        summary["bytes"] += readme_bytes

        _check_target(out)  # again: someone may have written there meanwhile
        if out.exists():
            shutil.rmtree(out)
        stage.rename(out)
    except BaseException:
        shutil.rmtree(stage, ignore_errors=True)
        raise
    summary["seconds"] = round(time.perf_counter() - started, 2)
    return summary
