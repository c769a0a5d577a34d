"""`earlyfuse-eval`: the figures it prints are the ones it claims, and they mean what
they say. A model trained on scenes whose captions are shuffled against their pictures shows no
dependence gap and draws at chance, while the same model trained on matched pairs does not.

The contrast test trains two tiny transformers in-process (plain AdamW, no DeepSpeed: the trainer
is not under test) on 40 scenes in both layouts, caption after picture and picture after
caption, and reads their drawings through a visual tokenizer with set weights (factories.
colour_vtok: patch-mean colours, no training).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import sys
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch
from PIL import Image
from trainrun import run_checkout

from data.demo_corpus import scenes as scenes_mod
from data.demo_corpus._common import rng_for
from data.layout import image_tokens
from data.loader import pack_documents
from data.text_tokenizer import TextTokenizer
from data.vocab import Modality
from model import presets
from tools.evaluate import main as eval_main
from tools.evaluate.heldout import MODEL_INPUTS, token_byte_lengths
from tools.evaluate.pair_dependence import CAPTION, DRAWING, dependence_gaps, find_pair
from tools.evaluate.scenes import evaluate_scenes, load_scenes
from tools.generate_requests import Generator


def test_eval_command_on_a_release(debug_release, tiny_tokens, tiny_corpus, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = eval_main(
        [
            str(debug_release),
            "--data",
            str(tiny_tokens),
            "--train-data",
            str(tiny_tokens),
            "--scenes",
            str(tiny_corpus / "scenes" / "scenes.jsonl"),
            "--max-scenes",
            "3",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    ev = json.loads(out.read_text())
    printed = capsys.readouterr().out
    # Evaluated on the training data itself: every document is reported as not held out.
    assert ev["overlap"]["documents"] == ev["overlap"]["checked"] > 0
    assert "WARNING" in printed and "memorisation" in printed
    first = ev["overlap"]["examples"][0]  # named, for the user to find the inputs
    assert len(ev["overlap"]["examples"]) <= 5 and f"e.g. {first}" in printed
    tot = ev["heldout"]["total"]
    for m in ("text", "code", "image", "video", "structure"):
        f = tot[m]
        assert f["tokens"] > 0 and math.isfinite(f["ce"])
        assert f["margin"] == pytest.approx(f["unigram"] - f["ce"])
        assert math.isfinite(f["bigram"])
    for m in ("text", "code"):
        # on the training tokens themselves the previous token predicts better than frequencies
        # (structure's unigram is told that a structure token comes, the bigram is not)
        assert tot[m]["bigram"] < tot[m]["unigram"]
    for m in ("text", "code"):
        nats = tot[m]["ce"] * tot[m]["tokens"]
        assert tot[m]["bpb"] == pytest.approx(nats / math.log(2) / tot[m]["bytes"])
    # The per-source figures add up to the total.
    n = sum(s["image"]["tokens"] for s in ev["heldout"]["sources"].values() if "image" in s)
    assert n == tot["image"]["tokens"]
    assert "scenes/caption" in ev["dependence"]
    assert ev["scenes"]["scenes"] == 3 and set(ev["scenes"]["draw"]) >= {"colour", "all"}
    # The tiny corpus's scenes are pictures of the training shards too: said, as for --data
    assert ev["scenes"]["in_training"]["scenes"] == 3
    assert "WARNING: 3 of these 3 scenes are pictures of the training data" in printed
    assert "scenes (3 single-shape scenes" in printed  # not called held-out
    assert "per modality" in printed and "dependence" in printed and "drawn from caption" in printed
    # Which code made the figures (their meaning changes with it): the version and commit
    from train.callbacks.run_info import code_commit, package_version

    commit, modified = code_commit()
    by = {"earlyfuse": package_version("earlyfuse"), "commit": commit, "modified": modified}
    assert ev["evaluated_by"] == by
    assert f"(step {ev['step']}), by earlyfuse {by['earlyfuse']}" in printed


def test_the_bigram_baseline_knows_the_previous_token_only(tiny_tokens, tiny_tokenizers):
    """Witten-Bell after (previous id, its modality), counted here by hand; its predictions
    range over the whole vocabulary (they sum to 1), so it is not told which modality the next
    token has (told that, it would find <eol> certain after a row's last code)."""
    from collections import Counter

    import torch

    from data.text_tokenizer import TextTokenizer
    from data.token_docs import iter_documents, source_tables
    from tools.evaluate.bigram import Bigram

    layout = TextTokenizer.load(tiny_tokenizers[0]).layout
    tables = source_tables(str(tiny_tokens))
    bigram = Bigram.from_tables(tables, layout)
    pairs: Counter = Counter()
    for doc in iter_documents(tables):
        ids, mods = doc.ids.tolist(), doc.modality.tolist()
        pairs.update(zip(mods[:-1], ids[:-1], ids[1:]))
    (mod, prev, label), seen = pairs.most_common(1)[0]
    after = {w: n for (m, p, w), n in pairs.items() if (m, p) == (mod, prev)}
    unigram = Counter()
    for (_, _, w), n in pairs.items():
        unigram[w] += n
    p_uni = (unigram[label] + 1) / (sum(unigram.values()) + layout.size)
    c, t = sum(after.values()), len(after)
    want = (seen + t * p_uni) / (c + t)
    unseen = next(i for i in range(layout.size) if (mod, i) not in {(m, p) for m, p, _ in pairs})
    ones = torch.ones(1, 2, dtype=torch.long)
    nll = bigram.nll_sums(torch.tensor([[prev, unseen]]), ones * mod, ones * label, ones * 0)
    assert nll[0] == pytest.approx(-np.log(want) - np.log(p_uni))
    every = torch.arange(layout.size).reshape(1, -1)
    probs = np.exp(
        -np.array(
            [
                bigram.nll_sums(
                    torch.tensor([[prev]]),
                    torch.tensor([[mod]]),
                    every[:, i : i + 1],
                    torch.zeros(1, 1, dtype=torch.long),
                )[0]
                for i in range(layout.size)
            ]
        )
    )
    assert probs.sum() == pytest.approx(1.0)


def test_scenes_are_looked_up_in_the_training_sources_only(tiny_tokens, tiny_corpus, tmp_path):
    """Only the raw sources the token folder holds are training data: ingest --val-fraction puts
    the held-out split beside them in the same raw folder (val/<source>), and its pictures were
    all called training pictures. A folder the check cannot read says so instead of nothing."""
    from tools.evaluate.scenes import load_scenes, scenes_in_training

    scenes = load_scenes([tiny_corpus / "scenes" / "scenes.jsonl"])[:4]
    assert scenes_in_training(scenes, tiny_tokens)["scenes"] == 4
    without = tmp_path / "tokens"  # the same tokens without their scenes source
    without.mkdir()
    (without / "manifest.json").write_text((tiny_tokens / "manifest.json").read_text())
    for folder in tiny_tokens.iterdir():
        if folder.is_dir() and folder.name != "scenes":
            (without / folder.name).symlink_to(folder)
    seen = scenes_in_training(scenes, without)
    assert (seen["checked"], seen["scenes"]) == (4, 0)
    assert (
        "holds no token manifest" in scenes_in_training(scenes, tiny_tokens / "scenes")["unchecked"]
    )


def test_scenes_of_a_val_fraction_split_are_read_from_its_folder(tiny_corpus, tmp_path):
    """ingest --val-fraction puts the held-out split in RAW/val/<source>, sources val/<source> of
    RAW's manifest: --scenes RAW/val was refused (no manifest.json there), and --scenes RAW mixed
    training and held-out scenes."""
    from data.ingest import ingest
    from tools.evaluate.scenes import load_scenes

    raw = tmp_path / "raw"
    ingest(raw, [f"images:{tiny_corpus / 'scenes' / 'scenes.jsonl'}"], val_fraction=0.5)
    held, every = load_scenes([raw / "val"]), load_scenes([raw])
    assert 0 < len(held) < len(every)
    assert {s["caption"] for s in held} <= {s["caption"] for s in every}


def test_a_release_shipped_without_its_run_folder_is_evaluated_on_the_runs_rows(
    debug_release, tiny_tokens, tmp_path, capsys
):
    """The release records how its run packed rows (config.json ``packing``); copied where its
    run folder is not (another machine), earlyfuse-eval packs the held-out documents as on the
    original: the same rows, the same figures. Flags win over the release; an older release
    without the record takes its run folder's config; with neither, one line names the defaults."""
    config = json.loads((debug_release / "config.json").read_text())
    # experiment=debug with train.micro_batch=2 on one rank, no validation sources
    rows = {"seq_len": 256, "micro_batch": 2, "whole_documents": False}
    assert config["packing"] == {**rows, "eval_batches": 2, "data_ranks": 1, "validation": []}

    def copy(name: str, **changes) -> Path:
        folder = tmp_path / name
        shutil.copytree(debug_release, folder)
        changed = {**config, **changes}
        (folder / "config.json").write_text(
            json.dumps({key: value for key, value in changed.items() if value})
        )
        return folder

    def evaluate(release: Path, *flags: str):
        out = tmp_path / f"{release.name}.json"
        argv = [str(release), "--data", str(tiny_tokens / "scenes"), "--max-docs", "3"]
        argv += ["--max-pairs", "0", "--no-progress", "--out", str(out)]
        assert eval_main([*argv, *flags]) == 0
        return json.loads(out.read_text()), capsys.readouterr()

    gone = {**config["source"], "run_dir": str(tmp_path / "elsewhere" / "run")}
    original, _ = evaluate(debug_release)
    shipped, printed = evaluate(copy("shipped", source=gone))
    assert shipped["heldout"] == original["heldout"]
    assert [shipped[key] for key in ("seq_len", "batch_rows", "whole_documents")] == [256, 2, False]
    assert set(shipped["packing_from"].values()) == {"release"} and "default" not in printed.err
    assert "rows of 256 tokens, 2 a batch, text split across rows (settings: release)" in (
        printed.out
    )
    flagged, _ = evaluate(copy("flagged", source=gone), "--seq-len", "128")
    assert flagged["seq_len"] == 128 and flagged["packing_from"]["seq_len"] == "flag"
    older, _ = evaluate(copy("older", packing=None))  # the run folder is still there
    assert set(older["packing_from"].values()) == {"run folder"}
    assert older["heldout"] == original["heldout"]
    bare, printed = evaluate(copy("bare", packing=None, source=gone), "--batch-rows", "2")
    notes = [line for line in printed.err.splitlines() if "default" in line]
    assert len(notes) == 1, printed.err
    assert "seq_len 2048" in notes[0] and "whole_documents off" in notes[0]
    assert "batch_rows" not in notes[0] and "--seq-len" in notes[0]
    assert bare["packing_from"] == {
        "seq_len": "default",
        "batch_rows": "flag",
        "whole_documents": "default",
    }
    # rows of 2048, not 256; the three scenes fit either and are never split: the same figures
    assert bare["seq_len"] == 2048 and bare["heldout"]["total"] == original["heldout"]["total"]


def test_token_data_of_other_tokenizers_is_refused_naming_the_source(
    debug_release, tiny_tokenizers, tmp_path, capsys
):
    """Held-out notes tokenized with another text tokenizer have ids inside the model's
    vocabulary: the pass would run and print figures of ids that mean other things. earlyfuse-eval
    compares each source's tokenizer fingerprints with the release's and refuses, naming the
    source, its manifest, what differs and the command that tokenizes it right."""
    from data.ingest import ingest
    from data.tokenize.run import tokenize
    from data.train_text_tokenizer import train_text_tokenizer

    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "n.txt").write_text("A held-out note, tokenized the wrong way.\n" * 4)
    assert ingest(tmp_path / "raw", [f"notes=text:{tmp_path / 'notes'}"])["finalized"]
    train_text_tokenizer([tmp_path / "raw"], tmp_path / "tok", vocab_size=300, max_grid=32)
    tokenize(tmp_path / "raw", tmp_path / "tokens", tmp_path / "tok", tiny_tokenizers[1])
    # the same note made with the release's own tokenizers: a held-out side that is right
    tokenize(tmp_path / "raw", tmp_path / "right", debug_release, tiny_tokenizers[1])
    wrong, right = str(tmp_path / "tokens"), str(tmp_path / "right")
    for flag, data, train in (("--data", wrong, right), ("--train-data", right, wrong)):
        argv = [str(debug_release), "--data", data, "--train-data", train, "--no-progress"]
        assert eval_main(argv) == 2
        printed = capsys.readouterr()
        assert printed.out == ""  # no table of meaningless figures
        assert f"error: {flag}: source notes ({wrong}/manifest.json)" in printed.err
        assert "(text tokenizer, vocabulary layout differ)" in printed.err
        assert f"tokenize --tokenizer {debug_release} --visual-tokenizer" in printed.err
    assert eval_main([str(debug_release), "--data", right, "--no-progress"]) == 0


