"""`earlyfuse-eval --long-context`: the loss by position and the needle tables.

The scorers are tested on predictions built from the prompts themselves (a "model" whose argmax
is the true next token scores 1.0, one that always says `<bos>` scores 0), the position table on
rows whose stretches and losses are set by hand, and the command end to end on the session's
released debug run.
"""

from __future__ import annotations

import json
import math

import numpy as np
import pytest
import torch

from data.layout import parse_video
from data.loader.expand import IGNORE
from data.passkey import passkey_text
from data.text_tokenizer import TextTokenizer
from data.vocab import Modality
from tools.evaluate import main as eval_main
from tools.evaluate.needle import (
    PasskeyPrompts,
    digit_hits,
    frame_prompts,
    pack_prompts,
    score_answers,
    score_codes,
)
from tools.evaluate.position import PositionAccumulator, bucket_edges

TEXT, CODE = int(Modality.TEXT), int(Modality.CODE)


def test_buckets_are_log_spaced_up_to_the_row():
    assert bucket_edges(256) == [0, 64, 128, 256]
    assert bucket_edges(1024, 16) == [0, 16, 32, 64, 128, 256, 512, 1024]
    assert bucket_edges(300) == [0, 64, 128, 256, 300]


def test_a_bucket_averages_the_stretches_that_cover_it():
    """Row 1: a text document of 200 tokens, a code document of 40, 16 of padding; row 2: one
    text stretch filling the row. A token's CE is its offset, so every mean is known."""
    acc = PositionAccumulator(bucket_edges(256))
    doc_ids = np.r_[np.zeros(200), np.ones(40), np.full(16, 2)].astype(np.int64)
    labels = np.r_[np.full(240, 7), np.full(16, IGNORE)]
    modality = np.r_[np.full(200, TEXT), np.full(40, CODE), np.full(16, TEXT)]
    offsets = np.r_[np.arange(200), np.arange(40), np.arange(16)].astype(float)
    acc.add_row(offsets, labels, modality, doc_ids)
    acc.add_row(np.arange(256.0), np.full(256, 7), np.full(256, TEXT), np.zeros(256, np.int64))
    out = acc.result()
    assert out["buckets"] == [[0, 64], [64, 128], [128, 256]]
    assert out["stretches"] == [2, 2, 1]  # the 200-token stretch does not reach 256
    text = out["modalities"]["text"]["buckets"]
    assert [c["tokens"] for c in text] == [128, 128, 128]
    assert [c["ce"] for c in text] == [31.5, 95.5, 191.5]
    assert [c["ce_first"] for c in text] == [31.5, 31.5, 31.5]
    # every token counted in ce_all: the 200-token stretch's 72 tokens past 128 too
    assert [c["tokens_all"] for c in text] == [128, 128, 128 + 72]
    assert text[2]["ce_all"] == pytest.approx((sum(range(128, 200)) + sum(range(128, 256))) / 200)
    code = out["modalities"]["code"]["buckets"]  # 40 tokens: no bucket is covered
    assert [c["tokens"] for c in code] == [0, 0, 0] and code[0]["ce"] is None
    assert code[0]["tokens_all"] == 40 and code[0]["ce_all"] == pytest.approx(19.5)


@pytest.fixture(scope="module")
def text_tok(tiny_tokenizers) -> TextTokenizer:
    return TextTokenizer.load(tiny_tokenizers[0])


def test_passkey_prompts_have_their_length_depth_and_control(text_tok):
    maker = PasskeyPrompts(text_tok)
    key = "48213"
    # The needle after its first word (which is bare at depth 0, the document's start).
    needle = text_tok.encode(" pass key is 48213. Remember it. 48213 is the pass key.")
    head = len(text_tok.encode(" The"))
    sentence = max(len(ids) for ids in maker.sentences)
    for depth in (0.0, 0.5, 1.0):
        prompt = maker.prompt(key, length=300, depth=depth)
        assert len(prompt.ids) == 300 and prompt.target[1] == 300
        text = text_tok.decode(prompt.ids[1:].tolist())
        assert text.endswith(f"What is the pass key? The pass key is {key}")
        ids = prompt.ids.tolist()
        at = next(j for j in range(300) if ids[j : j + len(needle)] == needle) - head
        fill = 300 - 1 - len(needle) - len(maker.question) - (300 - prompt.target[0])
        assert abs((at - 1) - depth * fill) <= sentence / 2, (at, fill)
    control = maker.prompt(key, length=300, depth=0.5, needle=False)
    assert len(control.ids) == 300 and control.target == prompt.target
    text = text_tok.decode(control.ids[1:].tolist())
    assert key not in text[: text.index("What is the pass")] and text.endswith(key)
    with pytest.raises(ValueError, match="--needle-lengths 20: a passkey prompt needs"):
        maker.prompt(key, length=20, depth=0.5)


