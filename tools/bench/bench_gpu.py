"""GPU throughput and MFU of a model preset, prepared to run in under 5 minutes on one
H100/H200: a few hundred bf16 training steps of ``model/`` on packed rows of random token ids.

What runs is the model and its loss exactly as training runs them (``Transformer`` with the fused
chunked CE, FlexAttention with document masking on CUDA, bf16 autocast with fp32 weights, AdamW,
gradient clipping); the data is random ids in rows of ``--docs`` documents each, so the loader is
not measured (``bench_trainer.py`` measures the trainer and the data wait). MFU = achieved
model FLOP/s (``model.flops.flops_per_token``, causal attention counted) / the GPU's dense bf16
peak (``train.mfu``). Prints tokens/s and MFU over the timed steps (after ``--warmup`` steps).
Needs only torch: the GPU machine lacks DeepSpeed and the other packages.

    python tools/bench/bench_gpu.py --preset 125m --micro-batch 16 --seq-len 2048 --steps 300
    python tools/bench/bench_gpu.py --preset 125m --compile --json out/125m_compiled.json
    python tools/bench/bench_gpu.py --preset debug --device cpu --dtype float32 --steps 3 --warmup 1 --seq-len 128
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.flops import flops_per_token  # noqa: E402
from model.presets import preset  # noqa: E402
from train.mfu import peak_tflops  # noqa: E402


def batch(cfg, micro_batch: int, seq_len: int, docs: int, device, gen) -> dict:
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=gen).to(device)
    bounds = torch.linspace(0, seq_len, docs + 1).long()[1:-1]
    doc = torch.zeros(seq_len, dtype=torch.long)
    for bound in bounds:
        doc[bound:] += 1
    doc = doc.expand(micro_batch, seq_len).contiguous().to(device)
    # The loader's flag: rows of several documents (the model then never reads doc ids back)
    return {
        "input_ids": ids[:, :-1],
        "labels": ids[:, 1:],
        "doc_ids": doc,
        "one_doc_rows": docs <= 1,
    }


def main(argv=None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--preset", default="125m")
    parser.add_argument("--micro-batch", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=2048)
    parser.add_argument(
        "--docs", type=int, default=4, help="documents packed per row (document-masked attention)"
    )
    parser.add_argument("--steps", type=int, default=300)
    parser.add_argument("--warmup", type=int, default=20)
    parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="autocast dtype"
    )
    parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each block and the loss head, as training does on CUDA "
        "(Transformer.compile_blocks; FlexAttention is compiled either way)",
    )
    parser.add_argument("--json", default="", help="also write the result to this JSON file")
    parser.add_argument("--activation-checkpoint", action="store_true")
    args = parser.parse_args(argv)
    dev = torch.device(args.device)
    torch.manual_seed(0)
    cfg = preset(args.preset)
    if args.activation_checkpoint:
        import dataclasses

        cfg = dataclasses.replace(cfg, activation_checkpoint_every=1)
    model = cfg.build(dev)
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda"
    )
    if args.compile:
        model.compile_blocks()
    gen = torch.Generator().manual_seed(0)
    batches = [batch(cfg, args.micro_batch, args.seq_len, args.docs, dev, gen) for _ in range(4)]
    dtype = getattr(torch, args.dtype)

    def step(b):
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    def sync():
        if dev.type == "cuda":
            torch.cuda.synchronize()

    for i in range(args.warmup):
        step(batches[i % len(batches)])
    sync()
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
    started = time.perf_counter()
    for i in range(args.steps):
        loss = step(batches[i % len(batches)])
    sync()
    seconds = time.perf_counter() - started
    tokens = args.steps * args.micro_batch * args.seq_len
    tps = tokens / seconds
    fpt = flops_per_token(cfg, args.seq_len, causal=True)
    peak, source = peak_tflops(0.0, dev)
    res = {
        "device": torch.cuda.get_device_name(dev)
        if dev.type == "cuda"
        else platform.processor() or "cpu",
        "preset": args.preset,
        "params": sum(param.numel() for param in model.parameters()),
        "micro_batch": args.micro_batch,
        "seq_len": args.seq_len,
        "docs_per_row": args.docs,
        "dtype": args.dtype,
        "compile": args.compile,
        "steps": args.steps,
        "tokens_per_s": tps,
        "step_s": seconds / args.steps,
        "tflops": tps * fpt / 1e12,
        "peak_tflops": peak,
        "peak_source": source,
        "mfu": tps * fpt / 1e12 / peak if peak else None,
        "final_loss": float(loss.detach()),
        "torch": torch.__version__,
        "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30
        if dev.type == "cuda"
        else None,
    }
    mfu = f"{res['mfu']:.1%}" if res["mfu"] is not None else "n/a"
    print(
        f"{args.preset} on {res['device']}: {tps:,.0f} tokens/s, {res['tflops']:.3g} TFLOP/s, MFU {mfu} of "
        f"{peak:.1f} TFLOP/s ({source}), step {res['step_s'] * 1e3:.1f} ms"
    )
    print(json.dumps(res, indent=1))
    if args.json:
        Path(args.json).write_text(json.dumps(res, indent=1) + "\n")
    return res


if __name__ == "__main__":
    main()
