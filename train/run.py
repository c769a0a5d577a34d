"""A run: set up (process group, seeds, task, engine, resume), loop, finish; the step-end
callbacks (metrics, logging, evaluation, checkpoints) live here so the loop stays small."""

from __future__ import annotations

import json
import math
import os
import random
import time
from collections import Counter
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch

from train.checkpoint import Checkpointer, rng_state, set_rng_state
from train.config import RunConfig
from train.dist import DistInfo, all_reduce_sum, barrier, init_distributed
from train.engine import build_engine, global_grad_norm
from train.faults import Faults, fault_step
from train.logger import RunLogger, console_line
from train.loop import Rollback, train_loop
from train.mfu import peak_tflops
from train.monitor import AlarmLog, Monitor, strongest
from train.skip_step import SkipStepRule, UpdateGate
from train.tasks import build_task


class RunHalted(RuntimeError):
    """A monitor ordered the run to stop (its alarm is in alarms.jsonl and on the console)."""


def seed_everything(seed: int, rank: int, deterministic: bool) -> None:
    random.seed(seed + rank)
    np.random.seed((seed + rank) % 2**32)
    torch.manual_seed(seed + rank)
    if deterministic:
        torch.use_deterministic_algorithms(True)
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")


class Run:
    def __init__(self, cfg: RunConfig, resolved_yaml: str, dist: DistInfo | None = None) -> None:
        self.cfg = cfg
        self.resolved_yaml = resolved_yaml
        self.dist = dist or init_distributed()
        self.run_dir = Path(cfg.run_dir)
        seed_everything(cfg.train.seed, self.dist.rank, cfg.train.deterministic)
        self.task = build_task(cfg, self.dist)
        model = self.task.build_model()
        if (
            cfg.train.init_from
        ):  # a release's weights (earlyfuse-convert import); a resuming run ignores it
            from tools.release import init_from_release

            init_from_release(model, cfg, self.task, self.dist.is_main)
        self.ckpt = Checkpointer(self.run_dir, self.dist, cfg.train.keep_last)
        if cfg.train.resume and self._resuming_universal():
            # DeepSpeed reads this flag when the engine is built: the ZeRO optimizer then loads the
            # per-parameter files of checkpoints/step_N/universal/ for this world size.
            cfg.deepspeed.config = {**cfg.deepspeed.config, "checkpoint": {"load_universal": True}}
        self.engine, self.optimizer, self.scheduler = build_engine(model, cfg, self.dist.world_size)
        self.rule = SkipStepRule(cfg.optim.skip_step)
        self.gate = UpdateGate(self.rule, lambda: global_grad_norm(self.engine))
        self.optimizer.gate = self.gate
        self.stream = self.task.batches()
        self.monitor = Monitor(
            cfg.monitor,
            total_steps=cfg.train.steps,
            chance=self.task.chance_levels(),
            probes=self.task.probes(cfg.monitor, self.engine),
        )
        self.faults = Faults(cfg.train.seed)
        self.pending_skip = 0  # batches the loop discards before going on (after a rollback)
        self.rollbacks = 0
        self.start_step = self._resume() if cfg.train.resume else 0
        self.peak, self.peak_source = peak_tflops(cfg.train.peak_tflops, self.dist.device)
        self.flops_per_unit = self.task.flops_per_unit()
        self.log = RunLogger(
            self.run_dir,
            is_main=self.dist.is_main,
            total=cfg.train.steps,
            start=self.start_step,
            unit=self.task.unit,
            progress=cfg.train.progress,
            tensorboard=cfg.train.tensorboard,
        )
        self.alarms = AlarmLog(self.run_dir, is_main=self.dist.is_main, write_line=self.log.write)
        self._t_start = time.perf_counter()
        self._steps_timed = 0
        self._time_sum = 0.0
        self.last_eval: dict = {}
        self._interval: Counter = Counter()
        self._skipped_shown = 0.0

    # --- resume / save ---------------------------------------------------------------------------
    def _resume(self) -> int:
        self.ckpt.clean_partial()
        barrier()
        tag = self.ckpt.latest()
        if tag is None:
            return 0
        meta = self.ckpt.check_compatible(tag, self.cfg.deepspeed.zero_stage)
        if meta["world_size"] != self.dist.world_size:
            self._load_resharded(tag, meta)
        else:
            self._load(tag)
        return int(meta["step"])

    def _resuming_universal(self) -> bool:
        tag = self.ckpt.latest() if self.ckpt.dir.is_dir() else None
        return (
            tag is not None
            and self.ckpt.meta(tag)["world_size"] != self.dist.world_size
            and self.ckpt.universal(tag)
        )

    def _load_resharded(self, tag: str, meta: dict) -> None:
        """Resume a checkpoint of another world size (docs/checkpoints.md, universal checkpoints)."""
        client, own = self.ckpt.load_resharded(self.engine, tag, self.cfg.deepspeed.zero_stage)
        self.rule.load_state_dict(client["skip_step"])
        self.monitor.load_state_dict(client.get("monitor", {}))
        from data.loader.dataset import PackedLoader

        note = []
        movable = isinstance(self.stream, PackedLoader)
        if own is not None:
            set_rng_state(own["rng"])
        if movable:
            note.append(self._redistribute_stream(tag))
        elif own is not None:
            try:
                self.stream.load_state_dict(own["stream"])
            except ValueError:
                note.append(
                    "the data stream starts afresh (its state cannot be moved to another world size)"
                )
        if own is None:
            note.append(
                f"rank {self.dist.rank} had no predecessor: fresh RNG"
                + ("" if movable else " and data stream")
            )
        if self.dist.is_main:
            print(
                f"resuming {tag} of {meta['world_size']} rank(s) on {self.dist.world_size}"
                f"{' from its universal checkpoint' if self.cfg.deepspeed.zero_stage else ''}"
                + ("; " + "; ".join(note) if note else ""),
                flush=True,
            )

    def _redistribute_stream(self, tag: str) -> str:
        """Move the token loader's position onto this run's split exactly (docs/loader.md): every
        rank reads all old ranks' loader states and keeps its own share, with no communication."""
        from data.loader.redistribute import redistribute

        st = redistribute(self.ckpt.load_streams(tag), self.stream)
        self.stream.load_state_dict(st)
        return (
            f"the loader's state was redistributed from {st['redistributed']['from_consumers']} "
            f"to {self.stream.consumers} consumers"
        )

    def _load(self, tag: str) -> None:
        from data.loader.dataset import PackedLoader

        client, own = self.ckpt.load(self.engine, tag)
        self.rule.load_state_dict(client["skip_step"])
        self.monitor.load_state_dict(client.get("monitor", {}))
        st = own["stream"]
        if isinstance(self.stream, PackedLoader) and (st.get("workers"), st.get("micro_batch")) != (
            self.stream.workers,
            self.stream.micro_batch,
        ):
            # Same world size, another data.num_workers or micro batch: a split of its own.
            note = self._redistribute_stream(tag)
            if self.dist.is_main:
                print(f"resuming {tag}: {note}", flush=True)
        else:
            self.stream.load_state_dict(st)
        set_rng_state(own["rng"])

    def save(self, step: int) -> str:
        files = {"config.yaml": self.resolved_yaml, **self.task.extra_files()}
        meta = {
            "world_size": self.dist.world_size,
            "zero_stage": self.cfg.deepspeed.zero_stage,
            "task": self.cfg.task,
            "bf16": self.cfg.train.bf16,
        }
        client = {
            "skip_step": self.rule.state_dict(),
            "monitor": self.monitor.state_dict(),
            "step": step,
        }
        return self.ckpt.save(
            self.engine,
            step,
            client=client,
            own={"stream": self.stream.state_dict(), "rng": rng_state()},
            meta=meta,
            files=files,
            protect=self.monitor.protected_steps(self.ckpt.complete_steps()),
        )

    # --- the step-end callbacks ------------------------------------------------------------------
    def step_end(self, step: int, sums: dict, seconds: float, wait: float) -> None:
        t = self.cfg.train
        m = self.task.metrics(sums)
        m["train/loss"] = sums["loss_sum"] / sums["micro"]
        m["optim/grad_norm"] = self.gate.grad_norm
        m["optim/lr"] = self.scheduler.get_last_lr()[0]
        m["optim/skipped_steps"] = self.rule.skipped
        m["optim/skipped"] = float(bool(self.gate.decision))
        units_per_s = sums["units"] / max(seconds, 1e-9)
        self._time_sum += seconds
        self._steps_timed += 1
        mean_step = self._time_sum / self._steps_timed
        m.update(
            {
                "throughput/units_per_s": units_per_s,
                "throughput/step_s": seconds,
                "throughput/data_wait": wait / max(seconds, 1e-9),
                "throughput/peak_tflops": self.peak,
                "throughput/mfu": (
                    units_per_s * self.flops_per_unit / 1e12 / self.peak / self.dist.world_size
                    if self.peak
                    else math.nan
                ),
                "throughput/eta_s": mean_step * (t.steps - step),
            }
        )
        log_now = step % t.log_every == 0 or step == t.steps
        self._interval.update(sums)
        if t.eval_every and step % t.eval_every == 0 and step != t.steps:
            m.update(self.evaluate(step))
        if log_now and hasattr(self.stream, "skipped"):
            m["data/skipped"] = self.data_skipped()
        tm = time.perf_counter()
        alarms = self.monitor.check(step, m, self.rule.last)
        self.alarms.record(alarms)
        m["monitor/alarms"] = float(self.alarms.count)
        m["throughput/monitor_s"] = time.perf_counter() - tm  # detectors + any probe of this step
        self.log.log(step, m, console=False)
        if log_now:
            # The console line averages the whole log interval (sums and counts again), so a
            # modality that was absent from the last step still shows its recent loss.
            avg = {
                **m,
                **self.task.metrics(self._interval),
                "train/loss": self._interval["loss_sum"] / self._interval["micro"],
            }
            self.log.write(console_line(avg, step, t.steps, self.task.unit))
            self._interval = Counter()
            if m.get("data/skipped", 0) > self._skipped_shown:
                self._skipped_shown = m["data/skipped"]
                self.log.write(
                    f"data: {int(self._skipped_shown)} unreadable sample(s) skipped so far, over all ranks "
                    "(each named on stderr as '[loader] skipped SHARD sample KEY: why')"
                )
        self.log.advance()
        if t.ckpt_every and step % t.ckpt_every == 0 and step != t.steps:
            if self.monitor.healthy():
                self.save(step)
            elif self.dist.is_main:  # a checkpoint taken mid-trouble is no place to roll back to
                self.log.write(
                    f"checkpoint at step {step} skipped: steps were skipped as spikes in the last "
                    f"{self.cfg.monitor.divergence.window}"
                )
        if fault_step("EARLYFUSE_FAULT_KILL_AT_STEP") == step:
            os._exit(137)  # fault injection for the resume tests: dies like kill -9, no cleanup
        self.act(strongest(alarms))

    def data_skipped(self) -> float:
        """Unreadable samples the loaders skipped so far, summed over ranks."""
        n = torch.tensor([float(self.stream.skipped())], device=self.dist.device)
        return float(all_reduce_sum(n).item())

    # --- the monitors' actions -------------------------------------------------------------------
    def act(self, alarm) -> None:
        if alarm is None or alarm.action in ("log", "warn", "skip"):
            return  # logged and shown by AlarmLog; a skip already happened in the gate
        if alarm.action == "halt":
            raise RunHalted(
                f"halted by the monitor at step {alarm.step}: {alarm.signal}"
                f"{f' [{alarm.modality}]' if alarm.modality else ''}: {alarm.message}"
            )
        raise Rollback(alarm)

    def rollback(self, alarm, step: int) -> int:
        """Back to the newest checkpoint at least ``rollback.margin`` steps before the trouble began,
        skipping the data seen since plus a window (PaLM's recipe); returns the step to go on from."""
        rb = self.cfg.monitor.rollback
        self.rollbacks += 1
        self.faults.rolled_back = True
        since = alarm.since if alarm.since is not None else alarm.step
        good = [s for s in self.ckpt.complete_steps() if s <= since - rb.margin]
        if self.rollbacks > rb.max_rollbacks or not good:
            why = (
                f"{rb.max_rollbacks} rollbacks already"
                if good
                else f"no checkpoint at or before step {since - rb.margin} to roll back to"
            )
            raise RunHalted(f"halted at step {step}: {alarm.signal} ({alarm.message}) and {why}")
        target = good[-1]
        self.ckpt.rewind(target)
        self._load(self.ckpt.latest())
        if rb.cap_lr:  # a divergence the lr caused must not simply recur (train/schedule.py)
            self.scheduler.cap_here(rb.lr_scale)
        self.monitor.divergence.reset()
        seen = step - target
        self.pending_skip = (
            rb.skip_window or seen
        ) * self.cfg.train.grad_accum + seen * self.cfg.train.grad_accum
        self._interval = Counter()
        if self.dist.is_main:
            self.log.write(
                f"ROLLBACK at step {step} ({alarm.signal}): back to the checkpoint of step {target}, "
                f"skipping {self.pending_skip} batches ({seen} already seen + the window); "
                f"rollback {self.rollbacks} of at most {rb.max_rollbacks}"
            )
        self.log.rewind(target)
        return target

    def scale_lr(self, factor: float) -> None:
        """Fault injection only: scale this update's lr (the scheduler sets it again after the step)."""
        if factor != 1.0:
            for g in self.optimizer.param_groups:
                g["lr"] *= factor

    def evaluate(self, step: int) -> dict:
        self.engine.eval()
        with torch.no_grad():
            out = self.task.evaluate(self.engine, step)
        self.engine.train()
        self.last_eval = out
        if self.dist.is_main and out:
            self.log.write(f"eval @ {step}: " + ", ".join(f"{k} {v:.4g}" for k, v in out.items()))
        return out

    # --- the whole run ---------------------------------------------------------------------------
    def __call__(self) -> dict:
        if self.dist.is_main:
            self.run_dir.mkdir(parents=True, exist_ok=True)
            (self.run_dir / "config.yaml").write_text(self.resolved_yaml)
            self.log.write(
                f"run {self.cfg.name} ({self.cfg.task}) in {self.run_dir}: {self.dist.world_size} rank(s) on "
                f"{self.dist.device.type}, ZeRO {self.cfg.deepspeed.zero_stage}, "
                f"{'bf16' if self.cfg.train.bf16 else 'fp32'}, steps {self.start_step}->{self.cfg.train.steps}, "
                f"peak {self.peak:.2f} TFLOP/s ({self.peak_source})"
            )
        try:
            if self.start_step < self.cfg.train.steps:
                train_loop(self)
                final = self.evaluate(self.cfg.train.steps)
                self.save(self.cfg.train.steps)
            else:
                final = self.evaluate(self.cfg.train.steps)
            final.update(self.task.finish(self.engine, self.run_dir))
            if hasattr(self.stream, "skipped"):
                final["data/skipped"] = self.data_skipped()
            if self.dist.is_main:
                (self.run_dir / "final.json").write_text(
                    json.dumps(final, indent=1, sort_keys=True) + "\n"
                )
        finally:
            self.log.close()
        return final


def config_dict(cfg: RunConfig) -> dict:
    return asdict(cfg)