def test_held_out_images_of_other_sizes_than_the_training_data_are_warned_of(
    debug_release, tiny_raw, tiny_tokenizers, tmp_path, capsys
):
    """Data tokenized with the release's tokenizers but the tokenize command's default budgets
    (images up to 65,536 pixels where the run trained on 1,024: the command the refusal above
    suggested) ran without a word, with figures far from the run's. The release records the
    training data's budgets: a source whose images or videos were made with others is warned
    of, with the command that makes them as the training data's were."""
    from data.tokenize.encoder import TokenizeOptions
    from data.tokenize.run import tokenize

    budgets = TokenizeOptions(
        image_max_pixels=48 * 48, video_max_pixels=32 * 32, video_max_tokens=240
    )
    tokenize(tiny_raw, tmp_path / "tokens", debug_release, tiny_tokenizers[1], opts=budgets)
    argv = [str(debug_release), "--data", str(tmp_path / "tokens"), "--no-progress"]
    assert eval_main([*argv, "--max-docs", "1", "--max-pairs", "0"]) == 0
    err = capsys.readouterr().err
    assert (
        "WARNING: --data: source scenes was tokenized with other block budgets than the "
        "release's training data (image_max_pixels 2304, the training data's 1024)"
    ) in err
    assert "source clips" not in err  # its videos are made as the training data's were
    assert f"--visual-tokenizer {debug_release}/visual_tokenizer --image-max-pixels 1024" in err
    # as the flags take them: a million pixels was written 1.04858e+06, which they refuse
    from train.release import number

    assert [number(v) for v in (1048576, 4.0, 2.5)] == ["1048576", "4", "2.5"]


