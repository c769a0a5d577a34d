"""The LM task's probe inputs, fixed for the whole run, and the calls that run each probe.

Probe rows come from the validation sources when the run has them (else the training sources),
through a loader of their own (no workers; the training stream is not touched), read once at the
first probe: ``attention`` uses the first ``rows`` rows of a batch; ``dependence`` scans up to 64
batches for ``probes`` rows where an image is followed by its caption, and as many where a
caption is followed by its image (the reverse direction), and takes this rank's share of them.
A direction whose rows the data does not have is not probed (its metrics are absent).
``code_use`` reads the codes of up to 8 x ``probes`` images of the same rows once: the yardstick
its drawings are judged against (``monitor/ref_*``; absent when the rows hold no image), and the
shape it draws at (their most common one; ``grid`` x ``grid`` without images).

Under sequence parallelism the probes run whole rows on every rank, the layers' SP switched off
meanwhile (``LMTask.whole_rows``): the ranks of one SP group read the same rows (the loader goes
by data-parallel rank), so their reduced figures weigh every group alike.
"""

from __future__ import annotations

from contextlib import closing

import torch

from train.dist import all_reduce_sum
from train.monitor import probes
from train.monitor.config import MonitorConfig
from train.names import MODEL_INPUTS

PROBE_KEYS = MODEL_INPUTS  # every field a probe row carries
REF_GROUPS = 8  # groups of real images the generated codes' yardstick averages over


class LMProbes:
    def __init__(self, cfg: MonitorConfig, run_cfg, task, dist, engine) -> None:
        self.cfg, self.run_cfg, self.task, self.dist, self.engine = cfg, run_cfg, task, dist, engine
        self._attn_batch: dict | None = None
        self._dep_batch: dict | None = None
        self._rev_batch: dict | None = None
        self._ref_codes: dict[str, float] | None = None  # the data's code use, read once
        self._draw_size = (cfg.code_use.grid, cfg.code_use.grid)  # the images' shape, once read
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
        """One probe's figures. Eager in a compiled model: each probe's rows have a shape of
        their own, and each shape (twice: rows of one document take another path) would be one
        more of the graphs dynamo compiles per block before its limit (8) ends the run."""
        module = self.engine.module
        was_training = module.training
        module.eval()
        try:
            with (
                torch.no_grad(),
                self.task.whole_rows(module),
                torch.compiler.set_stance("force_eager"),
            ):
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
        if self._ref_codes is None:
            found = self._images(per_rank * REF_GROUPS)
            # Drawn at the run's most common image shape, counted over every rank so that all
            # draw the same number of tokens (ZeRO-3 gathers weights in every forward).
            side = self.task.layout.max_grid
            shapes = torch.zeros(side * side, dtype=torch.float64)
            for _, (rows, cols) in found:
                shapes[(rows - 1) * side + cols - 1] += 1
            shapes = all_reduce_sum(shapes)
            common = int(shapes.argmax())
            self._draw_size = (
                (common // side + 1, common % side + 1) if shapes.sum() else (c.grid, c.grid)
            )
            self._ref_codes = probes.reference_code_use(
                [codes for codes, _ in found],
                self.task.layout,
                per_group=per_rank,
                want=self._draw_size[0] * self._draw_size[1],
                groups=REF_GROUPS,
            )
        # one draw per data-parallel rank: the ranks of a sequence-parallel group share it
        seed = self.run_cfg.train.seed * 1000003 + step * 31 + self.dist.data_rank
        drawn = probes.generated_code_use(
            module,
            self.task.layout,
            dev,
            images=per_rank,
            size=self._draw_size,
            seed=seed,
            counted=self.dist.sp_rank == 0,
        )
        return {**drawn, **self._ref_codes} if drawn else drawn

    def _images(self, want: int) -> list[tuple[torch.Tensor, tuple[int, int]]]:
        """The codes and shapes of up to ``want`` images of the probe rows (at most 64 batches
        scanned)."""
        found: list[tuple[torch.Tensor, tuple[int, int]]] = []
        with closing(iter(self.task.probe_stream())) as batches:
            for i, batch in enumerate(batches):
                found += probes.image_codes(batch, self.task.layout)
                if len(found) >= want or i >= 63:
                    break
        return found[:want]
