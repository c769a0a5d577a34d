"""``earlyfuse-train``: the Hydra entry point. The only place that sees Hydra: it composes
``configs/`` onto the typed schema (``train.config.RunConfig``), turns the result into
dataclasses once, takes the run folder's lock and hands everything to ``train.build``.

    earlyfuse-train experiment=vtok_debug
    earlyfuse-train experiment=vtok_demo train.steps=200 optim.lr=1e-3
    earlyfuse-torchrun --nproc_per_node 2 -m train.app experiment=vtok_debug deepspeed.zero_stage=2
    deepspeed --num_gpus 8 --module train.app experiment=...   (--local_rank is handled)

Exit codes: 0 done (or stopped by SIGTERM/SIGUSR1/SIGINT after a checkpoint), 1 an error, 2 a config,
checkpoint or run folder that cannot be used (a refused or damaged checkpoint, a disk full during
a save; one line says why), 3 halted by a monitor.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import errno
import logging
import os
import re
import sys
import threading
import time
import types
import typing
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import NoReturn

import hydra
from hydra.core.config_store import ConfigStore
from omegaconf import DictConfig, OmegaConf
from omegaconf.errors import OmegaConfBaseException

from data.names import MANIFEST_FILE, VISUAL_WEIGHTS_FILE
from train.config import RunConfig
from train.config_check import (
    ConfigError,
    check_known_keys,
    override_items,
    suggestion,
    unknown_override_keys,
)
from train.dist import peer_gone, strip_launcher_args
from train.names import (
    CHECKPOINT_META_FILE,
    CHECKPOINTS_DIR,
    CONFIG_FILE,
    LATEST_FILE,
    METRICS_FILE,
)

ConfigStore.instance().store(name="run_schema", node=RunConfig)
# An absolute path: Hydra would otherwise look for a Python package "configs".
CONFIG_DIR = str(Path(__file__).resolve().parents[1] / "configs")
SILENT_RANK_WAIT_S = 10.0  # refuse_before_start: the launcher stops the waiting ranks sooner

# Extra callbacks for one run, made from its config: tests and the instability suite only.
CallbackFactory = Callable[[RunConfig], Sequence]


def levels_from_layout(cfg: DictConfig) -> None:
    """A visual tokenizer run given the text tokenizer's folder (``vtok_data.tokenizer``) takes its
    FSQ levels from the vocabulary layout there: the levels are chosen once, by
    ``train-text-tokenizer --fsq-levels``, and tokenize never meets a mismatch."""
    folder = cfg.vtok_data.get("tokenizer") if "vtok_data" in cfg else ""
    if cfg.get("task") != "vtok" or not folder:
        return
    from data.names import LAYOUT_FILE
    from data.vocab import VocabLayout

    path = Path(folder)
    try:
        layout = VocabLayout.load(path / LAYOUT_FILE if path.is_dir() else path)
    except ValueError as e:
        raise ConfigError(f"vtok_data.tokenizer: {e}") from None
    levels = list(layout.fsq_levels)
    if list(cfg.vtok.levels) != levels:
        print(
            f"earlyfuse-train: vtok.levels {list(cfg.vtok.levels)} -> {levels}, the FSQ levels of "
            f"{folder} (vtok_data.tokenizer)"
        )
        cfg.vtok.levels = levels


def name_after_data(overrides: Sequence[str]) -> list[str]:
    """``name=DATA`` for a run that picks its own data config on the command line (``data=mine``)
    and gives no ``name=``: it is named after that data, not after the experiment whose recipe it
    borrows, so the run folder's default, the logs and the report's title say whose data it was;
    ``name=DATA_STAGE`` with a stage picked too (``stage=long_8k``), whose run is another than
    the one it continues. Added to the overrides before Hydra composes, so ``--cfg job`` shows
    what the run uses."""
    pairs = override_items(overrides)
    if any(key == "name" for key, _ in pairs):  # given, empty too (refused as such)
        return []
    chosen = {key: Path(value).name for key, value in pairs if key in ("data", "stage") and value}
    if chosen.get("data", "none") in ("none", "null"):
        return []
    stage = chosen.get("stage", "none")
    return [f"name={chosen['data']}" + ("" if stage in ("none", "null") else f"_{stage}")]


def to_run_config(cfg: DictConfig) -> tuple[RunConfig, str]:
    """The typed config and its resolved YAML (saved with every checkpoint)."""
    check_known_keys(OmegaConf.to_container(cfg, resolve=False), RunConfig)  # type: ignore[arg-type]
    levels_from_layout(cfg)
    try:
        if OmegaConf.get_type(cfg) is not RunConfig:
            # A file composed without the schema: a run's own config.yaml given as the primary
            # config (--config-path RUN_DIR --config-name config), as Hydra users rerun a run
            cfg = OmegaConf.merge(OmegaConf.structured(RunConfig), cfg)  # type: ignore[assignment]
        resolved = OmegaConf.to_yaml(cfg, resolve=True)
        run_cfg = OmegaConf.to_object(cfg)  # the structured schema makes this a RunConfig
    except OmegaConfBaseException as e:
        # A value left ??? (a source without a name) or an interpolation that cannot be resolved
        # (${nme}): found only now, as the config is resolved; as much a config error.
        raise ConfigError(f"{e.full_key}: {str(e).splitlines()[0]}") from None
    except ValueError as e:
        # The schema's own checks (__post_init__: steps, batch sizes, ZeRO stage, ...) name the
        # key and what to give: a config error, one line and exit code 2, not a traceback.
        raise ConfigError(str(e)) from None
    assert isinstance(run_cfg, RunConfig)
    return run_cfg, resolved


def run(
    cfg: RunConfig,
    resolved: str,
    extra_callbacks: CallbackFactory | None = None,
    command: Sequence[str] = (),
) -> int:
    """Train under the run folder's lock; the process's exit code. ``command``: the arguments
    as given (``RUN_DIR/launches.jsonl`` records them)."""
    import torch

    from data.loader.config import DataUnreadable
    from model.attention import RowsTooLong
    from train.build import build_trainer
    from train.callbacks.preemption import listen_from_start, stop_with_launcher
    from train.dist import all_reduce_sum, init_distributed, shutdown
    from train.run_lock import RunLock, RunLocked
    from train.safe_load import CheckpointError
    from train.save_errors import CheckpointWriteError
    from train.trainer import RunHalted

    threading.excepthook = quiet_disk_failures(threading.excepthook)
    listen_from_start()  # a preemption signal while the run starts stops it after step 1
    stop_with_launcher()  # its launcher killed with SIGKILL: a SIGTERM (stops as preempted)
    dist = init_distributed()
    if not dist.is_main:  # one console: rank 0's (the others still report warnings and errors)
        logging.getLogger("train").setLevel(logging.WARNING)
    if differs := run_dirs_differ(cfg.run_dir, dist.world_size):
        if dist.local_rank == 0:
            said(differs)
        return 2
    lock = RunLock(Path(cfg.run_dir))
    try:
        refused: RunLocked | str | None = None
        code = 0
        if dist.is_main and (wrong := holds_data(Path(cfg.run_dir))):
            refused, code = wrong, 2
        elif dist.is_main:
            try:
                lock.acquire()
            except RunLocked as e:
                refused, code = e, 2
            except OSError as e:  # a full or read-only disk: the machine's, not the config's
                if e.errno not in DISK_FULL_OR_READ_ONLY:
                    raise
                refused, code = disk_failure(e, Path(cfg.run_dir)), 1
        # Every rank learns whether rank 0 got the folder, and stops with it if not.
        flag = torch.tensor([float(code)], device=dist.device)
        code = int(all_reduce_sum(flag).item())
        if code:
            print(
                f"earlyfuse-train: {refused or 'rank 0 refused the run folder (its line says why)'}",
                file=sys.stderr,
            )
            return code
        extra = list(extra_callbacks(cfg)) if extra_callbacks else []
        trainer = build_trainer(cfg, resolved, dist, extra_callbacks=extra, command=command)
        if trainer.fit() is None:
            # Stopped by a signal, checkpoint written: a success for earlyfuse-torchrun too
            from train.launch import note_stopped

            note_stopped(dist.rank)
        shutdown()  # every rank got here: close the process groups together
    except RunHalted as e:  # a monitor's decision, not a crash: no traceback, a distinct exit code
        said(e)
        return 3
    except DataUnreadable as e:  # each sample was named as it was skipped: the cause is said
        print(
            f"earlyfuse-train: stopped: {e.last_line()}; the run resumes from its last checkpoint "
            "once the data can be read",
            file=sys.stderr,
        )
        return 1
    except OSError as e:
        if e.errno not in DISK_FULL_OR_READ_ONLY:
            raise
        said(disk_failure(e, Path(cfg.run_dir)))
        return 1
    except (ConfigError, CheckpointError, CheckpointWriteError, RowsTooLong) as e:
        # A config, a checkpoint or a run folder that cannot be used: the message says what to
        # do, a traceback would only bury it. A refusal every rank decided alike is said once
        # a node, not once a rank.
        if dist.local_rank == 0 or not getattr(e, "every_rank", False):
            said(e)
        return 2
    except RuntimeError as e:
        # A collective whose peer is gone (a rank died: its launcher names it and the signal):
        # this rank's traceback would only bury that line, and it is cut short by the launcher's
        # SIGTERM anyway
        found = peer_gone(e)
        if dist.world_size == 1 or not found:
            raise  # a reader's connection (object storage) reset is not a lost rank
        what = re.sub(r"^\[[^\]]*\]\s*", "", str(e)[: found.end()])  # gloo's source line off
        said(
            f"rank {dist.rank} lost the other ranks in a collective ({what}): one of them "
            "stopped or died, its launcher's line says which; the same command again resumes "
            "the run from its last complete checkpoint (from the start without one)"
        )
        return 1
    finally:
        lock.release()
    return 0


def run_dirs_differ(run_dir: str, world_size: int) -> str:
    """Why the ranks cannot share this run (empty: they can): each resolved ``run_dir`` itself,
    and an interpolation such as ``${now:...}`` resolves per process, so the ranks would each
    write a folder of their own, exit 0, and leave checkpoints that cannot be resumed."""
    if world_size == 1:
        return ""
    import torch.distributed as tdist

    dirs: list = [None] * world_size
    tdist.all_gather_object(dirs, run_dir)
    if len(set(dirs)) == 1:
        return ""
    other = next(rank for rank, d in enumerate(dirs) if d != dirs[0])
    return (
        f"run_dir differs between ranks (rank 0: {dirs[0]}, rank {other}: {dirs[other]}): every "
        "rank must write the same run folder. An interpolation such as ${now:...} resolves in "
        "each process: name the folder once, in the shell (run_dir=runs/$(date +%Y%m%d_%H%M%S))"
    )


DISK_FULL_OR_READ_ONLY = (errno.ENOSPC, errno.EDQUOT, errno.EROFS, errno.EFBIG)


def quiet_disk_failures(hook):
    """A thread hook that leaves out a full or read-only disk met by a background writer
    (TensorBoard's): its next write in the run's own thread raises it, and the run says it in
    one line (``disk_failure``)."""

    def hook_for(args) -> None:
        error = args.exc_value
        if isinstance(error, OSError) and error.errno in DISK_FULL_OR_READ_ONLY:
            return
        hook(args)

    return hook_for


def holds_data(run_dir: Path) -> str:
    """Why ``run_dir`` is refused (empty: it is not): a folder that is no run's yet (no
    config.yaml, no checkpoints) holding data, itself or a folder in it: shards (a
    manifest.json) or a release (model.safetensors). The run would write its checkpoints and
    logs among them: ``experiment=debug data=demo`` is named after its data, ``runs/demo``,
    where ``make demo`` keeps its corpus, tokens and release."""
    if not run_dir.is_dir() or any(
        (run_dir / name).exists() for name in (CONFIG_FILE, CHECKPOINTS_DIR, METRICS_FILE)
    ):
        return ""
    folders = [run_dir, *sorted(p for p in run_dir.iterdir() if p.is_dir())]
    found = [
        str(p.relative_to(run_dir)) + "/"
        for p in folders
        if (p / MANIFEST_FILE).is_file() or (p / VISUAL_WEIGHTS_FILE).is_file()
    ]
    if not found:
        return ""
    return (
        f"run_dir {run_dir} holds data, not a run ({', '.join(found[:4])}): the run would write "
        "its checkpoints and logs among them; give it a folder of its own (run_dir=..., or "
        "name=..., which names runs/NAME)"
    )


def disk_failure(error: OSError, run_dir: Path) -> str:
    """One line for a write the disk refused outside a checkpoint save (metrics, the run lock,
    TensorBoard): what, where, and where the run resumes from."""
    latest = run_dir / CHECKPOINTS_DIR / LATEST_FILE
    try:
        tag = latest.read_text().strip()
        resume = f"{latest} names {tag}: the same command resumes from it"
    except OSError:
        tag, resume = "", "no checkpoint was written: a rerun starts at step 0"
    # A save the full disk cut short is removed by the next run, once the run has started: a
    # rerun on a disk still full stops before that, and the user can free its room by hand
    cut = sorted(
        f.name
        for f in (run_dir / CHECKPOINTS_DIR).glob("step_*")
        if re.fullmatch(r"step_\d{8}", f.name)  # not a damaged one set aside (step_N.damaged)
        and f.name > tag
        and not (f / CHECKPOINT_META_FILE).is_file()
    )
    room = f" ({', '.join(cut)} in {run_dir / CHECKPOINTS_DIR}: cut short, deleting frees room)"
    return (
        f"stopped: {error.filename or run_dir}: {error.strerror}; {resume} once the disk has "
        f"room and can be written again{room if cut else ''}"
    )


def said(error: Exception | str) -> None:
    """The error's line in one write: print's two writes (the text, then the newline) from
    several ranks saying theirs glue their lines together."""
    sys.stderr.write(f"earlyfuse-train: {error}\n")
    sys.stderr.flush()


def refuse_before_start(error: Exception | str) -> NoReturn:
    """Exit 2 on a config error found before the ranks can talk, which every rank finds alike:
    the first rank of each node says it. The others wait a moment before they exit: the
    launcher stops the remaining ranks once one has exited, and the first must have said it."""
    if int(os.environ.get("LOCAL_RANK", "0")) == 0:
        said(error)
    else:
        time.sleep(SILENT_RANK_WAIT_S)
    sys.exit(2)


def config_groups() -> set[str]:
    return {p.name for p in Path(CONFIG_DIR).iterdir() if p.is_dir()}


HYDRA_RUN_SETTINGS = {"hydra.run.dir": ".", "hydra.output_subdir": "null"}  # configs/config.yaml's
MULTIRUN_REFUSED = (
    "--multirun (-m, hydra.mode=MULTIRUN) is not supported: a sweep would end after its first "
    "run; start one earlyfuse-train per setting, each with its own run_dir"
)


def main(extra_callbacks: CallbackFactory | None = None) -> None:
    sys.argv = strip_launcher_args(sys.argv)
    if "--version" in sys.argv[1:]:  # Hydra's own names only Hydra's version
        from train.callbacks.run_info import package_version

        own = package_version("earlyfuse") or "(not installed)"
        print(f"earlyfuse {own} (Hydra {package_version('hydra-core')})")
        sys.exit(0)
    command = sys.argv[1:]  # as given, before the overrides added below
    # Before Hydra: its own message for an unknown key suggests +key=..., which would add it.
    unknown = unknown_override_keys(overrides_given(sys.argv[1:]), RunConfig, config_groups())
    if unknown:
        refuse_before_start(f"unknown config key(s): {'; '.join(unknown)}")
    if wrong := dashed_override(sys.argv[1:]) or shadowed_config(sys.argv[1:]):
        refuse_before_start(wrong)
    add_overrides(name_after_data(overrides_given(sys.argv[1:])))
    flags = hydra_flags(sys.argv[1:])
    if (
        flags.config_path
        and "://" not in flags.config_path
        and not Path(flags.config_path).is_absolute()
    ):
        # Hydra reads a relative --config-path against train/ (the module's folder) and names
        # a Python package; the user means the folder the command runs in
        full = os.path.abspath(flags.config_path)
        for i, arg in enumerate(sys.argv[1:], 1):
            if arg == flags.config_path and sys.argv[i - 1] in ("--config-path", "-cp"):
                sys.argv[i] = full
            elif arg in (f"--config-path={flags.config_path}", f"-cp={flags.config_path}"):
                sys.argv[i] = f"--config-path={full}"
    if flags.config_path or flags.config_name:
        # Another primary config (a run's own config.yaml) lacks configs/config.yaml's hydra
        # settings: without these Hydra would make an outputs/DATE/TIME folder in the cwd and
        # log to an app.log there in its own format
        given = {arg.lstrip("+").split("=")[0] for arg in overrides_given(sys.argv[1:])}
        settings = {
            **HYDRA_RUN_SETTINGS,
            # where the next one is; quoted: a path may hold what the override grammar parses
            "hydra.searchpath": "['file://"
            + CONFIG_DIR.replace("\\", "\\\\").replace("'", "\\'")
            + "']",
            "hydra/job_logging": "stdout",
        }
        add_overrides([f"{k}={v}" for k, v in settings.items() if k not in given])
    if flags.multirun or any(map(asks_multirun, sys.argv[1:])):
        # The process ends with its run's exit code (a rank's os._exit), so a sweep would stop
        # after its first job, exit code 0; its jobs would share run_dir too.
        refuse_before_start(MULTIRUN_REFUSED)

    # Hydra reports an error found while composing (a misspelt key or a YAML syntax error in the
    # user's data/mine.yaml, a group option that does not exist, an override it cannot parse) in
    # many lines and exits 1. Only HYDRA_FULL_ERROR=1 makes it raise instead (Hydra reads any
    # other value, 0 or empty included, as unset), so that ``compose_error`` can say it in one
    # line. The user's own setting is put back once composed: an error of the run itself is
    # reported as Hydra reports it, and with their HYDRA_FULL_ERROR=1 everything is raised.
    own_full_error = os.environ.get("HYDRA_FULL_ERROR")
    composed = False

    def restore_full_error() -> None:
        if own_full_error is None:
            os.environ.pop("HYDRA_FULL_ERROR", None)
        else:
            os.environ["HYDRA_FULL_ERROR"] = own_full_error

    os.environ["HYDRA_FULL_ERROR"] = "1"

    @hydra.main(version_base="1.3", config_path=CONFIG_DIR, config_name="config")
    def hydra_main(cfg: DictConfig) -> None:
        from hydra.core.hydra_config import HydraConfig
        from hydra.types import RunMode

        nonlocal composed
        composed = True
        restore_full_error()
        if HydraConfig.get().mode == RunMode.MULTIRUN:  # set in a config file, say
            sweep = HydraConfig.get().sweep
            remove_sweep_folder(Path(sweep.dir), str(sweep.subdir))
            refuse_before_start(MULTIRUN_REFUSED)
        if HydraConfig.get().job.chdir:
            refuse_before_start(
                "hydra.job.chdir=true: every path of the run (run_dir, data shards, init_from) is "
                "taken from the folder the command runs in; leave hydra.job.chdir off"
            )
        try:
            run_cfg, resolved = to_run_config(cfg)
        except ConfigError as e:
            refuse_before_start(e)
        code = run(run_cfg, resolved, extra_callbacks, command)
        if int(os.environ.get("WORLD_SIZE", "1")) > 1:
            leave_rank(code)
        sys.exit(code)

    try:
        hydra_main()
    except Exception as e:
        restore_full_error()
        if own_full_error == "1":
            raise
        message = None if composed else compose_error(e, sys.argv[1:])
        if message is None:
            from hydra._internal.utils import run_and_report

            error = e
            run_and_report(lambda: _raise(error))  # Hydra's own report, exit code 1
        else:
            refuse_before_start(message)


def remove_sweep_folder(sweep_dir: Path, job_dir: str) -> None:
    """Hydra makes a sweep's folder (``multirun/DATE/TIME/``, its ``multirun.yaml`` and the first
    job's folder) before that job starts: a refused sweep leaves none of it behind. Only what
    Hydra put there goes, the folders while nothing else is in them, and of a relative sweep
    folder's parents only the empty ones (a sweep.dir of the user's keeps what it held)."""
    with contextlib.suppress(OSError):
        (sweep_dir / job_dir).rmdir()  # an empty folder only
    (sweep_dir / "multirun.yaml").unlink(missing_ok=True)  # Hydra's, just written over any other
    parents = [*sweep_dir.parents][:-1] if not sweep_dir.is_absolute() else []
    for folder in [sweep_dir, *parents]:  # up to the folder the command runs in, not past it
        with contextlib.suppress(OSError):
            folder.rmdir()


def _raise(error: BaseException) -> NoReturn:
    raise error


def compose_error(error: BaseException, args: Sequence[str]) -> str | None:
    """One line for a mistake found while Hydra composes the config, before the run starts (a
    config file that does not fit the schema or is not YAML, a group option that does not exist,
    an override that cannot be parsed or merged, a --config-dir that is not there): the file or
    override, the key and the problem. None for an error that is not a config's."""
    import yaml
    from hydra.errors import HydraException, MissingConfigException, OverrideParseException

    if isinstance(error, yaml.MarkedYAMLError) and error.problem_mark is not None:
        mark = error.problem_mark
        context = f" ({error.context})" if error.context else ""
        return (
            f"{mark.name}, line {mark.line + 1}, column {mark.column + 1}: not valid YAML: "
            f"{error.problem}{context}"
        )
    if isinstance(error, OverrideParseException):
        return override_parse_error(error)
    if isinstance(error, OSError) and not isinstance(error, HydraException):
        return f"{error.filename}: {error.strerror}"  # hydra.run.dir that cannot be made
    if isinstance(error, ValueError) and "Config group override must be" in str(error):
        groups = config_groups()
        nulls = [a.lstrip("+").split("=")[0].split("@")[0] for a in args if a.endswith("=null")]
        group = next((g for g in nulls if g in groups), "a config group")
        options = sorted(p.stem for p in (Path(CONFIG_DIR) / group).glob("*.yaml"))
        listed = f" ({', '.join(options)})" if options else ""
        without = f"give {group}=none" if "none" in options else f"leave {group}= out"
        return (
            f"{group}=null: a config group takes one of its options{listed}; to run without "
            f"one, {without}"
        )
    if not isinstance(error, (HydraException, OmegaConfBaseException)):
        return None
    missing_dir = re.match(r"Additional config directory '(.+)' not found", str(error))
    if missing_dir:
        what = "a file" if Path(missing_dir[1]).is_file() else "not there"
        return (
            f"--config-dir {missing_dir[1]}: {what}; give the folder that holds your config "
            "groups' folders (data/, model/, experiment/, ...)"
        )
    where = re.match(r"In '([^']+)'", str(error))
    place = config_file(where[1], args) + ": " if where and where[1] != "config" else ""
    if isinstance(error, MissingConfigException) and error.options:
        group, _, option = str(error.missing_cfg_file).rpartition("/")
        if not place and (chosen_in := defaults_file(args, group, option)):
            place = f"{chosen_in}: "  # Hydra says 'config': an override in a picked file's list
        own = hydra_flags(args).config_dir
        deep = (
            f"; --config-dir {own} is a group's own folder: give the folder that holds it"
            if own and Path(own).name in config_groups()
            else ""
        )
        return (
            f"{place}{group}={option}: config group {group} has no option {option!r} "
            f"(there are: {', '.join(error.options)}){deep}"
        )
    cause = error.__cause__ or error.__context__
    if where and place and isinstance(cause, OmegaConfBaseException) and cause.full_key:
        return place + schema_error(place[:-2], cause, config_package(where[1], args))
    twice = re.match(r"Multiple values for ([^.]+)\.", str(error))
    added = [a for a in args if twice and a.startswith(f"+{twice[1]}=")]
    if twice and added:  # the habit of templates without an experiment default: +experiment=X
        return (
            f"override {added[0]!r}: {twice[1]} is chosen in the config already; give "
            f"{added[0][1:]} (without the +)"
        )
    if twice and (chosen_in := defaults_file(args, twice[1], None)):
        return (
            f"{chosen_in}: picks {twice[1]} with '- /{twice[1]}: ...', but {twice[1]} is chosen "
            f"already (the primary config's defaults): write '- override /{twice[1]}: ...'"
        )
    if where and place and "Could not override" in str(error) and "@" in str(error):
        # ``override /model: x`` in a file not at the top: the group lands under its package
        text = Path(place[:-2]).read_text() if Path(place[:-2]).is_file() else ""
        if not re.search(r"^#\s*@package\s+_global_", text, re.MULTILINE):
            return (
                f"{place}{str(error).splitlines()[0].split(': ', 1)[-1]} A file that picks other "
                "groups' options (override /GROUP: ...) starts with '# @package _global_', as "
                "experiment files do"
            )
    deleted = re.match(r"Error merging override (~[^\s=]+)", str(error))
    if deleted and "does not support deletion" in str(cause):
        return (  # OmegaConf's words: "OptimConfig (DictConfig) does not support deletion"
            f"override {deleted[1]!r}: a key of the schema cannot be removed; give it a value "
            f"({deleted[1][1:]}=...), or turn a feature off by its own key (e.g. "
            "monitor.collapse.enabled=false)"
        )
    ambiguous = re.match(r"Ambiguous value for argument '(([^=]+)=(.*))'", str(error))
    if ambiguous:  # Hydra's own advice ends "add --multirun", which earlyfuse-train refuses
        override, key, value = ambiguous.groups()
        if key.lstrip("+") in config_groups():  # a list of a group's options merges them all
            choices = " or ".join(f"{key}={option}" for option in value.split(","))
            return f"override {override!r}: one run per command (no sweeps): give {choices}"
        kinds = field_kinds(key)
        if kinds and all(kind in (int, float, bool, type(None)) for kind in kinds):
            return (  # optim.lr=1e-3,3e-3: a sweep, for which a list would not do either
                f"override {override!r}: one value per run (no sweeps): one earlyfuse-train per "
                "value, each with its own run_dir (docs/training.md)"
            )
        forms = [f"a list as {key}=[{value}]", f"a string as {key}='{value}'"]
        if kinds == (str,) or any(typing.get_origin(kind) is list for kind in kinds):
            forms = forms[1:] if kinds == (str,) else forms[:1]
        return (
            f"override {override!r} holds a comma: give {' or '.join(forms)} (one run per "
            "command: no sweeps)"
        )
    sweep = re.match(r"Sweep parameters '([^']+)' requires --multirun", str(error))
    if sweep:  # choice(), range(), glob(), interval(): Hydra's advice is the refused --multirun
        return f"override {sweep[1]!r} is a sweep: one run per command (no sweeps): give one value"
    first, *rest = str(error).splitlines()
    problem = re.sub(r"^In '[^']+': |^Error merging ", "", first).removesuffix(".")
    if isinstance(cause, OmegaConfBaseException):
        # "ValidationError raised while composing config:" says nothing its cause does not
        said = str(cause).splitlines()[0]
        if problem.endswith("while composing config:"):
            problem = said
        elif said not in problem and "$VALUE" not in said:  # not the same, nor a bare template
            problem = f"{problem}: {said}"
    # Hydra's way to give a dict of free keys (deepspeed.config) keys it lacks: +KEY={...}
    add = rest[0].removeprefix("To append to your config use ") if rest else ""
    return place + problem + (f" (to add keys to it: {add})" if add.startswith("+") else "")


