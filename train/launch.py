"""``earlyfuse-torchrun`` (``python -m train.launch``): ``torchrun`` with its own options, for
which a run stopped by SIGTERM, SIGUSR1 or SIGINT after its checkpoint is a success (exit code 0).

    earlyfuse-torchrun --nproc_per_node 8 -m train.app experiment=gpu_350m run_dir=runs/350m

Why a wrapper: torchrun answers a SIGTERM it receives itself (a scheduler's preemption, its
time limit) by passing it on to its workers, waiting for them (``--shutdown-timeout``) and then
raising ``SignalException``, so it exits 1 with a traceback even when every worker saved its
checkpoint and exited 0; schedulers read that as a failure. Nothing in torchrun's options
changes it, and the workers' exit codes are not reported past that point. So every worker of a
run that stops by a signal leaves a note (``train/app.py``) in a folder this wrapper names in
``EARLYFUSE_STOP_NOTES``; when torchrun raises ``SignalException`` and every local worker left
its note, the exit code is 0, else 128 + the signal's number (what the signal alone would give).
A worker that exits 2 (a config, checkpoint or run folder refused) or 3 (halted by a monitor) first
makes those the launcher's exit code too, with one line, instead of torchrun's traceback and 1;
one killed by a signal (the out-of-memory killer's SIGKILL) makes it 128 + the signal's number,
with one line that names the rank and says the run resumes with the same command.

When the workers stopped after their checkpoint because a rank on another node was stopped (its
launcher killed: ``train/callbacks/preemption.py``), this launcher got no signal itself and
torchrun would wait up to 300 s at its exit barrier for the other node's launcher, which may be
gone, then log a traceback: it waits ``STOPPED_BARRIER_S`` instead (a live peer arrives within
seconds, its workers having stopped at the same step) without torchrun's traceback (c10d's own
two warnings of the timeout remain), and says what happened.

Two defaults differ from torchrun's, each overridden by its own option: SIGUSR1 is among the
signals handled and passed on (``--signals-to-handle``: Slurm's ``--signal=USR1@120``), and the
workers get 300 s, not 30, between the signal and SIGKILL (``--shutdown-timeout``): enough for a
step and a checkpoint of the small and mid-sized presets; raise it for larger ones.
"""

from __future__ import annotations

import os
import signal
import sys
import tempfile
from pathlib import Path

STOP_NOTES_ENV = "EARLYFUSE_STOP_NOTES"
SIGNALS = "SIGTERM,SIGINT,SIGHUP,SIGQUIT,SIGUSR1"
SHUTDOWN_TIMEOUT_S = "300"
STOPPED_BARRIER_S = 30.0  # the exit barrier's wait once every local worker stopped (above)
# earlyfuse-train's exit codes that are decisions, not crashes (train/app.py)
WORKER_CODES = {
    2: "a config, checkpoint or run folder that cannot be used",
    3: "halted by a monitor",
}


def note_stopped(rank: int) -> None:
    """A worker's note that it stopped after its checkpoint (a launcher's folder; none: nothing)."""
    folder = os.environ.get(STOP_NOTES_ENV)
    if folder and Path(folder).is_dir():
        local_world = os.environ.get("LOCAL_WORLD_SIZE", "1")
        (Path(folder) / f"rank_{rank:05d}").write_text(local_world + "\n")


def all_stopped(folder: Path) -> bool:
    """Every local worker left its note (each names how many local workers there are)."""
    notes = list(folder.glob("rank_*"))
    try:
        wanted = {int(note.read_text()) for note in notes}
    except (OSError, ValueError):
        return False
    return len(wanted) == 1 and len(notes) == wanted.pop()


def watch_the_agent(notes: Path) -> None:
    """Two changes to torchrun's agent (module docstring): the stop notes are cleared whenever
    it starts the workers (a restart under ``--max-restarts`` or a membership change stops the
    old ones with a signal, and their notes are not the new attempt's), and its exit barrier is
    bounded by ``STOPPED_BARRIER_S``, without its own error log, once every local worker left
    its note."""
    import logging

    from torch.distributed.elastic.agent.server import api

    start, barrier = (
        api.SimpleElasticAgent._initialize_workers,
        api.SimpleElasticAgent._exit_barrier,
    )

    def initialize_workers(agent, worker_group) -> None:
        for note in notes.glob("rank_*"):
            note.unlink(missing_ok=True)
        return start(agent, worker_group)

    def exit_barrier(agent) -> None:
        if not all_stopped(notes):
            return barrier(agent)
        agent._exit_barrier_timeout = min(agent._exit_barrier_timeout, STOPPED_BARRIER_S)
        level = api.logger.level
        api.logger.setLevel(logging.CRITICAL)  # a peer that is gone is said below, in one line
        try:
            return barrier(agent)
        finally:
            api.logger.setLevel(level)

    api.SimpleElasticAgent._initialize_workers = initialize_workers  # type: ignore[method-assign]
    api.SimpleElasticAgent._exit_barrier = exit_barrier  # type: ignore[method-assign]


