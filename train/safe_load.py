"""Every checkpoint file is read with ``torch.load(weights_only=True)``: tensors and plain data,
never code. A file that holds anything else is an error naming it, and nothing in it runs.

Design choices:
- DeepSpeed reads its own files with ``torch.load(weights_only=False)`` in a dozen places (its
  checkpoint engine, the ZeRO optimizers' universal loading, ``zero_to_fp32``,
  ``ds_to_universal``). Rather than follow each one, ``weights_only_loads()`` replaces
  ``torch.load`` itself, for as long as DeepSpeed reads, with ``safe_torch_load``: every path
  through DeepSpeed ends there, whichever engine, ZeRO stage or tool.
- The allow-list is what DeepSpeed 0.19 really writes, checked with
  ``torch.serialization.get_unsafe_globals_in_checkpoint`` on real checkpoints of ZeRO 0-3,
  fp32 and bf16, and their universal conversions: ZeRO 1-3 optimizer states hold
  ``ZeroStageEnum`` (an IntEnum), ``fragment_address`` (a dataclass of two ints) and the
  static ``LossScaler`` (plain attributes); fp16 runs (possible through ``deepspeed.config``) the
  ``DynamicLossScaler``. Model states and our own ``rank_*.pt`` hold none: they load with an
  empty allow-list. Allow-listed classes are rebuilt from their attributes; none runs code on
  load.
"""

from __future__ import annotations

import contextlib
import os
import pickle
from collections.abc import Iterator
from pathlib import Path
from unittest import mock

import torch

_TORCH_LOAD = torch.load  # the real one, kept before anything replaces it


class CheckpointError(ValueError):
    """A checkpoint file that cannot be read, or must not be; the message names the file."""

    every_rank = False  # True: every rank decides it alike, and each node's first rank says it

    @classmethod
    def alike(cls, message: str) -> CheckpointError:
        """A refusal every rank decides alike (ConfigError.alike)."""
        error = cls(message)
        error.every_rank = True
        return error


def deepspeed_globals() -> list:
    """The classes DeepSpeed's optimizer states pickle (module docstring)."""
    # Imported lazily: importing DeepSpeed costs seconds, and model states need none of these.
    from deepspeed.runtime.fp16.loss_scaler import DynamicLossScaler, LossScaler
    from deepspeed.runtime.zero.config import ZeroStageEnum
    from deepspeed.utils.tensor_fragment import fragment_address

    return [ZeroStageEnum, fragment_address, LossScaler, DynamicLossScaler]


def _name(f) -> str:
    return os.fspath(f) if isinstance(f, (str, os.PathLike)) else repr(f)


def safe_torch_load(
    f, *, map_location="cpu", mmap: bool | None = None, allow_deepspeed: bool = False
):
    """``torch.load(f, weights_only=True)``; any failure is a ``CheckpointError`` naming ``f``.
    ``allow_deepspeed`` admits DeepSpeed's optimizer-state classes (``deepspeed_globals``)."""
    if isinstance(f, (str, os.PathLike)) and not Path(f).is_file():
        raise CheckpointError(f"{_name(f)}: file missing")
    allowed = (
        torch.serialization.safe_globals(deepspeed_globals())
        if allow_deepspeed
        else contextlib.nullcontext()
    )
    try:
        with allowed:
            return _TORCH_LOAD(f, map_location=map_location, weights_only=True, mmap=mmap)
    except pickle.UnpicklingError as e:
        lines = [line.strip() for line in str(e).splitlines() if line.strip()]
        why = next((line for line in lines if "GLOBAL" in line or "Unsupported" in line), str(e))
        raise CheckpointError(
            f"{_name(f)}: holds objects other than tensors and plain data; refusing to "
            f"unpickle it ({why[:300]})"
        ) from None
    except (RuntimeError, EOFError, OSError, ValueError, KeyError, IndexError, TypeError) as e:
        raise CheckpointError(
            f"{_name(f)}: unreadable, truncated or corrupted checkpoint file "
            f"({type(e).__name__}: {str(e).strip()[:300]})"
        ) from None


def _guarded_load(f, map_location=None, pickle_module=None, *, weights_only=None, mmap=None, **_):
    """``torch.load``'s signature; whatever the caller asked, weights only."""
    if pickle_module is not None and pickle_module is not pickle:
        raise CheckpointError(f"{_name(f)}: a custom unpickler was asked for; refused")
    return safe_torch_load(f, map_location=map_location, mmap=mmap, allow_deepspeed=True)


@contextlib.contextmanager
def weights_only_loads() -> Iterator[None]:
    """While inside, every ``torch.load`` in this process (DeepSpeed's included) is
    ``safe_torch_load`` with DeepSpeed's allow-list."""
    with (
        mock.patch.object(torch, "load", _guarded_load),
        mock.patch.object(torch.serialization, "load", _guarded_load),
    ):
        yield