def overrides_given(args: Sequence[str]) -> list[str]:
    """The overrides among ``args``, as Hydra's parser reads them; none under --shell-completion
    (``-sc install=bash``: Hydra reads its ``install=...`` as the completion's command)."""
    flags = hydra_flags(args)
    return [] if flags.shell_completion else list(flags.overrides)


def add_overrides(extra: list[str]) -> None:
    """``extra`` on the command line right after the user's overrides (before every flag when
    there are none): Hydra's parser takes the overrides as one run of positional arguments, and
    a flag's value (a path holding ``=``) or a trailing ``--info`` must not take one."""
    if not extra:
        return
    args, given = sys.argv[1:], overrides_given(sys.argv[1:])
    starts = [i for i in range(len(args)) if given and args[i : i + len(given)] == given]
    at = 1 + (starts[0] + len(given) if starts else 0)
    sys.argv[at:at] = extra


def asks_multirun(arg: str) -> bool:
    """An override that sets hydra.mode to MULTIRUN, however written (``++hydra.mode=MULTIRUN``,
    ``hydra.mode='multirun'``)."""
    key, _, value = arg.partition("=")
    if key.lstrip("+~").startswith(("hydra.sweeper", "hydra/sweeper")):
        return True  # the sweeper's settings (its parameters): sweeps are not run
    return key.lstrip("+") == "hydra.mode" and value.strip("'\"").upper() == "MULTIRUN"