def test_blocks_longer_than_the_rows_are_said_to_be_left_out(
    debug_release, tiny_tokens, capsys, tmp_path
):
    """A training run refuses rows shorter than the data's visual blocks; the evaluation packs
    them without those blocks. Their modality fell out of the table without a word."""
    clips = str(tiny_tokens / "clips")  # video blocks of about 220 tokens
    assert eval_main([str(debug_release), "--data", clips, "--seq-len", "96", "--no-progress"]) == 0
    printed = capsys.readouterr().out
    assert "WARNING: visual blocks longer than a row left out, unmeasured: clips " in printed
    # Without the table the figures go to --out, and the warning still to the console.
    out = tmp_path / "ev.json"
    argv = [str(debug_release), "--data", clips, "--seq-len", "96", "--no-progress", "--no-table"]
    assert eval_main([*argv, "--out", str(out)]) == 0 and out.is_file()
    assert "left out, unmeasured: clips " in capsys.readouterr().err
    with pytest.raises(SystemExit):
        eval_main(argv)
    assert "--no-table needs --out FILE" in capsys.readouterr().err
    assert eval_main([str(debug_release), "--data", clips, "--no-progress"]) == 0
    assert "WARNING" not in capsys.readouterr().out
    # Caption pairs too: each is scored alone in a row of its own length, which were positions
    # the model never trained at; now left out of the dependence table, and said.
    scenes = str(tiny_tokens / "scenes")
    assert (
        eval_main([str(debug_release), "--data", scenes, "--seq-len", "64", "--no-progress"]) == 0
    )
    printed = capsys.readouterr().out
    assert (
        "WARNING: pair documents longer than a row (64 tokens) left out of the dependence "
        in printed
    )
    assert "scenes/caption" not in printed


