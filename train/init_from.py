"""``train.init_from``: a fresh run starts from a release's weights (train/release.py).

Design choices:
- Loaded into the freshly built model before DeepSpeed wraps it, so every ZeRO stage and world
  size starts the same way.
- A run that resumes from its own checkpoint ignores ``init_from``: the checkpoint already holds
  the weights it started from and everything since.
- Every check is ``train.release.check_compatible``: the ids must mean the same and every tensor
  must fit; fields that differ without changing a shape are reported, and the run's values win.
"""

from __future__ import annotations

from pathlib import Path

import torch

from train.config_check import ConfigError
from train.names import CHECKPOINTS_DIR, LATEST_FILE
from train.release import Release, ReleaseError, check_compatible, param_count


def init_from_release(model, cfg, task, is_main: bool = True) -> bool:
    """Load ``cfg.train.init_from`` into a freshly built ``model`` (before DeepSpeed wraps it).
    A run that resumes from its own checkpoint ignores it (returns False). Errors name what differs."""
    say = print if is_main else (lambda *a, **k: None)
    ckpt_latest = Path(cfg.run_dir) / CHECKPOINTS_DIR / LATEST_FILE
    if cfg.train.resume and ckpt_latest.is_file():
        say(
            f"train.init_from={cfg.train.init_from}: ignored, the run resumes from its own checkpoint "
            f"{ckpt_latest.read_text().strip()}",
            flush=True,
        )
        return False
    is_lm = cfg.task == "lm"
    try:
        release = Release(cfg.train.init_from)
        state = release.state_dict(dtype=None)
        own = model.state_dict()
        diff = check_compatible(
            release,
            task=cfg.task,
            net_cfg=model.cfg if is_lm else cfg.vtok,
            reference=own,
            layout=task.layout if is_lm else None,
            tok_folder=task.tok_folder if is_lm else None,
            state=state,
            where=f"train.init_from={release.path}",
        )
    except ReleaseError as e:
        # A release that cannot start this run is the config's mistake: one line, exit code 2
        said = str(e)
        raise ConfigError(
            said if said.startswith("train.init_from") else f"train.init_from: {said}"
        ) from None
    with torch.no_grad():
        for name, tensor in own.items():
            tensor.copy_(state[name].to(tensor.dtype))
    source = release.config.get("source", {})
    say(
        f"initialised from release {release.path} (step {source.get('step')} of {source.get('run_dir')}): "
        f"{len(state)} tensors, {param_count(state):,} parameters",
        flush=True,
    )
    if diff:
        say(
            "note: the run's config differs from the release's in fields that change no shape; the run's "
            "values are used:\n" + "\n".join(diff),
            flush=True,
        )
    if is_lm and not release.config.get("tokenizers"):
        say(
            "note: the release records no tokenizers: the run's token data was checked against "
            "its vocabulary layout alone, not its text and visual tokenizers",
            flush=True,
        )
    if is_lm:
        note = rope_note(release.config, cfg.data.seq_len, model.cfg.rope.theta)
        if note:
            say(note, flush=True)
        # A longer stage means longer blocks and documents, not larger images and frames: those
        # the model never saw, which nothing else says when the data was made at the defaults
        for table in task.tables.get(cfg.data.sources):
            if differ := release.budget_differences(table, SIZES):
                say(
                    f"note: source {table.name} was tokenized at other image or frame sizes than "
                    f"the release's training data ({'; '.join(differ)}): the run starts the model "
                    f"on sizes it did not train on; to keep the release's, tokenize it with "
                    f"{release.tokenize_command(SIZES)} (and this stage's --seq-len, --doc-budget)",
                    flush=True,
                )
    return True


SIZES = ("image_max_pixels", "video_max_pixels", "video_fps")  # tokenize options of sizes


def rope_note(release_config: dict, seq_len: int, theta: float) -> str | None:
    """A line when the run's rows are longer than those the release was trained on while RoPE's
    base is not raised: a long-context stage raises it with the row (docs/long_context.md), and
    nothing else would say that it was left as it was. Not an error: a base already large
    enough for the longer rows is a choice, not a slip."""
    rows = release_config.get("packing", {}).get("seq_len")
    base = release_config.get("model", {}).get("rope", {}).get("theta")
    if not rows or base is None or seq_len <= rows or theta > base:
        return None
    return (
        f"note: rows of {seq_len} tokens, {seq_len / rows:g}x the release's {rows}, with model.rope.theta "
        f"{'lowered' if theta < base else 'not raised'} ({theta:g}, the release's {base:g}); a "
        "long-context stage raises it with the row "
        "(docs/long_context.md, 'A long-context stage')"
    )
