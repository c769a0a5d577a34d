"""GPU throughput and MFU of a model preset, prepared to run in under 5 minutes on one
H100/H200: a few hundred bf16 training steps of ``model/`` on packed rows of random token ids.

What runs is the model and its loss exactly as training runs them (``Transformer`` with the fused
chunked CE, FlexAttention with document masking on CUDA, bf16 autocast with fp32 weights, AdamW,
gradient clipping); the data is random ids in rows of ``--docs`` documents each, so the loader is
not measured (``bench_trainer.py`` measures the trainer and the data wait). MFU = achieved
model FLOP/s (``model.flops.flops_per_token``, causal attention counted) / the GPU's dense bf16
peak (``train.mfu``). Prints tokens/s and MFU over the timed steps (after ``--warmup`` steps).
Needs only torch: the GPU machine lacks DeepSpeed and the other packages.

Long rows, several ``--seq-len`` each beside ``train.memory``'s estimate: docs/benchmarks.md,
"The long-context part", has the method.

    python tools/bench/bench_gpu.py --preset 125m --micro-batch 16 --seq-len 2048 --steps 300
    python tools/bench/bench_gpu.py --preset 125m --compile --json out/125m_compiled.json
    python tools/bench/bench_gpu.py --preset debug --device cpu --dtype float32 --steps 3 --warmup 1 --seq-len 128
    python tools/bench/bench_gpu.py --preset 1b --micro-batch 1 --seq-len 8192,32768,131072 \
        --activation-checkpoint --compile --attention local-global --json out/long-1b-lg.json
"""

from __future__ import annotations

import argparse
import dataclasses
import gc
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.attention import resolve_backend  # noqa: E402
from model.flops import flops_per_token  # noqa: E402
from model.presets import preset  # noqa: E402
from tools.bench import allow_recompiles, device_name, doc_ids, report, sync  # noqa: E402
from train.memory import estimate, is_out_of_memory  # noqa: E402
from train.mfu import peak_tflops  # noqa: E402


def batch(cfg, micro_batch: int, seq_len: int, docs: int, device, gen) -> dict:
    ids = torch.randint(0, cfg.vocab_size, (micro_batch, seq_len + 1), generator=gen).to(device)
    doc = doc_ids(seq_len, docs, device).expand(micro_batch, seq_len).contiguous()
    # The loader's flag: rows of several documents (the model then never reads doc ids back)
    return {
        "input_ids": ids[:, :-1],
        "labels": ids[:, 1:],
        "doc_ids": doc,
        "one_doc_rows": docs <= 1,
    }


def with_attention(cfg, args):
    """The preset with ``--attention``: ``doc`` keeps it (every layer sees its whole document);
    ``local-global`` makes all but every ``--global-every``-th layer local (a window of
    ``--local-window`` keys, RoPE base ``--local-theta``), Gemma 3's layout."""
    if args.attention == "doc":
        return cfg
    return dataclasses.replace(
        cfg,
        attention=dataclasses.replace(
            cfg.attention, local_window=args.local_window, global_every=args.global_every
        ),
        rope=dataclasses.replace(cfg.rope, local_theta=args.local_theta),
    )


def parser() -> argparse.ArgumentParser:
    """The command line (the GPU check's test parses its listed steps with it)."""
    arg_parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arg_parser.add_argument("--preset", default="125m")
    arg_parser.add_argument("--micro-batch", type=int, default=16)
    arg_parser.add_argument(
        "--seq-len",
        default="2048",
        help="tokens per row; several comma-separated (8192,32768,131072) are measured in turn "
        "by one process, shortest first, on the same model and optimizer",
    )
    arg_parser.add_argument(
        "--docs", type=int, default=4, help="documents packed per row (document-masked attention)"
    )
    arg_parser.add_argument("--steps", type=int, default=300)
    arg_parser.add_argument("--warmup", type=int, default=20)
    arg_parser.add_argument(
        "--dtype", choices=["bfloat16", "float32"], default="bfloat16", help="autocast dtype"
    )
    arg_parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arg_parser.add_argument(
        "--compile",
        action="store_true",
        help="torch.compile each block and the loss head, as training does on CUDA "
        "(Transformer.compile_blocks; FlexAttention is compiled either way)",
    )
    arg_parser.add_argument(
        "--json",
        default="",
        help="also write the result to this JSON file (with several --seq-len, one file per "
        "length: OUT-8192.json, ..., each written when its length is done)",
    )
    arg_parser.add_argument("--activation-checkpoint", action="store_true")
    arg_parser.add_argument(
        "--attention",
        choices=("doc", "local-global"),
        default="doc",
        help="doc: every layer sees its whole document (the preset); local-global: local layers "
        "of --local-window keys and a global one every --global-every layers",
    )
    arg_parser.add_argument("--local-window", type=int, default=1024)
    arg_parser.add_argument("--global-every", type=int, default=6)
    arg_parser.add_argument("--local-theta", type=float, default=10000.0)
    return arg_parser