def test_scene_settings_are_refused_first_and_too_few_scenes_said(
    debug_release, tiny_tokens, tiny_corpus, capsys
):
    """A negative --draw-temperature was refused after every other part (about 25 s on the demo),
    the table lost; with fewer than 2 single-shape scenes the scenes part gave nothing, unsaid
    (and took any drawing setting)."""

    scenes = str(tiny_corpus / "scenes" / "scenes.jsonl")
    base = [str(debug_release), "--data", str(tiny_tokens / "scenes"), "--no-progress"]
    for flag, value, said in (
        ("--draw-temperature", "-1", "--draw-temperature: temperature -1.0: must be 0 (greedy)"),
        ("--draw-guidance", "nan", "--draw-guidance nan: must be a finite number (1: off)"),
    ):
        assert eval_main([*base, "--verbose", "--scenes", scenes, flag, value]) == 2
        err = capsys.readouterr().err
        assert said in err and "held-out losses ..." not in err  # before any part, not after
    assert eval_main([*base, "--max-docs", "1", "--scenes", scenes, "--max-scenes", "1"]) == 0
    assert (
        "scenes: 1 single-shape scene(s) found; at least 2 are needed (each is scored against "
        "another for chance): not scored"
    ) in capsys.readouterr().out


@pytest.mark.parametrize("flag", ["--seq-len", "--batch-rows", "--max-docs"])
def test_a_row_length_or_batch_below_one_is_refused_by_name(flag, capsys):
    """0 would silently mean "not given" (--max-docs 0 evaluated every document, --max-pairs 0
    none) and a negative one fail deep in numpy."""
    from tools.evaluate import build_parser

    for value in ("0", "-5"):
        with pytest.raises(SystemExit):
            build_parser().parse_args(["REL", "--data", "VAL", flag, value])
        assert f"argument {flag}: {value} is not a count" in capsys.readouterr().err


