"""The evaluation's figures as a plain-text table (the console, `make demo`, earlyfuse-report).
Reads only the JSON, so the report can show an evaluation without importing torch."""

from __future__ import annotations

MODALITIES = ("text", "code", "image", "video", "structure")


def _f(value, spec=".3f") -> str:
    return "-" if value is None else format(value, spec)


def _packing_line(ev: dict) -> str:
    """The held-out rows and where their settings came from (the release, its run folder, a
    flag or the defaults: packing_from)."""
    whole = (
        "documents that fit a row kept whole"
        if ev.get("whole_documents")
        else "documents split across rows"
    )
    origin = ev.get("packing_from") or {}
    if len(set(origin.values())) == 1:
        whence = f" (settings: {next(iter(origin.values()))})"
    elif origin:
        whence = " (settings: " + ", ".join(f"{key} {where}" for key, where in origin.items()) + ")"
    else:
        whence = ""
    return f"rows of {ev['seq_len']} tokens, {ev.get('batch_rows', '?')} a batch, {whole}{whence}"


def format_eval(ev: dict) -> str:
    lines = [f"held-out evaluation of {ev.get('release', '?')} (step {ev.get('step', '?')})"]
    if "seq_len" in ev:
        lines.append(_packing_line(ev))
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
    lines += format_position(ev.get("position_loss") or {})
    lines += format_passkey(ev.get("passkey") or {})
    lines += format_frame_copy(ev.get("frame_copy") or {})
    return "\n".join(lines)


def format_position(pos: dict) -> list[str]:
    """CE per position bucket (columns) and modality (rows); a modality's row counts only the
    document stretches that cover the whole bucket, its ``first`` row those same stretches'
    first-bucket CE (docs/evaluation.md)."""
    if not pos.get("buckets"):
        return []
    buckets = pos["buckets"]
    names = [f"{start}-{end}" for start, end in buckets]
    width = max(9, *(len(name) + 2 for name in names))
    lines = [
        f"loss by position (nats per token, rows of {pos['seq_len']}"
        + ("; documents that fit a row kept whole" if pos.get("whole_documents") else "")
        + "; a bucket averages the document stretches that reach its end; first = their CE at "
        "positions of the first bucket):",
        f"  {'modality':<16}" + "".join(f"{name:>{width}}" for name in names),
        f"  {'stretches':<16}" + "".join(f"{count:>{width},}" for count in pos["stretches"]),
    ]
    for modality in MODALITIES:
        fig = (pos.get("modalities") or {}).get(modality)
        if not fig:
            continue
        cells = fig["buckets"]
        lines.append(f"  {modality:<16}" + "".join(f"{_f(c['ce']):>{width}}" for c in cells))
        lines.append(f"  {'  first':<16}" + "".join(f"{_f(c['ce_first']):>{width}}" for c in cells))
        lines.append(f"  {'  tokens':<16}" + "".join(f"{c['tokens']:>{width},}" for c in cells))
    if pos.get("sampled"):
        lines.append("  (a sample: the first documents of each source, --max-docs)")
    return lines


def _share(score: dict | None, key: str) -> str:
    value = (score or {}).get(key)
    return "-" if value is None else f"{value:.0%}"


def format_passkey(table: dict) -> list[str]:
    """Depth (rows) x length (columns): digits right, and in brackets whole keys right."""
    if not table.get("cells"):
        return []
    lengths = [str(length) for length in table["lengths"]]
    lines = [
        f"passkey (text; {table['trials']} keys of {table['digits']} digits a cell, teacher-forced; "
        "share of digits right, whole keys right in brackets; control = no key in the prompt):",
        f"  {'depth':<10}" + "".join(f"{length:>14}" for length in lengths),
    ]
    for depth in table["depths"]:
        cells = [table["cells"][length].get(f"{depth:g}") for length in lengths]
        lines.append(
            f"  {depth:<10g}"
            + "".join(f"{_share(c, 'digit'):>7} ({_share(c, 'whole'):>4})" for c in cells)
        )
    controls = [table["control"].get(length) for length in lengths]
    lines.append(
        f"  {'control':<10}"
        + "".join(f"{_share(c, 'digit'):>7} ({_share(c, 'whole'):>4})" for c in controls)
    )
    return lines


def format_frame_copy(table: dict) -> list[str]:
    """Depth (rows) x length (columns): the repeated frame's codes right, against a frame not
    seen before at the same place (control, after the slash)."""
    if table.get("missing"):
        return [f"frame copy (video): not run: {table['missing']}"]
    if not table.get("cells"):
        return []
    lengths = [str(length) for length in table["lengths"]]
    grid = "x".join(str(side) for side in table["grid"])
    lines = [
        f"frame copy (video; {table['trials']} frames of {grid} codes a cell, teacher-forced; share "
        "of the last frame's codes right when the frame at depth d is that frame / control: "
        "another frame there):",
    ]
    heads = [f"{length} ({table['frames'][length]} fr)" for length in lengths]
    lines.append(f"  {'depth':<10}" + "".join(f"{head:>18}" for head in heads))
    for depth in table["depths"]:
        key = f"{depth:g}"
        cells = [
            f"{_share(table['cells'][n].get(key), 'accuracy')} / "
            f"{_share(table['control'][n].get(key), 'accuracy')}"
            for n in lengths
        ]
        lines.append(f"  {depth:<10g}" + "".join(f"{cell:>18}" for cell in cells))
    return lines
