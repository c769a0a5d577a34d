"""Tokenize a raw shard folder into a token shard folder: the driver (``earlyfuse-prep
tokenize`` and ``merge``). It plans one job per raw shard, skips the ones already done, runs the
rest on the engine, and writes the folder's manifest when every shard is there. The job itself
(one raw shard in, one token shard out, run in the workers) is shard_job.py.

Layout (docs/formats.md, "Token shards"):
  TOKEN_DIR/<source>/shard-NNNNNN.tar    KEY.ids.npy (int32), KEY.mod.npy (uint8), KEY.json (spans)
  TOKEN_DIR/<source>/shard-NNNNNN.idx.jsonl, .idx.bin (the loader's binary index, from the JSONL)
  TOKEN_DIR/manifest.json, TOKEN_DIR/rejects.jsonl
  TOKEN_DIR/tokenizers/                  the tokenizers used (text BPE, layout, visual tokenizer)

Design choices:
- One token shard per raw shard, same names: the unit of work, parallelism and resumption
  (a shard is done when its record in ``TOKEN_DIR/.tokenize/`` matches the fingerprint and the
  files it names are there).
- The fingerprint covers the raw folder (its plan and shard hashes), both tokenizers, the
  layout and the options; a folder made with any other of them is refused, never mixed.
- The visual tokenizer runs on a GPU when there is one (``--device``), in batches of images
  (shard_job.py). The parent checks the visual tokenizer's files without building the model.
- Partitionable like ingest (``--num-partitions/--partition``): partition I takes the
  shards whose index is I mod P; the last one to finish (or ``earlyfuse-prep merge``)
  writes the manifest. Every partitioning and engine gives the same bytes.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections import Counter
from dataclasses import asdict
from pathlib import Path

from data.engine import EngineConfig
from data.names import (
    LAYOUT_FILE,
    MANIFEST_FILE,
    REJECTS_FILE,
    TOKENIZER_FILE,
    TOKENIZERS_DIR,
    VISUAL_TOKENIZER_DIR,
)
from data.shards.manifest import (
    MANIFEST_FORMAT,
    load_manifest,
    partition_share,
    refuse_strays,
    rejects_by_reason,
    run_shard_jobs,
    shard_done,
    shard_entry,
    versions,
)
from data.shards.manifest import TOKEN_FORMAT as FORMAT
from data.shards.storage import Folder, Staging, write_folder, writing
from data.text_tokenizer import TextTokenizer
from data.tokenize.blocks import block_summary
from data.tokenize.docs import TokenizeOptions
from data.tokenize.shard_job import STATE_DIR, TokenizeJob, binary_index_name, tokenize_shard
from data.tokenize.vtok_files import (
    check_visual_tokenizer,
    folder_fingerprints,
    weights_fingerprint,
)
from data.vocab import MODALITY_NAMES


def fingerprint_of(
    raw_manifest: dict, tok_dir: Path, vtok_dir: Path | None, opts: TokenizeOptions
) -> str:
    digest = hashlib.sha256()
    digest.update(
        json.dumps(
            {
                "raw_plan": raw_manifest["plan"]["fingerprint"],
                "raw_shards": [shard["sha256"] for shard in raw_manifest["shards"]],
                "opts": opts.record(),
            },
            sort_keys=True,
        ).encode()
    )
    digest.update((tok_dir / TOKENIZER_FILE).read_bytes())
    digest.update((tok_dir / LAYOUT_FILE).read_bytes())
    digest.update(weights_fingerprint(vtok_dir).encode() if vtok_dir else b"no visual tokenizer")
    return digest.hexdigest()[:24]


def check_text_only(raw_dir: str | Path, raw_manifest: dict) -> None:
    """Without a visual tokenizer, a corpus holding images or videos is refused, saying how
    many and in which sources; one of text and code alone needs none."""
    visual = {
        source["name"]: (source["segments"].get("image", 0), source["segments"].get("video", 0))
        for source in raw_manifest.get("sources", [])
        if source.get("segments", {}).get("image") or source.get("segments", {}).get("video")
    }
    if visual:
        images = sum(counts[0] for counts in visual.values())
        videos = sum(counts[1] for counts in visual.values())
        raise ValueError(
            f"{raw_dir}: {images} image(s) and {videos} video(s) (sources: "
            f"{', '.join(sorted(visual))}) need a visual tokenizer: give --visual-tokenizer "
            "RUN_DIR/visual_tokenizer (docs/visual_tokenizer.md)"
        )


def tokenize(
    raw_dir: str | Path,
    out: str | Path,
    tok_dir: str | Path,
    vtok_dir: str | Path | None,
    *,
    opts: TokenizeOptions | None = None,
    workers: int = 1,
    device: str | None = None,
    progress: bool = False,
    num_partitions: int = 1,
    partition: int = 0,
    engine: EngineConfig | None = None,
    command: list[str] | None = None,
) -> dict:
    """Tokenize this partition's missing shards; when every shard of the folder is done, write
    the manifest (then returned, with ``"finalized": True``). Otherwise returns a summary of
    what this run did and which shards other partitions still owe (``"missing"``)."""
    partition_share(0, num_partitions, partition)  # a bad --partition refused before any read
    raw, dest = Folder(raw_dir), Folder(out)
    tok_dir, vtok_dir = Path(tok_dir), (Path(vtok_dir) if vtok_dir else None)
    opts = opts or TokenizeOptions()
    engine = engine or EngineConfig(workers=workers)
    raw_m = load_manifest(raw_dir)
    text = TextTokenizer.load(tok_dir)  # fail early, with the file named, on a bad tokenizer folder
    if vtok_dir is None:
        check_text_only(raw_dir, raw_m)
    else:
        check_visual_tokenizer(vtok_dir, text.layout)
    fingerprint = fingerprint_of(raw_m, tok_dir, vtok_dir, opts)
    held = dest.read_json(MANIFEST_FILE) if dest.exists(MANIFEST_FILE) else None
    if held is not None and held.get("format") == MANIFEST_FORMAT:
        raise ValueError(f"{out} is an ingest's output (raw shards); choose a new --out")
    if held is not None and held.get("fingerprint") != fingerprint:
        raise ValueError(
            f"{out} holds token shards of other inputs, tokenizers or options; "
            "choose a new --out or delete that folder"
        )
    records = dest.records(STATE_DIR)
    if not records and not dest.exists(MANIFEST_FILE):
        ours = {REJECTS_FILE} | {
            name
            for shard in raw_m["shards"]
            for name in (shard["path"], shard["index"], binary_index_name(shard["index"]))
        }
        refuse_strays(dest, ours, (STATE_DIR, TOKENIZERS_DIR), "tokenize")
    if any(record["fingerprint"] != fingerprint for record in records.values()):
        raise ValueError(
            f"{out}/{STATE_DIR} holds shards of another tokenization; choose a new --out or delete it"
        )
    num_shards = len(raw_m["shards"])
    mine = partition_share(num_shards, num_partitions, partition)
    sizes = dest.sizes()
    # N local workers on N cores: one BPE/torch thread each (0: the libraries' defaults).
    threads = 1 if engine.kind == "ray" or engine.workers > 1 else 0
    jobs = [
        TokenizeJob(  # absolute paths: a Ray actor runs in another folder, maybe on another node
            raw.absolute(),
            dest.absolute(),
            raw_m["shards"][shard_index],
            shard_index,
            num_shards,
            str(tok_dir.resolve()),
            str(vtok_dir.resolve()) if vtok_dir else "",
            opts,
            fingerprint,
            device,
            threads,
            partition=(partition, num_partitions),
            command=tuple(command or ()),
        )
        for shard_index in mine
        if not shard_done(sizes, records.get(shard_index), fingerprint)
    ]
    gpu_setup = None
    if vtok_dir is not None and (device is None or device.startswith("cuda")):
        from data.tokenize.remote_visual import gpu_setup_for

        gpu_setup = gpu_setup_for(str(vtok_dir.resolve()), str(tok_dir.resolve()))
    run_shard_jobs(
        tokenize_shard, jobs, engine, records, len(mine), "tokenize", progress, gpu_setup=gpu_setup
    )
    records.update(dest.records(STATE_DIR))  # what other partitions finished meanwhile
    sizes = dest.sizes()
    missing = [
        shard_index
        for shard_index in range(num_shards)
        if not shard_done(sizes, records.get(shard_index), fingerprint)
    ]
    if missing:
        return {
            "finalized": False,
            "written": len(jobs),
            "skipped_done": len(mine) - len(jobs),
            "partition": [partition, num_partitions],
            "missing": missing,
            "rejects_by_reason": rejects_by_reason(records, list(mine)),
        }
    manifest = finalize_tokens(dest, raw, raw_m, records, tok_dir, vtok_dir, opts, fingerprint)
    return {
        **manifest,
        "finalized": True,
        "written": len(jobs),
        "skipped_done": len(mine) - len(jobs),
    }


def copy_tokenizers(folder: Path, tok_dir: Path, vtok_dir: Path | None) -> None:
    """The text tokenizer's files, and the visual tokenizer's folder as ``visual_tokenizer/``,
    into ``folder``, one file at a time: a copy that fails raises its own OSError, naming the
    file (``shutil.copytree`` gathers every failure into one ``shutil.Error``, a list)."""
    copies = [(tok_dir / name, folder / name) for name in (TOKENIZER_FILE, LAYOUT_FILE)]
    if vtok_dir is not None:
        copies += [
            (src, folder / VISUAL_TOKENIZER_DIR / src.relative_to(vtok_dir))
            for src in sorted(vtok_dir.rglob("*"))
            if src.is_file()
        ]
    for src, dst in copies:
        dst.parent.mkdir(parents=True, exist_ok=True)
        with writing(dst):
            shutil.copyfile(src, dst)


def finalize_tokens(
    dest: Folder,
    raw: Folder,
    raw_m: dict,
    records: dict,
    tok_dir: Path,
    vtok_dir: Path | None,
    opts: TokenizeOptions,
    fp: str,
) -> dict:
    """The tokenizers' copy, rejects.jsonl, then manifest.json (the folder is done once it is
    there): in place, or uploaded."""
    with Staging(dest) as stage:
        tdir = stage.path(TOKENIZERS_DIR)
        # Built whole beside its place, then moved in: a copy cut short (a full disk) leaves no
        # tokenizer folder that looks complete, nor half-overwrites the one a finished run left.
        write_folder(tdir, lambda folder: copy_tokenizers(folder, tok_dir, vtok_dir))
        copied = sorted(str(path.relative_to(stage.path(""))) for path in tdir.rglob("*"))
        stage.publish([rel_path for rel_path in copied if stage.path(rel_path).is_file()])
        fingerprints = folder_fingerprints(tdir)  # of the copy, while the staging holds it
    recs = [records[i] for i in sorted(records)]
    totals: Counter = Counter()
    rejects = []
    sources: dict[str, dict] = {}
    for record in recs:
        totals.update(record["tokens"])
        rejects.extend(record["rejects"])
        source = sources.setdefault(
            record["source"],
            {"name": record["source"], "samples": 0, "tokens": Counter(), "shards": 0},
        )
        source["samples"] += record["samples"]
        source["tokens"].update(record["tokens"])
        source["shards"] += 1
        squeezed = record.get("out_of_shape", {"documents": 0, "examples": []})
        if squeezed["documents"]:
            drawn = source.setdefault("out_of_shape", {"documents": 0, "examples": []})
            drawn["documents"] += squeezed["documents"]
            drawn["examples"] = (drawn["examples"] + squeezed["examples"])[:3]
        thinned = record.get("sparse_clips", {"clips": 0})
        if thinned["clips"]:
            said = source.setdefault("sparse_clips", {"clips": 0, "widest": 0.0, "examples": []})
            said["clips"] += thinned["clips"]
            said["widest"] = max(said["widest"], thinned["widest"])
            said["examples"] = (said["examples"] + thinned["examples"])[:3]

    blocks = block_summary(recs)
    for source in sources.values():
        source["tokens"] = {
            modality: source["tokens"].get(modality, 0) for modality in MODALITY_NAMES
        }
        source["blocks"] = blocks[source["name"]]
    manifest = {
        "format": FORMAT,
        "version": 1,
        "fingerprint": fp,
        "inputs": {
            "raw": raw.url if raw.remote else str(raw.local.resolve()),
            "raw_plan": raw_m["plan"]["fingerprint"],
        },
        "tokenizers": {**fingerprints, "folder": TOKENIZERS_DIR},
        "options": asdict(opts),
        "sources": list(sources.values()),
        "shards": [
            shard_entry(
                record,
                tokens=record["tokens"],
                # What the loader's start needs of a shard, so that it reads no index then.
                index_bin=record["index_bin"],
                blocks=record["block_stats"],
            )
            for record in recs
        ],
        "totals": {
            "samples": sum(record["samples"] for record in recs),
            "bytes": sum(record["bytes"] for record in recs),
            "tokens": sum(totals.values()),
            "tokens_by_modality": {
                modality: totals.get(modality, 0) for modality in MODALITY_NAMES
            },
            "rejects": len(rejects),
            "rejects_by_reason": dict(Counter(record["reason"] for record in rejects)),
        },
        "created_by": {
            "commands": [
                json.loads(c) for c in sorted({json.dumps(r.get("command", [])) for r in recs})
            ],
            "versions": versions(),
        },
    }
    dest.write_json(REJECTS_FILE, lines=rejects)
    dest.write_json(MANIFEST_FILE, manifest)
    return manifest


def merge_tokens(out: str | Path) -> dict:
    """Finish a token folder whose partitions all ran (``earlyfuse-prep merge TOKEN_DIR``)."""
    dest = Folder(out)
    records = dest.records(STATE_DIR)
    if not records:
        raise ValueError(f"{out}: no tokenize records in {out}/{STATE_DIR}")
    prints = {record["fingerprint"] for record in records.values()}
    if len(prints) > 1:
        raise ValueError(
            f"{out}: records of {len(prints)} different tokenizations; partitions must be run "
            "with identical inputs, tokenizers and options"
        )
    first = next(iter(records.values()))
    raw = Folder(first["inputs"]["raw"])
    tok_dir = Path(first["inputs"]["tokenizer"])
    vtok_dir = Path(first["inputs"]["visual"]) if first["inputs"]["visual"] else None
    fingerprint = first["fingerprint"]
    sizes = dest.sizes()
    missing = [
        shard_index
        for shard_index in range(first["num_shards"])
        if not shard_done(sizes, records.get(shard_index), fingerprint)
    ]
    if missing:
        parts = first["partition"][1] if "partition" in first else 0  # records name it since
        owners = sorted({index % parts for index in missing}) if parts else missing[:5]
        raise ValueError(
            f"{out}: {len(missing)} token shard(s) not written yet ("
            + (
                f"partitions {owners} of --num-partitions {parts} have not finished"
                if parts
                else f"e.g. {owners}"
            )
            + "); run them, then merge again"
        )
    opts = TokenizeOptions(**first["options"])
    raw_m = load_manifest(first["inputs"]["raw"])
    if fingerprint_of(raw_m, tok_dir, vtok_dir, opts) != fingerprint:
        raise ValueError(
            f"{out}: the raw folder or tokenizers changed since these shards were made"
        )
    return finalize_tokens(dest, raw, raw_m, records, tok_dir, vtok_dir, opts, fingerprint)
