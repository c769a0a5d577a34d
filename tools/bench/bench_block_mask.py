"""BlockMask build time and memory at long rows: the mask that ``Transformer.forward`` builds once
per batch for FlexAttention (``model.attention.build_attention_mask``), at given row lengths.

Two masks per length, as a local/global model uses them: ``doc`` (causal within each of the
row's ``--docs`` equal documents: the global layers' mask) and ``local`` (the same AND a window
of ``--window`` keys); docs/benchmarks.md, "The long-context part", has the method and what the
memory columns hold. An error other than out of memory makes the exit status non-zero. Needs
only torch (the GPU machine lacks the pipeline's other packages).

    python tools/bench/bench_block_mask.py --lengths 131072,1048576 --json out/blockmask.json
    python tools/bench/bench_block_mask.py --device cpu --builder eager --lengths 1024 --window 256
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.attention import build_attention_mask  # noqa: E402
from tools.bench import allow_recompiles, device_name, doc_ids, sync  # noqa: E402
from tools.bench.gpu_table import MASK_HEAD, mask_result_rows  # noqa: E402
from train.memory import is_out_of_memory  # noqa: E402

MIB = 2**20
KINDS = ("doc", "local")


def block_mask_bytes(block_mask) -> int:
    """Bytes of every tensor a BlockMask holds (block counts and indices, partial and full, by
    key and by query)."""
    tensors = [value for value in vars(block_mask).values() if isinstance(value, torch.Tensor)]
    return sum(tensor.numel() * tensor.element_size() for tensor in tensors)


def measure(seq_len: int, kind: str, args, device) -> dict:
    doc = doc_ids(seq_len, args.docs, device)
    window = args.window if kind == "local" else 0

    def build():
        # A window on every layer is the local layers' predicate (doc AND causal AND window).
        return build_attention_mask(
            1,
            seq_len,
            device,
            doc_ids=doc,
            sliding_window=window,
            backend="flex",
            one_doc_rows=args.docs <= 1,
            compile_mask=args.builder == "compiled",
        ).block_mask

    started = time.perf_counter()
    mask = build()  # warm-up: the compiled builder compiles for this length and window
    sync(device)
    first_s = time.perf_counter() - started
    del mask
    times, peaks = [], []
    index_bytes = 0
    for _ in range(args.repeats):
        if device.type == "cuda":
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(device)
            before = torch.cuda.memory_allocated(device)
        started = time.perf_counter()
        mask = build()
        sync(device)
        times.append(time.perf_counter() - started)
        if device.type == "cuda":
            peaks.append(torch.cuda.max_memory_allocated(device) - before)
        index_bytes = block_mask_bytes(mask)
        del mask
    return {
        "seq_len": seq_len,
        "kind": kind,
        "window": window,
        "docs": args.docs,
        "first_build_s": first_s,
        "build_s": statistics.median(times),
        "builds": args.repeats,
        "index_mib": index_bytes / MIB,
        "peak_build_mib": max(peaks) / MIB if peaks else None,
    }


def parser() -> argparse.ArgumentParser:
    """The command line (the GPU check's test parses its listed steps with it)."""
    arg_parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    arg_parser.add_argument(
        "--lengths", default="131072,1048576", help="row lengths in tokens, comma-separated"
    )
    arg_parser.add_argument("--kinds", default=",".join(KINDS), help="doc, local or both")
    arg_parser.add_argument("--window", type=int, default=1024, help="the local mask's window")
    arg_parser.add_argument("--docs", type=int, default=4, help="documents packed in the row")
    arg_parser.add_argument("--repeats", type=int, default=3, help="timed builds after the warm-up")
    arg_parser.add_argument(
        "--builder",
        choices=("compiled", "eager"),
        default="compiled",
        help="compiled: torch.compile(create_block_mask), what the model uses on CUDA; eager: "
        "the uncompiled builder, which materialises the dense mask (short rows only)",
    )
    arg_parser.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    arg_parser.add_argument("--json", default="", help="also write the results to this JSON file")
    return arg_parser


def main(argv: list[str] | None = None) -> dict:
    arg_parser = parser()
    args = arg_parser.parse_args(argv)
    lengths = [int(length) for length in args.lengths.split(",") if length]
    kinds = [kind for kind in args.kinds.split(",") if kind]
    unknown = sorted(set(kinds) - set(KINDS))
    if unknown or not lengths:
        arg_parser.error(f"--kinds must name {KINDS}, got {unknown}; --lengths at least one length")
    device = torch.device(args.device)
    # one compiled builder per length and window
    allow_recompiles(len(lengths), per_length=2 * len(kinds))
    results: list[dict] = []
    report = {
        "device": device_name(device),
        "torch": torch.__version__,
        "builder": args.builder,
        "results": results,
    }
    failed = False
    with torch.no_grad():  # FlexAttention on the CPU is forward-only (resolve_backend)
        for seq_len in lengths:
            for kind in kinds:
                try:
                    res = measure(seq_len, kind, args, device)
                except Exception as error:  # one failed size must not hide the others
                    res = {"seq_len": seq_len, "kind": kind, "window": args.window}
                    if is_out_of_memory(error):
                        res["error"] = f"OOM at {seq_len:,}"
                    else:
                        failed = True
                        res["error"] = f"{type(error).__name__}: {str(error).splitlines()[0]}"
                    print(f"{kind} mask at {seq_len:,} tokens: {error!r}", file=sys.stderr)
                    if device.type == "cuda":
                        torch.cuda.empty_cache()
                results.append(res)
                print(mask_result_rows([res])[0], flush=True)
                if args.json:  # after every size: a step stopped by its timeout keeps the rest
                    Path(args.json).write_text(json.dumps(report, indent=1) + "\n")
    print("\n".join([MASK_HEAD, *mask_result_rows(results)]))
    if failed:
        raise SystemExit(
            f"bench_block_mask: a build failed (not out of memory); see {args.json or 'above'}"
        )
    return report


if __name__ == "__main__":
    main()
