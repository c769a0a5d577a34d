"""Reading a run's DeepSpeed checkpoint back into one full fp32 state dict, on CPU, without
the world size that wrote it.

Design choices:
- A checkpoint is ``RUN_DIR/checkpoints/step_NNNNNNNN/``; its ``meta.json`` (written by
  train/checkpoint.py) says the ZeRO stage, world size and task. Stage 0 keeps the whole module
  in ``mp_rank_00_model_states.pt`` (fp32: the trainer refuses bf16 at stage 0). Stages 1-3
  keep the fp32 master weights partitioned over the ranks' ``*_optim_states.pt``; DeepSpeed's
  own ``zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint`` stitches them together, so we
  follow whatever padding and partitioning rules the installed DeepSpeed wrote with. bf16 at
  ZeRO 1 is DeepSpeed's BF16_Optimizer, whose files zero_to_fp32 does not read: its per-rank
  parameter fragments are joined here (``_consolidate_bf16_optimizer``).
- Pickle is never trusted. ``zero_to_fp32`` calls ``torch.load(weights_only=False)``; while it
  runs, ``torch.load`` is train/safe_load.py's: ``weights_only=True`` with an allowlist of the
  plain DeepSpeed classes its optimizer states hold (an IntEnum, a dataclass of two ints, the
  loss scaler's attributes). Anything else in a file is refused, naming the file and the class.
- The checkpoint is checked against the sizes and SHA-256 its ``meta.json`` lists before
  anything is read (train/checkpoint.py): a truncated or corrupted file is named.
- Every failure to read (a missing, truncated or corrupted file, a partition missing because
  the run had more ranks than files) is a ``CheckpointError`` naming the file or folder.
- zero_to_fp32's prints and progress bars are silenced; the caller reports.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from unittest import mock

import torch

from train.names import CHECKPOINT_META_FILE, CHECKPOINTS_DIR, LATEST_FILE
from train.safe_load import CheckpointError, weights_only_loads
from train.safe_load import safe_torch_load as _safe_load

TAG = re.compile(r"^step_(\d{8})$")
__all__ = ["CheckpointError", "Checkpoint", "consolidate", "find_checkpoint", "safe_torch_load"]


def safe_torch_load(path, *, mmap: bool = True, allow_deepspeed: bool = False):
    """``torch.load(weights_only=True)`` on CPU with errors that name the file. ``mmap`` keeps a
    stage-0 file's optimizer moments (as large as the model twice) out of memory."""
    return _safe_load(path, mmap=mmap, allow_deepspeed=allow_deepspeed)


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
        raise CheckpointError(
            f"{run_dir}: no checkpoints/ folder; is this an earlyfuse-train run folder?"
        )
    have = sorted(
        folder.name for folder in root.iterdir() if folder.is_dir() and TAG.match(folder.name)
    )
    if step is None:
        latest = root / LATEST_FILE
        if not latest.is_file():
            raise CheckpointError(
                f"{latest}: missing (no complete checkpoint yet); folders present: {have or 'none'}"
            )
        tag = latest.read_text().strip()
    else:
        tag = f"step_{step:08d}"
    if not TAG.match(tag) or not (root / tag).is_dir():
        steps = [int(tag_name[5:]) for tag_name in have]
        raise CheckpointError(f"{root / tag}: no such checkpoint; steps present: {steps or 'none'}")
    meta_path = root / tag / CHECKPOINT_META_FILE
    try:
        meta = json.loads(meta_path.read_text())
        int(meta["zero_stage"]), int(meta["world_size"])
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise CheckpointError(
            f"{meta_path}: missing or unreadable ({e}); the save of {tag} did not complete"
        ) from None
    from train.checkpoint import verify_folder

    problems = verify_folder(root / tag)
    if problems:
        raise CheckpointError(
            f"{root / tag}: damaged checkpoint: "
            + "; ".join(problems[:3])
            + (f" (+{len(problems) - 3} more)" if len(problems) > 3 else "")
            + "; pick an intact one with --step"
        )
    return Checkpoint(run_dir, tag, meta)


def consolidate(ckpt: Checkpoint) -> dict[str, torch.Tensor]:
    """Full fp32 weights of a checkpoint of any ZeRO stage: {name: tensor} on CPU, own storage each."""
    if ckpt.zero_stage == 0:
        path = ckpt.folder / "mp_rank_00_model_states.pt"
        state = safe_torch_load(path)
        module = state.get("module") if isinstance(state, dict) else None
        if not isinstance(module, dict) or not module:
            raise CheckpointError(f"{path}: holds no 'module' weights")
        return {
            name: tensor.detach().to(torch.float32, copy=True) for name, tensor in module.items()
        }
    if _is_bf16_optimizer(ckpt.folder):
        return _consolidate_bf16_optimizer(ckpt)
    from deepspeed.utils import zero_to_fp32

    quiet = contextlib.redirect_stdout(io.StringIO())
    try:
        with (
            weights_only_loads(),
            mock.patch.object(zero_to_fp32, "tqdm", lambda it, **_: it),
            quiet,
        ):
            state = zero_to_fp32.get_fp32_state_dict_from_zero_checkpoint(
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
    # Views into one flat partition share storage (safetensors refuses that): copy each.
    return {
        name: tensor.detach().to(torch.float32, copy=True).contiguous()
        for name, tensor in state.items()
    }


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
    opt = safe_torch_load(files[0], allow_deepspeed=True).get("optimizer_state_dict", {})
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
    model_states = safe_torch_load(model_file, allow_deepspeed=True)
    pieces: dict[str, list[torch.Tensor]] = {}
    for part_file in files:
        try:
            opt = safe_torch_load(part_file, allow_deepspeed=True)["optimizer_state_dict"]
            for flat, mapping in zip(
                opt["single_partition_of_fp32_groups"], opt["param_slice_mappings"]
            ):
                for name, frag in mapping.items():
                    pieces.setdefault(name, []).append(
                        flat.narrow(0, frag.start, frag.numel).float().clone()
                    )
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
            state[name] = (
                module[name].detach().float().clone()
            )  # not optimised: the module copy is the value
    except (KeyError, TypeError) as e:
        raise CheckpointError(
            f"{model_file}: lacks the parameter layout DeepSpeed writes ({e})"
        ) from None
    return state


def load_run_config(path: str | Path):
    """The resolved ``config.yaml`` of a run (or checkpoint) as a typed ``RunConfig``; keys a
    newer schema added get their defaults."""
    from omegaconf import OmegaConf

    from train.config import RunConfig

    path = Path(path)
    try:
        merged = OmegaConf.merge(OmegaConf.structured(RunConfig), OmegaConf.load(path))
        return OmegaConf.to_object(merged)
    except FileNotFoundError:
        raise CheckpointError(f"{path}: missing") from None
    except Exception as e:  # OmegaConf raises its own error classes
        raise CheckpointError(
            f"{path}: not a readable run config ({type(e).__name__}: {e})"
        ) from None
