"""A release of a tiny real LM run, shared by the checkpoint-tool tests."""

from __future__ import annotations

from pathlib import Path

import pytest
from trainrun import release_debug_run


@pytest.fixture(scope="session")
def debug_release(tiny_tokens, tmp_path_factory) -> Path:
    """Four steps of the debug LM on captioned scenes, video clips, prose and code, released."""
    root = tmp_path_factory.mktemp("release")
    return release_debug_run(tiny_tokens, root, ("scenes", "clips", "text", "code"))
