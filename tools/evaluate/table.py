"""The evaluation's figures as a plain-text table (the console, `make demo`, earlyfuse-report).
Reads only the JSON, so the report can show an evaluation without importing torch."""

from __future__ import annotations

MODALITIES = ("text", "code", "image", "video", "structure")


def fmt_figure(value, spec=".3f") -> str:
    """A figure of a table ('-': not measured); the instability suite's table uses it too."""
    return "-" if value is None else format(value, spec)


def _share(score: dict | None, key: str) -> str:
    return fmt_figure((score or {}).get(key), ".0%")


def rows_phrase(whole_documents) -> str:
    """How documents sit in the rows, in the words of every table and the HF export's README."""
    return "documents that fit a row kept whole" if whole_documents else "text split across rows"


def _packing_line(ev: dict) -> str:
    """The held-out rows and where their settings came from (the release, its run folder, a
    flag or the defaults: packing_from)."""
    whole = rows_phrase(ev.get("whole_documents"))
    origin = ev.get("packing_from") or {}
    whence = ""
    if len(set(origin.values())) == 1:
        whence = f" (settings: {next(iter(origin.values()))})"
    elif origin:
        whence = " (settings: " + ", ".join(f"{key} {where}" for key, where in origin.items()) + ")"
    return f"rows of {ev['seq_len']} tokens, {ev.get('batch_rows', '?')} a batch, {whole}{whence}"


def _row(label: str, cells, label_width: int, width) -> str:
    """A table's line: the label left-aligned, cells right-aligned in ``width`` (one or per cell)."""
    widths = [width] * len(cells) if isinstance(width, int) else width
    return f"  {label:<{label_width}}" + "".join(f"{c:>{w}}" for c, w in zip(cells, widths))


def dropped_warning(ev: dict) -> str:
    """The warning for visual blocks left out of the held-out figures, or "": a run refuses such
    rows (data.allow_block_drops); unsaid, they would leave the figures silently."""
    dropped = (ev.get("heldout") or {}).get("dropped") or {}
    lost = ", ".join(f"{k} {v}" for k, v in dropped.items() if v)
    return f"WARNING: visual blocks longer than a row left out, unmeasured: {lost}" if lost else ""


FEW_TOKENS = 100  # a modality's row on fewer is flagged