HELP = f"""\
earlyfuse-torchrun: torchrun for earlyfuse runs (python -m train.launch)
  earlyfuse-torchrun --nproc_per_node 8 -m train.app experiment=gpu_350m run_dir=runs/350m

Two defaults differ from those torchrun's help below gives: --signals-to-handle is
{SIGNALS} (SIGUSR1 added: Slurm's --signal=USR1@120), and
--shutdown-timeout is {SHUTDOWN_TIMEOUT_S} s, not 30 (between the signal and SIGKILL: a step and a
checkpoint). Exit codes: 0 trained, or stopped by a signal after every worker's checkpoint
(the same command resumes); 2 a config, checkpoint or run folder that cannot be used; 3 halted
by a monitor; 128 + N a worker (or this launcher) stopped by signal N before its checkpoint
(the same command resumes from the last one); 1 another failure (torchrun's report).
docs/training.md says more. torchrun's own help follows.
"""


def main(argv: list[str] | None = None) -> int:
    from torch.distributed import DistError
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError
    from torch.distributed.elastic.rendezvous.api import RendezvousError
    from torch.distributed.run import main as torchrun_main

    args = sys.argv[1:] if argv is None else argv
    script = (i for i, a in enumerate(args) if a in ("-m", "--module") or a.endswith(".py"))
    launcher = args[: next(script, len(args))]  # a script's own --help is the script's
    if "-h" in launcher or "--help" in launcher:  # torchrun's, not the training script's
        print(HELP)
    # torchrun reads its options' defaults from PET_<OPTION> (an option given wins)
    os.environ.setdefault("PET_SIGNALS_TO_HANDLE", SIGNALS)
    os.environ.setdefault("TORCH_ELASTIC_SHUTDOWN_TIMEOUT", SHUTDOWN_TIMEOUT_S)
    with tempfile.TemporaryDirectory(prefix="earlyfuse-stop-") as notes:
        os.environ[STOP_NOTES_ENV] = notes
        watch_the_agent(Path(notes))
        try:
            torchrun_main(args)
        except SignalException as e:
            name = e.sigval.name
            if all_stopped(Path(notes)):
                print(
                    f"earlyfuse-torchrun: {name}: every worker stopped after its checkpoint; "
                    "exit code 0 (run the same command again to resume)",
                    file=sys.stderr,
                )
                return 0
            print(
                f"earlyfuse-torchrun: {name}: not every worker stopped after a checkpoint; "
                f"exit code {128 + int(e.sigval)}",
                file=sys.stderr,
            )
            return 128 + int(e.sigval)
        except (RendezvousError, DistError):
            # The rendezvous store went down with the node that held it (its launcher killed):
            # torchrun stopped this node's workers; if each had stopped after its checkpoint
            # the run is resumable, as when another node's launcher is killed (below)
            if not all_stopped(Path(notes)):
                raise
            print(
                "earlyfuse-torchrun: every worker stopped after its checkpoint (a signal reached "
                "one of the run's ranks; the rendezvous went down with its node); exit code 0 "
                "(run the same command again to resume)",
                file=sys.stderr,
            )
            return 0
        except ChildFailedError as e:
            # A worker that refused the run (2) or was halted by a monitor (3) said why in one
            # line above; torchrun would bury it under a traceback and exit 1, which a scheduler
            # would requeue. Its code is the launcher's, as with one process.
            rank, failure = e.get_first_failure()
            # A rank killed by a signal is the cause; its peers' failures (a collective whose
            # peer is gone, exit code 1) may have been seen first. Not torchrun's own SIGTERM to
            # the workers left after a failure (a worker stops on SIGTERM after a checkpoint)
            killed = sorted(
                (
                    (-f.exitcode == signal.SIGABRT, f.timestamp, r, f)  # the first; an abort last
                    for r, f in e.failures.items()
                    if f.exitcode < 0 and -f.exitcode != signal.SIGTERM
                ),
                key=lambda found: found[:3],
            )
            if killed and failure.exitcode not in WORKER_CODES:
                rank, failure = killed[0][2], killed[0][3]
            if failure.exitcode < 0 and -failure.exitcode != signal.SIGTERM:
                # killed by a signal: it left no traceback of its own
                number = -failure.exitcode
                try:
                    name = signal.Signals(number).name
                except ValueError:
                    name = f"signal {number}"
                print(
                    f"earlyfuse-torchrun: rank {rank} (pid {failure.pid}) was killed by {name}"
                    + (
                        " (the kernel's out-of-memory killer sends it: `dmesg` says; or a "
                        "person's kill -9)"
                        if number == signal.SIGKILL
                        else " (a collective's watchdog aborts a rank whose peer is gone: the "
                        "cause may be another rank or node)"
                        if number == signal.SIGABRT
                        else ""
                    )
                    + "; torchrun stopped the other workers. The same command again resumes "
                    "the run from its last complete checkpoint (from the start without one); "
                    f"exit code {128 + number}",
                    file=sys.stderr,
                )
                return 128 + number
            if failure.exitcode not in WORKER_CODES:
                raise
            print(
                f"earlyfuse-torchrun: rank {rank} exited with code {failure.exitcode} "
                f"({WORKER_CODES[failure.exitcode]}: its line is above); exit code "
                f"{failure.exitcode}",
                file=sys.stderr,
            )
            return failure.exitcode
        if all_stopped(Path(notes)):
            print(
                "earlyfuse-torchrun: every worker stopped after its checkpoint (a signal reached "
                "one of the run's ranks); exit code 0 (run the same command again to resume)",
                file=sys.stderr,
            )
    return 0


if __name__ == "__main__":
    sys.exit(main())
