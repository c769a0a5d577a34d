"""Checkpoints of a run: ``RUN_DIR/checkpoints/step_NNNNNNNN/`` plus a ``latest`` pointer.

Design choices:
- DeepSpeed writes model, optimizer and scheduler (any ZeRO stage; ``zero_to_fp32.py`` beside
  them consolidates). Beside them each rank writes ``rank_RRRRR.pt`` (its RNG states, its loader
  state, task state); rank 0 writes the resolved config and the vocabulary layout.
- Nothing is unpickled: every file, DeepSpeed's included, is read weights-only
  (train/safe_load.py).
- ``meta.json`` (step, world size, ZeRO stage, and the size and SHA-256 of every file) is written
  last, after a barrier that every rank reaches once its files are written; each node then
  syncs what it wrote to disk (sync(2)) before the ranks share the hashing, so a node's crash or
  a power loss cannot leave a manifest naming files that come back empty. Then ``latest`` moves
  (written to a temporary name, synced, renamed, the rename synced). A crash mid-save leaves
  ``latest`` on the previous checkpoint; the half-written folder is removed on resume, with a
  warning. A crash between a checkpoint's ``meta.json`` and its ``latest`` leaves a complete
  checkpoint newer than ``latest`` (or no ``latest``, the first time): the next start resumes
  from it and says so. A rollback first writes what it does (the step it goes back to, the
  data it skips, the run's count of rollbacks) in ``checkpoints/rollback.json``, and that file
  stays until the next checkpoint is committed (removed just before ``latest`` moves): a start
  that finds it finishes the rollback, so what a rollback abandons is never taken for such a
  save, and carries it out again (``Rollback.pre_train``), since the checkpoint it went back to
  holds none of it. A save that fails (disk
  full, a file-size limit, a folder that cannot be written) is one error saying which, where,
  and which checkpoint the next start resumes from (train/save_errors.py).
- Resume checks the checkpoint ``latest`` names before loading it: sizes first (a truncated
  file is found at once), then SHA-256. A damaged checkpoint (or an unreadable ``latest``) is
  set aside as ``step_N.damaged`` (its ``DAMAGED.txt`` says why, so a later start that finds
  ``latest`` naming it reports it damaged, not missing) with a warning naming the bad file, and
  the newest intact one is used; if none is intact the run stops with an error listing them,
  never silently at step 0. A checkpoint without its manifest of files is refused the same way.
- keep-last-N: older checkpoints are deleted after ``latest`` has moved, except the steps in
  ``protect`` (the monitor's ``protected_steps``: the newest checkpoint from before an open
  alarm, so that a rollback still has somewhere to go); each is first renamed to
  ``step_N.deleting`` (one atomic step), so a kill mid-delete never leaves a folder that looks
  complete. Leftovers are removed at the next save or resume.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import torch

from data.shards.index import file_sha256
from data.shards.storage import write_atomic
from train.config_check import ConfigError
from train.dist import DistInfo, barrier, peer_gone
from train.names import CHECKPOINT_META_FILE, CHECKPOINTS_DIR, CONFIG_FILE, LATEST_FILE
from train.safe_load import CheckpointError, safe_torch_load, weights_only_loads
from train.save_errors import CheckpointWriteError, describe_write_failure

TAG = re.compile(r"^step_(\d{8})$")


@contextmanager
def model_must_fit(where: Path) -> Iterator[None]:
    """A checkpoint whose tensors do not fit the model (a model setting changed since it was
    saved: ``model.dim``, a layer more) is a config error said in one line, not torch's
    traceback of one "size mismatch" line per tensor; the checkpoint itself is sound."""
    try:
        yield
    except RuntimeError as e:
        lines = [line.strip() for line in str(e).splitlines()]
        first = next((line for line in lines if "size mismatch" in line or "key(s)" in line), None)
        if first is None:
            raise
        raise ConfigError(
            f"{where}: its weights do not fit this run's model ({first.rstrip('.')}): a model "
            "setting or the vocabulary (the tokenizers) changed since it was saved (any config "
            "change is listed above). A checkpoint resumes the model it was saved from: undo "
            "the change, or give the new model another run_dir"
        ) from None


def step_of_tag(tag: str) -> int:
    """The step of a checkpoint folder name ``step_NNNNNNNN``."""
    match = TAG.match(tag)
    if match is None:
        raise ValueError(f"{tag!r} is not a checkpoint folder name (step_NNNNNNNN)")
    return int(match.group(1))


META = CHECKPOINT_META_FILE
DAMAGED = ".damaged"
DELETING = ".deleting"
ROLLBACK = "rollback.json"  # a rollback no checkpoint holds yet: what it does (``rewind``)
DAMAGED_NOTE = "DAMAGED.txt"  # in a folder set aside: what was wrong with it


def tag_for(step: int) -> str:
    return f"step_{step:08d}"


# A copy of the run's config for people and tools, which they may edit (paths, after moving
# data); resume never reads it: not in the manifest.
EDITABLE = {CONFIG_FILE}


def checkpoint_files(folder: Path) -> list[str]:
    """The files a checkpoint's manifest covers: every file of the folder and its subfolders
    (``universal/`` has its own manifest), relative to ``folder``, but ``meta.json`` and the
    editable ``config.yaml``."""
    folder = Path(folder)
    return sorted(
        str(path.relative_to(folder))
        for path in folder.rglob("*")
        if path.is_file() and path.name not in (META, *EDITABLE) and not path.name.endswith(".tmp")
    )


def file_manifest(folder: Path, names: list[str]) -> dict[str, dict]:
    """{name: {"bytes": size, "sha256": hex}} of ``names`` inside ``folder``."""
    out = {}
    for name in names:
        path = Path(folder) / name
        out[name] = {"bytes": path.stat().st_size, "sha256": file_sha256(path)}
    return out


def sync_to_disk() -> None:
    """Flush what this node wrote (sync(2): files and folder entries, on every file system, a
    network one's client cache included) before a manifest declares the files complete: after a
    node's crash or a power loss, a manifest must not name files the page cache still held (they
    came back empty). Each node syncs its own: an fsync from another node does not flush them."""
    os.sync()


def verify_files(folder: Path, files: dict[str, dict], *, hashes: bool = True) -> list[str]:
    """Problems found checking ``folder`` against a manifest (empty: intact). Sizes first, for
    every file, so a truncated file is named without hashing anything."""
    folder = Path(folder)
    problems = []
    for name, want in files.items():
        path = folder / name
        try:
            size = path.stat().st_size
        except OSError:
            problems.append(f"{path}: missing")
            continue
        if size != want["bytes"]:
            problems.append(f"{path}: {size} bytes, the manifest says {want['bytes']} (truncated?)")
    if problems or not hashes:
        return problems
    for name, want in files.items():
        if file_sha256(folder / name) != want["sha256"]:
            problems.append(f"{folder / name}: SHA-256 differs from the manifest (corrupted)")
    return problems


def read_meta(folder: Path) -> dict:
    """A checkpoint's ``meta.json``; CheckpointError naming it when missing or unreadable."""
    path = Path(folder) / META
    try:
        meta = json.loads(path.read_text())
        int(meta["step"]), int(meta["world_size"]), int(meta["zero_stage"]), str(meta["task"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(f"{path}: missing or unreadable ({type(e).__name__}: {e})") from None
    return meta


def verify_folder(folder: Path, *, hashes: bool = True) -> list[str]:
    """Problems of one checkpoint folder (empty: intact): its meta and every file it lists. A
    ``meta.json`` without its manifest of files is not one a save wrote: nothing in the folder
    can be trusted. Its ``universal/`` conversion is not part of it (``verify_universal``)."""
    folder = Path(folder)
    try:
        meta = read_meta(folder)
    except CheckpointError as e:
        return [str(e)]
    if not isinstance(meta.get("files"), dict) or not meta["files"]:
        return [f"{folder / META}: no manifest of the checkpoint's files (not written by a save)"]
    return verify_files(folder, meta["files"], hashes=hashes)


def verify_universal(folder: Path, *, hashes: bool = True) -> list[str]:
    """Problems of the ``universal/`` conversion of checkpoint ``folder`` against its own
    manifest, ``source.json`` (written last). Only a resume on another world size reads the
    conversion, so a damaged one stops that resume alone: the checkpoint stays, at its own world
    size, for a release, and to convert again."""
    uni = Path(folder) / "universal" / "source.json"
    try:
        files = json.loads(uni.read_text())["files"]
    except FileNotFoundError:
        return [f"{uni}: missing (the conversion did not finish)"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        return [f"{uni}: unreadable ({e})"]
    return verify_files(uni.parent, files, hashes=hashes)


def remove_checkpoint(folder: Path) -> None:
    """Delete a checkpoint folder so that no kill can leave it looking complete: renamed out of
    the ``step_N`` names first (atomic), then removed."""
    folder = Path(folder)
    if not folder.exists():
        return
    doomed = folder.with_name(folder.name + DELETING)
    shutil.rmtree(doomed, ignore_errors=True)
    os.replace(folder, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def warn(msg: str) -> None:
    print(f"warning: {msg}", file=sys.stderr, flush=True)


def why_missing(checkpoints: Path, tag: str) -> str:
    """Why checkpoint ``tag`` is not in ``checkpoints``: set aside as damaged by an earlier start
    (its note says why), or gone."""

    def attempt(path: Path) -> int:  # step_N.damaged, .damaged2, ... .damaged10: by number
        number = path.name.removeprefix(f"{tag}{DAMAGED}")
        return int(number) if number.isdigit() else 1

    asides = sorted(Path(checkpoints).glob(f"{tag}{DAMAGED}*"), key=attempt)
    if not asides:
        return f"{Path(checkpoints) / tag} is missing"
    note = asides[-1] / DAMAGED_NOTE
    why = note.read_text().strip() if note.is_file() else "what was wrong was not recorded"
    return f"{tag} is damaged ({why}); an earlier start set it aside as {asides[-1].name}"


def universal_load(engine, on: bool) -> None:
    """Whether the engine's next ``load_checkpoint`` reads a universal checkpoint (the ZeRO
    optimizer then loads the per-parameter files of step_N/universal/ for this world size).
    DeepSpeed reads ``checkpoint.load_universal`` from its config at every load and has no
    setter; set per load, a run resumed from a universal checkpoint loads its own later ones, a
    rollback's, the ordinary way."""
    engine._config.load_universal_checkpoint = on


class Checkpointer:
    def __init__(
        self, run_dir: str | Path, dist: DistInfo, keep_last: int, *, verify_hashes: bool = True
    ) -> None:
        self.dir = Path(run_dir) / CHECKPOINTS_DIR
        self.dist = dist
        self.keep_last = max(1, keep_last)
        # False: resume checks sizes only (docs/checkpoints.md has what hashing costs)
        self.verify_hashes = verify_hashes
        self._checked = False  # this process has had `latest` checked (main) / waited for it
        self._main_checked = False
        # Called with the step once this rank's files of a save are written, before the barrier
        # after which `latest` moves. Tests use it to crash a save half-way (train/callbacks/faults.py).
        self.before_commit: Callable[[int], None] | None = None

    # --- reading -----------------------------------------------------------------------------
    def latest(self) -> str | None:
        """The checkpoint to resume from. The first call is collective (every rank makes it):
        rank 0 checks the checkpoint ``latest`` names and falls back to the newest intact one
        (``check_latest``) while the others wait; after that it only reads ``latest``."""
        if not self._checked:
            self._checked = True
            if self.dist.is_main:
                self.check_latest()
            barrier()
        return self._pointer()

    def _pointer(self) -> str | None:
        pointer = self.dir / LATEST_FILE
        if not pointer.is_file():
            return None
        tag = pointer.read_text().strip()
        if not TAG.match(tag) or not (self.dir / tag / META).is_file():
            raise CheckpointError(
                f"{pointer} names {tag!r}, which is not a complete checkpoint; delete {pointer} and the "
                f"step_* folders beside it to start over"
            )
        return tag

    def check_latest(self) -> str | None:
        """Rank 0, once: make ``latest`` name an intact checkpoint. Returns it (None: none yet)."""
        if self._main_checked or not self.dir.is_dir():
            return None
        self._main_checked = True
        record = self.pending_rollback()
        pointer = self.dir / LATEST_FILE
        named = pointer.read_text().strip() if pointer.is_file() else ""
        if record is not None and TAG.match(named) and step_of_tag(named) > record["to_step"]:
            # a rollback stopped before `latest` went back (the last thing it does): finish it
            warn(
                f"finishing a rollback to {tag_for(record['to_step'])} that was stopped before "
                "it was done"
            )
            self._rewind_to(record["to_step"])
        latest = self._intact_latest()
        if record is not None and latest is not None and step_of_tag(latest) > record["to_step"]:
            # a save past the rollback was complete but a kill came before `latest` moved: that
            # checkpoint (taken as newer than `latest`) holds the rollback
            (self.dir / ROLLBACK).unlink(missing_ok=True)
        return latest

    def _intact_latest(self) -> str | None:
        for folder in self.dir.iterdir():  # a kill mid-delete left these; they hold nothing needed
            if folder.is_dir() and folder.name.endswith(DELETING):
                shutil.rmtree(folder, ignore_errors=True)
        pointer = self.dir / LATEST_FILE
        if not pointer.is_file():
            return self._adopt_unnamed()
        named = pointer.read_text().strip()
        reasons: list[str] = []  # why `latest` cannot be taken as it is
        if TAG.match(named):
            newest: int | None = step_of_tag(named)
            if adopted := self._adopt_newer(named):
                return adopted
            if not (self.dir / named).is_dir():
                reasons.append(why_missing(self.dir, named))
        else:
            newest = None
            reasons.append(f"{pointer} is unreadable ({named[:40]!r}: truncated?)")
        candidates = [
            folder
            for folder in reversed(self.tags())
            if newest is None or step_of_tag(folder.name) <= newest
        ]
        for folder in candidates:
            problems = verify_folder(folder, hashes=self.verify_hashes)
            if not problems:
                if reasons:
                    warn(f"resuming from {folder}, not {named!r}: " + "; ".join(reasons))
                    write_atomic(pointer, f"{folder.name}\n".encode())
                return folder.name
            aside = self._set_aside(folder, problems)
            reasons.append(
                f"{folder.name} is damaged ({problems[0]}"
                + (f"; {len(problems) - 1} more problem(s)" if len(problems) > 1 else "")
                + f"), set aside as {aside.name}"
            )
        raise CheckpointError(
            f"{self.dir}: no intact checkpoint to resume from ("
            + "; ".join(reasons or ["no checkpoint folders"])
            + f"). Restore one, or delete {pointer} to start over from step 0"
        )

    def _adopt_newer(self, named: str) -> str | None:
        """A complete, intact checkpoint newer than the one ``latest`` names: a run killed after
        writing its ``meta.json`` (written last) and before ``latest`` moved. It becomes
        ``latest`` with a warning (a rollback's abandoned folders never look so: ``rewind``)."""
        for folder in reversed(self.tags()):
            if step_of_tag(folder.name) <= step_of_tag(named):
                return None
            if not (folder / META).is_file():
                continue  # a save cut short: clean_partial removes it
            if problems := verify_folder(folder, hashes=self.verify_hashes):
                aside = self._set_aside(folder, problems)
                warn(
                    f"{folder} is newer than {named} and damaged ({problems[0]}): set aside as {aside.name}"
                )
                continue
            warn(
                f"{folder} is complete and newer than {named}, which {LATEST_FILE} names (the "
                f"run was stopped between writing its {META} and {LATEST_FILE}): resuming from it"
            )
            write_atomic(self.dir / LATEST_FILE, f"{folder.name}\n".encode())
            return folder.name
        return None

    def _adopt_unnamed(self) -> str | None:
        """No ``latest``: no checkpoint was ever completed, or a run was killed after writing
        its first checkpoint's ``meta.json`` (written last: the checkpoint is complete) and before
        ``latest``. Such a checkpoint, intact, becomes ``latest`` with a warning; anything else
        is left to clean_partial."""
        for folder in reversed(self.tags()):
            if (folder / META).is_file() and not verify_folder(folder, hashes=self.verify_hashes):
                pointer = self.dir / LATEST_FILE
                warn(
                    f"{pointer} is missing but {folder} is complete (the run was stopped between "
                    f"writing its {META} and {LATEST_FILE}): resuming from it"
                )
                write_atomic(pointer, f"{folder.name}\n".encode())
                return folder.name
        return None

    def _set_aside(self, folder: Path, problems: list[str]) -> Path:
        aside, attempt = folder.with_name(folder.name + DAMAGED), 1
        while aside.exists():
            attempt += 1
            aside = folder.with_name(f"{folder.name}{DAMAGED}{attempt}")
        try:
            os.replace(folder, aside)
        except OSError as e:  # checkpoints/ not writable: say the damage, and why it stays
            raise CheckpointError(
                f"{folder} is damaged ({'; '.join(problems[:2])}) and cannot be set aside as "
                f"{aside.name}: {e.strerror}. Make {self.dir} writable for this user (or move the "
                "damaged folder away) and rerun"
            ) from None
        try:  # for the next start, which finds `latest` naming a folder that is gone
            (aside / DAMAGED_NOTE).write_text("; ".join(problems) + "\n")
        except OSError:
            pass  # a note only: the warning said it already
        return aside

    def meta(self, tag: str) -> dict:
        return read_meta(self.dir / tag)

    def verify(self, tag: str) -> list[str]:
        """Problems of checkpoint ``tag`` (empty: intact); see ``verify_folder``."""
        return verify_folder(self.dir / tag, hashes=self.verify_hashes)

    def check_compatible(self, tag: str, zero_stage: int) -> dict:
        """The checkpoint's meta; refuses what cannot resume here with a CheckpointError (one line,
        exit code 2). Another world size resumes from a ZeRO-0 checkpoint as it is, from a ZeRO 1-2
        one through its universal/ conversion, and not from a ZeRO-3 one."""
        meta = self.meta(tag)
        if meta["zero_stage"] != zero_stage:
            raise CheckpointError.alike(
                f"{self.dir / tag} was written with ZeRO stage {meta['zero_stage']}; this run uses "
                f"{zero_stage}. Resume with deepspeed.zero_stage={meta['zero_stage']}, or, to go on "
                f"under ZeRO {zero_stage}, release its weights (`earlyfuse-convert release "
                f"{self.dir.parent} OUT`) and start a new run from them with train.init_from=OUT "
                "(the optimizer starts again)."
            )
        if meta["world_size"] != self.dist.world_size and zero_stage == 3:
            # Tried: DeepSpeed 0.19 converts it and the ZeRO-3 engine loads the conversion, but
            # the run does not go on as it was (the loss of the second resumed step 8e-3 off,
            # ZeRO 2's 5e-7): weights yes, optimizer state not as saved.
            raise CheckpointError.alike(
                f"{self.dir / tag} was written by {meta['world_size']} rank(s) under ZeRO 3; "
                f"this run has {self.dist.world_size}. A ZeRO-3 checkpoint resumes only on the "
                "world size that wrote it (its universal conversion does not restore the "
                f"optimizer as saved): run with {meta['world_size']} rank(s), or release its "
                f"weights (`earlyfuse-convert release {self.dir.parent} OUT`) and start a new run "
                "from them with train.init_from=OUT."
            )
        if (
            meta["world_size"] != self.dist.world_size
            and zero_stage > 0
            and not self.universal(tag)
        ):
            # A universal/ left by a conversion that stopped half-way is replaced with --force
            force = " --force" if (self.dir / tag / "universal").exists() else ""
            raise CheckpointError.alike(
                f"{self.dir / tag} was written by {meta['world_size']} rank(s); this run has "
                f"{self.dist.world_size}. Its ZeRO-{zero_stage} shards fit only that world size: make a universal "
                f"checkpoint with `earlyfuse-convert universal {self.dir.parent}{force}` and rerun this command, "
                f"or run with {meta['world_size']} rank(s)."
            )
        if meta["world_size"] != self.dist.world_size and zero_stage > 0:
            # Sizes on every rank, the hashes (which read the whole conversion) on rank 0 alone
            hashes = self.verify_hashes and self.dist.is_main
            problems = verify_universal(self.dir / tag, hashes=hashes)
            if problems:
                raise CheckpointError(
                    f"{self.dir / tag / 'universal'}: the universal conversion is damaged "
                    f"({'; '.join(problems[:2])}); make it again with `earlyfuse-convert universal "
                    f"{self.dir.parent} --step {meta['step']} --force` (the checkpoint itself is "
                    "intact) and rerun this command"
                )
        return meta

    def universal(self, tag: str) -> bool:
        return (self.dir / tag / "universal" / "mp_rank_00_model_states.pt").is_file()

    def loadable(self, step: int, zero_stage: int) -> bool:
        """Whether this world can load the checkpoint of ``step`` (one written by another world
        size under ZeRO 1-3 only through its universal/ conversion)."""
        tag = tag_for(step)
        same = self.meta(tag)["world_size"] == self.dist.world_size
        return same or zero_stage == 0 or self.universal(tag)

    def load_resharded(self, engine, tag: str, zero_stage: int) -> tuple[dict, dict | None]:
        """Load a checkpoint written by another world size: (client state, this rank's own state if
        the old world had this rank, else None)."""
        load_dir, load_tag = (self.dir / tag, "universal") if zero_stage > 0 else (self.dir, tag)
        universal_load(engine, zero_stage > 0)
        with weights_only_loads(), model_must_fit(load_dir / load_tag):
            path, client = engine.load_checkpoint(
                str(load_dir),
                tag=load_tag,
                load_optimizer_states=True,
                load_lr_scheduler_states=True,
            )
        if path is None:
            raise CheckpointError(
                f"{load_dir / load_tag}: DeepSpeed could not load this checkpoint"
            )
        rank_file = self.dir / tag / f"rank_{self.dist.rank:05d}.pt"
        own = safe_torch_load(rank_file) if rank_file.is_file() else None
        return client or {}, own

    def load_streams(self, tag: str) -> list[dict]:
        """The data stream state of every rank that wrote ``tag``, in rank order: a loader moved onto
        another world size needs all of them (data.loader.redistribute), not only its own rank's."""
        out = []
        for rank in range(self.meta(tag)["world_size"]):
            rank_file = self.dir / tag / f"rank_{rank:05d}.pt"
            try:
                out.append(safe_torch_load(rank_file)["stream"])
            except (CheckpointError, KeyError, TypeError) as e:
                raise CheckpointError(
                    f"{rank_file}: unreadable rank state ({e}); every old rank's is needed to move "
                    "the loader's position onto this world size"
                ) from None
        return out

    def load(self, engine, tag: str) -> tuple[dict, dict]:
        """(client state saved by rank 0, this rank's own state)."""
        universal_load(engine, False)
        with weights_only_loads(), model_must_fit(self.dir / tag):
            path, client = engine.load_checkpoint(
                str(self.dir), tag=tag, load_optimizer_states=True, load_lr_scheduler_states=True
            )
        if path is None:
            raise CheckpointError(f"{self.dir / tag}: DeepSpeed could not load this checkpoint")
        own = safe_torch_load(self.dir / tag / f"rank_{self.dist.rank:05d}.pt")
        return client or {}, own

    def complete_steps(self) -> list[int]:
        """Steps of the complete checkpoints up to ``latest``, oldest first."""
        latest = self.latest()
        if latest is None:
            return []
        last = step_of_tag(latest)
        steps = [step_of_tag(folder.name) for folder in self.tags() if (folder / META).is_file()]
        return [step for step in steps if step <= last]

    def rewind(self, step: int, record: dict | None = None) -> None:
        """Make ``step`` the latest checkpoint and delete the newer ones (a rollback: they hold the
        trajectory being abandoned). ``record``: what else the rollback does (``ROLLBACK``)."""
        barrier()
        if self.dist.is_main:
            # said first: a kill at any point of it leaves the next start to finish it
            # (check_latest), never to take what it abandons for a save that lacks its latest
            text = json.dumps({**(record or {}), "to_step": step}) + "\n"
            write_atomic(self.dir / ROLLBACK, text.encode())
            self._rewind_to(step)
        barrier()

    def pending_rollback(self) -> dict | None:
        """The rollback no checkpoint holds yet (``rewind``'s record), or None."""
        try:
            return json.loads((self.dir / ROLLBACK).read_text())
        except FileNotFoundError:
            return None

    def _rewind_to(self, step: int) -> None:
        for folder in self.tags():
            if step_of_tag(folder.name) > step:
                remove_checkpoint(folder)
        write_atomic(self.dir / LATEST_FILE, f"{tag_for(step)}\n".encode())

    def clean_partial(self) -> None:
        """Remove checkpoint folders newer than ``latest`` (a save that a crash cut short), once
        ``latest`` names an intact checkpoint (``check_latest``)."""
        if not self.dist.is_main or not self.dir.is_dir():
            return
        self.check_latest()
        latest = self._pointer()
        last = step_of_tag(latest) if latest else -1
        for folder in self.tags():
            if step_of_tag(folder.name) > last:  # complete ones were taken or set aside
                why = f"newer than {LATEST_FILE}, left by a save that did not complete"
                warn(f"removing {folder}: {why}")
                remove_checkpoint(folder)

    def tags(self) -> list[Path]:
        """The checkpoint folders there are, complete or not, oldest first."""
        return (
            sorted(
                folder
                for folder in self.dir.iterdir()
                if folder.is_dir() and TAG.match(folder.name)
            )
            if self.dir.is_dir()
            else []
        )

    # --- writing -----------------------------------------------------------------------------
    def save(
        self,
        engine,
        step: int,
        *,
        client: dict,
        own: dict,
        meta: dict,
        files: dict[str, str],
        protect: set[int] | frozenset[int] = frozenset(),
    ) -> str:
        tag = tag_for(step)
        folder = self.dir / tag
        if self.dist.is_main and (folder / META).exists():
            (folder / META).unlink()  # a step saved again (after a rollback): incomplete until done
        barrier()
        pointer = self.dir / LATEST_FILE
        previous = pointer.read_text().strip() if pointer.is_file() else None
        try:
            self._write(engine, folder, step, client, own, meta, files, protect)
        except (OSError, RuntimeError) as error:
            if self.dist.world_size > 1 and peer_gone(error):
                raise  # another rank died mid-save: said as a lost rank (train/app.py), not a disk's
            kept = (
                f"{tag} is complete (its {META} is written): run the same command again once "
                "this is fixed to resume from it"
                if self.dist.is_main and (folder / META).is_file()
                else f"{self.dir / LATEST_FILE} still names {previous}, which is intact: run the "
                "same command again once this is fixed to resume from it (the incomplete "
                f"{tag} is removed then)"
                if previous
                else f"no earlier checkpoint exists: a rerun starts at step 0 (the incomplete "
                f"{tag} is removed then)"
            )
            raise CheckpointWriteError(
                f"checkpoint {folder} could not be written: {describe_write_failure(folder, error)}"
                f". {kept}"
            ) from error
        self._checked = self._main_checked = True  # `latest` is ours now
        return tag

    def _write(self, engine, folder, step, client, own, meta, files, protect) -> None:
        tag = folder.name
        engine.save_checkpoint(str(self.dir), tag=tag, client_state=client, save_latest=False)
        torch.save(own, folder / f"rank_{self.dist.rank:05d}.pt")
        if self.dist.is_main:
            for name, text in files.items():
                (folder / name).write_text(text)
        if self.before_commit is not None:
            self.before_commit(step)  # tests crash a save here: files written, `latest` not moved
        barrier()  # every rank's files are written before they are hashed and `latest` moves
        if self.dist.local_rank == 0:
            sync_to_disk()  # before the hashes, which every rank must gather
        manifest = self._hash_shared(folder)
        if self.dist.is_main:
            # meta.json last: a folder without it is never taken for a checkpoint
            record = {**meta, "step": step, "tag": tag, "files": manifest}
            write_atomic(folder / META, (json.dumps(record, indent=1) + "\n").encode())
            # this checkpoint holds a pending rollback's effects; a kill before latest moves
            # leaves it complete and newer than latest, which the next start takes
            (self.dir / ROLLBACK).unlink(missing_ok=True)
            write_atomic(self.dir / LATEST_FILE, f"{tag}\n".encode())
            for old in self.tags()[: -self.keep_last]:
                if int(old.name[len("step_") :]) not in protect:
                    remove_checkpoint(old)
        barrier()

    def _hash_shared(self, folder: Path) -> dict[str, dict]:
        """Every file's size and SHA-256, the files dealt out over the ranks (the manifest)."""
        names = checkpoint_files(folder)
        mine = file_manifest(folder, names[self.dist.rank :: self.dist.world_size])
        import torch.distributed as tdist

        if not (tdist.is_initialized() and tdist.get_world_size() > 1):
            return mine
        parts: list = [None] * tdist.get_world_size()
        tdist.all_gather_object(parts, mine)
        return {name: entry for part in parts for name, entry in sorted(part.items())}
