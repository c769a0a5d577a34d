"""Two checks of a run's config that its types alone do not make.

- Unknown keys. Hydra refuses ``optim.lrr=1`` against the typed schema, but ``+optim.lrr=1`` (the
  form its own error message suggests) adds the key anyway, and ``OmegaConf.to_object`` then sets
  a stray attribute that nothing reads. Every key of the composed config is therefore checked
  against the dataclasses of ``train/config.py`` (free-form dicts such as ``deepspeed.config``
  excepted), and an unknown one is an error that suggests the nearest known name.
- Resuming. The checkpoint's resolved config is compared with the new one; every difference is
  printed, and those that break an exact resume (the data and its mix, ``seq_len``, batch sizes,
  the schedule and its length, seeds, the world size, the sequence-parallel degree, the LM
  loader's worker count) are refused unless
  ``train.allow_config_change=true`` says they are meant.
"""

from __future__ import annotations

import dataclasses
import logging
import typing
from collections.abc import Sequence
from typing import Any

import yaml

from data.config_hint import nearest_field

log = logging.getLogger(__name__)


class ConfigError(ValueError):
    """A config that cannot run; the message says what to change."""

    every_rank = False  # True: every rank decides it alike, and each node's first rank says it

    @classmethod
    def alike(cls, message: str) -> ConfigError:
        """A refusal every rank decides alike, from the config, the world size and a checkpoint's
        meta (not from a file that one rank may fail to read)."""
        error = cls(message)
        error.every_rank = True
        return error


# Keys (or sections) whose change makes the resumed run another run than the saved one.
RESUME_CRITICAL: dict[str, tuple[str, ...]] = {
    "any": (
        "task",
        "train.micro_batch",
        "train.grad_accum",
        "train.steps",
        "train.seed",
        "optim.lr",
        "optim.betas",
        "optim.eps",
        "optim.weight_decay",
        "optim.clip_grad",
        "optim.min_lr_ratio",
        "optim.schedule",
        "optim.warmup_steps",
        "optim.decay_fraction",
        "model",
    ),
    "lm": (
        "data.sources",
        "data.seq_len",
        "data.mode",
        "data.seed",
        "data.shuffle_buffer",
        "data.shuffle_shards",
        "data.max_pending",
        "data.oversize",
        "data.whole_documents",
        "data.doc_budget",
        "data.tokenize",
        "data.tokenizers",
    ),
    "vtok": (
        "vtok_data.raw",
        "vtok_data.sources",
        "vtok_data.crop",
        "vtok_data.max_pixels",
        "vtok_data.video_frames",
        "vtok_data.heldout_fraction",
    ),
}
# Model settings that choose how the same function is computed, to float error (a kernel, a
# chunking, recomputation in the backward): a resume may change them (a compile failure, memory)
HOW_IT_RUNS = (
    "model.activation_checkpoint_every",
    "model.attention.backend",
    "model.attention.compile_flex",
    "model.loss.chunk_size",
)
WORLD_SIZE = "world size (ranks)"
# Rows per step and the loader's consumers follow the data-parallel replicas, world size over
# train.sequence_parallel: a change of either that keeps their quotient (SP 1 on 1 process to
# SP 2 on 2) resumes the same rows, a change that does not cannot.
DATA_PARALLEL = "data-parallel replicas (world size / train.sequence_parallel)"
# MoE's capacity limit applies to each rank's shard of a row: another SP degree drops other tokens
MOE_SHARDS = "train.sequence_parallel under MoE (its capacity limit is per shard)"


# --- unknown keys ----------------------------------------------------------------------------------
def _dataclass_in(hint: Any) -> type | None:
    """The dataclass a field's type holds (itself, in a list, or in an Optional), if any."""
    if dataclasses.is_dataclass(hint) and isinstance(hint, type):
        return hint
    for arg in typing.get_args(hint):
        found = _dataclass_in(arg)
        if found is not None:
            return found
    return None


