"""``earlyfuse-prep demo-corpus``: the small real demo corpus, built offline."""

from __future__ import annotations

from pathlib import Path


def _add_demo_corpus(sub) -> None:
    what = "build the small real demo corpus offline (code, prose, photos, scenes, clips)"
    p = sub.add_parser(
        "demo-corpus",
        help=what,
        description=f"{what}: the Python standard library's sources and documentation, photos "
        "installed packages ship, and generated captioned scenes, drawings and clips whose "
        "captions can be checked; OUT/README.md says what each part holds. make demo builds it.",
    )
    p.add_argument("--out", required=True, type=Path, help="the folder to write (made)")
    p.add_argument(
        "--seed", type=int, default=0, help="the draws of items and generated parts (default 0)"
    )
    p.add_argument(
        "--scale", type=float, default=1.0, help="multiply every part's size (default 1.0)"
    )
    p.add_argument(
        "--split",
        choices=["all", "train", "heldout"],
        default="all",
        help="which share of the real material (modules, docstrings, help topics, photos, digits): "
        "train and heldout never share an item; build a held-out corpus with --split heldout "
        "and another --seed (default all)",
    )
    p.add_argument(
        "--scenes",
        type=int,
        default=None,
        metavar="N",
        help="N generated scenes, and N drawings (caption then picture), whatever --scale",
    )
    p.add_argument("--no-progress", action="store_true")
    p.set_defaults(func=cmd_demo_corpus)


def cmd_demo_corpus(a) -> int:
    from data.demo_corpus import build
    from data.shards.stats import human_bytes

    s = build(
        a.out,
        seed=a.seed,
        scale=a.scale,
        progress=not a.no_progress,
        split=a.split,
        scene_count=a.scenes,
    )
    print(
        f"{a.out}: demo corpus, {s['files']} files, {human_bytes(s['bytes'])} in {s['seconds']} s "
        f"(seed {s['seed']}, scale {s['scale']:g}, split {s['split']}); see {a.out / 'README.md'}"
    )
    for name, part in s["parts"].items():
        counts = ", ".join(f"{v} {k}" for k, v in part.items() if k != "bytes")
        print(f"  {name:<12} {human_bytes(part['bytes']):>10}  {counts}")
    return 0