def hydra_flags(args: Sequence[str]):
    """Hydra's own flags on the command line (--config-dir, --multirun, ...), read by its parser
    (internal: Hydra hands its task only the composed config, not the flags it was given)."""
    from hydra._internal.utils import get_args_parser

    return get_args_parser().parse_known_args(list(args))[0]


def field_kinds(key: str) -> tuple:
    """The types the schema's ``key`` takes (``(float,)``; ``(str, NoneType)`` for an optional
    one); empty for a key it does not describe (a free-form dict's)."""
    hint: object = RunConfig
    for part in key.lstrip("+").split("."):
        if not isinstance(hint, type) or not dataclasses.is_dataclass(hint):
            return ()
        if part not in {field.name for field in dataclasses.fields(hint)}:
            return ()
        hint = typing.get_type_hints(hint)[part]
    union = typing.get_origin(hint) in (typing.Union, types.UnionType)  # Optional[X], X | None
    return typing.get_args(hint) if union else (hint,)


def dashed_override(args: Sequence[str]) -> str:
    """Why an argument written as a flag is refused (empty: none is): ``--experiment=demo`` is
    not one of Hydra's flags, and its parser would take it for an abbreviation of one
    (``--experimental-rerun``, which then fails with a traceback)."""
    from hydra._internal.utils import get_args_parser

    flags = set(get_args_parser()._option_string_actions)
    for i, arg in enumerate(args):
        name, eq, value = arg.partition("=")
        if arg.startswith("--") and len(name) > 2 and name not in flags:
            after = args[i + 1] if i + 1 < len(args) else ""
            if not eq:  # --exp demo: its value is the next argument, if that is no flag
                value = after if after[:1] not in ("", "-") and "=" not in after else "VALUE"
            example = f"{name[2:]}={value}"
            if close := difflib.get_close_matches(name, flags, n=1, cutoff=0.8):
                return f"{name}: not a flag of earlyfuse-train (Hydra's); did you mean {close[0]}?"
            return (
                f"{name}: earlyfuse-train takes Hydra overrides, key=value without dashes "
                f"({example}); its flags are Hydra's own (--config-dir, --cfg job, --help, "
                "--hydra-help lists them)"
            )
    return ""


