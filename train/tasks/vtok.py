"""Task ``vtok``: train the FSQ visual tokenizer on image crops from raw shards.

Logged every step: the loss and the batch's PSNR and code use. Evaluated on fixed held-out
crops (docs/visual_tokenizer.md, "What the figures mean"):

- PSNR of the set (from its mean MSE, finite when a crop is reproduced exactly) and SSIM; code
  use (fraction of codes hit, perplexity) with the tokens per code;
- the same bits per token spent two other ways, the sceptic's baselines: ``baseline`` (each patch's
  mean colour quantised to uniform RGB levels) and ``palette`` (each patch's mean colour replaced
  by the nearest of a k-means palette of as many colours as the tokenizer has codes, learned on
  training crops); and ``thumbnail`` (unquantised patch means: no tokenizer of mean colours can
  beat it);
- all of them again on the *flat* and the *detailed* crops separately (flat: the thumbnail alone
  reaches 30 dB), since a figure dominated by skies and walls says little about edges;
- shape identity on generated scenes (``vtok_data.scene_probe`` of them, data/demo_corpus/scenes.py,
  resized like the tokenize step): IoU of each reconstructed shape's pixels with the true shape,
  for the tokenizer and both baselines, and on single-shape scenes whether the pixel classifier
  (data/demo_corpus/scene_scoring.py) reads the stated colour, shape and cell back.

At the end: a PNG grid of originals beside reconstructions and the trained network as
``RUN_DIR/visual_tokenizer/`` (``model.safetensors`` + ``config.json``), which
``earlyfuse-prep tokenize`` loads.
"""

from __future__ import annotations

import json
import logging
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from data.image_crops import CropStream, fixed_crops, load_pool, to_tensor
from data.image_prep import ImagePrep
from data.names import VISUAL_CONFIG_FILE, VISUAL_TOKENIZER_DIR, VISUAL_WEIGHTS_FILE
from model.vtok_metrics import (
    code_use,
    detail_strata,
    learn_palette,
    palette_baseline,
    patch_mean_baseline,
    psnr_of_mse,
    ssim,
    thumbnail,
    to_unit,
)
from train.config import RunConfig
from train.config_check import ConfigError
from train.dist import DistInfo
from train.streams import CropStream as CropBatches
from train.tasks.base import StepOutput

log = logging.getLogger(__name__)


def full_state_dict(engine, zero_stage: int) -> dict[str, torch.Tensor]:
    """The whole model's weights on every rank, whatever the ZeRO stage (fp32 copies)."""
    module = engine.module
    if zero_stage == 3:
        import deepspeed

        with deepspeed.zero.GatheredParameters(list(module.parameters()), modifier_rank=None):
            return {k: v.detach().float().clone() for k, v in module.state_dict().items()}
    return {k: v.detach().float().clone() for k, v in module.state_dict().items()}


def save_visual_tokenizer(state: dict[str, torch.Tensor], cfg, folder: Path) -> None:
    from safetensors.torch import save_file

    folder.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in state.items()}, str(folder / VISUAL_WEIGHTS_FILE))
    (folder / VISUAL_CONFIG_FILE).write_text(json.dumps(asdict(cfg), indent=1) + "\n")


