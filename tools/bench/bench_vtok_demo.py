"""Measure trained demo visual tokenizers on one fixed held-out set, whatever they were trained on.

    python tools/bench/bench_vtok_demo.py runs/demo/vtok runs/vtok_try1 ... --raw runs/demo/raw

Each argument is a ``earlyfuse-train experiment=vtok_demo`` run folder (its ``visual_tokenizer/``
is loaded; ``cpu_seconds`` is read from ``RUN.time``, the ``/usr/bin/time -v`` output of the run,
when there is one). Prints one table row per run and writes ``--out`` (JSON).

Why a separate measurement: the task's own evaluation (``final.json``) takes its held-out crops
from images resized with the run's own ``vtok_data.max_pixels`` and cut with its own
``vtok_data.crop``, so two runs that differ in those settings are not scored on the same crops.
Here every run is scored by the task's own code (``VtokTask.evaluate``: code use, PSNR of the set
on all/flat/detailed crops against the uniform-levels and k-means palette baselines, scene IoU
and the single-shape colour/shape/cell reads) on two fixed sets:

- ``demo``: the demo's held-out crops as ``experiment=vtok_demo`` draws them today (images
  resized into 128x128, 256 crops of 32x32, documents held out by key hash at 10 %) and its
  64 probe scenes at their generated size (64x64 or 96x64);
- ``lm``: what the LM is fed (``make demo`` tokenizes images with ``--image-max-pixels 2304``,
  48x48): held-out crops of 32x32 cut from images resized into 48x48, and ``--scenes`` probe
  scenes resized the same way, so the scene reads are the tokenizer's ceiling at the LM's
  resolution.

The equal-bits baselines are learned/sized for each run's own code count, so a run with fewer
codes (fewer bits per token) faces weaker baselines: compare PSNR across level counts too.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
from dataclasses import replace
from pathlib import Path
from types import SimpleNamespace

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # see bench_vtok.py: shared cores

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))  # run from a checkout

from data.image_crops import CropStream
from data.tokenize.visual import load_visual_tokenizer
from data.vocab import VocabLayout
from model.vtok_metrics import learn_palette, to_unit
from train.config import ImageDataConfig, RunConfig
from train.dist import DistInfo
from train.tasks.vtok import VtokTask

SETS = {
    "demo": {"max_pixels": 16384, "scene_probe": 64},
    "lm": {"max_pixels": 2304, "scene_probe": 0},  # scenes: --scenes
}


def cpu_seconds(time_file: Path) -> float | None:
    """User + system seconds from a ``/usr/bin/time -v`` report."""
    if not time_file.is_file():
        return None
    text = time_file.read_text()
    found = [re.search(rf"{kind} time \(seconds\): ([0-9.]+)", text) for kind in ("User", "System")]
    return sum(float(m.group(1)) for m in found if m) if all(found) else None


def load(run: Path):
    folder = run / "visual_tokenizer"
    levels = json.loads((folder / "config.json").read_text())["levels"]
    return load_visual_tokenizer(folder, VocabLayout(text_size=512, fsq_levels=tuple(levels)))


def build_task(raw: list[str], set_name: str, scenes: int) -> VtokTask:
    settings = SETS[set_name]
    data = ImageDataConfig(
        raw=raw,
        crop=32,
        heldout_fraction=0.1,
        heldout_crops=256,
        max_pixels=settings["max_pixels"],
        scene_probe=scenes if set_name == "lm" else settings["scene_probe"],
    )
    cfg = RunConfig(task="vtok", vtok_data=data)
    cfg.vtok = replace(cfg.vtok, factor=4)
    return VtokTask(cfg, DistInfo(rank=0, world_size=1, local_rank=0, device=torch.device("cpu")))


def measure(task: VtokTask, model) -> dict[str, float]:
    """The task's own evaluation, with its baselines sized for ``model``'s code count."""
    if task.cfg.vtok.num_codes != model.num_codes or task.cfg.vtok.factor != model.cfg.factor:
        task.cfg = replace(task.cfg, vtok=model.cfg)
        sample = CropStream(task.pool.train, crop=32, batch=512, seed=7, rank=0).batch_at(0)
        task.palette = learn_palette(to_unit(sample["images"]), model.cfg.factor, model.num_codes)
    with torch.no_grad():
        return task.evaluate(SimpleNamespace(module=model), step=0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("runs", nargs="+", type=Path)
    parser.add_argument("--raw", default="runs/demo/raw")
    parser.add_argument("--scenes", type=int, default=256, help="probe scenes at 48x48")
    parser.add_argument("--out", type=Path, default=Path("runs/bench_vtok_demo.json"))
    args = parser.parse_args()
    tasks = {name: build_task([args.raw], name, args.scenes) for name in SETS}
    results = {}
    for run in args.runs:
        model = load(run)
        row: dict = {"levels": model.cfg.levels, "cpu_seconds": cpu_seconds(Path(f"{run}.time"))}
        for name, task in tasks.items():
            row[name] = measure(task, model)
            row[name]["single_shape_scenes"] = sum(len(f["shapes"]) == 1 for f, _ in task.scenes)
        results[str(run)] = row
        demo, lm = row["demo"], row["lm"]
        print(
            f"{run.name:28s} levels {model.cfg.levels} cpu {row['cpu_seconds']} | demo: use "
            f"{demo['eval/code_fraction']:.3f} psnr {demo['eval/psnr']:.2f} flat "
            f"{demo['eval/flat/psnr']:.2f} (pal {demo['eval/flat/palette_psnr']:.2f} uni "
            f"{demo['eval/flat/baseline_psnr']:.2f}) det {demo['eval/detailed/psnr']:.2f} (pal "
            f"{demo['eval/detailed/palette_psnr']:.2f} uni {demo['eval/detailed/baseline_psnr']:.2f})"
            f" iou {demo['eval/scene_iou']:.3f} | lm: use {lm['eval/code_fraction']:.3f} psnr "
            f"{lm['eval/psnr']:.2f} (pal {lm['eval/palette_psnr']:.2f}) flat {lm['eval/flat/psnr']:.2f}"
            f" det {lm['eval/detailed/psnr']:.2f} iou {lm['eval/scene_iou']:.3f} colour "
            f"{lm['eval/scene_colour']:.2f} cell {lm['eval/scene_position']:.2f} shape "
            f"{lm['eval/scene_shape']:.2f}",
            flush=True,
        )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1) + "\n")


if __name__ == "__main__":
    main()