def suggestion(key: str, schema: type, path: str) -> str:
    """`` (did you mean ...?)`` for an unknown ``key`` of ``schema`` (at ``path``): the nearest
    field name at its level, else a field of that name one or more levels down
    (``model.n_heads`` -> ``model.attention.n_heads``), else nothing."""
    if close := nearest_field(key, schema):
        return f" (did you mean {path}{close}?)"
    below = [f"{path}{name}" for name in _nested_paths(schema) if name.split(".")[-1] == key]
    if len(below) > 3:  # a common name (window, theta): the first few, and how many there are
        below = below[:3] + [f"{len(below) - 3} more"]
    return f" (did you mean {' or '.join(below)}?)" if below else ""


def _nested_paths(schema: type, prefix: str = "") -> list[str]:
    """The dotted path of every field nested in ``schema``'s dataclass fields (not into lists;
    its own plain fields are left out: its caller has looked at those)."""
    paths = []
    hints = typing.get_type_hints(schema)
    for field in dataclasses.fields(schema):
        inner = _dataclass_in(hints[field.name])
        if inner is not None and typing.get_origin(hints[field.name]) is not list:
            paths += _nested_paths(inner, f"{prefix}{field.name}.")
        elif prefix:
            paths.append(f"{prefix}{field.name}")
    return paths


def unknown_keys(tree: Any, schema: type, path: str = "") -> list[str]:
    """The keys of ``tree`` (a config as plain dicts and lists) that ``schema`` does not have,
    dotted, each with the nearest known name when one is close."""
    if not isinstance(tree, dict):
        return []
    hints = typing.get_type_hints(schema)
    names = [field.name for field in dataclasses.fields(schema)]
    found = []
    for key, value in tree.items():
        where = f"{path}{key}"
        if key not in names:
            found.append(where + suggestion(str(key), schema, path))
            continue
        inner = _dataclass_in(hints[key])
        if inner is None:
            continue  # a plain value or a free-form dict
        if isinstance(value, dict):
            found += unknown_keys(value, inner, f"{where}.")
        elif isinstance(value, list):
            for i, item in enumerate(value):
                found += unknown_keys(item, inner, f"{where}[{i}].")
    return found


def override_items(args: Sequence[str]) -> list[tuple[str, str]]:
    """``(key, value)`` of each ``KEY=VALUE`` override among ``args`` (a command line's words),
    its ``+``/``++``/``~`` prefix off; flags and their values left out."""
    return [
        (key, value)
        for key, _, value in (
            a.lstrip("+~").partition("=") for a in args if "=" in a and a[0] != "-"
        )
    ]


def unknown_override_keys(overrides: list[str], schema: type, groups: set[str]) -> list[str]:
    """The keys of command-line overrides (``a.b=1``, ``+a.b=1``, ``++a.b=1``, ``~a.b``) that
    ``schema`` does not have, each with the nearest known name; config group choices
    (``experiment=debug``) and ``hydra.*`` are Hydra's. Arguments that are not overrides (Hydra's
    own flags and their values) are left to Hydra."""
    from hydra.core.override_parser.overrides_parser import OverridesParser
    from hydra.errors import HydraException

    parser = OverridesParser.create()
    found = []
    for arg in overrides:
        try:
            (override,) = parser.parse_overrides([arg])
        except (HydraException, ValueError):
            continue
        key = override.key_or_group
        if not key:
            found.append(f"{arg!r} (no key before =; write KEY=VALUE, no spaces around =)")
            continue
        if override.package is not None or key.split(".")[0].split("/")[0] == "hydra":
            # hydra.run.dir=..., and Hydra's own groups (hydra/job_logging=disabled)
            continue
        if key.split("/")[0] in groups:
            # a group's choice (model=debug), or a nested group's (+data/extra=x, from a user's
            # --config-dir: Hydra names one that does not exist); model.dim=... is a key, checked
            continue
        cls: type | None = schema
        parts = key.split(".")
        for i, part in enumerate(parts):
            names = [field.name for field in dataclasses.fields(cls)]  # type: ignore[arg-type]
            if part not in names:
                path = ".".join(parts[:i])
                found.append(key + suggestion(part, cls, f"{path}." if path else ""))  # type: ignore[arg-type]
                break
            hint = typing.get_type_hints(cls)[part]
            if typing.get_origin(hint) is list:
                # An element of a list is not addressed by a dotted key, but a list given whole
                # (data.sources=[{name: a, shardz: ...}]) has its elements' keys checked here: Hydra
                # would refuse them with a traceback and no suggestion.
                inner = _dataclass_in(hint)
                if inner is not None and i == len(parts) - 1:
                    value = _override_value(override)
                    for index, item in enumerate(value if isinstance(value, list) else []):
                        found += unknown_keys(item, inner, f"{key}[{index}].")
                break
            cls = _dataclass_in(hint)
            if cls is None:
                break  # a plain value or a free-form dict (deepspeed.config.*)
    return found