def test_a_device_this_machine_lacks_is_one_line_before_the_release_is_read(tmp_path, capsys):
    """The help's own example (--device cuda) gave torch's traceback on a CPU machine, exit 1,
    after the release and the data were loaded."""
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has a CUDA device")
    for device, said in [
        ("cuda", "--device cuda: this machine has no CUDA device torch can use"),
        ("foo", "--device 'foo': not a device (cpu, cuda, cuda:1, ...)"),
    ]:
        args = [str(tmp_path / "no-release"), "--data", str(tmp_path), "--device", device]
        assert eval_main(args) == 2
        assert said in capsys.readouterr().err


def test_an_out_file_that_cannot_be_written_is_refused_before_evaluating(tmp_path, capsys):
    """--out is written after the evaluation: under a file, or at a folder, it failed then with
    a traceback, the figures lost."""
    from tools.evaluate import build_parser

    (tmp_path / "notes.txt").write_text("a file")
    for out, problem in [
        (tmp_path / "notes.txt" / "ev.json", f"{tmp_path / 'notes.txt'} is a file, not a folder"),
        (tmp_path, f"{tmp_path} is a folder, not a file"),
    ]:
        with pytest.raises(SystemExit) as exit_code:
            build_parser().parse_args(["REL", "--data", "VAL", "--out", str(out)])
        assert exit_code.value.code == 2
        assert problem in capsys.readouterr().err


def test_scenes_read_from_raw_shards_are_the_ingested_scenes(tiny_corpus, tiny_raw, tmp_path):
    """``--scenes RAW_DIR`` scores the scenes that ingest wrote (the held-out set as it is),
    with the bytes of their pictures; a scene that ingest kept out is not scored."""
    table = load_scenes([tiny_corpus / "scenes" / "scenes.jsonl"])
    shards = load_scenes([tiny_raw])
    assert len(shards) == len(table) > 0  # clips carry facts too, but are not scenes
    for from_table, from_shards in zip(table, shards):
        assert from_shards["caption"] == from_table["caption"]
        assert from_shards["facts"] == from_table["facts"]
        assert from_shards["image"] == Path(from_table["image"]).read_bytes()
    with pytest.raises(ValueError, match="not a raw shard folder"):
        load_scenes([tmp_path])