def shadowed_config(args: Sequence[str]) -> str:
    """Why a config folder of the user's is refused (empty: it is not): it holds a file under
    the name of one of ours (``experiment/demo.yaml``) that differs from ours. Hydra searches
    our folder before the user's (``--config-dir`` and ``hydra.searchpath`` come after the
    primary config's), so theirs would be ignored without a word."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import OverrideParseException

    ours = Path(CONFIG_DIR).resolve()
    dirs = [own] if (own := hydra_flags(args).config_dir) else []
    searchpath = [a for a in overrides_given(args) if a.lstrip("+").startswith("hydra.searchpath=")]
    try:
        parsed = OverridesParser.create().parse_overrides(searchpath)
    except OverrideParseException:
        parsed = []  # said as Hydra's parser says it, once composing starts
    for given in parsed:
        if isinstance(paths := given.value(), list):
            dirs += [str(p)[len("file://") :] for p in paths if str(p).startswith("file://")]
    for folder in map(Path, dirs):
        if not folder.is_dir() or folder.resolve() == ours:
            continue
        clashes = [
            (folder / theirs.relative_to(ours), theirs)
            for theirs in sorted(ours.rglob("*.yaml"))  # ours are few; the user's folder may be big
            if (folder / theirs.relative_to(ours)).is_file()
            and theirs.read_bytes() != (folder / theirs.relative_to(ours)).read_bytes()
        ]
        if clashes:
            mine, theirs = clashes[0]
            name = theirs.relative_to(ours)
            more = f" (and {len(clashes) - 1} more: {', '.join(str(m) for m, _ in clashes[1:4])})"
            return (
                f"{mine}: earlyfuse has a config of that name ({theirs}), which Hydra finds "
                f"before yours: yours would be ignored; rename it (e.g. "
                f"{name.with_name(f'my_{name.name}')}) and choose it by its new name"
                + (more if len(clashes) > 1 else "")
            )
    return ""


def defaults_file(args: Sequence[str], group: str, option: str | None) -> str:
    """The config file picked on the command line (``experiment=x``, ``stage=y``) whose defaults
    list names ``/GROUP: OPTION`` (any option for None, and then without ``override``): Hydra
    reports such a line as the primary config's. Empty when none does."""
    dirs = [hydra_flags(args).config_dir or "", CONFIG_DIR]
    picked = override_items(overrides_given(args))
    value = re.escape(option) if option else r"\S+"
    line = rf"^\s*-\s*{'' if option else '(?!override)'}(override\s+)?/{group}\s*:\s*{value}\s*$"
    for chosen_group, chosen in picked:
        for folder in filter(None, dirs):
            path = Path(folder) / chosen_group / f"{chosen}.yaml"
            if path.is_file() and re.search(line, path.read_text(), re.MULTILINE):
                return str(path)
    return ""


