"""The table of a GPU check (tools/gpu_check.sh): its bench_gpu.py results and its trainer run,
as markdown in OUT/table.md (for docs/benchmarks.md).

    python tools/bench/gpu_table.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

HEAD = (
    "| what | compile | tokens/s | MFU | step ms | peak GiB | loss |\n|---|---|---|---|---|---|---|"
)


def bench_rows(out: Path) -> list[str]:
    rows = []
    for path in sorted(out.glob("bench-*.json")):
        r = json.loads(path.read_text())
        mfu = f"{r['mfu']:.1%}" if r.get("mfu") is not None else "-"
        mem = f"{r['peak_mem_gib']:.1f}" if r.get("peak_mem_gib") is not None else "-"
        rows.append(
            f"| bench_gpu {r['preset']} mb {r['micro_batch']} x {r['seq_len']} | "
            f"{'on' if r['compile'] else 'off'} | {r['tokens_per_s']:,.0f} | {mfu} | "
            f"{r['step_s'] * 1e3:.0f} | {mem} | {r['final_loss']:.3f} |"
        )
    return rows


def trainer_rows(out: Path) -> list[str]:
    path = out / "metrics.jsonl"
    if not path.is_file():
        return []
    records = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    timed = [r for r in records if r["step"] > 2]  # past the compile and the loader's start
    if not timed:
        return []
    tps = sum(r["throughput/units_per_s"] for r in timed) / len(timed)
    mfu = sum(r["throughput/mfu"] for r in timed) / len(timed)
    step_ms = 1e3 * sum(r["throughput/step_s"] for r in timed) / len(timed)
    wait = sum(r["throughput/data_wait"] for r in timed) / len(timed)
    return [
        f"| earlyfuse-train gpu_125m, steps 3-{records[-1]['step']} (data wait {wait:.1%}) | "
        f"auto | {tps:,.0f} | {mfu:.1%} | {step_ms:.0f} | - | {records[-1]['train/loss']:.3f} |"
    ]


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder tools/gpu_check.sh wrote its logs to")
    out = parser.parse_args(argv).out
    rows = bench_rows(out) + trainer_rows(out)
    text = HEAD + "\n" + "\n".join(rows) + "\n"
    (out / "table.md").write_text(text)
    print(text, end="")


if __name__ == "__main__":
    main()