def format_eval(ev: dict) -> str:
    lines = [f"held-out evaluation of {ev.get('release', '?')} (step {ev.get('step', '?')})"]
    if by := ev.get("evaluated_by"):
        commit = f" at commit {by['commit'][:10]}" if by.get("commit") else ""
        changed = " with local changes" if by.get("modified") else ""
        lines[0] += f", by earlyfuse {by.get('earlyfuse') or '?'}{commit}{changed}"
    if "seq_len" in ev:
        lines.append(_packing_line(ev))
    held = ev.get("heldout") or {}
    if ev.get("overlap"):
        other = ev["overlap"]
        if other["documents"]:
            lines.append(
                f"WARNING: {other['documents']} of {other['checked']} held-out documents also occur in "
                f"the training data ({', '.join(f'{k} {v}' for k, v in other['by_source'].items())}; "
                f"e.g. {', '.join(other.get('examples') or ['-'])}): their figures measure memorisation"
            )
        else:
            lines.append(
                f"held out: none of the {other['checked']} documents occurs in the training data"
            )
    tot = held.get("total") or {}
    if tot:
        lines.append(
            "per modality (nats per token; margin = unigram - CE, > 0 beats token frequencies; "
            "bigram: the previous token alone):"
        )
        widths: tuple[int, ...] = (8, 9, 8, 8, 11, 10)
        heads = ("CE", "unigram", "margin", "bigram", "bits/byte", "tokens")
        lines.append(_row("modality", heads, 10, widths))
        for modality in MODALITIES:
            fig = tot.get(modality)
            if fig:
                figures = [fig["ce"], fig.get("unigram"), fig.get("margin"), fig.get("bigram")]
                figures.append(fig.get("bpb"))
                cells = [*map(fmt_figure, figures), f"{fig['tokens']:,}"]
                lines.append(_row(modality, cells, 10, widths))
        if few := [f"{m} {f['tokens']}" for m, f in tot.items() if 0 < f["tokens"] < FEW_TOKENS]:
            lines.append(  # code-only data still has text: the <|eos|> ending each document
                f"  (on fewer than {FEW_TOKENS} tokens, figures that say little: {', '.join(few)})"
            )
        if held.get("sampled"):
            lines.append("  (a sample: the first documents of each source, --max-docs)")
        if held.get("bigram_capped"):
            lines.append(
                f"  (the bigram counts the first {held['bigram_tokens']:,} training tokens only)"
            )
    if lost := dropped_warning(ev):
        lines.append(lost)
    if long_pairs := ev.get("dependence_left_out"):
        lines.append(
            f"WARNING: pair documents longer than a row ({ev.get('seq_len', '?')} tokens) left out "
            "of the dependence table, unmeasured: "
            + ", ".join(f"{k} {v}" for k, v in long_pairs.items())
        )
    dep = ev.get("dependence") or {}
    if dep:
        lines.append(
            "dependence (target CE after its own context vs another document's; gap = other - own):"
        )
        widths = (6, 8, 8, 8, 0)
        lines.append(
            _row("source/direction", ("pairs", "own", "other", "gap", "  target"), 26, widths)
        )
        for key, row in dep.items():
            what = "caption text" if row["direction"] == "caption" else "image codes"
            figures = [fmt_figure(row[name]) for name in ("ce_own", "ce_other", "gap")]
            lines.append(_row(key, [row["pairs"], *figures, f"  {what}"], 26, widths))
            if row["gap"] is None:
                lines[-1] += " (one pair: no other document's context to swap in)"
    scene_figs = ev.get("scenes") or {}
    if scene_figs and not scene_figs.get("draw"):
        lines.append(
            f"scenes: {scene_figs.get('scenes', 0)} single-shape scene(s) found; at least 2 are "
            "needed (each is scored against another for chance): not scored"
        )
    if scene_figs.get("draw"):
        guidance = scene_figs.get("draw_guidance", 1.0)
        guided = f" with classifier-free guidance {guidance:g}" if guidance != 1.0 else ""
        seen = scene_figs.get("in_training") or {}
        held = "" if seen.get("scenes") else "held-out "  # not when the WARNING below says so
        lines.append(
            f"scenes ({scene_figs['scenes']} {held}single-shape scenes, drawn at temperature "
            f"{scene_figs.get('draw_temperature', 0):g}{guided}; share right, chance = scored "
            "against another scene):"
        )
        if "unchecked" in seen:
            lines.append(f"scenes not checked against the training pictures: {seen['unchecked']}")
        elif seen.get("scenes"):
            lines.append(
                f"WARNING: {seen['scenes']} of these {seen['checked']} scenes are pictures of the "
                f"training data ({seen['raw']}; e.g. {', '.join(seen['examples'])}): their figures "
                "measure memorisation"
            )
        elif seen:
            lines.append(f"held out: none of the {seen['checked']} scenes is a training picture")
        widths = (8, 8, 10, 7)
        lines.append(_row("", ("colour", "shape", "position", "all"), 22, widths))
        for name, label in (
            ("draw", "drawn from caption"),
            ("draw_chance", "  chance"),
            ("caption", "captioned"),
            ("caption_chance", "  chance"),
            ("ceiling", "tokenizer ceiling"),
        ):
            attr = scene_figs[name]
            shares = [f"{attr[key]:.0%}" for key in ("colour", "shape", "position", "all")]
            lines.append(_row(label, shares, 22, widths))
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
    names = [f"{start}-{end}" for start, end in pos["buckets"]]
    width = max(9, *(len(name) + 2 for name in names))
    lines = [
        f"loss by position (nats per token, rows of {pos['seq_len']}"
        + ("; documents that fit a row kept whole" if pos.get("whole_documents") else "")
        + "; a bucket averages the document stretches that reach its end; first = their CE at "
        "positions of the first bucket):",
        _row("modality", names, 16, width),
        _row("stretches", [f"{count:,}" for count in pos["stretches"]], 16, width),
    ]
    for modality in MODALITIES:
        cells = ((pos.get("modalities") or {}).get(modality) or {}).get("buckets")
        if not cells:
            continue
        lines.append(_row(modality, [fmt_figure(c["ce"]) for c in cells], 16, width))
        lines.append(_row("  first", [fmt_figure(c["ce_first"]) for c in cells], 16, width))
        lines.append(_row("  tokens", [f"{c['tokens']:,}" for c in cells], 16, width))
    if pos.get("sampled"):
        lines.append("  (a sample: the first documents of each source, --max-docs)")
    return lines


def format_passkey(table: dict) -> list[str]:
    """Depth (rows) x length (columns): digits right, and in brackets whole keys right."""
    if not table.get("cells"):
        return []
    lengths = [str(length) for length in table["lengths"]]

    def shares(scores) -> list[str]:
        return [f"{_share(c, 'digit'):>7} ({_share(c, 'whole'):>4})" for c in scores]

    lines = [
        f"passkey (text; {table['trials']} keys of {table['digits']} digits a cell, teacher-forced; "
        "share of digits right, whole keys right in brackets; control = no key in the prompt):",
        _row("depth", lengths, 10, 14),
    ]
    for depth in table["depths"]:
        cells = [table["cells"][length].get(f"{depth:g}") for length in lengths]
        lines.append(_row(f"{depth:g}", shares(cells), 10, 14))
    lines.append(_row("control", shares(table["control"].get(n) for n in lengths), 10, 14))
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
        _row("depth", [f"{n} ({table['frames'][n]} fr)" for n in lengths], 10, 18),
    ]
    if short := table.get("left_out"):
        lengths_out = ", ".join(map(str, short["lengths"]))
        lines.insert(1, f"  (left out: {lengths_out}; 3 frames need rows of {short['need']}+)")
    for depth in table["depths"]:
        key = f"{depth:g}"
        cells = [
            f"{_share(table['cells'][n].get(key), 'accuracy')} / "
            f"{_share(table['control'][n].get(key), 'accuracy')}"
            for n in lengths
        ]
        lines.append(_row(key, cells, 10, 18))
    return lines