def config_file(where: str, args: Sequence[str]) -> str:
    """The file Hydra names as ``data/mine`` (a name is in one folder only: ``shadowed_config``),
    else ``config X``."""
    config_dir = hydra_flags(args).config_dir
    dirs = [Path(config_dir)] if config_dir else []
    files = [d / f"{where}.yaml" for d in dirs + [Path(CONFIG_DIR)]]
    return next((str(f) for f in files if f.is_file()), f"config {where}")


def config_package(where: str, args: Sequence[str]) -> str:
    """Where Hydra puts config ``where`` (``data/extra/x``) unless its ``# @package`` header says:
    the package of the override ``GROUP@PACKAGE=OPTION`` that chose it (one group may be chosen
    twice, at two packages), else its group's path with ``/`` as ``.`` (``data.extra``), the
    default package since Hydra 1.1."""
    from hydra.core.override_parser.overrides_parser import OverridesParser

    group, _, option = where.rpartition("/")
    for given in OverridesParser.create().parse_overrides([a for a in args if "@" in a]):
        value = given.value()  # x, 'x' or a list [x, y] of options
        chosen = option in value if isinstance(value, list) else value == option
        if given.key_or_group == group and given.package and chosen:
            return given.package.rpartition(":")[2]  # @OLD:NEW moves a default to NEW
    return group.replace("/", ".")


