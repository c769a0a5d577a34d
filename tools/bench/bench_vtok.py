"""Train a visual-tokenizer config for N minutes on photo crops, then measure it on held-out photos.

    python tools/bench/bench_vtok.py --minutes 15 --preset vtok_cpu --out /tmp/vtok
    python tools/bench/bench_vtok.py --minutes 2 --set enc_channels=[64] dec_blocks=1 --lr 3e-3

Prints (and writes to OUT/result.json) held-out PSNR and SSIM, the per-patch mean-colour baseline
on the same crops, code use (fraction hit, perplexity, token count), encode images/s, and saves
OUT/grid.png (rows: originals, reconstructions, baseline) and OUT/vtok.pt (config + weights).

Choices that make the numbers comparable between runs:
- Whole photos are held out (``HELD_OUT``), never only crops of training photos.
- Evaluation crops sit at fixed seeded positions at the photos' native resolution; their count
  gives at least ten tokens per code, as the issue asks for code use.
- PSNR is of the set's mean MSE (finite even when a flat crop is reproduced exactly); the
  baseline gets the same treatment on the same crops.
- The schedule is a function of elapsed time, not of steps: on a shared 2-core machine the step
  rate varies, and a budget in minutes is what the issue fixes. Steps done are reported.
"""

from __future__ import annotations

import argparse
import ast
import copy
import json
import math
import os
import platform
import time
from pathlib import Path

# On a shared machine a spinning OpenMP barrier waits for a descheduled sibling thread and a step
# can take 5x longer; passive waiting gives the core back (measured: 2 threads went from ~25 to
# ~80 img/s while another job held one of the 2 cores). Must be set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image

from data.image_prep import ImagePrep, load_image
from model import visual_tokenizer as vt
from model.vtok_metrics import CodeUse, patch_mean_baseline, psnr_of_mse, ssim, to_unit

HELD_OUT = ("brick", "camera", "chelsea", "coffee", "rocket")
_NATIVE = ImagePrep(factor=4, max_pixels=4096 * 4096, max_grid=1024)


def ensure_corpus(folder: Path) -> Path:
    if not (folder / "photos").is_dir():
        from data.demo_corpus import build

        build(folder, scale=0.05, progress=False)  # photos are always all there; the rest is small
    return folder


def load_folder(folder: Path) -> dict[str, torch.Tensor]:
    """name -> [3, H, W] float in [-1, 1] at native size (multiples of 4)."""
    out = {}
    for p in sorted(folder.iterdir()):
        if p.suffix.lower() in (".png", ".jpg", ".jpeg"):
            a = load_image(p.read_bytes(), _NATIVE)
            out[p.stem] = torch.from_numpy(np.array(a)).permute(2, 0, 1).float() / 127.5 - 1
    return out


def eval_crops(photos: list[torch.Tensor], crop: int, n_min: int, seed: int) -> torch.Tensor:
    g = np.random.default_rng(seed)
    per = math.ceil(n_min / len(photos))
    crops = []
    for im in photos:
        _, h, w = im.shape
        for _ in range(per):
            y, x = int(g.integers(0, h - crop + 1)), int(g.integers(0, w - crop + 1))
            crops.append(im[:, y : y + crop, x : x + crop])
    return torch.stack(crops)


class CropSampler:
    """Random crops (hflip, optional half-scale copies) from training images, weighted by area."""

    def __init__(self, images: list[torch.Tensor], crop: int, half_scale: bool, seed: int) -> None:
        imgs = list(images)
        if half_scale:  # a second, antialiased half-size copy: coarser structure per crop
            imgs += [
                F.interpolate(i[None], scale_factor=0.5, mode="bilinear", antialias=True)[0]
                for i in images
                if min(i.shape[1:]) >= 4 * crop
            ]
        self.images = [i for i in imgs if min(i.shape[1:]) >= crop]
        area = np.array([math.sqrt(i.shape[1] * i.shape[2]) for i in self.images])
        self.p = area / area.sum()  # sqrt(area): big photos more often, small ones still seen
        self.crop, self.g = crop, np.random.default_rng(seed)

    def batch(self, n: int) -> torch.Tensor:
        out = torch.empty(n, 3, self.crop, self.crop)
        for k, i in enumerate(self.g.choice(len(self.images), size=n, p=self.p)):
            im = self.images[i]
            y = int(self.g.integers(0, im.shape[1] - self.crop + 1))
            x = int(self.g.integers(0, im.shape[2] - self.crop + 1))
            c = im[:, y : y + self.crop, x : x + self.crop]
            out[k] = c.flip(-1) if self.g.random() < 0.5 else c
        return out


