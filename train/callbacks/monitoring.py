"""The monitors (``train/monitor/``) as callbacks: ``Monitoring`` runs the detectors and probes on
every step's metrics and records their alarms; ``Rollback`` turns a rollback alarm into the
loop's decision to go back to a good checkpoint (PaLM's recipe).

Design choices:
- The monitor's state (detector windows, latches, the count of alarms) is checkpointed under
  ``monitor``.
- A halt is a ``Decision``: the loop stops and the entry point exits with code 3.
- ``Rollback`` picks the newest complete checkpoint at least ``monitor.rollback.margin`` steps
  before the trouble began, and skips the data seen since plus a window. It runs after the
  checkpoint callback, so that a checkpoint of this very step (taken while the run still looked
  healthy) is among the candidates, as it always was. Its count of rollbacks is checkpointed
  and only ever goes up: loading the checkpoint a rollback returns to must not reset it.
- A rollback no checkpoint holds yet is kept in ``checkpoints/rollback.json`` (its step, signal,
  count, the data it skips and the collapse levels reached): a run stopped before its next
  checkpoint carries it out again when it starts, rather than replaying the trouble.
- After a rollback the lr is capped at ``rollback.lr_scale`` x its value at the checkpoint
  returned to (``rollback.cap_lr``; ``train/schedule.py``): a divergence the lr caused does not
  simply recur.
"""

from __future__ import annotations

import dataclasses
import logging
import time
from typing import TYPE_CHECKING

from train.callbacks.base import HALT, ROLLBACK, Callback, Decision, StepRecord
from train.dist import broadcast_from_main
from train.monitor import AlarmLog, Monitor
from train.monitor import strongest as strongest_alarm
from train.monitor.alarms import Alarm
from train.monitor.config import DETECTORS, RollbackConfig
from train.skip_step import SkipStepRule

if TYPE_CHECKING:
    from train.trainer import Trainer

log = logging.getLogger(__name__)


class Monitoring(Callback):
    state_key = "monitor"

    def __init__(self, monitor: Monitor, alarm_log: AlarmLog, rule: SkipStepRule) -> None:
        self.monitor, self.alarm_log, self.rule = monitor, alarm_log, rule
        self.alarms: list[Alarm] = []  # this step's
        # the collapse detector's best levels at this step's rollback alarm (loading the
        # checkpoint replaces them with older ones)
        self.reached: dict[str, dict[str, float]] = {}

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> Decision | None:
        start = time.perf_counter()
        self.monitor.total = trainer.total_steps  # a resume may count the data's steps again
        self.alarms = self.monitor.check(step, record.metrics, self.rule.last)
        if any(alarm.action == "rollback" for alarm in self.alarms):
            self.reached = self.monitor.reached()
        if any(alarm.action == "halt" for alarm in self.alarms):
            # no evaluation will judge what waits for one: said now (a rollback restores the
            # alarms that waited at its checkpoint, to be judged as before)
            self.alarms += self.monitor.flush(step, "the run stops before the next evaluation")
        self.alarm_log.record(self.alarms)
        record.metrics["monitor/alarms"] = float(self.alarm_log.count)
        # The detectors and any probe of this step.
        record.metrics["throughput/monitor_s"] = time.perf_counter() - start
        alarm = strongest_alarm(self.alarms)
        if alarm is None or alarm.action != "halt":
            return None
        where = f" [{alarm.modality}]" if alarm.modality else ""
        return Decision(
            action=HALT,
            reason=f"halted by the monitor at step {alarm.step}: {alarm.signal}{where}: "
            f"{alarm.message}",
        )

    def pre_train(self, trainer: Trainer, step: int) -> None:
        if step == 0:  # no checkpoint: a killed first attempt's alarms are raised again
            self.alarm_log.resume_at(0)

    def post_train(self, trainer: Trainer, step: int, final: dict) -> None:
        # the evaluation at the end (in ``final`` by now) judges the alarms that wait for one
        self.alarm_log.record(self.monitor.finish(step, final))

    def healthy(self) -> bool:
        """No step skipped in the divergence window: a checkpoint now is one to return to."""
        return self.monitor.healthy()

    def on_rollback(self, trainer: Trainer, step: int) -> None:
        self.monitor.divergence.reset()
        # What the model had learned before the rollback stays learned: a collapse that recurs
        # on the same broken data fires again (and the rollbacks end in a halt) instead of
        # waiting, unarmed, for a level the model never reaches on noise.
        self.monitor.keep_reached(self.reached)

    def on_mix_change(self, trainer: Trainer, step: int) -> None:
        self.monitor.restart_data_references()
        if trainer.dist.is_main:
            log.info(
                f"the training mix differs from step {step}'s (data.sources): the monitors' loss "
                "levels and trends, token shares and code-use references start again from here"
            )

    def state_dict(self) -> dict:
        return {**self.monitor.state_dict(), "alarms": self.alarm_log.count}

    def load_state_dict(self, state: dict) -> None:
        self.monitor.load_state_dict(state)
        # ``monitor/alarms`` counts every alarm of the run: a resume continues the checkpoint's
        # count (alarms.jsonl cut to it, AlarmLog.resume_at), a rollback keeps its own, past any
        # alarm (the abandoned steps' alarms stay in alarms.jsonl).
        if self.alarm_log.count == 0 and "alarms" in state:  # a resume: nothing raised yet
            self.alarm_log.resume_at(int(state["alarms"]))
        self.alarm_log.count = max(self.alarm_log.count, int(state.get("alarms", 0)))


