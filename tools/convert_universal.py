"""``earlyfuse-convert universal RUN_DIR [--step N]``: make a ZeRO 1-2 checkpoint, whose
optimizer shards load only on the world size that wrote them, resumable on another one with
DeepSpeed's ``ds_to_universal`` (docs/checkpoints.md, "Another world size").
"""

from __future__ import annotations

import argparse
import os
import shutil
import tempfile
from pathlib import Path

from data.cli.common import unwritable
from data.shards.storage import Folder, write_folder
from tools.convert_deepspeed import CheckpointError, add_run_dir, find_checkpoint
from train.checkpoint import checkpoint_files, file_manifest, sync_to_disk
from train.names import CHECKPOINTS_DIR, LATEST_FILE
from train.safe_load import weights_only_loads
from train.save_errors import write_failure_cause

EXAMPLES = """\
examples:
  earlyfuse-torchrun --nproc_per_node 8 -m train.app experiment=gpu_1b run_dir=runs/1b      # ZeRO 2 on 8 ranks
  earlyfuse-convert universal runs/1b                                               # latest checkpoint
  earlyfuse-torchrun --nproc_per_node 4 -m train.app experiment=gpu_1b run_dir=runs/1b train.allow_config_change=true
"""
DESCRIPTION = (
    "Write checkpoints/step_N/universal/ beside RUN_DIR's checkpoint: its optimizer and weight "
    "shards as one file per parameter, which a run with the same run_dir resumes from on any "
    "number of ranks. The LM's loader state is redistributed over the new ranks and "
    "workers: it goes on from where it was."
)
UNIVERSAL = "universal"


def make_universal(
    run_dir, step: int | None = None, *, force: bool = False, log=print
) -> Path | None:
    """The universal checkpoint written; None for a ZeRO-0 run, which needs none."""
    ckpt = find_checkpoint(run_dir, step)
    stage, world = ckpt.zero_stage, int(ckpt.meta["world_size"])
    if stage == 0:  # nothing to convert: not an error, a script may call this for every run
        log(
            f"{ckpt.folder}: a ZeRO-0 checkpoint holds whole copies of model and optimizer; it "
            "resumes on any world size as it is (nothing written)"
        )
        return None
    if stage == 3:  # converted, its optimizer does not resume as saved
        raise CheckpointError(
            f"{ckpt.folder}: a ZeRO-3 checkpoint resumes only on the world size that wrote "
            f"it ({world}); on another, release its weights (earlyfuse-convert release) and "
            "start a new run from them with train.init_from"
        )
    out = ckpt.folder / UNIVERSAL
    prefix = f".{ckpt.tag}.{UNIVERSAL}-"
    for left in sorted(ckpt.folder.parent.glob(f"{prefix}*")):  # by a --force killed mid-way
        if (left / UNIVERSAL).is_dir() and not out.exists():
            os.replace(left / UNIVERSAL, out)
            log(f"{out}: restored (a conversion with --force cut short had set it aside)")
        shutil.rmtree(left, ignore_errors=True)
    if out.exists() and not force:
        raise CheckpointError(f"{out} exists (use --force to make it again)")
    if why := unwritable(ckpt.folder / "x"):  # before DeepSpeed's work (and --force's removal)
        raise CheckpointError(f"{out}: cannot be written ({why})")
    from deepspeed.checkpoint.ds_to_universal import main as ds_to_universal

    def write(folder: Path) -> None:
        # ds_to_universal's options as its own parse_arguments() makes them. Our runs do not set
        # Megatron's universal_checkpoint_info: DeepSpeed injects the default (no tensor or
        # pipeline parallelism to undo, which is what we have).
        options = argparse.Namespace(
            input_folder=str(ckpt.folder),
            output_folder=str(folder),
            num_extract_workers=1,
            num_merge_workers=1,
            keep_temp_folder=False,
            strict=True,
            inject_missing_state=True,
        )
        try:
            with weights_only_loads():  # DeepSpeed's own loads there unpickle nothing but data
                ds_to_universal(options)
        except CheckpointError:
            raise
        except (AssertionError, KeyError, RuntimeError, ValueError, OSError) as e:
            # A full disk reaches DeepSpeed's writer as torch's "unexpected pos ...": the cause
            # is found the trainer's way, in the partial folder before it is removed. It is the
            # machine's (exit 1) or an unwritable folder's (exit 2), not the checkpoint's.
            cause = write_failure_cause(folder, e)
            if cause is not None:
                raise type(cause)(
                    f"{out} could not be written: {cause}; nothing of it is left and {ckpt.tag} "
                    "is unchanged: run the same command again once this is fixed"
                ) from None
            raise CheckpointError(
                f"{ckpt.folder}: DeepSpeed could not make a universal checkpoint ({e})"
            ) from None
        # Sizes and hashes of what was written, checked before a resume loads it.
        sync_to_disk()
        files = file_manifest(folder, checkpoint_files(folder))
        source = {"step": ckpt.meta.get("step"), "world_size": world, "zero_stage": stage}
        Folder(folder).write_json("source.json", {**source, "files": files})

    # Built whole beside it and moved into place: a conversion cut short (Ctrl-C, kill -9, a
    # full disk) leaves no universal/, and --force keeps the old one until the new one is whole,
    # out of the checkpoint folder meanwhile (DeepSpeed counts the model files under it).
    aside = None
    try:
        if out.exists():
            aside = Path(tempfile.mkdtemp(prefix=prefix, dir=ckpt.folder.parent))
            os.replace(out, aside / UNIVERSAL)
        write_folder(out, write)
    except BaseException:
        if aside is not None and (aside / UNIVERSAL).is_dir() and not out.exists():
            os.replace(aside / UNIVERSAL, out)
        raise
    finally:
        if aside is not None:
            shutil.rmtree(aside, ignore_errors=True)
    (ckpt.folder / "latest_universal").write_text(UNIVERSAL)  # DeepSpeed's pointer, renamed too
    sync_to_disk()
    pointer = Path(ckpt.run_dir) / CHECKPOINTS_DIR / LATEST_FILE
    latest = pointer.read_text().strip() if pointer.is_file() else ckpt.tag
    resumes = (
        f"`earlyfuse-train ... run_dir={ckpt.run_dir} train.allow_config_change=true` on any "
        "number of ranks resumes from it (another world size is a change the resume is told of)"
        if latest == ckpt.tag
        else f"a run resumes from {LATEST_FILE} ({latest}), not from it: convert {latest} to "
        "resume on other ranks"
    )
    log(
        f"wrote {out}: {ckpt.tag} (ZeRO {stage}, {world} rank(s)) as a universal checkpoint; {resumes}"
    )
    return out


def run(args: argparse.Namespace) -> None:
    make_universal(args.run_dir, args.step, force=args.force)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_dir(parser)
    parser.add_argument("--force", action="store_true", help="make it again if it exists")
