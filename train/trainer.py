"""The trainer: the loop, and the state a checkpoint holds. Everything else a run does (metrics and
their sinks, evaluation, checkpoint timing, monitors, rollback, preemption, speed, progress) is a
callback (``train/callbacks/``), registered once in ``train/build.py``.

One iteration of ``fit`` is one optimizer step over ``grad_accum`` micro-batches, then the
callbacks' ``post_step``; the strongest ``Decision`` they return is acted on here:

- ``rollback``: reload the checkpoint it names, start a fresh batch iterator and first discard
  the window of data it says to skip;
- ``stop`` (a preemption signal): checkpoint this step and return (exit code 0);
- ``halt``: raise ``RunHalted`` (exit code 3).

In epoch mode the data may end before ``total_steps``: the run then finishes at the last complete
step (final evaluation, checkpoint, final.json) like a run that reached its end.

Checkpoints (``Checkpointer``, ``train/checkpoint.py``) hold the model, optimizer and scheduler
(DeepSpeed), rank 0's client state (the union of the callbacks' ``state_dict``s, plus ``step``)
and each rank's own state (its batch stream's position and its RNG states).
"""

from __future__ import annotations

import json
import logging
import math
import time
from collections.abc import Callable, Iterator
from contextlib import closing
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from data.shards.storage import write_atomic
from train.callbacks.base import HALT, STOP, Callbacks, Decision, StepRecord
from train.checkpoint import Checkpointer, tag_for
from train.config import TrainConfig
from train.config_check import ConfigError, check_resume_config, training_mix
from train.dist import DistInfo, barrier
from train.engine import config_hyperparameters
from train.names import CONFIG_FILE, FINAL_FILE, HALTED_FILE
from train.rng_state import rng_state, set_rng_state
from train.safe_load import CheckpointError
from train.skip_step import SkipStepAdamW, UpdateGate
from train.step_sums import StepSums
from train.streams import BatchStream
from train.tasks.base import Task

log = logging.getLogger(__name__)


class RunHalted(RuntimeError):
    """A monitor ordered the run to stop (its alarm is in alarms.jsonl and on the console)."""