def _override_value(override) -> Any:
    """An override's value as plain lists and dicts (None when Hydra cannot make one)."""
    try:
        return override.value()
    except Exception:  # an interpolation or a sweep: Hydra's own error names it
        return None


def check_known_keys(tree: dict, schema: type) -> None:
    unknown = unknown_keys(tree, schema)
    if unknown:
        raise ConfigError(
            "unknown config key(s): "
            + "; ".join(unknown)
            + " (every key must be a field of train/config.py's schema, also with Hydra's +key=)"
        )


# --- resuming --------------------------------------------------------------------------------------
def flatten(tree: Any, path: str = "") -> dict[str, Any]:
    """Dotted keys of nested dicts; lists are values (a changed source list is one change)."""
    if not isinstance(tree, dict):
        return {path.rstrip("."): tree}
    out: dict[str, Any] = {}
    for key, value in tree.items():
        out.update(flatten(value, f"{path}{key}."))
    return out


def config_diff(saved: dict, new: dict) -> list[tuple[str, Any, Any]]:
    old_flat, new_flat = flatten(saved), flatten(new)
    missing = object()
    out = []
    for key in sorted(set(old_flat) | set(new_flat)):
        old_value, new_value = old_flat.get(key, missing), new_flat.get(key, missing)
        if old_value != new_value:
            out.append(
                (
                    key,
                    None if old_value is missing else old_value,
                    None if new_value is missing else new_value,
                )
            )
    return out


def _consumers_per_rank(workers: Any) -> int:
    try:
        return max(1, int(workers))
    except (TypeError, ValueError):
        return -1  # unreadable: counts as a change


def breaks_resume(key: str, task: str, old: Any = None, new: Any = None) -> bool:
    if key == "data.num_workers":
        # Each of a rank's loader workers is a consumer with its own slice of the data and the
        # rank takes their batches in turn, so the data order depends on the worker count
        # (0 and 1 are one consumer alike). Another count resumes by redistributing the
        # position (docs/loader.md): no sample lost or repeated, but not the same batches.
        return task == "lm" and _consumers_per_rank(old) != _consumers_per_rank(new)
    if key in HOW_IT_RUNS:
        return False
    prefixes = RESUME_CRITICAL["any"] + RESUME_CRITICAL.get(task, ())
    return key in (DATA_PARALLEL, MOE_SHARDS) or any(
        key == prefix or key.startswith(prefix + ".") for prefix in prefixes
    )


def shown_change(old: Any, new: Any) -> str:
    """``old -> new``; for two lists of named sources (data.sources, data.validation), only what
    differs, source by source: their whole lists are lines of hundreds of characters."""

    def named(value: Any) -> dict | None:
        if isinstance(value, list) and all(isinstance(s, dict) and "name" in s for s in value):
            return {str(s["name"]): s for s in value}
        return None

    before, after = named(old), named(new)
    if (
        before is None
        or after is None
        or (list(before) != list(after) and set(before) == set(after))
    ):
        return f"{old!r} -> {new!r}"
    parts = [f"{name} added" for name in after if name not in before]
    parts += [f"{name} removed" for name in before if name not in after]
    for name in (n for n in before if n in after):
        fields = sorted(set(before[name]) | set(after[name]))
        parts += [
            f"{name}.{f} {before[name].get(f)!r} -> {after[name].get(f)!r}"
            for f in fields
            if before[name].get(f) != after[name].get(f)
        ]
    return "; ".join(parts)


# Changes after which no checkpoint of an LM run can be loaded, with or without
# train.allow_config_change: tensors of other shapes, a data position on rows of another length
# or in another mode (the loader refuses it, data/loader/dataset.py). The visual tokenizer's run
# trains the vtok section on vtok_data: these keys are not its.
NO_RESUME = ("model.dim", "model.n_layers", "model.vocab_size", "data.seq_len", "data.mode")