class Rollback(Callback):
    """Turns a ``rollback`` alarm into a Decision (or a halt past ``max_rollbacks``), caps the lr
    after it, and carries out again a rollback that no checkpoint held when the run stopped
    (``checkpoints/rollback.json``: the checkpoint it went back to holds neither the data it
    skips nor the cap nor the count)."""

    state_key = "rollback"

    def __init__(
        self, monitoring: Monitoring, cfg: RollbackConfig, *, grad_accum: int, is_main: bool
    ) -> None:
        self.monitoring, self.cfg, self.grad_accum, self.is_main = (
            monitoring,
            cfg,
            grad_accum,
            is_main,
        )
        self.count = 0

    def pre_train(self, trainer: Trainer, step: int) -> None:
        # rank 0's reading for all: ranks that saw different files would part ways
        record = broadcast_from_main(trainer.checkpointer.pending_rollback())
        if record is not None and record["to_step"] == step:
            self.count = max(self.count, int(record["count"]))
            trainer.skip_batches = int(record["skip_batches"])
            self.monitoring.reached = record.get("reached") or {}
            if self.is_main:
                log.warning(
                    f"the rollback at step {record['step']} ({record['signal']}) back to step "
                    f"{step} was not yet in a checkpoint when the run stopped: carried out again, "
                    f"skipping the data of {record['skip_batches']} batch(es) from here; "
                    f"rollback {self.count} of at most {self.cfg.max_rollbacks}"
                )
            trainer.callbacks.on_rollback(trainer, step)
        cfg = self.monitoring.monitor.cfg
        rolling = [
            name
            for name in DETECTORS
            if getattr(cfg, name).enabled and getattr(cfg, name).action == "rollback"
        ]
        if cfg.enabled and rolling and not trainer.train.ckpt_every and self.is_main:
            log.warning(
                f"monitor.{rolling[0]}.action=rollback, but train.ckpt_every=0 writes a checkpoint "
                "only at the end: a rollback would find none to go back to and halt the run "
                "(exit code 3); set train.ckpt_every to keep a way back"
            )

    def post_step(self, trainer: Trainer, step: int, record: StepRecord) -> Decision | None:
        alarm = strongest_alarm(self.monitoring.alarms)
        if alarm is None or alarm.action != "rollback":
            return None
        self.count += 1
        since = alarm.since if alarm.since is not None else alarm.step
        before = [s for s in trainer.checkpointer.complete_steps() if s <= since - self.cfg.margin]
        # a run resumed on another world size loads its older checkpoints only when converted
        good = [s for s in before if trainer.checkpointer.loadable(s, trainer.zero_stage)]
        if self.count > self.cfg.max_rollbacks or not good:
            why = (
                f"{self.cfg.max_rollbacks} rollbacks already (the run's count, kept across "
                "resumes: raise monitor.rollback.max_rollbacks to go on)"
                if good
                else f"no checkpoint from at least {self.cfg.margin} steps before the trouble "
                f"began (step {since}) to roll back to"
                + (
                    f" on this world size ({len(before)} of another, not converted: "
                    "earlyfuse-convert universal)"
                    if before
                    else ""
                )
            )
            # The alarm was recorded as a rollback: record that it ended the run instead
            self.monitoring.alarm_log.record(  # the console says it in the run's last line
                [dataclasses.replace(alarm, action="halt", message=f"{why}: {alarm.message}")],
                echo=False,
            )
            return Decision(
                action=HALT,
                reason=f"halted at step {step}: {alarm.signal} ({alarm.message}) and {why}",
            )
        target = good[-1]
        seen = step - target
        window = self.cfg.skip_window or seen
        skip = (window + seen) * self.grad_accum
        unit = "batches" if self.grad_accum == 1 else f"micro-batches, {self.grad_accum} a step"
        if self.is_main:
            log.warning(
                f"ROLLBACK at step {step} ({alarm.signal}): back to the checkpoint of step "
                f"{target}, skipping the data of {seen + window} steps ({seen} already seen + a "
                f"window of {window}: {skip} {unit}); rollback {self.count} of at most "
                f"{self.cfg.max_rollbacks}"
            )
        said = {"step": step, "signal": alarm.signal, "count": self.count}
        said["reached"] = self.monitoring.reached  # carried out again, the collapse stays armed
        return Decision(
            action=ROLLBACK, reason=alarm.signal, to_step=target, skip_batches=skip, record=said
        )

    def state_dict(self) -> dict:
        return {"count": self.count}

    def load_state_dict(self, state: dict) -> None:
        # a rollback loads an older checkpoint: the run's count of rollbacks goes on
        self.count = max(self.count, int(state["count"]))

    def on_rollback(self, trainer: Trainer, step: int) -> None:
        # The checkpoint's scheduler state is loaded by now: cap from the step returned to.
        scheduler = getattr(trainer.engine, "lr_scheduler", None)
        if self.cfg.cap_lr and scheduler is not None and hasattr(scheduler, "cap_here"):
            cap = scheduler.cap_here(self.cfg.lr_scale)
            if self.is_main:
                log.warning(
                    f"lr capped at {cap:.3g} x the peak from step {step} on "
                    f"(monitor.rollback.lr_scale {self.cfg.lr_scale:g} x its value there)"
                )
