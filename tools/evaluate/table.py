"""The evaluation's figures as a plain-text table (the console, `make demo`, earlyfuse-report).
Reads only the JSON, so the report can show an evaluation without importing torch."""

from __future__ import annotations

MODALITIES = ("text", "code", "image", "video", "structure")


def _f(v, spec=".3f") -> str:
    return "-" if v is None else format(v, spec)


def format_eval(ev: dict) -> str:
    lines = [f"held-out evaluation of {ev.get('release', '?')} (step {ev.get('step', '?')})"]
    ho = ev.get("heldout") or {}
    if ev.get("overlap"):
        o = ev["overlap"]
        if o["documents"]:
            lines.append(
                f"WARNING: {o['documents']} of {o['checked']} held-out documents also occur in "
                f"the training data ({', '.join(f'{k} {v}' for k, v in o['by_source'].items())}): "
                "their figures measure memorisation"
            )
        else:
            lines.append(
                f"held out: none of the {o['checked']} documents occurs in the training data"
            )
    tot = ho.get("total") or {}
    if tot:
        lines.append(
            "per modality (nats per token; margin = unigram - CE, > 0 beats token frequencies):"
        )
        lines.append(
            f"  {'modality':<10}{'CE':>8}{'unigram':>9}{'margin':>8}{'bits/byte':>11}{'tokens':>10}"
        )
        for m in MODALITIES:
            f = tot.get(m)
            if f:
                lines.append(
                    f"  {m:<10}{_f(f['ce']):>8}{_f(f.get('unigram')):>9}{_f(f.get('margin')):>8}"
                    f"{_f(f.get('bpb')):>11}{f['tokens']:>10,}"
                )
        if ho.get("sampled"):
            lines.append("  (a sample: the first documents of each source, --max-docs)")
    dep = ev.get("dependence") or {}
    if dep:
        lines.append(
            "dependence (target CE after its own context vs another document's; gap = other - own):"
        )
        lines.append(
            f"  {'source/direction':<26}{'pairs':>6}{'own':>8}{'other':>8}{'gap':>8}  target"
        )
        for k, d in dep.items():
            what = "caption text" if d["direction"] == "caption" else "image codes"
            lines.append(
                f"  {k:<26}{d['pairs']:>6}{_f(d['ce_own']):>8}{_f(d['ce_other']):>8}"
                f"{_f(d['gap']):>8}  {what}"
            )
    sc = ev.get("scenes") or {}
    if sc.get("draw"):
        lines.append(
            f"scenes ({sc['scenes']} held-out single-shape scenes, drawn at temperature "
            f"{sc.get('draw_temperature', 0):g}; share right, chance = scored against another scene):"
        )
        lines.append(f"  {'':<22}{'colour':>8}{'shape':>8}{'position':>10}{'all':>7}")
        for name, label in (
            ("draw", "drawn from caption"),
            ("draw_chance", "  chance"),
            ("caption", "captioned"),
            ("caption_chance", "  chance"),
            ("ceiling", "tokenizer ceiling"),
        ):
            a = sc[name]
            lines.append(
                f"  {label:<22}{a['colour']:>8.0%}{a['shape']:>8.0%}{a['position']:>10.0%}"
                f"{a['all']:>7.0%}"
            )
    return "\n".join(lines)