def test_token_byte_lengths_count_utf8_bytes(tiny_tokenizers):
    tok = TextTokenizer.load(tiny_tokenizers[0])
    lengths = token_byte_lengths(tok)
    for text in ("def f(x):\n    return x", "Grüße, 🙂 and a tab\t."):
        assert int(lengths[tok.encode(text)].sum()) == len(text.encode("utf-8"))
    assert lengths[tok.bos_id] == lengths[tok.eos_id] == 0


# --- matched against shuffled: the figures detect dependence, and its absence ----------------------


def _scene_images(n: int, size: int = 32) -> list[tuple[dict, np.ndarray]]:
    out, i = [], 0
    while len(out) < n:
        rng = rng_for(11, "scenes", i)
        facts = scenes_mod.sample_facts(rng)
        img = scenes_mod.render(facts, rng)
        i += 1
        if len(facts["shapes"]) != 1 or facts["background"]["kind"] != "plain":
            continue
        small = np.asarray(Image.fromarray(img).resize((size, size), Image.BICUBIC))
        out.append((facts, small))
    return out


def _docs(tok, layout, vtok, scenes, captions):
    """Both layouts of every scene: picture then caption, caption then picture."""
    docs = []
    x = torch.stack([torch.from_numpy(a.copy()).permute(2, 0, 1) for _, a in scenes]).float()
    codes = vtok.encode(x / 127.5 - 1).numpy()
    for grid, cap in zip(codes, captions):
        block, bmod = image_tokens(grid, layout)
        text = np.asarray(tok.encode(cap))
        tmod = np.full(len(text), int(Modality.TEXT))
        for first, second in (((block, bmod), (text, tmod)), ((text, tmod), (block, bmod))):
            ids = np.concatenate([[tok.bos_id], first[0], second[0], [tok.eos_id]])
            mod = np.concatenate([[0], first[1], second[1], [0]])
            start = 1 if first[0] is block else 1 + len(text)
            blocks = [[start, start + len(block), 0, *grid.shape]]
            docs.append((ids.astype(np.int64), mod.astype(np.int64), blocks))
    return docs, codes


def _train(layout, docs, steps: int, seed: int):
    torch.manual_seed(seed)
    model = presets.preset("debug", layout).build()
    opt = torch.optim.AdamW(model.parameters(), lr=4e-3, weight_decay=0.0)
    # one document per row, as evaluation runs them
    rows = [
        next(pack_documents([SimpleNamespace(ids=ids, modality=mod, blocks=blocks)], 128))
        for ids, mod, blocks in docs
    ]
    batch = {key: torch.cat([row[key] for row in rows]) for key in MODEL_INPUTS}
    inputs = {k: batch[k] for k in MODEL_INPUTS}
    for _ in range(steps):
        loss = model(**inputs).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    return model.eval()


def test_a_source_with_one_pair_is_listed_unmeasured(tiny_tokenizers):
    """Before: a source with a single held-out pair left the dependence table without a word
    (its progress bar stopped at 2/3)."""
    import factories

    from tools.evaluate.table import format_eval

    tok = TextTokenizer.load(tiny_tokenizers[0])
    scenes = _scene_images(3)
    docs, _ = _docs(tok, tok.layout, factories.colour_vtok(), scenes, ["a", "b", "c"])
    captioned = docs[0::2]  # picture then caption
    pairs = [find_pair("two", str(i), *doc) for i, doc in enumerate(captioned[:2])]
    pairs.append(find_pair("one", "0", *captioned[2]))
    torch.manual_seed(0)
    model = presets.preset("debug", tok.layout).build().eval()
    gaps = dependence_gaps(model, pairs, "cpu")
    assert gaps["two/caption"]["pairs"] == 2 and gaps["two/caption"]["gap"] is not None
    assert gaps["one/caption"] == {
        **{"source": "one", "direction": "caption", "pairs": 1, "tokens": 0},
        **{"ce_own": None, "ce_other": None, "gap": None},
    }
    printed = format_eval({"dependence": gaps})
    assert "one pair: no other document's context to swap in" in printed