def schema_error(name: str, cause, package: str = "") -> str:
    """The key and the problem of a config file's value the schema refuses: an unknown key with
    the nearest known one, or a value of the wrong type; ``package``: the file's when it has no
    ``# @package`` header (``config_package``)."""
    from omegaconf.errors import ConfigKeyError

    key = str(cause.full_key)
    if "." not in key and "[" not in key and Path(name).is_file():
        # OmegaConf names a list item's key alone
        value = None if isinstance(cause, ConfigKeyError) else cause.value
        key = list_item_path(Path(name), key, value, package) + key
    schema = getattr(cause, "object_type", None)
    if isinstance(cause, ConfigKeyError) and dataclasses.is_dataclass(schema):
        path = key[: len(key) - len(str(cause.key))]
        return f"unknown config key {key}{suggestion(str(cause.key), schema, path)}"  # type: ignore[arg-type]
    return f"{key}: {str(cause).splitlines()[0]}"


def list_item_path(file: Path, key: str, value: object = None, package: str = "") -> str:
    """``data.sources[0].``: where in ``file`` the first list item holding ``key`` (with that
    ``value``, when given) is, its package (``# @package``, else ``package``) in front; "" when
    no list item holds it. A package is absolute: ``_global_`` is the top, ``_global_.data`` is
    ``data``."""
    import yaml

    text = file.read_text()
    tree = yaml.safe_load(text)
    header = re.search(r"^#\s*@package\s+(\S+)", text, re.MULTILINE)
    package = re.sub(r"^_global_\.?", "", header[1] if header else package)
    package = f"{package}." if package else ""

    def find(node, path: str) -> str | None:
        items = node.items() if isinstance(node, dict) else enumerate(node)
        for k, item in items:
            inner = f"{path}{k}." if isinstance(node, dict) else f"{path[:-1]}[{k}]."
            if k == key and "[" in path and (value is None or str(item) == str(value)):
                return path
            if isinstance(item, (dict, list)) and (found := find(item, inner)) is not None:
                return found
        return None

    body = {k: v for k, v in tree.items() if k != "defaults"} if isinstance(tree, dict) else {}
    found = find(body, package)
    return found or ""


