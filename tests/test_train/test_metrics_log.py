"""train/callbacks/metrics_log.py: metrics.jsonl after a crash."""

from __future__ import annotations

import json

from train.callbacks.metrics_log import JsonlSink


def test_a_record_cut_short_by_a_crash_does_not_swallow_the_next_one(tmp_path):
    """A full disk cut the last record short; the next run's first record was appended to it and
    both were lost (one line that does not parse)."""
    path = tmp_path / "metrics.jsonl"
    path.write_text('{"step": 1, "train/loss": 2.5}\n{"step": 2, "train/lo')
    sink = JsonlSink(path)
    sink.write(1, {"train/loss": 3.0})
    sink.close()
    lines = path.read_text().splitlines()
    assert lines[1] == '{"step": 2, "train/lo'  # kept, as it was: readers skip it
    assert json.loads(lines[2]) == {"step": 1, "train/loss": 3.0}
    sink = JsonlSink(path)  # a file that ends whole gets nothing added
    sink.close()
    assert path.read_text().count("\n") == 3