@torch.no_grad()
def evaluate(model, crops: torch.Tensor, device, bs: int = 128) -> dict:
    model.eval()
    cu = CodeUse(model.num_codes)
    se = se_b = ss = ss_b = 0.0
    for s in range(0, len(crops), bs):
        x = crops[s : s + bs].to(device)
        idx = model.encode(x)
        cu.update(idx)
        y, t = to_unit(model.decode(idx)), to_unit(x)
        b = patch_mean_baseline(t, model.cfg.factor, model.num_codes)
        se += float(((y - t) ** 2).flatten(1).mean(1).sum())
        se_b += float(((b - t) ** 2).flatten(1).mean(1).sum())
        ss += float(ssim(y, t).sum())
        ss_b += float(ssim(b, t).sum())
    n = len(crops)
    return {
        "psnr": float(psnr_of_mse(se / n)),
        "ssim": ss / n,
        "baseline_psnr": float(psnr_of_mse(se_b / n)),
        "baseline_ssim": ss_b / n,
        "code_fraction": cu.fraction(),
        "code_perplexity": cu.perplexity(),
        "tokens": cu.tokens,
        "images": n,
    }


@torch.no_grad()
def evaluate_video(model, clips: Path, device, n: int = 4) -> dict:
    """Demo clips through the causal video path vs frame-by-frame image tokens (no video training:
    the merge is at its mean initialisation unless a video run trained it)."""
    from data.video_frames import VideoSampling, decode_frames

    model.eval()
    prep = ImagePrep(factor=model.cfg.factor, max_pixels=96 * 96, max_grid=64)
    se_v = se_i = 0.0
    frames = tokens_v = tokens_i = 0
    for path in sorted(clips.glob("*.mp4"))[:n]:
        f = decode_frames(path.read_bytes(), VideoSampling(target_fps=8, max_frames=9), prep).frames
        x = torch.from_numpy(np.array(f)).permute(0, 3, 1, 2).float().div(127.5).sub(1).to(device)
        idx = model.encode_video(x[None])
        y = to_unit(model.decode_video(idx, num_frames=len(x))[0])
        yi = to_unit(model.decode(model.encode(x)))
        t = to_unit(x)
        se_v += float(((y - t) ** 2).sum() / t[0].numel())
        se_i += float(((yi - t) ** 2).sum() / t[0].numel())
        frames, tokens_v, tokens_i = (
            frames + len(x),
            tokens_v + idx.numel(),
            tokens_i + model.encode(x).numel(),
        )
    if not frames:
        return {}
    return {
        "clips": min(n, len(list(clips.glob("*.mp4")))),
        "frames": frames,
        "video_psnr": float(psnr_of_mse(se_v / frames)),
        "video_tokens": tokens_v,
        "per_frame_psnr": float(psnr_of_mse(se_i / frames)),
        "per_frame_tokens": tokens_i,
    }


@torch.no_grad()
def encode_speed(model, device, size: int, bs: int, seconds: float = 3.0) -> float:
    model.eval()
    x = torch.rand(bs, 3, size, size, device=device) * 2 - 1
    model.encode(x)  # warm-up
    n, t0 = 0, time.perf_counter()
    while time.perf_counter() - t0 < seconds:
        model.encode(x)
        n += bs
    if device.type == "cuda":
        torch.cuda.synchronize()
    return n / (time.perf_counter() - t0)


