"""Failing video decodes cannot grow a loader worker without bound: past a
budget of failures a worker decodes each clip in a child process (data/loader/decode_guard.py).
Its frames are the in-process frames exactly, its failures are ValueErrors like decord's, a
child that dies is a failed decode, and it works inside a real DataLoader worker (a daemon
process). The memory it saves is in docs/benchmarks.md (measured by
tools/bench/bench_decode_leak.py at commit 8076146, since removed)."""

from __future__ import annotations

import os
import subprocess
import sys

import numpy as np
import pytest
import torch
from factories import mp4_bytes

from data.image_prep import ImagePrep
from data.loader import LoaderConfig, SourceConfig, build_loader
from data.loader.decode_guard import CHILD_COMMAND, DecodeGuard
from data.video_frames import VideoSampling, decode_frames

PREP = ImagePrep(factor=8, max_pixels=32 * 32, max_grid=32)
SAMPLING = VideoSampling(4.0, 8)


def test_past_its_budget_the_guard_decodes_in_a_child_with_the_same_frames():
    good, bad = mp4_bytes(frames=16, w=64, h=64), os.urandom(5000)
    want = decode_frames(good, SAMPLING, PREP, (64, 64))
    guard = DecodeGuard(budget=2)
    for _ in range(2):
        with pytest.raises(ValueError, match="cannot decode video"):
            guard(bad, SAMPLING, PREP, (64, 64))
    assert (guard.failures, guard.isolated) == (2, 0)
    with pytest.raises(ValueError, match="cannot decode video"):
        guard(bad, SAMPLING, PREP, (64, 64))  # in a child now
    got = guard(good, SAMPLING, PREP, (64, 64))
    assert (guard.failures, guard.isolated) == (3, 2)
    assert np.array_equal(got.frames, want.frames) and np.array_equal(got.times, want.times)
    assert (got.source_fps, got.duration) == (want.source_fps, want.duration)


def test_a_child_that_dies_is_a_failed_decode(monkeypatch):
    import data.loader.decode_guard as guard_module

    # a child that is killed mid-decode (a crash inside FFmpeg looks the same to the parent)
    die = "import os, signal; os.kill(os.getpid(), signal.SIGKILL)"
    monkeypatch.setattr(guard_module, "CHILD_COMMAND", [sys.executable, "-c", die])
    guard = DecodeGuard(budget=0)
    with pytest.raises(ValueError, match="decoding process died"):
        guard(mp4_bytes(), SAMPLING, PREP, (32, 32))
    assert guard.failures == 1


def test_a_dataloader_worker_decoding_in_children_gives_the_same_batches(tiny_raw, tiny_tokens):
    def batches(budget: int) -> list[dict]:
        cfg = LoaderConfig(
            sources=[SourceConfig(name="clips", shards=[str(tiny_raw / "clips")])],
            seq_len=256,
            num_workers=1,  # a real DataLoader worker: a daemon process
            tokenizers=str(tiny_tokens / "tokenizers"),
            video_failure_budget=budget,
        )
        cfg.tokenize.video_max_pixels = cfg.tokenize.image_max_pixels = 32 * 32
        cfg.tokenize.video_max_tokens = 240
        it = iter(build_loader(cfg, rank=0, world_size=1, micro_batch=2))
        out = [next(it) for _ in range(3)]
        it.close()
        return out

    for a, b in zip(batches(0), batches(64)):  # budget 0: every clip decoded in a child
        assert torch.equal(a["input_ids"], b["input_ids"])
        assert torch.equal(a["modality"], b["modality"])


def test_the_child_imports_neither_torch_nor_numba():
    # A child starts for every clip past the budget: torch and numba would cost seconds a clip.
    code = (
        CHILD_COMMAND[-1].split(";")[0]
        + "; import sys; print([m for m in ('torch', 'numba') if m in sys.modules])"
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert done.stdout.strip() == "[]"
