"""``earlyfuse-convert import RELEASE RUN_DIR [OVERRIDE ...]``: check that a release can start a
training run and print the command that starts it (docs/checkpoints.md, "Starting a run from a
release"). Nothing is written: a run starts from a release through ``train.init_from``, before
DeepSpeed wraps the model, so every ZeRO stage and world size works; a fake DeepSpeed
checkpoint would tie the release to one and invent optimizer state.
"""

from __future__ import annotations

import argparse
import dataclasses
import shlex
from pathlib import Path
from typing import TYPE_CHECKING

from data.cli.common import local_folder
from train.names import CHECKPOINTS_DIR, LATEST_FILE
from train.release import (
    NOT_ARCHITECTURE,
    Release,
    ReleaseError,
    check_compatible,
    flat,
    meta_module,
)

if TYPE_CHECKING:
    from data.vocab import VocabLayout

EXAMPLES = """\
examples:
  # validate a release and print the command that starts a run from it
  earlyfuse-convert import releases/demo runs/finetune
  # also check the run's own overrides against the release (layout, tokenizer, every shape)
  earlyfuse-convert import releases/demo runs/finetune experiment=demo train.steps=500 optim.lr=1e-4
  # then, as printed:
  earlyfuse-train experiment=demo train.steps=500 optim.lr=1e-4 run_dir=runs/finetune \\
      train.init_from=/abs/releases/demo
"""
DESCRIPTION = (
    "Check RELEASE (files, shapes, finiteness) and, given the training overrides, that it fits the "
    "run they define (layout, tokenizer, shapes); print the earlyfuse-train command that starts "
    "RUN_DIR from its weights (train.init_from). Writes nothing."
)

# Set from the token data's layout when the run starts, never by hand.
VOCAB_FIELDS = {"vocab_size", "text_vocab_size", "visual_offset"}


def hydra_value(v) -> str:
    """``v`` as Hydra's override grammar reads it back (``None`` is ``null``: Hydra reads
    ``None`` as the string)."""
    if v is None:
        return "null"
    if isinstance(v, bool):
        return "true" if v else "false"
    if isinstance(v, (list, tuple)):
        return "[" + ",".join(hydra_value(item) for item in v) + "]"
    return str(v)


def architecture_overrides(rel: Release) -> list[str]:
    section, cfg = (
        ("model", dataclasses.asdict(rel.transformer_config))
        if rel.task == "lm"
        else ("vtok", dataclasses.asdict(rel.visual_config()))
    )
    return [
        f"{section}.{key}={hydra_value(value)}"
        for key, value in flat(cfg).items()
        if key not in NOT_ARCHITECTURE and key not in VOCAB_FIELDS
    ]


def compose_run_config(overrides: list[str], config_dir: str = ""):
    """The typed RunConfig ``earlyfuse-train [--config-dir DIR] OVERRIDES`` would run with, and
    its resolved YAML (what the run writes as config.yaml). ``config_dir``: a config folder of the
    user's, searched after ours (as earlyfuse-train's --config-dir; a file of the same name as
    one of ours refused)."""
    from hydra import compose, initialize_config_dir
    from hydra.errors import HydraException
    from omegaconf.errors import OmegaConfBaseException

    # importing train.app registers the schema
    from train.app import CONFIG_DIR, compose_error, config_groups, shadowed_config, to_run_config
    from train.config import RunConfig
    from train.config_check import unknown_override_keys

    # earlyfuse-train's one-line account of each mistake, as its command line would give it
    args = [*(["--config-dir", config_dir] if config_dir else []), *overrides]
    if unknown := unknown_override_keys(overrides, RunConfig, config_groups()):
        raise ReleaseError(f"unknown config key(s): {'; '.join(unknown)}")
    if shadowed := shadowed_config(args):
        raise ReleaseError(shadowed)
    try:
        with initialize_config_dir(config_dir=CONFIG_DIR, version_base="1.3"):
            search = (
                [f"hydra.searchpath=[file://{Path(config_dir).resolve()}]"] if config_dir else []
            )
            cfg = compose(config_name="config", overrides=[*search, *overrides])
        return to_run_config(cfg)
    except (HydraException, OmegaConfBaseException, ValueError) as e:
        said = compose_error(e, args) if not isinstance(e, ValueError) else None
        raise ReleaseError(
            said or f"the overrides {overrides} do not make a training config: {e}"
        ) from None