def test_a_passkey_prompt_is_a_training_document_token_for_token(text_tok):
    """The evaluation asks the question the way the training documents ask it: with filler of
    whole sentences, a prompt is a data/passkey.py document tokenized as `earlyfuse-prep
    tokenize` lays out a text document (<bos>, then the text's tokens), up to its key."""
    maker = PasskeyPrompts(text_tok)
    key = "48213"
    period = text_tok.encode(".")
    for depth in (0.0, 1.0):
        text = passkey_text(key, depth=depth, sentences=10)
        document = [text_tok.bos_id, *text_tok.encode(text)]
        assert document[-len(period) :] == period  # the key, then the document's full stop
        document = document[: -len(period)]
        prompt = maker.prompt(key, length=len(document), depth=depth)
        assert prompt.ids.tolist() == document
        answer = text_tok.encode(" " + key)
        assert prompt.target == (len(document) - len(answer), len(document))


def test_the_passkey_scorer_gives_one_when_the_answer_is_predicted(text_tok):
    maker = PasskeyPrompts(text_tok)
    prompts = [maker.prompt(key, length=200, depth=0.25) for key in ("48213", "90017", "55555")]
    ids = torch.tensor(np.stack([p.ids for p in prompts]))
    vocab = text_tok.layout.size
    # Logits that put the true next token first: teacher forcing's perfect model.
    logits = 10 * torch.nn.functional.one_hot(ids.roll(-1, dims=1), vocab).float()
    score = score_answers(logits.argmax(-1).numpy(), prompts, maker.token_text)
    assert score == {"digit": 1.0, "whole": 1.0, "prompts": 3, "digits": 15}
    wrong = np.full(ids.shape, text_tok.bos_id)
    assert score_answers(wrong, prompts, maker.token_text)["digit"] == 0.0
    # One answer token of the first key replaced by another number: that key is not whole.
    first = prompts[0]
    places = [
        j for j in range(*first.target) if any(c.isdigit() for c in maker.token_text(first.ids[j]))
    ]
    guessed = logits.argmax(-1).numpy()
    guessed[0, places[0] - 1] = text_tok.encode(" 0")[-1]
    partial = score_answers(guessed, prompts, maker.token_text)
    assert partial["whole"] == pytest.approx(2 / 3) and 12 / 15 <= partial["digit"] < 1.0
    assert digit_hits("482", "483") == (2, 3) and digit_hits(" 4", " 48") == (1, 2)


def test_frame_copy_prompts_repeat_the_needle_frame(text_tok):
    layout = text_tok.layout
    rng = np.random.default_rng(0)
    videos = [rng.integers(0, layout.num_codes, size=(5, 3, 4)) for _ in range(4)]
    for depth in (0.0, 0.5, 1.0):
        copy = frame_prompts(
            videos, layout, text_tok.bos_id, length=256, depth=depth, trial=1, copy=True
        )
        control = frame_prompts(
            videos, layout, text_tok.bos_id, length=256, depth=depth, trial=1, copy=False
        )
        assert len(copy.ids) <= 256 and len(copy.ids) == len(control.ids)
        frames = parse_video(copy.ids[1:], layout)
        needle = videos[1][2]  # trial 1: video 1's middle frame
        slot = round(depth * (len(frames) - 2))
        assert (frames[-1] == needle).all() and (frames[slot] == needle).all()
        other = parse_video(control.ids[1:], layout)
        assert (other[-1] == needle).all() and (other[slot] == videos[2][2]).all()
        assert copy.blocks == [[1, len(copy.ids), len(frames), 3, 4]]
    batch = pack_prompts([copy, control], 256, text_tok.pad_id)
    assert batch["input_ids"].shape == (2, 256)
    predicted = np.roll(np.stack([copy.ids, control.ids]), -1, axis=1)
    assert score_codes(predicted, [copy, control], layout.is_code)["accuracy"] == 1.0
    assert score_codes(predicted + 1, [copy, control], layout.is_code)["accuracy"] == 0.0
    # a length too short for 3 frames names the flag that set it
    with pytest.raises(
        ValueError, match=r"--needle-lengths 40: .* 3 frames of 3x4 codes, 53 tokens"
    ):
        frame_prompts(videos, layout, text_tok.bos_id, length=40, depth=0.5, trial=1, copy=True)


