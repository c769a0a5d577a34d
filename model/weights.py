"""Reading a safetensors weights file with an error that names it, and finding a tensor that holds
NaN or Inf: one of each for a release's weights and a visual tokenizer folder's, each caller
raising its own error type."""

from __future__ import annotations

from pathlib import Path

import torch


def load_safetensors(path: Path, error: type[Exception] = ValueError) -> dict[str, torch.Tensor]:
    """The tensors in ``path``, or ``error`` naming the file when it is missing or cannot be
    read (cut short, damaged, not safetensors)."""
    from safetensors.torch import load_file

    if not path.is_file():
        raise error(f"{path}: file missing")
    try:
        return load_file(str(path))
    except Exception as e:  # noqa: BLE001 - safetensors raises SafetensorError / OSError for cut or damaged files
        raise error(f"{path}: unreadable, truncated or corrupted safetensors file ({e})") from None


def nonfinite_tensor(state: dict[str, torch.Tensor]) -> str | None:
    """The name of the first floating-point tensor holding NaN or Inf (a run that diverged before
    it was saved), or None. Tensors on the meta device have no values to check."""
    for name, tensor in state.items():
        if (
            tensor.is_floating_point()
            and tensor.device.type != "meta"
            and not bool(torch.isfinite(tensor).all())
        ):
            return name
    return None