def no_resume_carries(key: str, task: str, old: Any, new: Any) -> bool:
    """Whether no resume of a ``task`` run can carry this change; also an LM source added or
    removed (the loader's position is per source)."""
    if task != "lm":
        return False
    if key == "data.sources" and isinstance(old, list) and isinstance(new, list):

        def names(sources: list) -> set:
            return {s.get("name") for s in sources if isinstance(s, dict)}

        return names(old) != names(new)
    return key in NO_RESUME


def training_mix(config_yaml: str | None) -> list[tuple[str, float]] | None:
    """The training sources' names and shares (weights are relative) in a run's config.yaml;
    None when it records none."""
    data = ((yaml.safe_load(config_yaml or "") or {}).get("data")) or {}
    sources = [s for s in data.get("sources") or [] if isinstance(s, dict)]
    if not sources:
        return None
    weights = [float(s.get("weight", 1.0)) for s in sources]
    total = sum(weights) or 1.0
    return [(str(s.get("name")), round(w / total, 9)) for s, w in zip(sources, weights)]


def check_resume_config(
    saved_yaml: str | None,
    new_yaml: str,
    *,
    saved_world_size: int,
    world_size: int,
    allowed: bool,
    where: str,
    show: bool,
    saved_sp: int | None = 1,
    sp: int = 1,
) -> list[str]:
    """Print how the new config differs from the checkpoint's; refuse the differences that break
    an exact resume unless ``allowed``. World sizes and SP degrees (``saved_sp``: the checkpoint
    meta's, None before SP existed) come from the runs themselves, not from the editable
    config.yaml. Returns the config's keys that differ (not the world's layout)."""
    new = yaml.safe_load(new_yaml) or {}
    diffs = config_diff(yaml.safe_load(saved_yaml) or {}, new) if saved_yaml is not None else []
    if saved_world_size != world_size:
        diffs.append((WORLD_SIZE, saved_world_size, world_size))
    saved_sp = saved_sp or 1  # the checkpoint's meta.json; none: written before SP existed
    if saved_world_size // saved_sp != world_size // sp:
        diffs.append((DATA_PARALLEL, saved_world_size // saved_sp, world_size // sp))
    moe = (new.get("model") or {}).get("moe") or {}
    if saved_sp != sp and moe.get("num_experts", 0) > 0 and moe.get("capacity_factor", 0) > 0:
        diffs.append((MOE_SHARDS, saved_sp, sp))
    if not diffs:
        return []
    task = str(new.get("task", "lm"))
    breaking = [diff for diff in diffs if breaks_resume(diff[0], task, diff[1], diff[2])]
    if show:
        lines = [
            f"  {key}: {shown_change(old, value)}"
            + (" (breaks an exact resume)" if breaks_resume(key, task, old, value) else "")
            for key, old, value in diffs
            if key != "train.allow_config_change"  # how this start is told, not the run's config
        ]
        log.info(f"config changes since the checkpoint ({where}):\n" + "\n".join(lines))
    never = [key for key, old, value in breaking if no_resume_carries(key, task, old, value)]
    if never:  # the flag cannot help: said first, not after a rerun with it
        raise ConfigError.alike(
            f"resuming {where.rsplit('/', 1)[0]} with changes no resume can carry: "
            f"{', '.join(never)} (the weights' shapes, or the data's position, change). Undo "
            "them, or start a new run with another run_dir (from these weights, when the model "
            "is unchanged: earlyfuse-convert release RUN_DIR OUT, then train.init_from=OUT)"
        )
    if breaking and not allowed:
        names = ", ".join(key for key, _, _ in breaking)
        raise ConfigError.alike(
            f"resuming {where.rsplit('/', 1)[0]} with changes that break an exact resume: {names}. "
            "Undo them, or rerun with train.allow_config_change=true if they are meant (the "
            "resumed run then differs from an uninterrupted one; the schedule follows the new "
            "values from the saved step on)"
        )
    layout = (WORLD_SIZE, DATA_PARALLEL, MOE_SHARDS, "train.allow_config_change")
    return [key for key, _, _ in diffs if key not in layout]
