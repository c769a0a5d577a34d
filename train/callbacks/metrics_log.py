"""Where each step's metrics go: ``metrics.jsonl``, TensorBoard and (``train.wandb``) Weights &
Biases every step, one fixed-field console line (through Python ``logging``) every
``train.log_every`` steps.

Metric names are namespaced (OLMo-core style): ``train/…``, ``loss/<m>``, ``optim/…``,
``throughput/…``, ``eval/…``, ``val/…``, ``monitor/…``, ``data/…``. The console line always has
the same fields in the same order, so runs can be compared by eye and grepped:

  step 120/1000 | loss 3.412 | text 3.10 (u 5.62) code 2.95 (u 4.80) image 5.21 (u 6.40) video 5.40 (u 6.51) |
  gnorm 1.23 | lr 3.00e-04 | 12.3k tok/s | MFU 1.2% of 0.50 TFLOP/s | data 2.1% | ETA 3m12s

Design choices:
- The console line averages the whole log interval from its sums and counts (not the last step),
  so a modality that was absent from the last step still shows its recent loss.
- Only rank 0 writes; the sinks are small objects with ``write(step, metrics)`` and ``close()``,
  so another one (a remote tracker) is one class and one line in ``train/build.py``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import math
from collections import Counter
from pathlib import Path
from typing import TYPE_CHECKING, Protocol

from data.vocab import MODALITY_NAMES
from train.callbacks.base import Callback, StepRecord

if TYPE_CHECKING:
    from train.trainer import Trainer

log = logging.getLogger(__name__)


def fmt_duration(seconds: float) -> str:
    if not math.isfinite(seconds):
        return "?"
    whole = int(seconds)
    if whole >= 3600:
        return f"{whole // 3600}h{whole % 3600 // 60:02d}m"
    return f"{whole // 60}m{whole % 60:02d}s" if whole >= 60 else f"{whole}s"


def fmt_rate(rate: float) -> str:
    if rate >= 1e6:
        return f"{rate / 1e6:.2f}M"
    return f"{rate / 1e3:.1f}k" if rate >= 1e3 else f"{rate:.0f}"


def console_line(metrics: dict, step: int, total: int, unit: str) -> str:
    def show(key: str, fmt: str = "{:.3f}") -> str:
        value = metrics.get(key)
        finite = isinstance(value, (int, float)) and math.isfinite(value)
        return fmt.format(value) if finite else "-"

    # "(u X)": the modality's unigram baseline on the same tokens (data/unigram.py), when known.
    per_modality = " ".join(
        f"{name} {show(f'loss/{name}', '{:.2f}')}"
        + (f" (u {show(f'unigram/{name}', '{:.2f}')})" if f"unigram/{name}" in metrics else "")
        for name in MODALITY_NAMES
        if name != "structure"
    )
    rate = fmt_rate(metrics.get("throughput/units_per_s", 0.0))
    return (
        f"step {step}/{total} | loss {show('train/loss')} | {per_modality} | "
        f"gnorm {show('optim/grad_norm', '{:.2f}')} | lr {show('optim/lr', '{:.2e}')} | "
        f"{rate} {unit}/s | MFU {show('throughput/mfu', '{:.1%}')} of "
        f"{show('throughput/peak_tflops', '{:.2f}')} TFLOP/s | "
        f"data {show('throughput/data_wait', '{:.1%}')} | "
        f"ETA {fmt_duration(metrics.get('throughput/eta_s', math.nan))}"
        + (
            f" | dropped {metrics['data/dropped_blocks']:.0f} blocks"
            if metrics.get("data/dropped_blocks")
            else ""
        )
    )


class MetricSink(Protocol):
    def write(self, step: int, metrics: dict) -> None: ...
    def close(self) -> None: ...


class JsonlSink:
    """``RUN_DIR/metrics.jsonl``: one JSON object per step (a resumed or rolled-back run appends;
    earlyfuse-report keeps the pass the run goes on with: docs/report.md, "What it reads")."""

    def __init__(self, path: Path) -> None:
        path.parent.mkdir(parents=True, exist_ok=True)
        self.file = open(path, "a+b")  # noqa: SIM115 - closed by close()
        end = self.file.seek(0, 2)
        if end:
            self.file.seek(end - 1)
            if self.file.read(1) != b"\n":
                # A crash (a full disk) cut the last record short: end its line, or the next
                # record would be appended to it and both lost (readers skip the torn line)
                self.file.write(b"\n")

    def write(self, step: int, metrics: dict) -> None:
        record = {"step": step, **metrics}
        try:
            self.file.write((json.dumps(record, allow_nan=True) + "\n").encode())
            self.file.flush()
        except OSError as e:  # a full or read-only disk: said with the file's name
            raise OSError(e.errno, e.strerror, self.file.name) from None

    def close(self) -> None:
        try:
            self.file.close()
        except OSError:
            pass  # what could not be flushed was said by the write that failed


class TensorBoardSink:
    """``RUN_DIR/tb``: every finite number as a scalar."""

    def __init__(self, folder: Path) -> None:
        from torch.utils.tensorboard import SummaryWriter

        self.writer = SummaryWriter(str(folder))
        self.folder = folder

    def write(self, step: int, metrics: dict) -> None:
        try:
            for key, value in metrics.items():
                number = isinstance(value, (int, float)) and not isinstance(value, bool)
                if number and math.isfinite(value):
                    self.writer.add_scalar(key, value, step)
        except OSError as e:  # its writer thread's failure (a full disk), raised here
            raise OSError(e.errno, e.strerror, str(self.folder)) from None

    def close(self) -> None:
        try:
            self.writer.close()
        except OSError:
            pass  # said by the write that failed, or by the step that stopped the run


class WandbSink:
    """Weights & Biases (``train.wandb``): every finite number under the same name as in
    TensorBoard, at its step; the resolved config as the run's config; its files in
    ``RUN_DIR/wandb``. The W&B run's id is made from the run folder, so a resumed run continues
    the same W&B run. Where it logs (account, offline) is W&B's own environment: ``WANDB_MODE``
    (``offline`` writes locally, ``wandb sync`` uploads later), ``WANDB_ENTITY``, ... A step
    logged again after a resume or a rollback is older than the newest step W&B has, and W&B
    keeps the first value it was given (metrics.jsonl keeps both)."""

    def __init__(self, run_dir: Path, *, project: str, name: str, config: dict) -> None:
        try:
            import wandb
        except ImportError as e:
            raise ImportError(
                "train.wandb=true needs the wandb package: pip install 'earlyfuse[wandb]'"
            ) from e
        folder = run_dir.resolve()
        folder.mkdir(parents=True, exist_ok=True)
        run_id = hashlib.sha256(str(folder).encode()).hexdigest()[:16]
        self.run = wandb.init(
            project=project,
            name=name,
            id=run_id,
            resume="allow",
            dir=str(folder),
            config=config,
        )

    def write(self, step: int, metrics: dict) -> None:
        numbers = {
            key: value
            for key, value in metrics.items()
            if isinstance(value, (int, float)) and not isinstance(value, bool)
            if math.isfinite(value)
        }
        self.run.log(numbers, step=step)

    def close(self) -> None:
        self.run.finish()


class MetricsLog(Callback):
    """Writes every step's metrics to the sinks and the console line every ``log_every`` steps."""

    def __init__(
        self, sinks: list[MetricSink], *, log_every: int, unit: str, task_metrics, is_main: bool
    ) -> None:
        self.sinks = sinks if is_main else []
        self.log_every, self.unit, self.is_main = log_every, unit, is_main
        self.task_metrics = task_metrics  # Task.metrics: sums and counts -> metrics
        self.interval: Counter = Counter()

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> None:
        metrics = {
            k: v for k, v in record.metrics.items() if isinstance(v, (int, float, str, bool))
        }
        for sink in self.sinks:
            sink.write(step, metrics)
        self.interval.update(record.sums)
        if step % self.log_every == 0 or step == trainer.total_steps:
            if self.is_main:
                averaged = {
                    **record.metrics,
                    **self.task_metrics(self.interval),
                    "train/loss": self.interval["loss_sum"] / self.interval["micro"],
                }
                log.info(console_line(averaged, step, trainer.total_steps, self.unit))
            self.interval = Counter()

    def on_rollback(self, trainer: Trainer, step: int) -> None:
        self.interval = Counter()

    def post_train(self, trainer: Trainer, step: int, final: dict) -> None:
        # The final evaluation (final.json, run after the last step's record) at the last step in
        # TensorBoard and W&B too: their held-out curves end at the final value, and a run that
        # evaluates only at the end (train.eval_every=0) has one there at all. metrics.jsonl
        # keeps one record a step; the report reads final.json.
        evaluated = {k: v for k, v in final.items() if k.startswith(("val/", "eval/"))}
        for sink in self.sinks:
            if evaluated and not isinstance(sink, JsonlSink):
                sink.write(step, evaluated)

    def close(self, trainer: Trainer) -> None:
        for sink in self.sinks:
            sink.close()