def test_long_context_evaluation_end_to_end(debug_release, tiny_tokens, tmp_path, capsys):
    out = tmp_path / "eval.json"
    code = eval_main(
        [
            str(debug_release),
            "--data",
            str(tiny_tokens),
            "--long-context",
            "--needle-lengths",
            "96,256,512",  # 96: a passkey fits, 3 of the clips' frames do not
            "--needle-depths",
            "0,1",
            "--needle-trials",
            "2",
            "--max-docs",
            "12",
            "--max-pairs",
            "1",
            "--no-progress",
            "--out",
            str(out),
        ]
    )
    assert code == 0
    ev = json.loads(out.read_text())
    printed = capsys.readouterr().out
    pos = ev["position_loss"]
    assert pos["buckets"] == [[0, 64], [64, 128], [128, 256]] and pos["seq_len"] == 256
    # Every scored token is in one bucket: the buckets add up to the held-out figures.
    for name, fig in ev["heldout"]["total"].items():
        cells = pos["modalities"][name]["buckets"]
        assert sum(c["tokens_all"] for c in cells) == fig["tokens"]
        nats = sum(c["ce_all"] * c["tokens_all"] for c in cells if c["tokens_all"])
        assert nats / fig["tokens"] == pytest.approx(fig["ce"], rel=1e-5)
    for cell in pos["modalities"]["text"]["buckets"]:
        assert cell["tokens"] <= cell["tokens_all"]
    passkey = ev["passkey"]
    lengths = {"96", "256", "512"}
    assert set(passkey["cells"]) == lengths and set(passkey["control"]) == lengths
    for length in lengths:
        assert set(passkey["cells"][length]) == {"0", "1"}
        for score in [*passkey["cells"][length].values(), passkey["control"][length]]:
            assert score["prompts"] == 2 and score["digits"] == 10
            assert 0 <= score["digit"] <= 1 and 0 <= score["whole"] <= 1
    frames = ev["frame_copy"]
    assert "missing" not in frames, frames
    assert frames["lengths"] == [256, 512] and frames["left_out"]["lengths"] == [96]
    assert f"(left out: 96; 3 frames need rows of {frames['left_out']['need']}+)" in printed
    for length in ("256", "512"):
        assert frames["frames"][length] >= 3
        for cells in (frames["cells"][length], frames["control"][length]):
            assert set(cells) == {"0", "1"}
            assert all(math.isfinite(c["accuracy"]) and c["codes"] > 0 for c in cells.values())
    assert "loss by position" in printed and "passkey" in printed and "frame copy" in printed
    assert "control" in printed


def test_bad_needle_flags_fail_before_the_held_out_pass(debug_release, tiny_tokens, capsys):
    argv = [str(debug_release), "--data", str(tiny_tokens), "--needle"]
    assert eval_main([*argv, "--needle-depths", "0,1.5"]) == 2
    assert "--needle-depths 0,1.5: depths are fractions in [0, 1]" in capsys.readouterr().err
    assert eval_main([*argv, "--needle-lengths", "256,x"]) == 2
    assert "--needle-lengths '256,x'" in capsys.readouterr().err


def test_needles_too_long_for_the_machine_name_their_flag(
    debug_release, tiny_tokens, capsys, monkeypatch
):
    """A needle row whose dense mask the CPU cannot hold (a release with bidirectional images or
    local layers masks every row) is refused naming --needle-lengths, not --seq-len."""
    import tools.evaluate.needle as needle
    from model.attention import RowsTooLong

    def too_long(*args, **kwargs):
        raise RowsTooLong("attention over 1 row(s) of 80,000 tokens on the CPU needs ...")

    monkeypatch.setattr(needle, "passkey_table", too_long)
    argv = [str(debug_release), "--data", str(tiny_tokens), "--needle", "--no-progress"]
    assert eval_main([*argv, "--needle-lengths", "512,80000", "--max-pairs", "0"]) == 2
    assert "error: --needle-lengths 512,80000: attention over 1 row(s)" in capsys.readouterr().err


def test_a_first_bucket_outside_the_rows_is_refused_before_the_held_out_pass(
    debug_release, tiny_tokens, capsys
):
    """A first bucket as long as the rows made a table of one bucket, its `first` row the bucket
    itself; 0 or below failed after the whole held-out pass. Both are refused before any work."""
    argv = [str(debug_release), "--data", str(tiny_tokens), "--position-loss", "--verbose"]
    for first in ("256", "1000", "0", "-3"):
        assert eval_main([*argv, "--no-progress", "--position-first-bucket", first]) == 2
        printed = capsys.readouterr()
        assert printed.out == "" and len(printed.err.splitlines()) == 1, printed.err
        assert f"--position-first-bucket {first}: give 1 to 255 (row length 256)" in printed.err


def test_the_scored_logits_are_the_full_forward_ones(debug_release, text_tok):
    """The needle tests read logits at the scored positions only (tools/evaluate/heldout.py):
    the same argmax as the model's whole-row logits."""
    from tools.evaluate.needle import predictions
    from train.release import Release

    model = Release(debug_release).build_model(torch.device("cpu"))
    maker = PasskeyPrompts(text_tok)
    prompts = [maker.prompt(key, length=256, depth=0.5) for key in ("48213", "90017")]
    guessed = predictions(model, prompts, 256, text_tok.pad_id, torch.device("cpu"), 1)
    batch = pack_prompts(prompts, 256, text_tok.pad_id)
    with torch.no_grad():
        logits = model(**{k: v for k, v in batch.items() if k not in ("labels", "num_real_tokens")})
    full = logits.argmax(-1).numpy()
    for row, prompt in enumerate(prompts):
        cols = [place - 1 for place in range(*prompt.target)]
        assert (guessed[row, cols] == full[row, cols]).all()
        assert (np.delete(guessed[row], cols) == -1).all()