def test_a_modality_on_a_few_tokens_is_flagged():
    """Code-only held-out data has a text row of its documents' <|eos|> labels: four tokens
    whose CE read like a finding."""
    from tools.evaluate.table import format_eval

    fig = {"ce": 1.0, "unigram": 2.0, "margin": 1.0, "bigram": 1.5, "bpb": None}
    held = {"total": {"text": {**fig, "tokens": 4}, "code": {**fig, "tokens": 5000}}}
    printed = format_eval({"heldout": held})
    assert "(on fewer than 100 tokens, figures that say little: text 4)" in printed


@pytest.mark.slow  # two models trained for 150 steps, then 2 x 40 scenes drawn and captioned: minutes
def test_shuffled_pairs_show_no_dependence_and_draw_at_chance(tiny_tokenizers, tmp_path):
    import factories

    tok = TextTokenizer.load(tiny_tokenizers[0])
    layout = tok.layout
    vtok = factories.colour_vtok()
    scenes = _scene_images(40)
    captions = [scenes_mod.caption(f) for f, _ in scenes]
    shuffled = captions[7:] + captions[:7]  # every picture with another scene's caption
    matched_docs, codes = _docs(tok, layout, vtok, scenes, captions)
    shuffled_docs, _ = _docs(tok, layout, vtok, scenes, shuffled)
    models = {
        "matched": _train(layout, matched_docs, steps=150, seed=0),
        "shuffled": _train(layout, shuffled_docs, steps=150, seed=0),
    }
    # Both are measured on the true pairs (the matched documents).
    pairs = [
        find_pair("scenes", str(i), ids, mod, blocks)
        for i, (ids, mod, blocks) in enumerate(matched_docs)
    ]
    assert {p.direction for p in pairs} == {CAPTION, DRAWING}
    gaps = {k: dependence_gaps(m, pairs, "cpu") for k, m in models.items()}
    for direction in (CAPTION, DRAWING):
        key = f"scenes/{direction}"
        # 150 full-batch steps on 40 scenes: the matched model's gap is 0.3-0.5 nats per target
        # token (it varied with the merged code); the shuffled one's is noise around zero
        assert gaps["matched"][key]["gap"] > 0.2, gaps
        assert gaps["matched"][key]["gap"] > gaps["shuffled"][key]["gap"] + 0.15, gaps
        assert abs(gaps["shuffled"][key]["gap"]) < 0.25, gaps
    # Drawings read back by the pixel classifier: the shuffled model draws at chance.
    folder = tmp_path / "scenes"
    folder.mkdir()
    rows = []
    for i, ((facts, img), cap) in enumerate(zip(scenes, captions)):
        Image.fromarray(img).save(folder / f"s{i}.png")
        rows.append({"image": str(folder / f"s{i}.png"), "caption": cap, "facts": facts})
    results = {}
    for name, model in models.items():
        judge = Generator.around(model, layout, tok, vtok, "cpu", 32 * 32)
        # Greedy: a model this overfit draws its scenes exactly, and the figures do not
        # depend on a sampler's luck.
        results[name] = evaluate_scenes(judge, rows, draw_temperature=0.0)
    m, s = results["matched"], results["shuffled"]
    assert m["ceiling"]["colour"] > 0.5  # the tokenizer keeps the colour
    assert m["draw"]["colour"] > m["draw_chance"]["colour"] + 0.25, m
    assert abs(s["draw"]["colour"] - s["draw_chance"]["colour"]) < 0.2, s
    assert abs(s["caption"]["colour"] - s["caption_chance"]["colour"]) < 0.2, s


