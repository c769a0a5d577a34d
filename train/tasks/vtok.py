"""Task ``vtok``: train the FSQ visual tokenizer on image crops from raw shards.

Logged every step: the loss and the batch's PSNR and code use. Evaluated on fixed held-out
crops: PSNR, SSIM, code use (fraction of codes hit, perplexity) over at least ten tokens per
code when the held-out set allows, and the baseline the issue measures against (per-patch mean
colour quantised to the same bits per token, upsampled bilinearly). At the end: a PNG grid of
originals beside reconstructions and the trained network as ``RUN_DIR/visual_tokenizer/``
(``model.safetensors`` + ``config.json``), which ``earlyfuse-prep tokenize`` loads.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.flop_counter import FlopCounterMode

from data.image_crops import CropStream, fixed_crops, load_pool
from data.image_prep import ImagePrep
from data.names import VISUAL_CONFIG_FILE, VISUAL_TOKENIZER_DIR, VISUAL_WEIGHTS_FILE
from model.vtok_metrics import code_use, patch_mean_baseline, psnr, ssim, to_unit
from train.config import RunConfig
from train.dist import DistInfo
from train.streams import CropStream as CropBatches
from train.tasks.base import StepOutput


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
        if d.crop % v.factor:
            raise ValueError(
                f"vtok_data.crop {d.crop} must be a multiple of vtok.factor {v.factor}"
            )
        if not d.raw:
            raise ValueError("vtok_data.raw is empty: give the raw shard folders to train on")
        self.prep = ImagePrep(factor=v.factor, max_pixels=d.max_pixels, max_grid=4096)
        self.pool = load_pool(
            d.raw,
            sources=d.sources,
            prep=self.prep,
            crop=d.crop,
            heldout_fraction=d.heldout_fraction,
            video_frames=d.video_frames,
            limit=d.cache_images,
        )
        self.eval_images = fixed_crops(
            self.pool.heldout or self.pool.train, d.crop, d.heldout_crops
        )

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
        n_codes = self.cfg.vtok.num_codes
        base = patch_mean_baseline(x, self.cfg.vtok.factor, n_codes)
        use = code_use(idx, n_codes)
        # Mean over images of per-image PSNR / SSIM, the same for the baseline.
        return {
            "eval/psnr": float(psnr(to_unit(y), to_unit(x)).mean()),
            "eval/ssim": float(ssim(to_unit(y), to_unit(x)).mean()),
            "eval/baseline_psnr": float(psnr(to_unit(base), to_unit(x)).mean()),
            "eval/code_fraction": use["code_fraction"],
            "eval/code_perplexity": use["code_perplexity"],
            "eval/tokens_per_code": idx.numel() / n_codes,
            "eval/heldout": float(bool(self.pool.heldout)),
        }

    def finish(self, engine, run_dir: Path) -> dict[str, float]:
        state = full_state_dict(engine, self.cfg.deepspeed.zero_stage)
        if not self.dist.is_main:
            return {}
        save_visual_tokenizer(state, self.cfg.vtok, run_dir / VISUAL_TOKENIZER_DIR)
        x = self.eval_images[:16]
        y, _ = self.reconstruct(engine, x)
        save_grid(x, y, run_dir / "vtok_reconstructions.png")
        return {
            "images_in_pool": len(self.pool.train),
            "heldout_images": len(self.pool.heldout),
            "skipped_images": self.pool.skipped,
        }

    def extra_files(self) -> dict[str, str]:
        return {}

    def chance_levels(self) -> None:
        return None  # one loss, no vocabulary: the spike and divergence monitors apply

    def probes(self, monitor_cfg, engine) -> None:
        return None


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
