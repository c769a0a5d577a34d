"""``earlyfuse-convert release RUN_DIR OUT``: a checkpoint of any ZeRO stage becomes a release
folder (format: train/release.py, docs/checkpoints.md "Release folder"), on CPU and from any
world size. The token data's tokenize options and the run's packing travel in config.json, so
that a release shipped without its run folder still encodes images at the training resolution
(``earlyfuse-generate``) and evaluates the run's validation rows (``earlyfuse-eval``).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import shutil
import sys
from importlib.metadata import version
from pathlib import Path

from safetensors.torch import save_file

from data.cli.common import check_new_folder, local_folder
from data.shards.index import file_sha256
from data.shards.manifest import versions
from data.shards.storage import write_folder
from data.tokenize.blocks import image_grids
from tools.convert_deepspeed import (
    CheckpointError,
    add_run_dir,
    consolidate,
    find_checkpoint,
    load_run_config,
)
from train.names import CHECKPOINT_META_FILE, CHECKPOINTS_DIR, CONFIG_FILE
from train.release import (
    CONFIG,
    DTYPES,
    FORMAT,
    LAYOUT,
    VERSION,
    VISUAL,
    WEIGHTS,
    ReleaseError,
    check_state,
    check_tokenizer_files,
    meta_module,
    param_count,
    tokenizer_files,
)

EXAMPLES = """\
examples:
  # the latest checkpoint of a run, fp32
  earlyfuse-convert release runs/demo/lm releases/demo
  # step 800, stored in bf16 (half the size; loaded back as fp32 or bf16)
  earlyfuse-convert release runs/demo/lm --step 800 releases/demo-800 --dtype bf16
  # the token data moved: name its tokenizers/ folder (checked against what the checkpoint recorded)
  earlyfuse-convert release runs/demo/lm releases/demo --tokenizers /data/tokens/tokenizers
  # a visual tokenizer run: OUT/visual_tokenizer/ is what `earlyfuse-prep tokenize` takes
  earlyfuse-convert release runs/demo/vtok releases/vtok
