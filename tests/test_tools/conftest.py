"""A release of a tiny real LM run, shared by the checkpoint-tool tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainrun import train

from tools.convert_release import make_release


@pytest.fixture(scope="session")
def debug_release(tiny_tokens, tmp_path_factory) -> Path:
    """Four steps of the debug LM on captioned scenes, video clips, prose and code, released."""
    root = tmp_path_factory.mktemp("release")
    srcs = ",".join(
        f"{{name: {s}, shards: [{tiny_tokens / s}], weight: 1.0}}"
        for s in ("scenes", "clips", "text", "code")
    )
    train(
        [
            "experiment=debug",
            f"data.sources=[{srcs}]",
            f"run_dir={root / 'run'}",
            "train.steps=4",
            "train.micro_batch=2",
        ]
    )
    make_release(root / "run", root / "rel", log=lambda *a, **k: None)
    return root / "rel"
