"""Writing a release folder (``earlyfuse-convert release``, tools/convert_release.py). The format,
its reader and its checks are in train/release.py, which a training run needs too.

Design choices:
- A release is built in ``OUT.partial`` and moved into place at the end: a crash never leaves a
  half-written folder that looks complete.
- Files are made readable by everyone the umask allows (safetensors writes 0600): a release is
  meant to be shared.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import torch

from train.release import CONFIG, ReleaseError, sha256_file


def dtype_name(dtype: torch.dtype) -> str:
    return {torch.float32: "float32", torch.bfloat16: "bfloat16"}[dtype]


# --- writing -----------------------------------------------------------------------------------
def save_safetensors(state: dict[str, torch.Tensor], path: Path, metadata: dict[str, str]) -> None:
    from safetensors.torch import save_file

    save_file({k: v.contiguous() for k, v in state.items()}, str(path), metadata=metadata)


def check_out(out: Path, force: bool) -> None:
    if out.exists() and (not out.is_dir() or any(out.iterdir())) and not force:
        raise ReleaseError(f"{out}: exists and is not empty; choose another folder or pass --force")


def write_release(out: str | Path, config: dict, write_files, *, force: bool = False) -> dict:
    """Build a release in ``OUT.partial`` (``write_files(folder)`` puts the files there), record
    every file's sha256 in config.json, then move it to ``OUT``: a crash never leaves a
    half-written folder that looks complete. An existing non-empty OUT needs ``force``."""
    out = Path(out)
    check_out(out, force)
    tmp = out.with_name(out.name + ".partial")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    try:
        write_files(tmp)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        mask = os.umask(0)
        os.umask(mask)
        for p in files:  # safetensors writes 0600; a release is meant to be shared
            os.chmod(p, 0o666 & ~mask)
        config = {**config, "files": {p.relative_to(tmp).as_posix(): sha256_file(p) for p in files}}
        (tmp / CONFIG).write_text(json.dumps(config, indent=1, sort_keys=False) + "\n")
        if out.exists():
            shutil.rmtree(out) if out.is_dir() else out.unlink()
        os.replace(tmp, out)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return config
