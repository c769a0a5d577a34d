"""Reading a run's DeepSpeed checkpoint back into one full fp32 state dict, on CPU, without
the world size that wrote it (docs/checkpoints.md, "Consolidation"). Stages 1-3 go through
DeepSpeed's own ``zero_to_fp32``, so we follow whatever padding and partitioning the installed
DeepSpeed wrote with; only bf16 at ZeRO 1, whose files zero_to_fp32 does not read, is joined
here. Pickle is never trusted (train/safe_load.py); every failure is a ``CheckpointError``
naming the file or folder.
"""

from __future__ import annotations

import contextlib
import glob
import io
import math
import re
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from data.cli.common import local_folder
from train.checkpoint import (
    META,
    TAG,
    read_meta,
    step_of_tag,
    tag_for,
    verify_folder,
    why_missing,
)
from train.names import CHECKPOINTS_DIR, CONFIGS_DIR, LATEST_FILE
from train.safe_load import CheckpointError, safe_torch_load, weights_only_loads

__all__ = ["CheckpointError", "Checkpoint", "consolidate", "find_checkpoint"]


@dataclass
class Checkpoint:
    """One checkpoint folder of a run and what its ``meta.json`` says."""

    run_dir: Path
    tag: str
    meta: dict

    @property
    def folder(self) -> Path:
        return self.run_dir / CHECKPOINTS_DIR / self.tag

    @property
    def step(self) -> int:
        return int(self.meta["step"])

    @property
    def zero_stage(self) -> int:
        return int(self.meta["zero_stage"])


def find_checkpoint(run_dir: str | Path, step: int | None = None) -> Checkpoint:
    """The run's ``latest`` checkpoint, or the one of ``step``; errors list what exists."""
    run_dir = Path(run_dir)
    root = run_dir / CHECKPOINTS_DIR
    if not root.is_dir():
        # The folders a user finds inside a run: name the run folder and step to give instead.
        if run_dir.name == CHECKPOINTS_DIR and run_dir.is_dir():
            raise CheckpointError(
                f"{run_dir}: the checkpoints folder of a run; give the run folder ({run_dir.parent})"
            )
        if TAG.match(run_dir.name) and run_dir.parent.name == CHECKPOINTS_DIR:
            raise CheckpointError(
                f"{run_dir}: one checkpoint of a run; give the run folder and its step "
                f"({run_dir.parent.parent} --step {step_of_tag(run_dir.name)})"
            )
        what = "no checkpoints/ folder in it" if run_dir.is_dir() else "no such folder"
        raise CheckpointError(
            f"{run_dir}: {what}; give an earlyfuse-train run folder, the one holding checkpoints/ "
            "(a step_N/ folder copied on its own: into a checkpoints/ of its own, with --step N)"
        )
    have = sorted(
        folder.name for folder in root.iterdir() if folder.is_dir() and TAG.match(folder.name)
    )
    # the steps a --step can name: a save that did not finish has no meta.json (written last)
    steps = [step_of_tag(name) for name in have if (root / name / META).is_file()]
    if step is None:
        latest = root / LATEST_FILE
        tag = latest.read_text().strip() if latest.is_file() else ""
        if not tag:
            what = "empty" if latest.is_file() else "missing"
            fix = f"name a checkpoint with --step (complete steps: {steps})"
            raise CheckpointError(
                f"{latest}: {what}; {fix if steps else 'no complete checkpoint yet'}"
            )
    elif step < 0:
        raise CheckpointError(f"--step {step}: no such step; complete steps: {steps or 'none'}")
    else:
        tag = tag_for(step)
    if not TAG.match(tag) or not (root / tag).is_dir():
        named = f"{root / tag}" if step is not None else f"{root / LATEST_FILE} names {tag!r}"
        # one an earlier start set aside as damaged is said to be that, not missing
        why = why_missing(root, tag) if TAG.match(tag) else ""
        what = why if " is damaged " in why else "no such checkpoint"
        raise CheckpointError(f"{named}: {what}; complete steps: {steps or 'none'}")
    if not (root / tag / META).is_file():
        raise CheckpointError(
            f"{root / tag}: an incomplete checkpoint (no {META}, which a save writes last: a save "
            f"in progress, or one that did not finish); complete steps: {steps or 'none'}"
        )
    if problems := verify_folder(root / tag):
        more = f" (+{len(problems) - 3} more)" if len(problems) > 3 else ""
        raise CheckpointError(
            f"{root / tag}: damaged checkpoint: {'; '.join(problems[:3])}{more}; pick an intact "
            "one with --step"
        )
    meta = read_meta(root / tag)
    where = str((root / tag).absolute())
    if int(meta["zero_stage"]) and glob.escape(where) != where:
        raise CheckpointError(
            f"{where}: a ZeRO-{meta['zero_stage']} checkpoint under a path holding [ ] * or ?: "
            "DeepSpeed finds its files by glob pattern, which those characters break; rename the "
            "folder, or give a run folder without them whose checkpoints/ links to this one's"
        )
    return Checkpoint(run_dir, tag, meta)


