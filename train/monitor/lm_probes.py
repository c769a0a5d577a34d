"""The LM task's probe inputs, fixed for the whole run, and the calls that run each probe.

Probe rows come from the validation sources when the run has them (else the training sources),
through a loader of their own (no workers; the training stream is not touched), read once at the
first probe: ``attention`` uses the first ``rows`` rows of a batch; ``dependence`` scans up to 64
batches for ``probes`` rows where an image is followed by its caption, and as many where a
caption is followed by its image (the reverse direction), and takes this rank's share of them.
A direction whose rows the data does not have is not probed (its metrics are absent).

Under sequence parallelism the probes run whole rows on every rank, the layers' SP switched off
meanwhile (``LMTask.whole_rows``): the ranks of one SP group read the same rows (the loader goes
by data-parallel rank), so their reduced figures weigh every group alike.
"""

from __future__ import annotations

from contextlib import closing

import torch

from train.monitor import probes
from train.monitor.config import MonitorConfig
from train.names import MODEL_INPUTS

PROBE_KEYS = MODEL_INPUTS  # every field a probe row carries


class LMProbes:
    def __init__(self, cfg: MonitorConfig, run_cfg, task, dist, engine) -> None:
        self.cfg, self.run_cfg, self.task, self.dist, self.engine = cfg, run_cfg, task, dist, engine
        self._attn_batch: dict | None = None
        self._dep_batch: dict | None = None
        self._rev_batch: dict | None = None
        # Fault injection only (train/callbacks/faults.py): from this step on the dependence
        # probe's "matched" images are shuffled too; -1: never.
        self.shuffle_matched_from = -1

    def _rows(self, want_captions: int, finder=probes.caption_rows):
        loader = self.task.probe_stream()
        first, rows = None, []
        with closing(iter(loader)) as batches:
            for i, b in enumerate(batches):
                first = first or b
                if not want_captions or i >= 64:
                    break
                labels, blocks = finder(b, self.task.layout)
                for r in sorted({blk[0] for blk in blocks}):
                    rows.append({k: b[k][r : r + 1] for k in PROBE_KEYS})
                if len(rows) >= want_captions:
                    break
        if want_captions:
            rows = rows[:want_captions]
            return {k: torch.cat([r[k] for r in rows]) for k in rows[0]} if rows else None
        return first

    def run(self, name: str, step: int) -> dict[str, float]:
        module = self.engine.module
        was_training = module.training
        module.eval()
        try:
            with torch.no_grad(), self.task.whole_rows(module):
                return self._run(name, step, module)
        finally:
            module.train(was_training)

    def _run(self, name: str, step: int, module) -> dict[str, float]:
        dev = self.dist.device
        if name == "attention":
            if self._attn_batch is None:
                first = self._rows(0)
                self._attn_batch = {k: first[k][: self.cfg.attention.rows] for k in PROBE_KEYS}
            return probes.attention_stats(module, self._attn_batch, dev)
        if name == "dependence":
            if self._dep_batch is None:
                per_rank = max(1, self.cfg.dependence.probes // self.dist.data_size)
                self._dep_batch = self._rows(per_rank) or {}
                self._rev_batch = (
                    self._rows(per_rank, probes.image_after_caption_rows) or {}
                    if self.cfg.dependence.reverse
                    else {}
                )
            out: dict[str, float] = {}
            if self._dep_batch:
                shuffled = 0 <= self.shuffle_matched_from <= step
                out.update(
                    probes.dependence_gap(
                        module, self._dep_batch, self.task.layout, dev, fault_shuffled=shuffled
                    )
                )
            if self._rev_batch:
                out.update(
                    probes.reverse_dependence_gap(module, self._rev_batch, self.task.layout, dev)
                )
            return out
        c = self.cfg.code_use
        per_rank = max(1, c.probes // self.dist.data_size)
        seed = self.run_cfg.train.seed * 1000003 + step * 31 + self.dist.rank
        return probes.generated_code_use(
            module, self.task.layout, dev, images=per_rank, grid=c.grid, seed=seed
        )
