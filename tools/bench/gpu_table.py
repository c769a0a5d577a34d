"""The tables of a GPU check (tools/gpu_check.sh), as markdown for docs/benchmarks.md:

- OUT/table.md, the throughput part: its bench_gpu.py results (``bench-*.json``) and its
  trainer run (``metrics.jsonl``);
- OUT/long_table.md, the long-context part: bench_gpu.py at long rows (``long-*.json``), the
  measured peak beside ``train.memory``'s estimate, then the BlockMask builds
  (``blockmask.json``), then the steps that failed or ran out of time (``summary.txt``).

Each is written when its results are there (the throughput table also when nothing is).

    python tools/bench/gpu_table.py OUT_DIR
"""

from __future__ import annotations

import argparse
import json
import statistics
from operator import itemgetter
from pathlib import Path

HEAD = (
    "| what | compile | tokens/s | MFU | step ms | peak GiB | loss |\n|---|---|---|---|---|---|---|"
)


def read_json(path: Path):
    """A result file; a truncated one (its step killed mid-write) is an error naming it."""
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise SystemExit(f"{path}: not valid JSON ({error}); rerun its step or delete it") from None


def bench_rows(out: Path) -> list[str]:
    rows = []
    for path in sorted(out.glob("bench-*.json")):
        r = read_json(path)
        rows.append(
            f"| bench_gpu {r['preset']} mb {r['micro_batch']} x {r['seq_len']} | "
            f"{'on' if r['compile'] else 'off'} | {r['tokens_per_s']:,.0f} | "
            f"{_or_dash(r.get('mfu'), '.1%')} | {r['step_s'] * 1e3:.0f} | "
            f"{_or_dash(r.get('peak_mem_gib'))} | {r['final_loss']:.3f} |"
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
    tps, mfu, step_s, wait = (
        statistics.fmean(record[f"throughput/{key}"] for record in timed)
        for key in ("units_per_s", "mfu", "step_s", "data_wait")
    )
    return [
        f"| earlyfuse-train gpu_125m, steps 3-{records[-1]['step']} (data wait {wait:.1%}) | "
        f"auto | {tps:,.0f} | {mfu:.1%} | {step_s * 1e3:.0f} | - | {records[-1]['train/loss']:.3f} |"
    ]


LONG_HEAD = (
    "| model | tokens/row | attention | tokens/s | MFU | step s | peak GiB | estimate GiB "
    "| peak - at rest GiB | estimate - states GiB |\n|---|---|---|---|---|---|---|---|---|---|"
)
MASK_HEAD = (
    "| tokens | mask | first build s | build ms | index MiB | peak build MiB |\n"
    "|---|---|---|---|---|---|"
)


def _or_dash(value, spec: str = ".1f") -> str:
    """``value`` formatted, or "-" where there is none (a CPU run's memory, an unknown peak)."""
    return "-" if value is None else format(value, spec)


def long_rows(out: Path) -> list[str]:
    results = [read_json(path) for path in out.glob("long-*.json")]
    # smallest model first (by its model states: an out-of-memory row has no parameter count),
    # then by length, the two kinds of attention side by side
    results.sort(key=itemgetter("estimate_states_gib", "preset", "seq_len", "attention"))
    rows = []
    for res in results:
        attention = (
            f"local/global (window {res['local_window']}, global every {res['global_every']})"
            if res["attention"] == "local-global"
            else "document"
        )
        what = f"| {res['preset']} | {res['seq_len']:,} | {attention} |"
        if res.get("oom"):
            rows.append(f"{what} {res['oom']} | | | | {_or_dash(res['estimate_gib'])} | | |")
            continue
        # both measured on CUDA only
        above = res["peak_mem_gib"] - res["at_rest_gib"] if res["at_rest_gib"] is not None else None
        rows.append(
            f"{what} {res['tokens_per_s']:,.0f} | {_or_dash(res.get('mfu'), '.1%')} | "
            f"{res['step_s']:.2f} | {_or_dash(res.get('peak_mem_gib'))} | "
            f"{_or_dash(res['estimate_gib'])} | {_or_dash(above)} | "
            f"{_or_dash(res['estimate_above_states_gib'])} |"
        )
    return rows


def mask_result_rows(results: list[dict]) -> list[str]:
    """The rows of MASK_HEAD's table, one per BlockMask measured (bench_block_mask.py prints
    them as it goes)."""
    rows = []
    for res in results:
        name = res["kind"] + (f" (window {res['window']})" if res["kind"] == "local" else "")
        if res.get("error"):
            rows.append(f"| {res['seq_len']:,} | {name} | {res['error']} | | | |")
            continue
        rows.append(
            f"| {res['seq_len']:,} | {name} | {res['first_build_s']:.1f} | {res['build_s'] * 1e3:,.1f} "
            f"| {res['index_mib']:,.2f} | {_or_dash(res.get('peak_build_mib'), ',.1f')} |"
        )
    return rows


def failed_steps(out: Path) -> list[str]:
    """The summary's steps that did not exit 0 (124: stopped by their timeout)."""
    path = out / "summary.txt"
    if not path.is_file():
        return []
    return [
        line for line in path.read_text().splitlines() if ": rc " in line and ": rc 0 " not in line
    ]


def long_table(out: Path) -> str:
    masks = out / "blockmask.json"
    tables = [
        (LONG_HEAD, long_rows(out)),
        (MASK_HEAD, mask_result_rows(read_json(masks)["results"]) if masks.is_file() else []),
    ]
    lines = [line for head, rows in tables if rows for line in (head, *rows, "")]
    if lines:
        lines += [f"Failed: {line}" for line in failed_steps(out)]
    return "\n".join(lines).rstrip("\n") + "\n" if lines else ""


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path, help="the folder tools/gpu_check.sh wrote its logs to")
    out = parser.parse_args(argv).out
    rows = bench_rows(out) + trainer_rows(out)
    long = long_table(out)
    if rows or not long:
        text = HEAD + "\n" + "\n".join(rows) + "\n"
        (out / "table.md").write_text(text)
        print(text, end="")
    if long:
        (out / "long_table.md").write_text(long)
        print(long, end="")


if __name__ == "__main__":
    main()
