"""Fixtures shared by every test folder: a tiny real corpus, its raw shards, its tokenizers; a
small file system that fills up."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

# pytest-xdist workers share the cores: each takes its share of torch threads (set before torch
# is imported), unless told otherwise. Each worker's default, a thread per core, oversubscribed
# them, and the in-process model tests waited on each other's threads.
if (workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))) > 1:
    os.environ.setdefault("OMP_NUM_THREADS", str(max(1, (os.cpu_count() or 1) // workers)))

from data.demo_corpus import build  # noqa: E402
from data.ingest import ingest  # noqa: E402
from data.sources import Limits  # noqa: E402

# Any DeepSpeed op a test builds is built once per virtual environment, never in the home folder
# that every checkout shares (train/ds_env.py does the same for the project's own entry points).
os.environ.setdefault("TORCH_EXTENSIONS_DIR", str(Path(sys.prefix) / "torch_extensions"))


@pytest.fixture(scope="session")
def tiny_corpus(tmp_path_factory) -> Path:
    """The demo corpus at 5 % scale (seconds to build): code, prose, scenes, digits, clips. 20
    scenes, not 5 % of the demo's 1,500: tests count on the scenes source filling 2 shards of 16
    samples and a few batches per epoch (tests/test_data/test_loader_sources.py,
    test_redistribute.py, tests/test_train/test_run_control.py)."""
    root = tmp_path_factory.mktemp("corpus") / "corpus"
    build(root, scale=0.05, progress=False, scene_count=20)
    return root


@pytest.fixture(scope="session")
def tiny_raw(tiny_corpus, tmp_path_factory) -> Path:
    """Raw shards of the tiny corpus (no photos: they are large and slow to decode)."""
    out = tmp_path_factory.mktemp("raw") / "raw"
    c = tiny_corpus
    s = ingest(
        out,
        [
            f"code:{c / 'code'}",
            f"text:{c / 'text'}",
            f"images:{c / 'scenes' / 'scenes.jsonl'}",
            f"images:{c / 'digits' / 'digits.csv'}",
            f"videos:{c / 'clips'}",
            f"interleaved:{c / 'interleaved' / 'docs.jsonl'}",
        ],
        shard_max_samples=16,
        # the corpus's interleaved documents name its photos, scenes and clips in sibling folders
        limits=Limits(allow_outside_paths=True),
    )
    assert s["finalized"]
    return out


@pytest.fixture(scope="session")
def tiny_tokenizers(tiny_raw, tmp_path_factory) -> tuple[Path, Path]:
    """(text tokenizer folder, visual tokenizer folder) for the tiny raw shards. The visual
    tokenizer is the debug network, untrained: real weights, real codes, no training time."""
    import torch

    from data.train_text_tokenizer import train_text_tokenizer
    from model.visual_tokenizer import vtok_debug
    from train.tasks.vtok import save_visual_tokenizer

    root = tmp_path_factory.mktemp("tok")
    train_text_tokenizer([tiny_raw], root / "text", vocab_size=512, max_grid=32)
    torch.manual_seed(0)
    cfg = vtok_debug()
    save_visual_tokenizer(cfg.build().state_dict(), cfg, root / "visual")
    return root / "text", root / "visual"


@pytest.fixture(scope="session")
def tiny_tokens(tiny_raw, tiny_tokenizers, tmp_path_factory) -> Path:
    """Token shards of the tiny raw shards: images at most 8x8 codes, videos at most 240 tokens,
    so every block fits the 256-token rows of the debug experiment."""
    from data.tokenize.encoder import TokenizeOptions
    from data.tokenize.run import tokenize

    out = tmp_path_factory.mktemp("tokens") / "tokens"
    text, visual = tiny_tokenizers
    tokenize(
        tiny_raw,
        out,
        text,
        visual,
        opts=TokenizeOptions(
            image_max_pixels=32 * 32, video_max_pixels=32 * 32, video_max_tokens=240
        ),
    )
    return out


@pytest.fixture
def small_tmpfs(tmp_path):
    """A tmpfs mount point (a real file system that fills up), where mounting is allowed (root
    in a sandbox, CI); skipped elsewhere. Sized by the test with ``mount -o remount``."""
    point = tmp_path / "tmpfs"
    point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=64m", "tmpfs", str(point)], capture_output=True
    )
    if mounted.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {mounted.stderr.decode().strip()}")
    try:
        yield point
    finally:
        subprocess.run(["umount", "-l", str(point)], capture_output=True)