@pytest.mark.parametrize("bidirectional", [False, True])
def test_scene_captions_read_the_picture_as_earlyfuse_generate_does(
    debug_release, tiny_corpus, bidirectional
):
    """The evaluation's captions are what `earlyfuse-generate --caption` prints for the same
    picture, also for a model whose image blocks attend both ways (it must pass the block's
    image ids, or it scores a model that reads its pictures differently)."""
    from train.release import Release

    gen = Generator(Release(debug_release), torch.device("cpu"))
    gen.model.cfg.attention.bidirectional_images = bidirectional
    torch.manual_seed(0)  # random weights: greedy text follows every change of attention
    with torch.no_grad():
        for param in gen.model.parameters():
            param.normal_(0.0, 0.3)
    for image in sorted((tiny_corpus / "scenes").rglob("*.png"))[:3]:
        codes = gen.encode_image(str(image))
        ours = gen.caption(
            str(image), max_new_tokens=12, temperature=0.0, top_k=0, top_p=1.0, seed=0
        )["text"]
        # the evaluation captions the code grid it encoded, greedy (tools/evaluate/scenes.py)
        assert gen.caption(codes, max_new_tokens=12)["text"] == ours, image.name


def test_rows_too_long_for_the_machine_are_refused_before_allocating(
    debug_release, tiny_tokens, capsys
):
    """On the CPU, SDPA needs the dense mask of a row and a float copy of it: rows whose mask
    alone exceeds the machine's memory are refused by name, not left to the allocator."""
    total = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    seq_len = math.isqrt(total // 5) + 128  # the mask just past the memory; activations small
    argv = [str(debug_release), "--data", str(tiny_tokens / "scenes"), "--max-docs", "3"]
    argv += ["--max-pairs", "0", "--no-progress", "--seq-len", str(seq_len), "--batch-rows", "1"]
    assert eval_main(argv) == 2
    err = capsys.readouterr().err
    assert f"attention over 1 row(s) of {seq_len:,} tokens on the CPU needs a dense" in err
    assert "use shorter rows (--seq-len, data.seq_len)" in err


@pytest.mark.parametrize(
    "options, said",
    [
        (["--needle-lengths", "512"], "--needle-lengths applies only with --needle or"),
        (["--position-first-bucket", "32"], "applies only with --position-loss or --long-context"),
        (["--needle-depths", "0.5", "--needle-trials", "3"], "--needle-trials apply only with"),
    ],
)
def test_the_long_context_tables_options_are_refused_without_their_table(options, said, capsys):
    """Before: given without --needle (or --position-loss), they were ignored without a word."""
    with pytest.raises(SystemExit):
        eval_main(["release", "--data", "tokens", *options])
    assert said in capsys.readouterr().err


def test_an_out_file_a_full_disk_cuts_short_is_left_as_it_was(tmp_path):
    """A full disk (here a file-size limit, which fails a write the same way): --out was written
    in place, an earlier heldout_eval.json left at 0 bytes, after a chained traceback."""
    out = tmp_path / "heldout_eval.json"
    out.write_text('{"step": 2}\n')
    text = {"ce": 5.5, "unigram": 4.9, "tokens": 9}
    ev = {"step": 4, "heldout": {"total": {"text": text}}, "examples": ["x" * 100] * 50}
    evaluated = (  # the figures as evaluate() returns them, without a model to evaluate
        "import json, sys; import tools.evaluate as e; "
        "e.evaluate = lambda args: json.loads(sys.argv[1]); sys.exit(e.main(sys.argv[2:]))"
    )
    argv = [json.dumps(ev), "REL", "--data", "VAL", "--no-progress", "--out", str(out)]
    p = run_checkout([sys.executable, "-c", evaluated, *argv], file_size_limit=1000)
    assert p.returncode == 1 and p.stderr == (
        f"earlyfuse-eval: error: {out} could not be written (File too large); a file there "
        "before is unchanged\n"
    )
    assert "held-out evaluation of ? (step 4)" in p.stdout  # the figures are not lost with it
    assert out.read_text() == '{"step": 2}\n' and [f.name for f in tmp_path.iterdir()] == [out.name]
