"""A corrupted token sample cannot stop a run (issue 14, item 2). Before: 256 bytes flipped in one
sample's ids crashed the model's embedding ('IndexError: index out of range in self') at the
same step after every restart. Now the loader skips it, counts it in data/skipped and names its
shard and key, and the run finishes."""

from __future__ import annotations

import json
import shutil

from factories import flip_token_bytes, token_sample_with_id
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
    # 12 steps of 2 rows of 256 tokens: more than both sources hold, so every sample is read.
    p = train(
        [
            "experiment=debug",
            f"data.sources=[{srcs}]",
            f"run_dir={run}",
            "train.steps=12",
            "train.log_every=4",
            "train.micro_batch=2",
        ]
    )
    assert "step 12/12" in p.stdout
    assert f"[loader] skipped {flipped_tar} sample {flipped}: its members do not match" in p.stderr
    assert f"[loader] skipped {oov_tar} sample {oov}: 1 id(s) outside" in p.stderr
    assert "unreadable sample(s) skipped so far" in p.stdout
    assert json.loads((run / "final.json").read_text())["data/skipped"] >= 2
