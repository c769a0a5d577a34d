"""Training validation and ``earlyfuse-eval`` on the same held-out documents, with the same
release: the same label tokens per modality and the same CE, with loader workers (which the
validation pass does not use), one validation source spanning several shard folders, as
``tokens/val`` does, and the run's ``data.whole_documents``; a capped validation over a
held-out set smaller than a batch per worker still evaluates it."""

from __future__ import annotations

import json

import pytest
from trainrun import train

from data.token_docs import iter_documents, source_tables
from data.vocab import MODALITY_NAMES
from tools.convert_release import make_release
from tools.evaluate import main as eval_main

TRAIN = ("scenes", "text", "code")
HELDOUT = ("clips", "docs", "scenes")  # video, interleaved text and images, captioned images


def run(tokens, run_dir, *extra: str) -> dict:
    srcs = ",".join(f"{{name: {s}, shards: [{tokens / s}], weight: 1.0}}" for s in TRAIN)
    val = ",".join(str(tokens / s) for s in HELDOUT)
    train(
        [
            "experiment=debug",
            f"data.sources=[{srcs}]",
            f"data.validation=[{{name: heldout, shards: [{val}]}}]",
            f"run_dir={run_dir}",
            "train.steps=2",
            "train.micro_batch=3",
            "data.num_workers=2",
            *extra,
        ]
    )
    return json.loads((run_dir / "final.json").read_text())


def label_tokens(tokens) -> dict[str, float]:
    """Every held-out document's tokens but its first, per modality: what validation predicts."""
    out = dict.fromkeys(MODALITY_NAMES, 0.0)
    tables = [t for t in source_tables(tokens) if t.name in HELDOUT]
    for doc in iter_documents(tables):
        for m in doc.modality[1:]:
            out[MODALITY_NAMES[int(m)]] += 1
    return out


def mean_ce(ev: dict) -> float:
    """The CE of every label of the held-out sources (``--data`` holds the training ones too)."""
    figs = [f for s in HELDOUT for f in ev["heldout"]["sources"][s].values()]
    return sum(f["ce"] * f["tokens"] for f in figs) / sum(f["tokens"] for f in figs)


def test_training_validation_equals_earlyfuse_eval(tiny_tokens, tmp_path, capsys):
    """A run with ``data.whole_documents``: validation and earlyfuse-eval (which reads the
    setting from the run's config) both keep every held-out document that fits a row whole;
    packed without it (``--no-whole-documents``) text is split at row ends, documents holding
    pictures are not."""
    final = run(tiny_tokens, tmp_path / "run", "train.eval_batches=0", "data.whole_documents=true")
    assert final["val/complete"] == 1.0 and final["val/skipped"] == 0
    assert final["val/dropped_blocks"] == 0
    want = label_tokens(tiny_tokens)
    assert {m: final.get(f"val/tokens/{m}", 0.0) for m in MODALITY_NAMES} == want
    make_release(tmp_path / "run", tmp_path / "rel", log=lambda *a, **k: None)
    out = tmp_path / "eval.json"
    argv = [str(tmp_path / "rel"), "--data", str(tiny_tokens)]
    assert eval_main([*argv, "--position-loss", "--out", str(out)]) == 0
    assert "held-out" in capsys.readouterr().err  # the progress bar (stderr)
    ev = json.loads(out.read_text())
    assert ev["batch_rows"] == 3 and ev["seq_len"] == 256 and ev["whole_documents"]  # the run's
    sources = ev["heldout"]["sources"]
    for m in MODALITY_NAMES:
        if not want[m]:
            continue
        tokens = sum(sources[s].get(m, {}).get("tokens", 0) for s in HELDOUT)
        nats = sum(
            sources[s][m]["ce"] * sources[s][m]["tokens"] for s in HELDOUT if m in sources[s]
        )
        assert tokens == want[m] == final[f"val/tokens/{m}"], m
        assert nats / tokens == pytest.approx(final[f"val/loss/{m}"], rel=1e-6, abs=1e-9), m
    assert mean_ce(ev) == pytest.approx(final["val/loss"], rel=1e-6)
    # The loss by position is read off the same rows: documents whole, every label once.
    assert ev["position_loss"]["whole_documents"]
    for m, fig in ev["heldout"]["total"].items():
        cells = ev["position_loss"]["modalities"][m]["buckets"]
        assert sum(c["tokens_all"] for c in cells) == fig["tokens"], m
    split = tmp_path / "split.json"
    flags = ["--no-whole-documents", "--max-pairs", "0", "--no-progress", "--out", str(split)]
    assert eval_main([*argv, *flags]) == 0
    ev_split = json.loads(split.read_text())
    assert ev_split["whole_documents"] is False
    assert ev_split["heldout"]["total"] != ev["heldout"]["total"]
    for m, fig in ev["heldout"]["total"].items():  # the same labels, other rows
        assert ev_split["heldout"]["total"][m]["tokens"] == fig["tokens"], m
    # The held-out documents all hold a picture or clip and fit a row: whole either way, the
    # same figure. The text of the training sources (in --data too) is packed otherwise.
    assert mean_ce(ev_split) == pytest.approx(final["val/loss"], rel=1e-6)
    assert ev_split["heldout"]["total"]["text"]["ce"] != ev["heldout"]["total"]["text"]["ce"]


def test_capped_validation_with_workers_evaluates_small_sets(tiny_tokens, tmp_path):
    """Rows of 2,048 and 16 per batch, 2 workers: the held-out set is less than a batch per
    worker, and validation capped at 2 batches evaluates the batches there are."""
    final = run(
        tiny_tokens,
        tmp_path / "run",
        "train.eval_batches=2",
        "data.seq_len=2048",
        "train.micro_batch=16",
    )
    assert final["val/batches"] > 0
    assert final["val/tokens/image"] > 0 and final["val/tokens/video"] > 0