@dataclass(kw_only=True, eq=False)
class Trainer:
    train: TrainConfig
    dist: DistInfo
    task: Task
    engine: Any  # deepspeed.DeepSpeedEngine
    optimizer: SkipStepAdamW
    gate: UpdateGate
    stream: BatchStream
    checkpointer: Checkpointer
    callbacks: Callbacks
    total_steps: int  # train.steps, or the steps the data holds (train.steps=-1, epoch mode)
    run_dir: Path
    zero_stage: int
    resolved_yaml: str  # saved with every checkpoint and compared on resume
    save_meta: dict  # meta.json fields of every checkpoint (besides step and tag)
    save_files: dict[str, str]  # files written beside every checkpoint
    given_keys: frozenset[str] = frozenset()  # the config keys set on the command line
    # Older checkpoints keep-last must keep at every save, periodic, stop or final alike (the
    # monitor's protected steps: the way back from a trouble still open)
    protect: Callable[[list[int]], set[int]] = field(default=lambda steps: set())
    skip_batches: int = 0  # batches to discard before the next step (after a rollback)
    last_saved: int = -1  # the step of the newest checkpoint written or loaded
    saved_lr: float = 0.0  # the next step's lr as the checkpoint last loaded had it
    untrained_batches: int = 0  # micro-batches of a last step the data ended in (never applied)

    # --- the loop --------------------------------------------------------------------------------
    def fit(self) -> dict[str, float] | None:
        """Train from the latest checkpoint (or step 0) to ``total_steps``; final.json's contents,
        or None when a signal stopped the run early (after a checkpoint)."""
        step = self.resume() if self.train.resume else self.start_over()
        if self.dist.is_main:  # an earlier end's records: this start goes on from it
            (self.run_dir / HALTED_FILE).unlink(missing_ok=True)
            (self.run_dir / FINAL_FILE).unlink(missing_ok=True)
        try:
            self.callbacks.pre_train(self, step)
            while step < self.total_steps:
                decision: Decision | None = None
                with closing(iter(self.stream)) as batches:  # closing stops the loader's workers
                    for _ in range(self.skip_batches):  # the data window a rollback skips
                        next(batches)
                    self.skip_batches = 0
                    while decision is None and step < self.total_steps:
                        record = self.train_step(step + 1, batches)
                        if record is None:  # epoch mode: the data ended before total_steps
                            break
                        step += 1
                        decision = self.after_step(step, record)
                if decision is None or (decision.action == STOP and step >= self.total_steps):
                    break  # the end, of the steps or of the data (a signal at the end: no matter)
                if decision.action == HALT:
                    if self.dist.is_main:  # for earlyfuse-report: a halt, not a crash or a kill
                        text = json.dumps({"step": step, "reason": decision.reason})
                        write_atomic(self.run_dir / HALTED_FILE, (text + "\n").encode())
                    raise RunHalted(decision.reason)
                if decision.action == STOP:
                    self.stop(step, decision)
                    return None
                step = self.roll_back(decision)
            return self.finish(step)
        finally:
            self.callbacks.close(self)

    def after_step(self, step: int, record: StepRecord) -> Decision | None:
        """The callbacks' decision on a finished step. The monitors' probes read data of their
        own: when it cannot be read (its folder moved away mid-run) the run stops, and the step,
        complete with its data position, is checkpointed first."""
        from data.loader.config import DataUnreadable

        try:
            return self.callbacks.post_step(self, step, record)
        except DataUnreadable:
            if self.last_saved != step:
                self.save_checkpoint(step)
            raise

    def train_step(self, step: int, batches: Iterator[dict]) -> StepRecord | None:
        """Optimizer step ``step`` (1-based) over ``grad_accum`` micro-batches; None when the data
        ended before the step was complete (its partial gradients are never applied)."""
        self.callbacks.pre_step(self, step)
        start, wait = time.perf_counter(), 0.0
        sums = StepSums(self.dist.device)  # on the device until the step's one read-back
        reduced: dict[str, float] = {}
        for micro in range(self.train.grad_accum):
            waited = time.perf_counter()
            batch = next(batches, None)
            wait += time.perf_counter() - waited
            if batch is None:
                self.untrained_batches = micro
                return None
            out = self.task.forward(self.engine, batch)
            self.engine.backward(out.loss)
            sums.add({**out.sums, "loss_sum": out.loss.detach(), "micro": 1, "units": out.units})
            if micro == self.train.grad_accum - 1:
                # The skip-step gate needs this step's loss, identical on every rank, before
                # engine.step() applies (or drops) the update: the step's one read-back, which
                # also carries the callbacks' flags (a preemption signal) to every rank.
                sums.add(self.callbacks.step_flags(self))
                reduced = sums.reduce()
                self.gate.begin(step, reduced["loss_sum"] / reduced["micro"], reduced)
            self.engine.step()
        return StepRecord(sums=reduced, seconds=time.perf_counter() - start, data_wait=wait)

    # --- acting on decisions ---------------------------------------------------------------------
    def roll_back(self, decision: Decision) -> int:
        record = {**decision.record, "skip_batches": decision.skip_batches}
        self.checkpointer.rewind(decision.to_step, record)
        tag = tag_for(decision.to_step)
        # the checkpoint the run resumed from on another world size may be the way back
        other_world = self.checkpointer.meta(tag)["world_size"] != self.dist.world_size
        self.load_checkpoint(tag, other_world=other_world)
        self.last_saved = decision.to_step
        self.skip_batches = decision.skip_batches
        self.callbacks.on_rollback(self, decision.to_step)
        return decision.to_step

    def stop(self, step: int, decision: Decision) -> None:
        if self.last_saved != step:
            self.save_checkpoint(step)
        if self.dist.is_main:
            log.info(
                f"earlyfuse-train: stopped by {decision.reason} at step {step} of "
                f"{self.total_steps} with checkpoint {tag_for(step)} in {self.checkpointer.dir}; "
                "run the same command again to resume"
            )

    def finish(self, step: int) -> dict[str, float]:
        if step < self.total_steps and self.dist.is_main:
            partial = self.untrained_batches
            log.info(
                f"the data ended after step {step} of {self.total_steps} (data.mode=epoch): "
                "finishing there"
                + (
                    f"; its last {partial} micro-batch(es) could not fill a step of "
                    f"train.grad_accum={self.train.grad_accum}: not trained on "
                    "(data/untrained_batches in final.json)"
                    if partial
                    else ""
                )
            )
        # What ran, beside what it measured: the layout is otherwise only in the console's first
        # line and the checkpoints' meta.json (report.py lists numbers only, not this dict).
        meta = self.save_meta
        final: dict = {
            "run": {
                **{key: value for key, value in meta.items() if key != "network"},  # config.yaml's
                "data_parallel": meta["world_size"] // meta["sequence_parallel"],
                "steps": step,
            }
        }
        self.callbacks.post_train(self, step, final)  # final evaluation, data counts, checkpoint
        final.update(self.task.finish(self.engine, self.run_dir))
        if self.untrained_batches:
            final["data/untrained_batches"] = self.untrained_batches
        if self.dist.is_main:
            text = json.dumps(final, indent=1, sort_keys=True) + "\n"
            write_atomic(self.run_dir / FINAL_FILE, text.encode())  # a reader sees it whole
        return final

    # --- checkpoints -----------------------------------------------------------------------------
    def save_checkpoint(self, step: int) -> str:
        tag = self.checkpointer.save(
            self.engine,
            step,
            client={**self.callbacks.state_dict(), "step": step},
            own={
                "stream": self.stream.state_dict(),
                "task": self.task.state_dict(),
                "rng": rng_state(),
            },
            meta={**self.save_meta, **self.data_length()},
            files=self.save_files,
            protect=self.protect(self.checkpointer.complete_steps()),
        )
        self.last_saved = step
        return tag

    def resume(self) -> int:
        """Load the run folder's latest checkpoint, if it has one; the step to go on from."""
        self.checkpointer.clean_partial()
        barrier()
        tag = self.checkpointer.latest()
        if tag is None:
            return 0
        meta = self.checkpointer.check_compatible(tag, self.zero_stage)
        step = int(meta["step"])
        if self.train.steps != -1:  # before the load: a refusal costs nothing
            self.check_goal(tag, step)
        saved = self.checkpointer.dir / tag / CONFIG_FILE
        changed = check_resume_config(
            saved.read_text() if saved.is_file() else None,
            self.resolved_yaml,
            saved_world_size=meta["world_size"],
            world_size=self.dist.world_size,
            saved_sp=meta.get("sequence_parallel"),
            sp=self.dist.sp_degree,
            allowed=self.train.allow_config_change,
            where=str(saved),
            show=self.dist.is_main,
        )
        given = [
            key
            for key in changed
            if any(key == g or key.startswith((f"{g}.", f"{g}[")) for g in self.given_keys)
        ]
        if given and step == self.total_steps and self.train.steps != -1:
            # a loop over settings without a run_dir each: every command after the first would
            # "resume" the finished run, train nothing and exit 0. Only what the command line
            # sets: a finished run started again after an upgrade (a new key, another default)
            # or an edited config file is "nothing to train", as before.
            raise ConfigError.alike(
                f"{self.checkpointer.dir / tag}: the run is complete (train.steps={step}) and "
                f"this command's config differs from its ({', '.join(given[:3])}"
                f"{', ...' if len(given) > 3 else ''}): it would train nothing; give another "
                "run_dir for a new run, or train.steps above it to go on with these changes"
            )
        other_world = meta["world_size"] != self.dist.world_size
        notes = self.load_checkpoint(tag, other_world=other_world)
        if self.train.steps == -1:
            saved_length = meta.get("data_length") or {}
            accum = self.train.grad_accum
            if self.stream.recounted or saved_length.get("grad_accum", accum) != accum:
                # the rest of the epoch, on another split or mix, or in steps of another size
                length = step + max(0, self.stream.batches_left() or 0) // accum
                notes.append(f"the data holds {length - step} more step(s) from here")
            else:  # the run's own length, which an earlier resume may have counted again
                length = int(saved_length.get("steps", self.total_steps))
            if length != self.total_steps:
                self.total_steps = length
                self.engine.lr_scheduler.stretch_to(length)
            self.check_goal(tag, step)
        lr = self.engine.lr_scheduler.get_last_lr()[0]
        if not math.isclose(lr, self.saved_lr, rel_tol=0.01):
            # optim.lr, the schedule or the run's length changed: a jump the loss may answer
            notes.append(f"the lr goes on at {lr:.3g}, not the {self.saved_lr:.3g} saved")
        self.last_saved = step
        saved_mix = training_mix(saved.read_text() if saved.is_file() else None)
        if saved_mix is not None and saved_mix != training_mix(self.resolved_yaml):
            self.callbacks.on_mix_change(self, step)
        if self.dist.is_main:
            head = f"resuming {tag}"
            if other_world:
                universal = " from its universal checkpoint" if self.zero_stage else ""
                head += f" of {meta['world_size']} rank(s) on {self.dist.world_size}{universal}"
            log.info(
                head + ((";" if other_world else ":") + " " + "; ".join(notes) if notes else "")
            )
        return step

    def start_over(self) -> int:
        """``train.resume=false``: step 0, in a run folder without checkpoints. Beside an earlier
        run's, this run's would overwrite some and leave the newer ones, which a later start would
        resume from as its own."""
        if found := self.checkpointer.tags():
            raise ConfigError.alike(
                f"train.resume=false, but {self.checkpointer.dir} holds {len(found)} checkpoint(s) "
                f"of an earlier run (up to {found[-1].name}): starting over beside them would mix "
                "the two runs' checkpoints; give another run_dir, or delete that folder to start "
                "over in this one"
            )
        return 0

    def data_length(self) -> dict:
        """For a checkpoint's meta.json: a run until the data ends (``train.steps=-1``) keeps its
        length there, as a resume onto another split counted it (a fresh count of the split it was
        saved on would start the epoch over)."""
        if self.train.steps != -1:
            return {}
        return {"data_length": {"steps": self.total_steps, "grad_accum": self.train.grad_accum}}

    def check_goal(self, tag: str, step: int) -> None:
        """Refuse a checkpoint past the run's length; say when the run is complete already."""
        given = self.train.steps
        goal = f"train.steps={given}" if given != -1 else f"the {self.total_steps} the data holds"
        if step > self.total_steps:  # nothing to train, and a report of 200 %
            raise ConfigError.alike(
                f"{self.checkpointer.dir / tag}: the run is at step {step} already, past "
                f"{goal}: give train.steps above it to train on, or another run_dir for a new run"
            )
        if step == self.total_steps and self.dist.is_main:
            log.info(  # the same command run again, or a new run given a finished run's folder
                f"{self.checkpointer.dir / tag}: the run is complete ({goal}): nothing to train; "
                "give train.steps above it to train on, or another run_dir for a new run"
            )

    def load_checkpoint(self, tag: str, *, other_world: bool = False) -> list[str]:
        """Load checkpoint ``tag`` into the engine, the callbacks, the stream and the RNG; notes
        for the console (a stream moved onto another split, a rank without a predecessor)."""
        with config_hyperparameters(self.engine) as lrs:
            if other_world:
                client, own = self.checkpointer.load_resharded(self.engine, tag, self.zero_stage)
            else:
                client, own = self.checkpointer.load(self.engine, tag)
        self.callbacks.load_state_dict(client, str(self.checkpointer.dir / tag))
        notes = []
        self.saved_lr = lrs["saved"]
        note = self.stream.resume(
            own["stream"] if own else None, lambda: self.checkpointer.load_streams(tag)
        )
        if note:
            notes.append(note)
        if own is None:
            notes.append(f"rank {self.dist.rank} had no predecessor: fresh RNG")
        else:
            try:
                self.task.load_state_dict(own["task"])
            except (KeyError, TypeError, ValueError) as e:
                raise CheckpointError(
                    f"{self.checkpointer.dir / tag}: the task's state is not in the format this "
                    f"code writes ({type(e).__name__}: {e}); resume from a checkpoint this "
                    "version saved, or start the run over"
                ) from None
            # Last, and nothing draws from the global RNG from here to the first step: a resumed
            # run draws exactly what the uninterrupted one drew.
            set_rng_state(own["rng"])
        return notes