class VtokTask:
    unit = "img"

    def __init__(self, cfg: RunConfig, dist: DistInfo) -> None:
        self.cfg, self.dist = cfg, dist
        d, v = cfg.vtok_data, cfg.vtok
        if d.crop <= 0 or d.crop % v.factor:
            raise ConfigError(
                f"vtok_data.crop {d.crop} must be a positive multiple of vtok.factor {v.factor}"
            )
        if not d.raw:
            raise ConfigError("vtok_data.raw is empty: give the raw shard folders to train on")
        self.prep = ImagePrep(factor=v.factor, max_pixels=d.max_pixels, max_grid=4096)
        try:
            self.pool = load_pool(
                d.raw,
                sources=d.sources,
                prep=self.prep,
                crop=d.crop,
                heldout_fraction=d.heldout_fraction,
                video_frames=d.video_frames,
                limit=d.cache_images,
            )
        except ValueError as e:  # no manifest, no such source, no image as large as a crop
            raise ConfigError(f"vtok_data: {e}") from None
        # Said at start and again in final.json: what a user would change before trusting the run.
        self.warnings = [
            said
            for said in (
                self.pool.describe_skipped(d.crop),
                self.pool.describe_heldout(d.heldout_fraction),
                self.pool.describe_not_read(d.cache_images),
            )
            if said
        ]
        if dist.is_main:
            for said in self.warnings:
                log.warning(f"vtok: {said}")
        self.last_eval: dict[str, float] = {}
        self.eval_images = fixed_crops(
            self.pool.heldout or self.pool.train, d.crop, d.heldout_crops
        )
        # The palette baseline's colours: k-means of the patch means of training crops.
        sample = CropStream(self.pool.train, crop=d.crop, batch=512, seed=7, rank=0).batch_at(0)
        self.palette = learn_palette(to_unit(sample["images"]), v.factor, v.num_codes)
        self.scenes = probe_scenes(d.scene_probe, self.prep)

    def build_model(self):
        return self.cfg.vtok.build()

    def batches(self) -> CropBatches:
        crops = CropStream(
            self.pool.train,
            crop=self.cfg.vtok_data.crop,
            batch=self.cfg.train.micro_batch,
            seed=self.cfg.train.seed,
            rank=self.dist.rank,
        )
        return CropBatches(crops)

    def _dtype(self, engine) -> torch.dtype:
        return next(engine.module.parameters()).dtype

    def forward(self, engine, batch: dict) -> StepOutput:
        x = batch["images"].to(self.dist.device, self._dtype(engine))
        loss, m = engine(x)
        sums = {f"vtok/{k}": v.detach().float() for k, v in m.items()}
        return StepOutput(loss=loss, sums=sums, units=x.shape[0])

    def metrics(self, sums: dict[str, float]) -> dict[str, float]:
        n = sums["micro"]
        out = {k: v / n for k, v in sums.items() if k.startswith("vtok/")}
        out["loss/image"] = sums["loss_sum"] / n
        return out

    def flops_per_unit(self) -> float:
        model = self.cfg.vtok.build()
        x = torch.zeros(1, 3, self.cfg.vtok_data.crop, self.cfg.vtok_data.crop)
        with FlopCounterMode(display=False) as fc:
            model(x)[0].backward()
        return float(fc.get_total_flops())

    @torch.no_grad()
    def reconstruct(
        self, engine, images: torch.Tensor, batch: int = 64
    ) -> tuple[torch.Tensor, torch.Tensor]:
        module, dtype = engine.module, self._dtype(engine)
        recons, codes = [], []
        for i in range(0, len(images), batch):
            x = images[i : i + batch].to(self.dist.device, dtype)
            idx = module.encode(x)
            recons.append(module.decode(idx).float().cpu())
            codes.append(idx.cpu())
        return torch.cat(recons), torch.cat(codes)

    def evaluate(self, engine, step: int) -> dict[str, float]:
        x = self.eval_images
        if not len(x):
            return {}
        y, idx = self.reconstruct(engine, x)
        f, n_codes = self.cfg.vtok.factor, self.cfg.vtok.num_codes
        ux, uy = to_unit(x), to_unit(y)
        # The baselines work on [0, 1] images; the tokenizer's are in [-1, 1].
        rivals = {
            "": uy,
            "baseline_": patch_mean_baseline(ux, f, n_codes),
            "palette_": palette_baseline(ux, f, self.palette),
            "thumbnail_": thumbnail(ux, f),
        }
        mse = {k: ((r - ux) ** 2).flatten(1).mean(1) for k, r in rivals.items()}
        use = code_use(idx, n_codes)
        out = {
            "eval/ssim": float(ssim(uy, ux).mean()),
            "eval/code_fraction": use["code_fraction"],
            "eval/code_perplexity": use["code_perplexity"],
            "eval/tokens_per_code": idx.numel() / n_codes,
            "eval/heldout": float(bool(self.pool.heldout)),
        }
        strata = {"": torch.ones(len(x), dtype=torch.bool), **detail_strata(ux, f)}
        for name, mask in strata.items():
            prefix = f"eval/{name}/" if name else "eval/"
            if name:
                out[f"{prefix}crops"] = float(mask.sum())
            if mask.any():
                for k, e in mse.items():
                    out[f"{prefix}{k}psnr"] = float(psnr_of_mse(e[mask].mean()))
        out.update(self.scene_figures(engine))
        self.last_eval = out
        return out

    def scene_figures(self, engine) -> dict[str, float]:
        """Shape identity on the generated probe scenes (see the module doc)."""
        from data.demo_corpus.scene_scoring import score, shape_iou

        if not self.scenes:
            return {}
        f, n_codes = self.cfg.vtok.factor, self.cfg.vtok.num_codes
        by_shape: dict[tuple, list] = {}
        for facts, arr in self.scenes:
            by_shape.setdefault(arr.shape, []).append((facts, arr))
        ious: dict[str, list[float]] = {"": [], "baseline_": [], "palette_": []}
        reads = {"colour": 0, "shape": 0, "position": 0}
        single = 0
        for group in by_shape.values():
            x = to_tensor(np.stack([a for _, a in group]))
            y, _ = self.reconstruct(engine, x)
            ux = to_unit(x)
            pictures = {
                "": to_unit(y),
                "baseline_": patch_mean_baseline(ux, f, n_codes),
                "palette_": palette_baseline(ux, f, self.palette),
            }
            for k, imgs in pictures.items():
                for (facts, _), img in zip(group, to_uint8(imgs)):
                    ious[k] += shape_iou(img, facts)
                    if k == "" and len(facts["shapes"]) == 1:
                        single += 1
                        got = score(img, facts)
                        for a in reads:
                            reads[a] += int(got[a])
        out = {
            f"eval/scene_iou{'_' + k[:-1] if k else ''}": float(np.mean(v)) for k, v in ious.items()
        }
        if single:
            out.update({f"eval/scene_{a}": n / single for a, n in reads.items()})
        return out

    def finish(self, engine, run_dir: Path) -> dict[str, float]:
        state = full_state_dict(engine, self.cfg.deepspeed.zero_stage)
        if not self.dist.is_main:
            return {}
        save_visual_tokenizer(state, self.cfg.vtok, run_dir / VISUAL_TOKENIZER_DIR)
        x = self.eval_images[:16]
        y, _ = self.reconstruct(engine, x)
        save_grid(x, y, run_dir / "vtok_reconstructions.png")
        out: dict = {
            "images_in_pool": len(self.pool.train),
            "heldout_images": len(self.pool.heldout),
            "skipped_images": self.pool.skipped,
            "skipped_by_source": self.pool.skipped_by_source,
        }
        below = below_baselines(self.last_eval)
        if below:
            log.warning(f"vtok: {below}")
        if self.warnings or below:
            out["warnings"] = self.warnings + ([below] if below else [])
        return out

    def extra_files(self) -> dict[str, str]:
        return {}

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        pass

    def chance_levels(self) -> None:
        return None  # one loss, no vocabulary: the spike and divergence monitors apply

    def probes(self, monitor_cfg, engine) -> None:
        return None