def add_run_dir(parser) -> None:
    """RUN_DIR and ``--step``: the checkpoint ``find_checkpoint`` reads, as a command's arguments."""
    parser.add_argument(
        "run_dir", metavar="RUN_DIR", type=local_folder, help="a run folder (holding checkpoints/)"
    )
    parser.add_argument(
        "--step", type=int, default=None, help="checkpoint step (default: checkpoints/latest)"
    )


def consolidate(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a checkpoint of any ZeRO stage: {name: tensor} on CPU, own storage each."""
    if ckpt.zero_stage == 0:
        path = ckpt.folder / "mp_rank_00_model_states.pt"
        # mmap: the file's optimizer moments (twice the model) stay out of memory
        state = safe_torch_load(path, mmap=True)
        state = state.get("module") if isinstance(state, dict) else None
        if not isinstance(state, dict) or not state:
            raise CheckpointError(f"{path}: holds no 'module' weights")
    elif _is_bf16_optimizer(ckpt.folder):
        state = _consolidate_bf16_optimizer(ckpt)
    else:
        state = _zero_to_fp32(ckpt)
    # Views into a memory-mapped file or into one flat partition share storage (safetensors
    # refuses that): copy each.
    return {
        name: tensor.detach().to(torch.float32, copy=True).contiguous()
        for name, tensor in state.items()
    }


def _zero_to_fp32(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    from deepspeed.utils import zero_to_fp32

    try:
        with (
            weights_only_loads(),
            mock.patch.object(zero_to_fp32, "tqdm", lambda it, **_: it),
            contextlib.redirect_stdout(io.StringIO()),
        ):
            return zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
                str(ckpt.folder.parent), tag=ckpt.tag
            )
    except CheckpointError:
        raise
    except (ValueError, FileNotFoundError, KeyError, IndexError, RuntimeError, AssertionError) as e:
        raise CheckpointError(
            f"{ckpt.folder}: DeepSpeed could not consolidate this ZeRO-{ckpt.zero_stage} "
            f"checkpoint of {ckpt.meta['world_size']} rank(s) "
            f"({type(e).__name__}: {str(e).strip()[:400]})"
        ) from None


def _rank_of(path: Path) -> int:
    match = re.search(r"zero_pp_rank_(\d+)_", path.name)
    if match is None:
        raise CheckpointError(f"{path}: not a ZeRO rank file (zero_pp_rank_N_...)")
    return int(match.group(1))


def _is_bf16_optimizer(folder: Path) -> bool:
    """BF16_Optimizer's state has parameter fragments and no ZeRO stage (ZeRO 2/3 with bf16 write
    files with the same ``bf16_`` prefix that zero_to_fp32 does read)."""
    files = sorted(folder.glob("bf16_zero_pp_rank_*_optim_states.pt"))
    if not files:
        return False
    opt = safe_torch_load(files[0], mmap=True, allow_deepspeed=True).get("optimizer_state_dict", {})
    return "zero_stage" not in opt and "param_slice_mappings" in opt


def _consolidate_bf16_optimizer(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """bf16 at ZeRO 1 runs DeepSpeed's BF16_Optimizer, whose ``bf16_zero_*`` files zero_to_fp32
    does not read ("not a zero checkpoint"). Each rank's file holds its contiguous slice of every
    flat fp32 group and, per parameter, the fragment (start, numel) of that slice it owns; the
    fragments of one parameter, in rank order, are the whole parameter."""
    folder = ckpt.folder
    files = sorted(folder.glob("bf16_zero_pp_rank_*_mp_rank_00_optim_states.pt"), key=_rank_of)
    world = int(ckpt.meta["world_size"])
    if [_rank_of(part_file) for part_file in files] != list(range(world)):
        raise CheckpointError(
            f"{folder}: expected the bf16 optimizer partitions of ranks 0..{world - 1}, found "
            f"{[part_file.name for part_file in files]}; the save did not complete on every rank"
        )
    model_file = folder / "mp_rank_00_model_states.pt"
    model_states = safe_torch_load(model_file, mmap=True, allow_deepspeed=True)
    pieces: dict[str, list[torch.Tensor]] = {}
    for part_file in files:
        try:
            opt = safe_torch_load(part_file, mmap=True, allow_deepspeed=True)[
                "optimizer_state_dict"
            ]
            for flat, mapping in zip(
                opt["single_partition_of_fp32_groups"], opt["param_slice_mappings"]
            ):
                for name, frag in mapping.items():
                    pieces.setdefault(name, []).append(flat.narrow(0, frag.start, frag.numel))
        except (KeyError, TypeError, AttributeError, RuntimeError) as e:
            raise CheckpointError(
                f"{part_file}: not a DeepSpeed bf16 optimizer partition ({type(e).__name__}: {e})"
            ) from None
    state: dict[str, torch.Tensor] = {}
    try:
        for group in model_states["param_shapes"]:
            for name, shape in group.items():
                got = torch.cat(pieces.pop(name)) if name in pieces else torch.empty(0)
                if got.numel() != math.prod(shape):
                    raise CheckpointError(
                        f"{folder}: parameter {name!r} has {got.numel()} of its "
                        f"{math.prod(shape)} elements in the optimizer partitions"
                    )
                state[name] = got.view(tuple(shape))
        module = model_states["module"]
        for name in [
            *model_states.get("buffer_names", []),
            *(model_states.get("frozen_param_shapes") or {}),
        ]:
            state[name] = module[name]  # not optimised: the module copy is the value
    except (KeyError, TypeError) as e:
        raise CheckpointError(
            f"{model_file}: lacks the parameter layout DeepSpeed writes ({e})"
        ) from None
    return state


def load_run_config(path: str | Path, network: dict | None = None, log=None):
    """The resolved ``config.yaml`` of a run (or checkpoint) as a typed ``RunConfig``; keys a
    newer schema added get their defaults, values its checks now refuse are kept (read_saved).
    ``network``: a checkpoint's ``meta.json`` record of the network it trained, which wins over
    an edited copy (each value that differs is said through ``log``)."""
    from omegaconf import DictConfig, OmegaConf

    from train.config import RunConfig, read_saved
    from train.config_check import config_diff

    path = Path(path)
    try:
        saved = OmegaConf.load(path)
        for section, trained in (network or {}).items():
            node = saved.get(section)
            edited = OmegaConf.to_container(node) if isinstance(node, DictConfig) else {}
            for key, value, copy in config_diff(trained, edited):  # type: ignore[arg-type]
                if log:
                    log(
                        f"note: {path} says {section}.{key}: {copy}, but the checkpoint trained "
                        f"with {value} (its meta.json): the trained value is used"
                    )
        return read_saved(OmegaConf.merge(OmegaConf.structured(RunConfig), saved, network or {}))
    except FileNotFoundError:
        step = path.parent.name.removeprefix("step_")
        hint = (  # the run's own config.yaml is the latest pass's, which may differ
            f"; copy there the config of the pass that saved it: {path.parents[2] / CONFIGS_DIR}"
            f"/from_step_N.yaml with the largest N below {int(step)}"
            if path.parent.parent.name == CHECKPOINTS_DIR and step.isdigit()
            else ""
        )
        raise CheckpointError(f"{path}: missing{hint}") from None
    except Exception as e:  # OmegaConf raises its own error classes
        raise CheckpointError(
            f"{path}: not a readable run config ({type(e).__name__}: {e})"
        ) from None
