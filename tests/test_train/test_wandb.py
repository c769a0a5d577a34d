"""Weights & Biases as an optional sink (``train.wandb=true``), offline: the same metric names as
TensorBoard and metrics.jsonl at every step, and a resumed run continuing the same W&B run.
Skipped where the optional ``wandb`` extra is not installed."""

from __future__ import annotations

import json
import math
import struct

import pytest
from trainrun import metrics, train

wandb = pytest.importorskip("wandb")

SOURCES = {"scenes": 0.3, "clips": 0.3, "text": 0.3, "code": 0.1}


def test_wandb_offline_logs_what_tensorboard_logs(tiny_tokens, tmp_path):
    srcs = ",".join(
        f"{{name: {s}, shards: [{tiny_tokens / s}], weight: {w}}}" for s, w in SOURCES.items()
    )
    run = tmp_path / "run"
    args = ["experiment=debug", f"data.sources=[{srcs}]", f"run_dir={run}"]
    args += ["train.log_every=1", "train.micro_batch=2", "train.wandb=true"]
    env = {"WANDB_MODE": "offline", "WANDB_SILENT": "true", "WANDB_DIR": str(tmp_path)}
    train([*args, "train.steps=3"], env=env)
    train([*args, "train.steps=4", "train.allow_config_change=true"], env=env)  # resumed
    runs = sorted((run / "wandb").glob("offline-run-*"))
    assert len(runs) == 2 and len({r.name.rsplit("-", 1)[1] for r in runs}) == 1  # one run id
    logged = {step: items for r in runs for step, items in history(r).items()}
    assert sorted(logged) == [1, 2, 3, 4]
    for step, record in metrics(run).items():
        numbers = {
            key: value
            for key, value in record.items()
            if key != "step" and isinstance(value, (int, float)) and math.isfinite(value)
        }
        assert set(numbers) == {k for k in logged[step] if not k.startswith("_")}, step
        assert logged[step]["train/loss"] == pytest.approx(numbers["train/loss"])


def history(run_folder) -> dict[int, dict[str, float]]:
    """{step: {name: value}} of the history records in an offline run's ``run-ID.wandb`` (a
    LevelDB-style log of W&B's protobuf records: 32 KiB blocks of chunks with 7-byte headers,
    after a 7-byte file header)."""
    from wandb.proto import wandb_internal_pb2

    raw = next(run_folder.glob("run-*.wandb")).read_bytes()
    block, pos, chunk, out = 32768, 7, b"", {}
    while pos + 7 <= len(raw):
        if block - pos % block < 7:  # a block's tail too short for a header is padding
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", raw[pos : pos + 7])
        chunk, pos = chunk + raw[pos + 7 : pos + 7 + length], pos + 7 + length
        if kind in (1, 4):  # a full record, or the last chunk of one
            record = wandb_internal_pb2.Record()
            record.ParseFromString(chunk)
            chunk = b""
            if record.WhichOneof("record_type") == "history":
                items = {
                    item.key or "/".join(item.nested_key): json.loads(item.value_json)
                    for item in record.history.item
                }
                out[int(items["_step"])] = items
        elif kind == 0 and length == 0:  # zero fill to the block's end
            pos += (block - pos % block) % block
    return out
