"""Fixtures for the data tests: a small corpus with every kind of planted fault."""

from __future__ import annotations

import signal

import pytest
from factories import jpeg_bytes, mp4_bytes, png_bytes, png_header_bomb, write_wds


@pytest.fixture
def no_hang():
    """Fails a test that blocks for 120 s instead of leaving it blocked: a named pipe opened for
    reading with no writer waits for ever, which is what the tests using it would do if ingest
    opened one again."""

    def stop(signum, frame):
        raise TimeoutError("blocked for 120 s (a named pipe opened?)")

    before = signal.signal(signal.SIGALRM, stop)
    signal.alarm(120)
    try:
        yield
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, before)


@pytest.fixture
def planted_corpus(tmp_path) -> dict:
    """A small corpus with one of each planted fault beside good inputs."""
    root = tmp_path / "in"
    (root / "text").mkdir(parents=True)
    (root / "text" / "good.txt").write_text("A plain paragraph of prose.\n")
    (root / "text" / "latin1.txt").write_bytes("caf\xe9 cr\xe8me".encode("latin-1"))
    (root / "images").mkdir()
    (root / "images" / "ok.png").write_bytes(png_bytes())
    (root / "images" / "ok.txt").write_text("a red rectangle")
    jpg = jpeg_bytes(64, 48)
    (root / "images" / "cut.jpg").write_bytes(jpg[: len(jpg) // 2])
    (root / "images" / "bomb.png").write_bytes(png_header_bomb())
    (root / "videos").mkdir()
    (root / "videos" / "clip.mp4").write_bytes(mp4_bytes())
    (root / "videos" / "empty.mp4").write_bytes(b"")
    (root / "videos" / "captions.jsonl").write_text(
        '{"file": "clip.mp4", "caption": "a white bar moves right"}\n'
    )
    (root / "docs.jsonl").write_text(
        '{"texts": ["intro", null, "after"], "images": [null, "images/ok.png", null]}\n'
        '{"texts": ["lost", null], "images": [null, "images/nope.png"]}\n'
    )
    (root / "wds").mkdir()
    write_wds(
        root / "wds" / "00000.tar",
        [
            ("000000001", {"jpg": jpeg_bytes(seed=1), "txt": b"first"}),
            ("000000002", {"jpg": jpeg_bytes(seed=2), "txt": b"second"}),
            ("000000001", {"jpg": jpeg_bytes(seed=3), "txt": b"dup of first"}),
            ("../escape", {"jpg": jpeg_bytes(seed=4), "txt": b"evil"}),
        ],
    )
    sources = [
        f"text:{root / 'text'}",
        f"images:{root / 'images'}",
        f"videos:{root / 'videos'}",
        f"interleaved:{root / 'docs.jsonl'}",
        f"wds:{root / 'wds'}",
    ]
    expected_rejects = {
        ("text", "latin1.txt", "not-utf8"),
        ("images", "cut.jpg", "truncated-image"),
        ("images", "bomb.png", "pixel-limit"),
        ("videos", "empty.mp4", "empty-video"),
        ("docs", "docs.jsonl:2", "missing-media"),
        ("wds", "00000.tar:000000001", "duplicate-key"),
        ("wds", "00000.tar:../escape", "unsafe-name"),
    }
    return {
        "root": root,
        "sources": sources,
        "expected_rejects": expected_rejects,
        "good_samples": 6,
    }