def check_against_run(
    rel: Release, state: dict, overrides: list[str], config_dir: str = ""
) -> tuple[list[str], int]:
    """(the fields that differ without changing a shape, the run's sequence-parallel degree)."""
    cfg, _ = compose_run_config(overrides, config_dir)
    layout: VocabLayout | None = None  # an LM run's
    tok_folder: Path | None = None
    if cfg.task == "lm":
        from train.tasks.lm import layout_of_data

        try:
            layout, tok_folder = layout_of_data(cfg)
        except (ValueError, OSError, KeyError, IndexError) as e:
            raise ReleaseError(f"cannot read the run's token data (data.sources): {e}") from None
        try:
            net_cfg = cfg.model.with_layout(layout)
        except ValueError as e:  # a vocabulary size set by hand
            raise ReleaseError(str(e)) from None
    else:
        net_cfg = cfg.vtok
    diff = check_compatible(
        rel,
        task=cfg.task,
        net_cfg=net_cfg,
        reference=meta_module(cfg.task, net_cfg).state_dict(),
        layout=layout,
        tok_folder=tok_folder,
        state=state,
        where=f"release {rel.path} for this run config",
    )
    return diff, cfg.train.sequence_parallel


def run(args: argparse.Namespace) -> None:
    rel = Release(args.release)
    state = rel.state_dict()  # sha256 of every file, names, shapes, finite
    src = rel.config.get("source", {})
    print(
        f"{rel.path}: valid {rel.task} release, {len(state)} tensors, {rel.config.get('parameters', 0):,} "
        f"parameters, {rel.config.get('dtype')}, from step {src.get('step')} of {src.get('run_dir')}"
    )
    run_dir = Path(args.run_dir)
    latest = run_dir / CHECKPOINTS_DIR / LATEST_FILE
    if latest.is_file():
        raise ReleaseError(
            f"{run_dir} already has a checkpoint ({latest.read_text().strip()}): a run that resumes "
            "ignores train.init_from. Choose a new run folder or remove its checkpoints/."
        )
    own = {"run_dir": str(run_dir), "train.init_from": str(rel.path.resolve())}
    tail = [f"{key}={value}" for key, value in own.items()]
    overrides = []
    for override in args.overrides:  # RUN_DIR and RELEASE say these two: not dropped unsaid
        key, _, value = override.lstrip("+~").partition("=")
        if key not in own:
            overrides.append(override)
        elif Path(value).resolve() != Path(own[key]).resolve():
            raise ReleaseError(
                f"{override}: {key} is this command's {'RUN_DIR' if key == 'run_dir' else 'RELEASE'} "
                f"({own[key]}); give it there, not as an override"
            )
    if overrides:
        diff, sp = check_against_run(rel, state, overrides + tail, args.config_dir)
        checked = "tokenizers" if rel.config.get("tokenizers") else "no tokenizers: none recorded"
        checks = (
            f"layout, {checked}, every tensor shape" if rel.task == "lm" else "every tensor shape"
        )
        print(f"the run config fits the release ({checks})")
        if diff:
            print(
                "note: these fields differ without changing a shape; the run's values will be used:\n"
                + "\n".join(diff)
            )
        given = ["--config-dir", args.config_dir] if args.config_dir else []
        # sequence parallelism needs its ranks: a launcher with (a multiple of) that many
        launch = ["earlyfuse-torchrun", "--nproc_per_node", str(sp), "-m", "train.app"]
        cmd = [*(launch if sp > 1 else ["earlyfuse-train"]), *given, *overrides, *tail]
        print("start the run with:\n  " + shlex.join(cmd))
    else:
        cmd = ["earlyfuse-train", *tail, *architecture_overrides(rel)]
        print(
            "start the run with your experiment and data overrides added (data tokenized with the release's "
            "tokenizers):\n  " + shlex.join(cmd)
        )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "release", metavar="RELEASE", type=local_folder, help="an earlyfuse-convert release folder"
    )
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", type=local_folder, help="a new run's folder (no checkpoint)"
    )
    parser.add_argument(
        "--config-dir",
        default="",
        metavar="DIR",
        help="a config folder of yours, as earlyfuse-train --config-dir takes (data=mine in it)",
    )
    parser.add_argument(
        "overrides",
        metavar="OVERRIDE",
        nargs="*",
        help="earlyfuse-train overrides of the new run (e.g. experiment=demo optim.lr=1e-4), checked now",
    )