def override_parse_error(error) -> str:
    """Hydra's parser's report of an override in one line: what it could not read, and where."""
    override = error.override
    lines = [line for line in str(error).splitlines() if not line.startswith("See https://")]
    if len(lines) > 1 and lines[1].strip() == "^":  # the lexer's: a caret under the first bad one
        at = lines[1].index("^") - len("LexerNoViableAltException: ")
        hint = {"'": "an unclosed quote?", '"': "an unclosed quote?", " ": "quote it"}
        problem = f"cannot read {override[at:]!r} (character {at + 1})"
        problem += f": {hint[override[at]]}" if override[at : at + 1] in hint else ""
    else:
        problem = lines[-1].split(" expecting {")[0]  # the expected tokens' list is the grammar's
    bare = re.fullmatch(r"[\w.-]{1,100}", override) is not None  # a name, not a long value
    groups = sorted(
        (
            g
            for g in config_groups()
            if bare and (Path(CONFIG_DIR) / g / f"{override}.yaml").is_file()
        ),
        key=lambda g: (g != "experiment", g),  # a whole recipe is what a bare name means most
    )
    if "=" not in override and groups:  # `earlyfuse-train demo`: a preset's name alone
        problem += f": did you mean {' or '.join(f'{g}={override}' for g in groups)}?"
    if re.match(r"[^=\[]+\[\d", override):
        problem += (
            ": an override cannot index a list; give the whole list (KEY=[...]) or set it in a "
            "config file of your own (--config-dir, docs/own_data.md)"
        )
    return (
        f"cannot parse override {override!r}: {problem} "
        "(https://hydra.cc/docs/advanced/override_grammar/basic)"
    )


def leave_rank(code: int) -> NoReturn:
    """End a rank of a multi-process run without tearing the interpreter down. PyTorch's C++
    threads (gloo's workers, autograd's) can still call into Python while it is being
    finalized, which aborts the process ("terminate called without an active exception",
    SIGABRT) after the run is done; torchrun then reports the job as failed and a scheduler
    retries it. By now ``run`` has closed everything it wrote to, stopped the loader's workers
    and destroyed the process groups: only the logging handlers and the console remain."""
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    main()
