"""Where metrics go: one fixed-field console line per log step, JSONL, TensorBoard, a progress bar.

Only rank 0 writes. Metric names are namespaced (OLMo-core style): ``train/…``, ``loss/<m>``,
``optim/…``, ``throughput/…``, ``eval/…``, ``monitor/…``. The console line always has the
same fields in the same order, so runs can be compared by eye and grepped:

  step 120/1000 | loss 3.412 | text 3.10 code 2.95 image 5.21 video 5.40 | gnorm 1.23 | lr 3.00e-04 |
  12.3k tok/s | MFU 1.2% of 0.50 TFLOP/s | data 2.1% | ETA 3m12s
"""

from __future__ import annotations

import json
import math
from pathlib import Path

from tqdm import tqdm

from data.vocab import MODALITY_NAMES


def fmt_duration(s: float) -> str:
    if not math.isfinite(s):
        return "?"
    s = int(s)
    if s >= 3600:
        return f"{s // 3600}h{s % 3600 // 60:02d}m"
    return f"{s // 60}m{s % 60:02d}s" if s >= 60 else f"{s}s"


def fmt_rate(x: float) -> str:
    return f"{x / 1e6:.2f}M" if x >= 1e6 else f"{x / 1e3:.1f}k" if x >= 1e3 else f"{x:.0f}"


def console_line(m: dict, step: int, total: int, unit: str) -> str:
    def g(k, f="{:.3f}"):
        v = m.get(k)
        return f.format(v) if isinstance(v, (int, float)) and math.isfinite(v) else "-"

    per_mod = " ".join(
        f"{n} {g(f'loss/{n}', '{:.2f}')}" for n in MODALITY_NAMES if n != "structure"
    )
    return (
        f"step {step}/{total} | loss {g('train/loss')} | {per_mod} | gnorm {g('optim/grad_norm', '{:.2f}')} | "
        f"lr {g('optim/lr', '{:.2e}')} | {fmt_rate(m.get('throughput/units_per_s', 0.0))} {unit}/s | "
        f"MFU {g('throughput/mfu', '{:.1%}')} of {g('throughput/peak_tflops', '{:.2f}')} TFLOP/s | "
        f"data {g('throughput/data_wait', '{:.1%}')} | ETA {fmt_duration(m.get('throughput/eta_s', math.nan))}"
        + (
            f" | dropped {m['data/dropped_blocks']:.0f} blocks"
            if m.get("data/dropped_blocks")
            else ""
        )
    )


class RunLogger:
    def __init__(
        self,
        run_dir: str | Path,
        *,
        is_main: bool,
        total: int,
        start: int,
        unit: str,
        progress: bool,
        tensorboard: bool,
    ) -> None:
        self.is_main = is_main
        self.total, self.unit = total, unit
        self.jsonl = None
        self.tb = None
        self.bar = None
        if not is_main:
            return
        run_dir = Path(run_dir)
        run_dir.mkdir(parents=True, exist_ok=True)
        self.jsonl = open(run_dir / "metrics.jsonl", "a", encoding="utf-8")
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter

            self.tb = SummaryWriter(str(run_dir / "tb"))
        if progress:
            self.bar = tqdm(
                total=total, initial=start, unit="step", dynamic_ncols=True, leave=False
            )

    def write(self, line: str) -> None:
        if not self.is_main:
            return
        if self.bar:
            self.bar.write(line)
        else:
            print(line, flush=True)

    def log(self, step: int, metrics: dict, *, console: bool = False) -> None:
        if not self.is_main:
            return
        record = {
            "step": step,
            **{k: v for k, v in metrics.items() if isinstance(v, (int, float, str, bool))},
        }
        self.jsonl.write(json.dumps(record, allow_nan=True) + "\n")
        self.jsonl.flush()
        if self.tb:
            for k, v in record.items():
                if (
                    isinstance(v, (int, float))
                    and not isinstance(v, bool)
                    and k != "step"
                    and math.isfinite(v)
                ):
                    self.tb.add_scalar(k, v, step)
        if console:
            self.write(console_line(metrics, step, self.total, self.unit))

    def advance(self, n: int = 1) -> None:
        if self.bar:
            self.bar.update(n)

    def rewind(self, step: int) -> None:
        """After a rollback the bar goes back to the checkpoint's step."""
        if self.bar:
            self.bar.n = step
            self.bar.refresh()

    def close(self) -> None:
        if self.bar:
            self.bar.close()
        if self.jsonl:
            self.jsonl.close()
        if self.tb:
            self.tb.close()
