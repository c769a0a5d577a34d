"""The evaluation's figures as a plain-text table (the console, `make demo`, earlyfuse-report).
Reads only the JSON, so the report can show an evaluation without importing torch."""

from __future__ import annotations

MODALITIES = ("text", "code", "image", "video", "structure")


def _f(value, spec=".3f") -> str:
    return "-" if value is None else format(value, spec)


def format_eval(ev: dict) -> str:
    lines = [f"held-out evaluation of {ev.get('release', '?')} (step {ev.get('step', '?')})"]
    held = ev.get("heldout") or {}
    if ev.get("overlap"):
        other = ev["overlap"]
        if other["documents"]:
            lines.append(
                f"WARNING: {other['documents']} of {other['checked']} held-out documents also occur in "
                f"the training data ({', '.join(f'{k} {v}' for k, v in other['by_source'].items())}): "
                "their figures measure memorisation"
            )
        else:
            lines.append(
                f"held out: none of the {other['checked']} documents occurs in the training data"
            )
    tot = held.get("total") or {}
    if tot:
        lines.append(
            "per modality (nats per token; margin = unigram - CE, > 0 beats token frequencies):"
        )
        lines.append(
            f"  {'modality':<10}{'CE':>8}{'unigram':>9}{'margin':>8}{'bits/byte':>11}{'tokens':>10}"
        )
        for modality in MODALITIES:
            fig = tot.get(modality)
            if fig:
                lines.append(
                    f"  {modality:<10}{_f(fig['ce']):>8}{_f(fig.get('unigram')):>9}{_f(fig.get('margin')):>8}"
                    f"{_f(fig.get('bpb')):>11}{fig['tokens']:>10,}"
                )
        if held.get("sampled"):
            lines.append("  (a sample: the first documents of each source, --max-docs)")
    dep = ev.get("dependence") or {}
    if dep:
        lines.append(
            "dependence (target CE after its own context vs another document's; gap = other - own):"
        )
        lines.append(
            f"  {'source/direction':<26}{'pairs':>6}{'own':>8}{'other':>8}{'gap':>8}  target"
        )
        for key, row in dep.items():
            what = "caption text" if row["direction"] == "caption" else "image codes"
            lines.append(
                f"  {key:<26}{row['pairs']:>6}{_f(row['ce_own']):>8}{_f(row['ce_other']):>8}"
                f"{_f(row['gap']):>8}  {what}"
            )
    scene_figs = ev.get("scenes") or {}
    if scene_figs.get("draw"):
        guidance = scene_figs.get("draw_guidance", 1.0)
        guided = f" with classifier-free guidance {guidance:g}" if guidance != 1.0 else ""
        lines.append(
            f"scenes ({scene_figs['scenes']} held-out single-shape scenes, drawn at temperature "
            f"{scene_figs.get('draw_temperature', 0):g}{guided}; share right, chance = scored "
            "against another scene):"
        )
        lines.append(f"  {'':<22}{'colour':>8}{'shape':>8}{'position':>10}{'all':>7}")
        for name, label in (
            ("draw", "drawn from caption"),
            ("draw_chance", "  chance"),
            ("caption", "captioned"),
            ("caption_chance", "  chance"),
            ("ceiling", "tokenizer ceiling"),
        ):
            attr = scene_figs[name]
            lines.append(
                f"  {label:<22}{attr['colour']:>8.0%}{attr['shape']:>8.0%}{attr['position']:>10.0%}"
                f"{attr['all']:>7.0%}"
            )
    return "\n".join(lines)
