"""The training step reads values back from the device once, at the step's end: the sums of the
step (losses, counts, monitors' sums, flags) in one vector (train/step_sums.py).

On a GPU every read-back of a device tensor's value (``item``, ``tolist``, ``bool``, ``float``,
``int``) makes the host wait for the device, so the CPU cannot queue the next work ahead. A CPU
run has nothing to wait for, so the calls are counted instead (tests/train_counting_syncs.py
wraps the real methods with a counter around the real trainer's steps)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ENTRY = Path(__file__).parents[1] / "train_counting_syncs.py"
SOURCES = {"scenes": 0.3, "clips": 0.3, "text": 0.3, "code": 0.1}


def ours(calls: dict[str, int]) -> dict[str, int]:
    """The calls made by the project's model and trainer (not by a library's internals)."""
    return {where: n for where, n in calls.items() if where.startswith(("model/", "train/"))}


def test_a_step_between_log_steps_reads_the_device_once(tiny_tokens, tmp_path):
    srcs = ",".join(
        f"{{name: {s}, shards: [{tiny_tokens / s}], weight: {w}}}" for s, w in SOURCES.items()
    )
    out = tmp_path / "syncs.json"
    cmd = [sys.executable, str(ENTRY), str(out), "experiment=debug", f"data.sources=[{srcs}]"]
    cmd += [f"run_dir={tmp_path / 'run'}", "train.steps=6", "train.log_every=3"]
    cmd += ["train.micro_batch=2", "train.grad_accum=2", "train.progress=false"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stderr[-4000:]
    steps = {int(step): ours(calls) for step, calls in json.loads(out.read_text()).items()}
    assert sorted(steps) == [1, 2, 3, 4, 5, 6]
    # Two read-backs a step, both for the skip-step gate, which decides before the update: the
    # step's sums over its 2 micro-batches and ranks (the loss among them), and the gradient norm
    # (this fp32 ZeRO-0 engine's; under bf16 or ZeRO DeepSpeed's optimizer reads its own).
    expected = {
        line_of("train/step_sums.py", ".tolist()"): 1,
        line_of("train/engine.py", "return float(torch.linalg.vector_norm(norms))"): 1,
    }
    for step in (1, 2, 4, 5):  # not log steps (log_every 3), no evaluation, no checkpoint
        assert steps[step] == expected, (step, steps[step])
    # A log step reads a little more (the data-health count); never per micro-batch or per value.
    assert sum(steps[3].values()) < 5, steps[3]


def line_of(path: str, text: str) -> str:
    """``path:line`` of the first line of ``path`` (in the project) that holds ``text``."""
    source = (Path(__file__).parents[2] / path).read_text().splitlines()
    return f"{path}:{next(i for i, line in enumerate(source, 1) if text in line)}"