def main(argv=None) -> list[dict]:
    arg_parser = parser()
    args = arg_parser.parse_args(argv)
    lengths = [int(length) for length in args.seq_len.split(",") if length]
    if not lengths or lengths != sorted(lengths):
        arg_parser.error(f"--seq-len: one length or several, shortest first; got {args.seq_len!r}")
    dev = torch.device(args.device)
    torch.manual_seed(0)
    try:
        cfg = with_attention(preset(args.preset), args)
    except ValueError as error:
        arg_parser.error(f"--preset {args.preset} with --attention {args.attention}: {error}")
    if args.activation_checkpoint:
        cfg = dataclasses.replace(cfg, activation_checkpoint_every=1)
    model = cfg.build(dev)
    opt = torch.optim.AdamW(
        model.parameters(), lr=3e-4, betas=(0.9, 0.95), weight_decay=0.1, fused=dev.type == "cuda"
    )
    if args.compile:
        model.compile_blocks()
    allow_recompiles(len(lengths))
    peak = peak_tflops(0.0, dev)  # the GPU's datasheet figure; on the CPU a measured matmul
    results = []
    oom_at = 0
    for seq_len in lengths:
        # longer rows than one that did not fit are not worth the device's time
        res = {"preset": args.preset, "seq_len": seq_len, "attention": args.attention}
        if not oom_at:
            try:
                res = measure(model, opt, cfg, args, seq_len, dev, peak)
            except Exception as error:
                if not is_out_of_memory(error):
                    raise
                print(f"{args.preset} at {seq_len:,} tokens: {error}", file=sys.stderr)
                oom_at = seq_len
            if oom_at:  # here, once the error's traceback no longer holds the step's tensors
                opt.zero_grad(set_to_none=True)
                gc.collect()
                if dev.type == "cuda":
                    torch.cuda.empty_cache()
        if oom_at:
            res["oom"] = f"OOM at {oom_at:,}"
        res.update(setup(cfg, args, seq_len, dev))
        results.append(res)
        target = Path(args.json) if args.json else None
        if target and len(lengths) > 1:  # one file per length: OUT.json -> OUT-8192.json
            target = target.with_name(f"{target.stem}-{seq_len}{target.suffix}")
        report(res, target)
    return results


def setup(cfg, args, seq_len: int, dev) -> dict:
    """What was measured, and what ``train.memory`` expects it to need (one GPU, bf16, the mask
    this device's attention uses)."""
    mask = "flex" if resolve_backend(cfg.attention.backend, dev) == "flex" else "sdpa"
    expected = estimate(
        cfg,
        micro_batch=args.micro_batch,
        seq_len=seq_len,
        act_ckpt=bool(cfg.activation_checkpoint_every),
        mask=mask,
    )
    return {
        "micro_batch": args.micro_batch,
        "docs_per_row": args.docs,
        "dtype": args.dtype,
        "compile": args.compile,
        "activation_checkpoint": bool(cfg.activation_checkpoint_every),
        "attention": args.attention,
        "local_window": cfg.attention.local_window,
        "global_every": cfg.attention.global_every,
        "local_theta": cfg.rope.local_theta,
        "estimate_gib": expected.total_gib,
        "estimate_states_gib": expected.states_gib,
        "estimate_above_states_gib": expected.total_gib - expected.states_gib,
        "torch": torch.__version__,
    }


def measure(model, opt, cfg, args, seq_len: int, dev, peak_and_source) -> dict:
    gen = torch.Generator().manual_seed(0)
    count = min(4, args.warmup + args.steps)  # long rows: no more batches than steps
    batches = [batch(cfg, args.micro_batch, seq_len, args.docs, dev, gen) for _ in range(count)]
    dtype = getattr(torch, args.dtype)

    def step(b):
        with torch.autocast(dev.type, dtype=dtype, enabled=dtype != torch.float32):
            loss = model(**b).loss
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        return loss

    for i in range(args.warmup):
        step(batches[i % len(batches)])
    sync(dev)
    at_rest = None
    if dev.type == "cuda":
        torch.cuda.reset_peak_memory_stats()
        # Between steps (gradients freed): weights, optimizer states and the batches.
        at_rest = torch.cuda.memory_allocated(dev) / 2**30
    started = time.perf_counter()
    for i in range(args.steps):
        loss = step(batches[i % len(batches)])
    sync(dev)
    seconds = time.perf_counter() - started
    tokens = args.steps * args.micro_batch * seq_len
    tps = tokens / seconds
    fpt = flops_per_token(cfg, seq_len, causal=True)
    peak, source = peak_and_source
    res = {
        "device": device_name(dev),
        "preset": args.preset,
        "params": sum(param.numel() for param in model.parameters()),
        "seq_len": seq_len,
        "steps": args.steps,
        "tokens_per_s": tps,
        "step_s": seconds / args.steps,
        "tflops": tps * fpt / 1e12,
        "peak_tflops": peak,
        "peak_source": source,
        "mfu": tps * fpt / 1e12 / peak if peak else None,
        "final_loss": float(loss.detach()),
        "peak_mem_gib": torch.cuda.max_memory_allocated(dev) / 2**30
        if dev.type == "cuda"
        else None,
        "at_rest_gib": at_rest,
    }
    mfu = f"{res['mfu']:.1%}" if res["mfu"] is not None else "n/a"
    print(
        f"{args.preset} at {seq_len:,} tokens on {res['device']}: {tps:,.0f} tokens/s, "
        f"{res['tflops']:.3g} TFLOP/s, MFU {mfu} of {peak:.1f} TFLOP/s ({source}), "
        f"step {res['step_s'] * 1e3:.1f} ms"
    )
    return res


if __name__ == "__main__":
    main()