"""
DESCRIPTION = (
    "Consolidate a checkpoint of RUN_DIR (any ZeRO stage, any world size, on CPU) into OUT: "
    "model.safetensors, config.json, vocab_layout.json, tokenizer.json, visual_tokenizer/. "
    "Tensor names and shapes are checked against the model the run's config builds."
)


def write_release(out: Path, config: dict, write_files) -> dict:
    """Write a release to ``OUT`` (``write_files(folder)`` puts the files there) with every file's
    sha256 recorded in config.json, built whole beside it (``write_folder``)."""

    def write(tmp: Path) -> dict:
        write_files(tmp)
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        full = {**config, "files": {p.relative_to(tmp).as_posix(): file_sha256(p) for p in files}}
        (tmp / CONFIG).write_text(json.dumps(full, indent=1, sort_keys=False) + "\n")
        return full

    return write_folder(out, write)


def find_tokenizers(run_cfg, run_dir: Path) -> Path:
    """The token data's tokenizers/ folder (the run's ``data.tokenizers``, else the one its token
    shards name); a ReleaseError naming every place tried otherwise."""
    from train.tasks.lm import tokenizer_folder

    try:
        return tokenizer_folder(run_cfg)
    except ValueError as e:
        raise ReleaseError(
            f"{run_dir}: no tokenizers found through the run's data ({e}); pass --tokenizers DIR "
            "(tokenizer.json, vocab_layout.json, visual_tokenizer/) or --no-tokenizers for "
            "weights only"
        ) from None


def check_tokenizers(folder: Path, layout) -> dict:
    """Fingerprints of a tokenizers/ folder after checking it belongs to ``layout``."""
    from data.tokenize.visual import load_visual_tokenizer
    from data.tokenize.vtok_files import folder_fingerprints, has_visual_tokenizer
    from data.vocab import VocabLayout

    check_tokenizer_files(folder)
    theirs = VocabLayout.load(folder / LAYOUT)
    if theirs.fingerprint() != layout.fingerprint():
        raise ReleaseError(
            f"{folder / LAYOUT}: differs from the checkpoint's vocab_layout.json "
            f"({theirs.to_dict()['ranges']} vs {layout.to_dict()['ranges']}); these are not the "
            "tokenizers this model was trained with"
        )
    try:
        if has_visual_tokenizer(folder):
            load_visual_tokenizer(folder / VISUAL, layout)
        return folder_fingerprints(folder)  # what a token manifest records for this folder
    except ValueError as e:
        raise ReleaseError(str(e)) from None


def recorded_tokenizers(folder: Path) -> dict | None:
    """The fingerprints of the tokenizers a checkpoint's token sources were made with, from its
    record: one text tokenizer and layout for every source, and the visual tokenizer of those
    made with one (a source of text and code alone has none); None without a record, or when
    the sources differ."""
    from train.names import CHECKPOINT_TOKENIZERS_FILE

    record = folder / CHECKPOINT_TOKENIZERS_FILE
    entries = json.loads(record.read_text()) if record.is_file() else []
    texts = {(e.get("text"), e.get("layout")) for e in entries}
    visuals = {e.get("visual") for e in entries} - {None}
    if len(texts) != 1 or len(visuals) > 1:
        return None
    (text, layout), visual = texts.pop(), visuals.pop() if visuals else None
    return {"text": text, "layout": layout, "visual": visual}


def packing(run_cfg, world_size: int) -> dict:
    """How the run packed and validated its rows: what ``earlyfuse-eval`` needs to evaluate the
    held-out documents in the rows training validation saw (data/loader/heldout.py packs by
    seq_len, micro_batch and whole_documents alone), and what capped that validation."""
    return {
        "seq_len": int(run_cfg.data.seq_len),
        "micro_batch": int(run_cfg.train.micro_batch),
        "whole_documents": bool(run_cfg.data.whole_documents),
        # validation evaluated the first eval_batches x data_ranks batches of the pass (0: all)
        "eval_batches": int(run_cfg.train.eval_batches),
        "data_ranks": int(world_size) // max(1, int(run_cfg.train.sequence_parallel)),
        "validation": [
            {"name": src.name, "shards": list(src.shards)} for src in run_cfg.data.validation
        ],
    }


def make_release(
    run_dir: str | Path,
    out: str | Path,
    *,
    step: int | None = None,
    dtype: str = "fp32",
    tokenizers: str | Path | None = None,
    no_tokenizers: bool = False,
    force: bool = False,
    command: list[str] | None = None,
    log=print,
) -> dict:
    """Write the release of one checkpoint of ``run_dir`` to ``out``; returns its config.json."""
    from data.loader.table_load import find_manifest
    from data.shards.manifest import TOKEN_FORMAT
    from data.vocab import VocabLayout
    from train.tasks.lm import tokens_made_with_other

    run_dir = Path(run_dir).resolve()
    check_new_folder(Path(out), force, run_dir / CHECKPOINTS_DIR, ReleaseError)
    ckpt = find_checkpoint(run_dir, step)
    # the config the checkpoint saved, its network as meta.json recorded it
    run_cfg = load_run_config(ckpt.folder / CONFIG_FILE, ckpt.meta.get("network"), log)
    task = ckpt.meta["task"]
    torch_dtype = DTYPES[dtype]
    log(
        f"{ckpt.folder}: task {task}, step {ckpt.step}, ZeRO {ckpt.zero_stage}, {ckpt.meta['world_size']} rank(s)"
    )

    layout: VocabLayout | None = None  # an LM checkpoint's
    tok_dir: Path | None = None
    fingerprints, tok_options = None, {}
    if task == "lm":
        # in the checkpoint's manifest, which find_checkpoint checked: the layout it trained with
        layout = VocabLayout.load(ckpt.folder / LAYOUT)
        net_cfg = run_cfg.model.with_layout(layout, strict=False)
        if no_tokenizers:  # the fingerprints, from the checkpoint's record, without the files
            fingerprints = recorded_tokenizers(ckpt.folder)
        else:
            tok_dir = Path(tokenizers) if tokenizers else find_tokenizers(run_cfg, run_dir)
            if not tok_dir.is_dir():
                named = "--tokenizers" if tokenizers else "data.tokenizers"
                raise ReleaseError(f"{named} {tok_dir}: not a folder")
            fingerprints = check_tokenizers(tok_dir, layout)
            # same layout, other ids (the run's token manifests, or what its checkpoint recorded)
            if differ := tokens_made_with_other(run_cfg, fingerprints, ckpt.folder):
                raise ReleaseError(f"{tok_dir}: not the tokenizers of the run's tokens ({differ})")
            # the manifest of the token folder that holds tokenizers/, if it is one
            manifest = (find_manifest(str(tok_dir)) or [{}])[0]
            if manifest.get("format") == TOKEN_FORMAT:
                # The grids the images were trained at: earlyfuse-generate --draw picks from them.
                grids = {"image_grids": image_grids(manifest)} if image_grids(manifest) else {}
                tok_options = {**manifest.get("options", {}), **grids}
    elif task == "vtok":
        net_cfg = run_cfg.vtok
    else:
        raise CheckpointError(f"{ckpt.folder / CHECKPOINT_META_FILE}: unknown task {task!r}")

    state = consolidate(ckpt)
    check_state(state, meta_module(task, net_cfg).state_dict(), str(ckpt.folder))
    state = {
        key: (tensor.to(torch_dtype) if tensor.is_floating_point() else tensor)
        for key, tensor in state.items()
    }
    n_params = param_count(state)
    log(
        f"consolidated {len(state)} tensors, {n_params:,} parameters; shapes match the model config"
    )

    config = {
        "format": FORMAT,
        "version": VERSION,
        "task": task,
        **({"model": dataclasses.asdict(net_cfg)} if task == "lm" else {}),
        "dtype": str(torch_dtype).removeprefix("torch."),
        "tensors": len(state),
        "parameters": n_params,
        "source": {
            "run_dir": str(run_dir),
            "run_name": run_cfg.name,
            "tag": ckpt.tag,
            "step": ckpt.step,
            "zero_stage": ckpt.zero_stage,
            "world_size": ckpt.meta["world_size"],
            "bf16": bool(ckpt.meta.get("bf16", False)),
        },
        **({"tokenizers": fingerprints, "tokenize": tok_options} if task == "lm" else {}),
        **({"packing": packing(run_cfg, ckpt.meta["world_size"])} if task == "lm" else {}),
        "created_by": {
            "command": command or [],
            # the packages a shard manifest records, and the two that wrote the weights
            "versions": {
                **versions(),
                **{pkg: version(pkg) for pkg in ("deepspeed", "safetensors")},
            },
        },
    }

    def write(folder: Path) -> None:
        if layout is not None:  # task lm
            # One key: safetensors writes a metadata dict in an order that varies from process to
            # process, and the same checkpoint must give the same bytes (its sha256 in config.json)
            save_file(state, str(folder / WEIGHTS), metadata={"format": FORMAT})
            layout.save(folder / LAYOUT)
            if tok_dir is not None:
                for name in tokenizer_files(tok_dir):
                    (folder / name).parent.mkdir(exist_ok=True)
                    shutil.copyfile(tok_dir / name, folder / name)
        else:  # the folder a vtok run exports and `earlyfuse-prep tokenize` reads
            from train.tasks.vtok import save_visual_tokenizer

            save_visual_tokenizer(state, net_cfg, folder / VISUAL)

    config = write_release(Path(out), config, write)
    log(f"wrote {out}: " + ", ".join(config["files"]))
    if task == "lm" and tok_dir is None:
        log(
            "note: no tokenizers in this release (--no-tokenizers): earlyfuse-generate cannot use it; "
            "train.init_from can, earlyfuse-convert hf cannot"
        )
    if task == "vtok" and dtype == "bf16":
        log(
            "note: a visual tokenizer in bf16 encodes some positions to other codes than in fp32 "
            "(0.6 % of them on the demo's): token data made with it differs from the run's; "
            "keep fp32 for the tokenizer earlyfuse-prep tokenize reads"
        )
    return config


def run(args: argparse.Namespace) -> None:
    make_release(
        args.run_dir,
        args.out,
        step=args.step,
        dtype=args.dtype,
        tokenizers=args.tokenizers,
        no_tokenizers=args.no_tokenizers,
        force=args.force,
        command=["earlyfuse-convert", *sys.argv[1:]] if sys.argv else None,
    )


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_run_dir(parser)
    parser.add_argument(
        "out",
        metavar="OUT",
        type=local_folder,
        help="release folder to write (must not exist or be empty, see --force)",
    )
    parser.add_argument(
        "--dtype",
        choices=["fp32", "bf16"],
        default="fp32",
        help="weight dtype stored (default fp32). An LM release's visual tokenizer stays fp32 "
        "either way; a visual-tokenizer run released in bf16 encodes some positions to other codes",
    )
    parser.add_argument(
        "--tokenizers",
        metavar="DIR",
        type=local_folder,
        help="the tokenizers/ folder of the token data (default: found from the run config's data.sources)",
    )
    parser.add_argument(
        "--no-tokenizers",
        action="store_true",
        help="weights, config, layout and the tokenizers' fingerprints only, no tokenizer files "
        "(enough for train.init_from, not for earlyfuse-generate)",
    )
    parser.add_argument(
        "--force", action="store_true", help="replace OUT once the new one is complete"
    )