def below_baselines(figures: dict[str, float]) -> str:
    """A warning when the tokenizer's held-out PSNR is below a baseline spending the same bits
    per token ("" when it beats both, or there was no evaluation): such a tokenizer is worse
    than quantising each patch's mean colour, and an LM trained on its codes inherits that."""
    psnr = figures.get("eval/psnr")
    if psnr is None:
        return ""
    rivals = {
        name: figures[key]
        for name, key in (("mean-colour", "eval/baseline_psnr"), ("palette", "eval/palette_psnr"))
        if key in figures and figures[key] > psnr
    }
    if not rivals:
        return ""
    beaten = ", ".join(f"{name} {value:.2f} dB" for name, value in rivals.items())
    measured = "held-out PSNR" if figures.get("eval/heldout", 1.0) else "PSNR on training crops"
    return (
        f"{measured} {psnr:.2f} dB is below the equal-bits baseline(s) {beaten}: train longer "
        "(train.steps), on more images, or with the level-entropy bonus (vtok.entropy); "
        "docs/visual_tokenizer.md, 'What the figures mean'"
    )


def to_uint8(images: torch.Tensor) -> list[np.ndarray]:
    """[B, 3, H, W] in [0, 1] -> HxWx3 uint8 arrays."""
    return list((images.clamp(0, 1) * 255).round().byte().permute(0, 2, 3, 1).numpy())


def probe_scenes(count: int, prep: ImagePrep, seed: int = 17) -> list[tuple[dict, np.ndarray]]:
    """``count`` generated scenes with their facts, resized as ``earlyfuse-prep tokenize`` would
    (through a PNG, ``load_image``); their own random stream, so never a training scene."""
    import io

    from data.demo_corpus import scenes
    from data.demo_corpus._common import rng_for
    from data.image_prep import load_image

    out = []
    for i in range(count):
        rng = rng_for(seed, "vtok-probe-scenes", i)
        facts = scenes.sample_facts(rng)
        buf = io.BytesIO()
        Image.fromarray(scenes.render(facts, rng)).save(buf, format="PNG")
        out.append((facts, np.array(load_image(buf.getvalue(), prep))))
    return out


def save_grid(
    originals: torch.Tensor, recons: torch.Tensor, path: Path, scale: int = 4, per_row: int = 4
) -> None:
    """Pairs (original | reconstruction), ``per_row`` pairs per row, enlarged ``scale`` x."""

    def img(t):
        return (to_unit(t.float()).clamp(0, 1) * 255).round().byte().permute(1, 2, 0).numpy()

    pairs = [
        np.concatenate([img(a), np.full((a.shape[1], 1, 3), 255, np.uint8), img(b)], axis=1)
        for a, b in zip(originals, recons)
    ]
    h, w = pairs[0].shape[:2]
    rows = -(-len(pairs) // per_row)
    grid = np.full((rows * (h + 3), per_row * (w + 6), 3), 40, np.uint8)
    for i, p in enumerate(pairs):
        r, c = divmod(i, per_row)
        grid[r * (h + 3) : r * (h + 3) + h, c * (w + 6) : c * (w + 6) + w] = p
    Image.fromarray(grid).resize(
        (grid.shape[1] * scale, grid.shape[0] * scale), Image.Resampling.NEAREST
    ).save(path)