def save_grid(model, crops: torch.Tensor, path: Path, device, n: int = 12, zoom: int = 3) -> None:
    with torch.no_grad():
        x = crops[:n].to(device)
        y = model.decode(model.encode(x))
        b = patch_mean_baseline(to_unit(x), model.cfg.factor, model.num_codes)
    rows = [to_unit(x), to_unit(y), b]  # originals, reconstructions, baseline
    grid = torch.cat([torch.cat(list(r.cpu()), 2) for r in rows], 1)
    a = (grid.permute(1, 2, 0).numpy() * 255 + 0.5).astype(np.uint8)
    Image.fromarray(a).resize(
        (a.shape[1] * zoom, a.shape[0] * zoom), Image.Resampling.NEAREST
    ).save(path)


def parse_sets(items: list[str]) -> dict:
    out = {}
    for it in items:
        k, v = it.split("=", 1)
        try:
            out[k] = ast.literal_eval(v)
        except (ValueError, SyntaxError):
            out[k] = v
    return out


def main(argv: list[str] | None = None) -> dict:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--corpus", type=Path, default=Path("/tmp/vtok_corpus"))
    ap.add_argument("--out", type=Path, default=Path("/tmp/vtok_bench"))
    ap.add_argument("--preset", default="vtok_cpu")
    ap.add_argument("--set", nargs="*", default=[], help="config overrides key=value")
    ap.add_argument("--minutes", type=float, default=15.0)
    ap.add_argument(
        "--clock",
        choices=["cpu", "wall"],
        default="cpu",
        help="budget clock: cpu = this process's CPU seconds / threads (what an unloaded "
        "machine with that many cores would take; robust to other jobs), or wall",
    )
    ap.add_argument(
        "--steps",
        type=int,
        default=0,
        help="ablations: schedule by steps and stop there (--minutes stays a cap); "
        "on a shared CPU equal steps compare configs, equal minutes do not",
    )
    ap.add_argument("--crop", type=int, default=32)
    ap.add_argument("--batch", type=int, default=32)
    ap.add_argument("--lr", type=float, default=2e-3)
    ap.add_argument("--final-lr", type=float, default=0.02, help="as a fraction of --lr")
    ap.add_argument("--warmup", type=int, default=100, help="steps")
    ap.add_argument("--wd", type=float, default=1e-4)
    ap.add_argument("--ema", type=float, default=0.0, help="EMA decay of weights for eval (0: off)")
    ap.add_argument("--half-scale", action="store_true", help="also train on half-size photos")
    ap.add_argument("--mix", type=float, default=0.0, help="fraction of crops from scenes+digits")
    ap.add_argument("--eval-crops", type=int, default=320)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument(
        "--amp",
        choices=["bf16", "none"],
        default="bf16",
        help="bf16 autocast (CPU: ~1.7x faster on AVX512-BF16, measured)",
    )
    ap.add_argument("--device", default="auto")
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args(argv)

    torch.set_num_threads(a.threads)
    torch.set_flush_denormal(
        True
    )  # tiny weights near zero-initialised convs must not hit slow denormal paths
    torch.manual_seed(a.seed)
    dev = torch.device(
        ("cuda" if torch.cuda.is_available() else "cpu") if a.device == "auto" else a.device
    )
    cfg = getattr(vt, a.preset)()
    for k, v in parse_sets(a.set).items():
        if not hasattr(cfg, k):
            raise SystemExit(f"unknown config key {k!r}")
        setattr(cfg, k, v)
    cfg.__post_init__()
    # channels_last: oneDNN's native layout for convs; with bf16 it was the fastest combination
    model = cfg.build().to(dev, memory_format=torch.channels_last)
    params = sum(p.numel() for p in model.parameters())

    corpus = ensure_corpus(a.corpus)
    photos = load_folder(corpus / "photos")
    train = [v for k, v in photos.items() if k not in HELD_OUT]
    held = [photos[k] for k in HELD_OUT]
    tok_per_crop = (a.crop // cfg.factor) ** 2
    n_eval = max(a.eval_crops, math.ceil(10 * cfg.num_codes / tok_per_crop))
    crops = eval_crops(held, a.crop, n_eval, seed=1234)
    sampler = CropSampler(train, a.crop, a.half_scale, a.seed)
    extra = None
    if a.mix > 0:
        ims = list(load_folder(corpus / "scenes" / "img").values()) + list(
            load_folder(corpus / "digits" / "img").values()
        )
        extra = CropSampler(ims, a.crop, False, a.seed + 1)

    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, betas=(0.9, 0.99), weight_decay=a.wd)
    ema = copy.deepcopy(model) if a.ema else None

    def clock() -> float:
        return time.process_time() / a.threads if a.clock == "cpu" else time.perf_counter()

    budget, step, seen, t0, last = a.minutes * 60, 0, 0, clock(), 0.0
    w0 = time.perf_counter()
    print(
        f"params {params / 1e6:.3f}M  train photos {len(train)}  held-out crops {len(crops)}  device {dev}",
        flush=True,
    )
    while (el := clock() - t0) < budget and not (a.steps and step >= a.steps):
        p = step / a.steps if a.steps else el / budget
        lr = (
            a.lr
            * min(1.0, (step + 1) / a.warmup)
            * (a.final_lr + (1 - a.final_lr) * 0.5 * (1 + math.cos(math.pi * p)))
        )
        for gr in opt.param_groups:
            gr["lr"] = lr
        if extra is not None:
            k = int(round(a.batch * a.mix))
            x = torch.cat([sampler.batch(a.batch - k), extra.batch(k)])
        else:
            x = sampler.batch(a.batch)
        model.train()
        with torch.autocast(dev.type, dtype=torch.bfloat16, enabled=a.amp == "bf16"):
            loss, m = model(x.to(dev, memory_format=torch.channels_last))
        opt.zero_grad(set_to_none=True)
        loss.backward()
        opt.step()
        if ema is not None:
            with torch.no_grad():
                for pe, pm in zip(ema.parameters(), model.parameters()):
                    pe.lerp_(pm, 1 - a.ema)
        step, seen = step + 1, seen + len(x)
        if el - last > 30:
            last = el
            print(
                f"{el / 60:5.1f} min ({a.clock})  step {step}  loss {loss.item():.4f}  psnr {m['psnr']:.2f}  "
                f"lr {lr:.2e}  {seen / el:.0f} img/s  wall {(time.perf_counter() - w0) / 60:.1f} min",
                flush=True,
            )
    train_s, wall_s = clock() - t0, time.perf_counter() - w0
    final = ema if ema is not None else model
    res = evaluate(final, crops, dev)
    res.update(
        train_minutes=train_s / 60,
        wall_minutes=wall_s / 60,
        clock=a.clock,
        steps=step,
        images_seen=seen,
        params=params,
        config=vars(cfg),
        args={k: str(v) for k, v in vars(a).items()},
        device=str(dev),
        cpu=platform.processor(),
        encode_img_s={
            f"{a.crop}px_b64": encode_speed(final, dev, a.crop, 64),
            "256px_b8": encode_speed(final, dev, 256, 8),
        },
    )
    res["video"] = evaluate_video(final, corpus / "clips", dev)
    if ema is not None:
        res["no_ema"] = {
            k: v for k, v in evaluate(model, crops, dev).items() if k in ("psnr", "ssim")
        }
    a.out.mkdir(parents=True, exist_ok=True)
    save_grid(final, crops[:: max(1, len(crops) // 12)], a.out / "grid.png", dev)
    torch.save({"config": vars(cfg), "state_dict": final.state_dict()}, a.out / "vtok.pt")
    (a.out / "result.json").write_text(json.dumps(res, indent=1))
    print(
        f"held-out: PSNR {res['psnr']:.2f} dB (baseline {res['baseline_psnr']:.2f})  SSIM {res['ssim']:.3f} "
        f"(baseline {res['baseline_ssim']:.3f})  codes hit {res['code_fraction']:.1%} of {model.num_codes} "
        f"over {res['tokens']} tokens, perplexity {res['code_perplexity']:.0f}  steps {step}  "
        f"encode {res['encode_img_s']}\nvideo {res['video']}",
        flush=True,
    )
    return res


if __name__ == "__main__":
    main()
