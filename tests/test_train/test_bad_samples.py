"""A corrupted token sample cannot stop a run. Before: 256 bytes flipped in one
sample's ids crashed the model's embedding ('IndexError: index out of range in self') at the
same step after every restart. Now the loader skips it, counts it in data/skipped and names its
shard and key, and the run finishes; validation counts those it leaves out in val/skipped. A source none of whose samples can be read is left out of
the mix at start, and a run with no readable source is refused there (exit code 2)."""

from __future__ import annotations

import json
import shutil

from factories import corrupt_every_sample, flip_token_bytes, token_sample_with_id
from trainrun import train

from data.vocab import VocabLayout


def test_a_run_skips_corrupted_and_out_of_vocabulary_samples_and_finishes(tiny_tokens, tmp_path):
    tokens = tmp_path / "tokens"
    shutil.copytree(tiny_tokens, tokens)
    flipped_tar = tokens / "scenes" / "shard-000000.tar"
    flipped = flip_token_bytes(flipped_tar, 3)
    size = VocabLayout.load(tokens / "tokenizers" / "vocab_layout.json").size
    oov_tar = tokens / "digits" / "shard-000000.tar"
    oov = token_sample_with_id(oov_tar, 2, size + 7)
    run = tmp_path / "run"
    srcs = ", ".join(
        f"{{name: {s}, shards: [{tokens / s}], weight: 0.5}}" for s in ("scenes", "digits")
    )
    # 24 steps of 2 rows of 256 tokens: twice what both sources hold, so every sample is read
    # at least twice.
    p = train(
        [
            "experiment=debug",
            f"data.sources=[{srcs}]",
            f"data.validation=[{{name: heldout, shards: [{tokens / 'scenes'}, {tokens / 'digits'}]}}]",
            f"run_dir={run}",
            "train.steps=24",
            "train.eval_batches=0",
            "train.log_every=4",
            "train.micro_batch=2",
        ]
    )
    assert "step 24/24" in p.stdout
    assert f"[loader] skipped {flipped_tar} sample {flipped}: its members do not match" in p.stderr
    assert f"[loader] skipped {oov_tar} sample {oov}: 1 id(s) outside" in p.stderr
    assert p.stderr.count("[loader] skipped") > 2  # met again in later epochs
    # Counted once each, and named. Before: each skip counted, and the samples not named.
    final = json.loads((run / "final.json").read_text())
    assert final["data/skipped"] == 2
    # Validation over the same shards leaves both out too, and says so: it read as complete.
    assert final["val/skipped"] == 2 and final["val/complete"] == 1.0
    assert "unreadable sample(s) skipped so far, over all ranks, each counted once" in p.stdout
    named = [ln for ln in p.stdout.splitlines() if "unreadable sample(s) skipped so far" in ln]
    assert any(f"{flipped_tar} {flipped}" in ln for ln in named)
    assert any(f"{oov_tar} {oov}" in ln for ln in named)


def test_a_source_whose_every_sample_is_corrupt_is_left_out_and_none_readable_is_refused(
    tiny_tokens, tmp_path
):
    """Before: 'RuntimeError: 16 unreadable samples in a row' at step 1, and again on every
    rerun, although the start-up pass had found every document of the source unreadable."""
    tokens = tmp_path / "tokens"
    shutil.copytree(tiny_tokens, tokens)
    keys = corrupt_every_sample(tokens / "digits" / "shard-000000.tar")
    run = tmp_path / "run"
    srcs = ", ".join(
        f"{{name: {s}, shards: [{tokens / s}], weight: 0.5}}" for s in ("scenes", "digits")
    )
    common = ["experiment=debug", "train.micro_batch=2", "train.log_every=1"]
    p = train([*common, f"data.sources=[{srcs}]", f"run_dir={run}", "train.steps=3"])
    out = p.stdout + p.stderr
    assert f"source(s) digits ({len(keys)} documents) left out of the mix" in out
    assert "step 3/3" in p.stdout and "unreadable samples in a row" not in out
    assert json.loads((run / "final.json").read_text())["data/skipped"] == 0  # never read
    # Every named document listed is capped: a few by name, then a count.
    assert out.count("left out: its members do not match") <= 5
    assert f"{len(keys) - 5} more document(s) left out" in out

    only = f"[{{name: digits, shards: [{tokens / 'digits'}], weight: 1.0}}]"
    p = train(
        [*common, f"data.sources={only}", f"run_dir={tmp_path / 'none'}", "train.steps=3"],
        check=False,
    )
    assert p.returncode == 2, p.stderr[-3000:]
    assert "no training source has a readable document: every document of digits" in p.stderr
    assert "Traceback" not in p.stderr
