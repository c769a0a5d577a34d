"""`earlyfuse-generate` on the release of a tiny real LM run: text and code continuations are valid
UTF-8 (checked on the console script's raw stdout bytes), greedy output is reproducible and seeded
sampling repeats, images are captioned from their visual-tokenizer codes, drawn images are PNGs
that decode at the grid's pixel size, and a JSONL batch runs every request, reporting bad ones."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from PIL import Image

from tools.generate import main as generate_main

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def release(debug_release) -> Path:
    return debug_release


@pytest.fixture(scope="module")
def image(tiny_corpus) -> Path:
    return sorted((tiny_corpus / "scenes").rglob("*.png"))[0]


def run_cli(*args) -> subprocess.CompletedProcess:
    return subprocess.run(
        [sys.executable, "-m", "tools.generate", *map(str, args)],
        cwd=ROOT,
        capture_output=True,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1", "LC_ALL": "C"},
        timeout=120,
    )


def test_text_continuation_is_valid_utf8_and_reproducible(release):
    # LC_ALL=C: a console that claims ASCII still gets UTF-8 bytes.
    p = run_cli(release, "--prompt", "Grüße, 世界 🙂 and", "--max-new-tokens", "24")
    assert p.returncode == 0, p.stderr.decode()[-2000:]
    text = p.stdout.decode("utf-8")  # strict: raises on invalid UTF-8
    assert text.endswith("\n") and len(text) > 1
    again = run_cli(release, "--prompt", "Grüße, 世界 🙂 and", "--max-new-tokens", "24")
    assert again.stdout == p.stdout  # greedy is deterministic


def test_code_prompt_sampling_repeats_with_its_seed(release, capsysbinary):
    args = [
        str(release),
        "--code",
        "--prompt",
        "def f(x):\n    return",
        "--temperature",
        "0.9",
        "--top-k",
        "50",
        "--top-p",
        "0.95",
        "--max-new-tokens",
        "16",
    ]
    outs = []
    for seed in ("1", "1"):
        assert generate_main([*args, "--seed", seed]) == 0
        outs.append(capsysbinary.readouterr().out)
    assert outs[0] == outs[1]
    outs[0].decode("utf-8")


def test_caption_an_image(release, image, capsysbinary):
    assert (
        generate_main([str(release), "--image", str(image), "--caption", "--max-new-tokens", "12"])
        == 0
    )
    capsysbinary.readouterr().out.decode("utf-8")
    assert (
        generate_main(
            [
                str(release),
                "--image",
                str(image),
                "--prompt",
                "A picture of",
                "--max-new-tokens",
                "8",
            ]
        )
        == 0
    )
    capsysbinary.readouterr().out.decode("utf-8")


def test_draw_writes_a_png_that_decodes(release, tmp_path, capsys):
    out = tmp_path / "fixed.png"
    assert (
        generate_main([str(release), "--draw", "a red square", "--out", str(out), "--size", "4x6"])
        == 0
    )
    factor = json.loads((release / "visual_tokenizer" / "config.json").read_text())["factor"]
    # both sizes height x width, as --size takes them (the pixels were said width x height)
    assert f"4x6 tokens, {4 * factor}x{6 * factor} pixels" in capsys.readouterr().out
    with Image.open(out) as im:
        im.load()
        assert im.format == "PNG" and im.size == (6 * factor, 4 * factor) and im.mode == "RGB"
    for name, kind in (("as.jpg", "JPEG"), ("no_suffix", "PNG")):  # the format its name asks for
        argv = [str(release), "--draw", "a red square", "--out", str(tmp_path / name)]
        assert generate_main([*argv, "--size", "4x6"]) == 0
        with Image.open(tmp_path / name) as im:
            assert im.format == kind
    free = tmp_path / "free.png"  # the model picks the grid (sampled), within --max-size
    assert (
        generate_main(
            [
                str(release),
                "--draw",
                "a cat",
                "--out",
                str(free),
                "--max-size",
                "5",
                "--temperature",
                "1.0",
                "--seed",
                "3",
            ]
        )
        == 0
    )
    with Image.open(free) as im:
        im.load()
        assert max(im.size) <= 5 * factor
    for size in ("99x99", "0x0"):  # named as the flag and the line say it
        argv = [str(release), "--draw", "x", "--out", str(free), "--size", size]
        assert generate_main(argv) == 2
        said = f"size {size}: each side 1 to 32 tokens, this model's largest grid"
        assert said in capsys.readouterr().err
    # a largest side of 0 is refused, not taken for "no cap" (it drew the default grid)
    with pytest.raises(SystemExit) as refused:
        generate_main([str(release), "--draw", "x", "--out", str(free), "--max-size", "0"])
    assert refused.value.code == 2
    assert "error: --max-size 0: a grid's side is at least 1 token" in capsys.readouterr().err
    # and one past the layout's grids is refused, not cut to them unsaid
    assert generate_main([str(release), "--draw", "x", "--out", str(free), "--max-size", "33"]) == 2
    assert "max_size 33: give 1 to 32, this model's largest grid" in capsys.readouterr().err
    # flags a request would ignore are refused, as --size without --draw is
    for flags, said in [
        (["--size", "4x4", "--max-size", "5"], "--size fixes the grid and --max-size lets"),
        (["--max-new-tokens", "9"], "--max-new-tokens is text's and captions'"),
        (["--code"], "--code is --prompt's"),
    ]:
        with pytest.raises(SystemExit):
            generate_main([str(release), "--draw", "x", "--out", str(free), *flags])
        assert said in capsys.readouterr().err
    # Classifier-free guidance: seeded draws repeat, and the guided picture is another one
    # (its codes come from other log-probabilities; model/generate.py tests the arithmetic).
    pictures = []
    for name, scale in (("plain", "1"), ("guided", "4"), ("guided_again", "4")):
        path = tmp_path / f"{name}.png"
        argv = ["--draw", "a red square", "--out", str(path), "--size", "4x4"]
        argv += ["--temperature", "1", "--seed", "5", "--guidance", scale]
        assert generate_main([str(release), *argv]) == 0
        with Image.open(path) as im:
            pictures.append(np.asarray(im.convert("RGB")))
    assert np.array_equal(pictures[1], pictures[2])
    assert not np.array_equal(pictures[0], pictures[1])


def test_draw_picks_the_grid_most_training_images_had(release, tmp_path, capsys):
    """Tokenize counts the image grids, the release carries them, --draw uses the most common."""
    grids = json.loads((release / "config.json").read_text())["tokenize"]["image_grids"]
    most = max(grids.items(), key=lambda item: (item[1], item[0]))[0]
    out = tmp_path / "default.png"
    assert generate_main([str(release), "--draw", "a red square", "--out", str(out)]) == 0
    said = capsys.readouterr().out
    assert f"{most} tokens" in said and "grid: the training images' most common" in said
    factor = json.loads((release / "visual_tokenizer" / "config.json").read_text())["factor"]
    height, width = map(int, most.split("x"))
    with Image.open(out) as im:
        assert im.size == (width * factor, height * factor)


def test_a_batch_line_that_is_not_utf8_or_out_of_range_fails_alone(release, tmp_path, capsys):
    """Before: one byte that is not UTF-8 refused the whole file (its good lines never ran,
    the message a byte offset); a seed past 64 bits read "Overflow when unpacking long long";
    a range error carried "ValueError:", the mark of a machine's fault; blank lines counted."""
    src = tmp_path / "req.jsonl"
    good = b'{"prompt": "a", "max_new_tokens": 2}'
    src.write_bytes(
        b"\xef\xbb\xbf"
        + good
        + b"\r\n\xff\xfe\n\n"
        + b'{"prompt": "a", "seed": 18446744073709551616, "temperature": 1}\n'
        + b'{"prompt": "a", "max_new_tokens": 0}\n'
        + b'{"draw": "a", "out": "x.png", "max_new_tokens": 5}\n'  # keys it would ignore
        + b'{"draw": "a", "out": "x.png", "code": true}\n'
    )
    assert generate_main([str(release), "--batch", str(src)]) == 3
    printed = capsys.readouterr()
    recs = [json.loads(line) for line in printed.out.splitlines()]
    assert [r["line"] for r in recs] == [1, 2, 4, 5, 6, 7] and "text" in recs[0]
    assert recs[1]["error"] == "not UTF-8 (byte 0xff at 0)"
    assert recs[2]["error"] == "seed 18446744073709551616: must fit in 64 bits"
    assert recs[3]["error"] == "max_new_tokens 0: must be at least 1"
    assert "takes no 'max_new_tokens'" in recs[4]["error"]
    assert "'code' is a prompt's" in recs[5]["error"]
    assert "5 of 6 request(s) failed" in printed.err


def test_batch_jsonl_runs_every_request(release, image, tmp_path):
    reqs = [
        {"id": "t", "prompt": "Once upon a time", "max_new_tokens": 8},
        {
            "id": "c",
            "prompt": "import os",
            "code": True,
            "temperature": 0.7,
            "seed": 2,
            "max_new_tokens": 8,
        },
        {"id": "i", "image": str(image), "caption": True, "max_new_tokens": 6},
        {"id": "d", "draw": "blue sky", "out": str(tmp_path / "sky.png"), "size": "3x3"},
        {"id": "bad", "prompt": "x", "colour": "red", "temprature": 0.5},
        {"id": "mixed", "draw": "sky", "prompt": "x", "out": str(tmp_path / "no.png")},
        {"id": "half", "prompt": "x", "max_new_tokens": 2.5},  # not cut to 2 unsaid
        {"id": "nocap", "image": str(image), "caption": False},  # was captioned
        {"id": "num", "prompt": 5},  # ran as the text "5"
        {"id": "again", "draw": "sea", "out": str(tmp_path / "sky.png"), "size": "3x3"},
    ]
    src = tmp_path / "req.jsonl"
    src.write_text("\n".join(json.dumps(r) for r in reqs) + "\nnot json\n", encoding="utf-8")
    out = tmp_path / "out.jsonl"
    assert (
        generate_main([str(release), "--batch", str(src), "--output", str(out)]) == 3
    )  # seven lines failed
    recs = [json.loads(line) for line in out.read_text(encoding="utf-8").splitlines()]
    ids = [r.get("id") for r in recs]
    assert ids == ["t", "c", "i", "d", "bad", "mixed", "half", "nocap", "num", "again", None]
    assert "'caption' can only be true" in recs[7]["error"]
    assert recs[8]["error"] == "prompt must be a JSON string, got 5"
    assert recs[9]["error"] == f"out {tmp_path / 'sky.png'}: line 4 wrote that file"
    assert [r.get("kind") for r in recs[:4]] == ["text", "text", "caption", "draw"]
    assert "unknown request keys ['colour', 'temprature']" in recs[4]["error"]
    assert "('temprature': did you mean 'temperature'?)" in recs[4]["error"] and "error" in recs[10]
    assert recs[6]["error"] == "max_new_tokens must be a whole number, got 2.5"
    assert "a draw request takes no 'prompt'" in recs[5]["error"]  # as the command line refuses
    with Image.open(tmp_path / "sky.png") as im:
        im.load()
    # A request's result does not depend on its neighbours.
    solo = tmp_path / "solo.jsonl"
    solo.write_text(json.dumps(reqs[1]) + "\n")
    assert (
        generate_main([str(release), "--batch", str(solo), "--output", str(tmp_path / "solo.out")])
        == 0
    )
    assert json.loads((tmp_path / "solo.out").read_text())["text"] == recs[1]["text"]


def test_a_prompt_past_the_training_rows_runs_with_a_note(release, capsys):
    """The debug run trained on rows of 256 tokens: a longer prompt still runs (RoPE has no
    length cap) and its continuation is printed, with a note on stderr that the positions past
    the row were never trained; a short prompt gets none."""
    assert generate_main([str(release), "--prompt", "a b c " * 200, "--max-new-tokens", "4"]) == 0
    printed = capsys.readouterr()
    assert printed.out.strip()
    assert "earlyfuse-generate: note: " in printed.err
    assert "new tokens pass the 256-token rows the model trained on" in printed.err
    assert generate_main([str(release), "--prompt", "a b c", "--max-new-tokens", "4"]) == 0
    assert "note" not in capsys.readouterr().err


@pytest.mark.parametrize(
    ("flag", "value", "refusal"),
    [
        ("--temperature", "-1", "temperature -1.0: must be 0 (greedy) or more, finite"),
        ("--temperature", "inf", "temperature inf: must be 0 (greedy) or more, finite"),
        ("--top-p", "0", "top_p 0.0: must be in (0, 1]"),
        ("--top-k", "-2", "top_k -2: must be 0 (off) or more"),
        ("--max-new-tokens", "0", "max_new_tokens 0: must be at least 1"),
    ],
)
def test_a_sampling_option_out_of_range_is_refused_by_name(release, capsys, flag, value, refusal):
    sampled = [] if flag == "--temperature" else ["--temperature", "1"]
    assert generate_main([str(release), "--prompt", "x", flag, value, *sampled]) == 2
    assert f"earlyfuse-generate: error: {refusal}" in capsys.readouterr().err


def test_top_k_or_top_p_without_a_temperature_is_refused(release, tmp_path, capsys):
    """Greedy (temperature 0, the default) ignored them and --seed with them: the same text for
    every seed, without a word."""
    for cut in (["--top-k", "5"], ["--top-p", "0.9"], ["--seed", "2"], ["--seed", "0"]):
        with pytest.raises(SystemExit) as refused:
            generate_main([str(release), "--prompt", "x", *cut])
        assert refused.value.code == 2
        assert "--top-k, --top-p and --seed shape a sample" in capsys.readouterr().err
    requests = tmp_path / "requests.jsonl"
    requests.write_text(
        '{"prompt": "x", "top_k": 5}\n{"prompt": "x", "top_k": 5, "temperature": 1}\n'
        '{"prompt": "x", "temperature": 0}\n'  # greedy on purpose beside --top-p's default: runs
        # a line's own seed at temperature 0 (ran greedy, the seed ignored); a caption without an
        # image (ran as text); code with no prompt (nothing marked code: plain text)
        '{"prompt": "x", "seed": 0}\n{"prompt": "hi", "caption": true}\n'
        '{"prompt": "", "code": true}\n'
    )
    argv = [str(release), "--batch", str(requests), "--max-new-tokens", "2", "--top-p", "0.9"]
    assert generate_main(argv) == 3
    records = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    first, second, third, seeded, caption, code = records
    assert "'top_k', 'top_p' and 'seed' shape a sample" in first["error"]
    assert "error" not in second and "error" not in third
    assert "'top_k', 'top_p' and 'seed' shape a sample" in seeded["error"]
    assert caption["error"] == "'caption' needs 'image' (the picture to caption)"
    assert code["error"].startswith("'code' needs a prompt (the code to continue)")
    with pytest.raises(SystemExit):
        generate_main([str(release), "--prompt", "", "--code"])
    assert "--code needs a --prompt (the code to continue)" in capsys.readouterr().err
    blank = tmp_path / "blank.jsonl"  # exit 0 and not a word: read as a batch lost
    blank.write_text("\n  \n")
    assert generate_main([str(release), "--batch", str(blank)]) == 0
    assert f"no request in {blank} (empty, or blank lines only)" in capsys.readouterr().err
    # "outdir/" means a folder: it wrote a file named outdir
    argv = [str(release), "--draw", "x", "--temperature", "1", "--out", f"{tmp_path / 'outdir'}/"]
    assert generate_main(argv) == 2
    assert f"{tmp_path / 'outdir'}/: a folder; give a file name" in capsys.readouterr().err
    assert not (tmp_path / "outdir").exists()
    utf16 = tmp_path / "utf16.jsonl"  # PowerShell's > writes UTF-16: one line for the file
    utf16.write_text('{"prompt": "x"}\n', encoding="utf-16")
    assert generate_main([str(release), "--batch", str(utf16)]) == 2
    assert "UTF-16 text (PowerShell's default): save it as UTF-8" in capsys.readouterr().err


@pytest.mark.parametrize("scale", ["inf", "nan"])
def test_a_guidance_that_is_not_a_finite_number_is_refused(release, tmp_path, capsys, scale):
    argv = [str(release), "--draw", "x", "--out", str(tmp_path / "x.png"), "--guidance", scale]
    assert generate_main([*argv, "--temperature", "1"]) == 2
    err = capsys.readouterr().err
    assert f"earlyfuse-generate: error: guidance {scale}: must be a finite number (1: off)" in err
    assert not (tmp_path / "x.png").exists()


def test_unusable_release_is_a_clear_error(release, tmp_path, capsys):
    """User errors are one line and exit code 2 (before: 1; a device torch does not know or this
    machine lacks was torch's traceback)."""
    import torch

    assert generate_main([str(tmp_path), "--prompt", "x"]) == 2
    assert "config.json: missing" in capsys.readouterr().err
    absent = f"cuda:{torch.cuda.device_count()}"  # one past this machine's GPUs
    for argv, said in [
        (["--device", "gpu0"], "--device 'gpu0': not a device (cpu, cuda, cuda:1, ...)"),
        (["--device", absent], f"--device {absent}: this machine has "),
        (
            ["--image", str(tmp_path / "nope.jpg"), "--caption"],
            f"{tmp_path / 'nope.jpg'}: cannot read the image",
        ),
    ]:
        assert generate_main([str(release), "--prompt", "x", *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"earlyfuse-generate: error: {said}") and err.count("\n") == 1


PEAK_RSS = (
    "import resource, sys; from tools.generate import main; rc = main(sys.argv[1:]); "
    "print('PEAK_KB', resource.getrusage(resource.RUSAGE_SELF).ru_maxrss, file=sys.stderr); "
    "sys.exit(rc)"
)


def batch_peak_kb(release, requests: list[dict], tmp_path, name: str, *extra) -> tuple[int, list]:
    """Run a --batch in its own process: (its peak RSS in KB, its result records)."""
    src, out = tmp_path / f"{name}.jsonl", tmp_path / f"{name}.out.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in requests))
    p = subprocess.run(
        [sys.executable, "-c", PEAK_RSS, str(release), "--batch", str(src), "--output", str(out)]
        + list(extra),
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={"PATH": "/usr/bin:/bin", "OMP_NUM_THREADS": "1"},
        timeout=300,
    )
    peak = int(p.stderr.split("PEAK_KB")[1].split()[0])
    return peak, [json.loads(line) for line in out.read_text().splitlines()]


def test_hostile_images_are_error_records_and_cost_no_memory(release, image, tmp_path):
    """Before: a 420 KB PNG of 12000x12000 pixels took the process to 1.45 GB, and Pillow's
    DecompressionBombError ended the whole batch after its line."""
    from factories import png_header_bomb, png_solid

    big = tmp_path / "big.png"  # 144 M pixels: Pillow only warns below 179 M and decodes it
    big.write_bytes(png_solid(12000, 12000))
    bomb = tmp_path / "bomb.png"  # 900 M pixels: Pillow raises DecompressionBombError
    bomb.write_bytes(png_header_bomb(30000, 30000))
    junk = tmp_path / "junk.png"
    junk.write_bytes(b"\x89PNG\r\n\x1a\n not really")
    ok = {"id": "ok", "image": str(image), "caption": True, "max_new_tokens": 2}
    base_kb, _ = batch_peak_kb(release, [ok], tmp_path, "base")
    reqs = [
        {"id": "big", "image": str(big), "caption": True},
        {"id": "bomb", "image": str(bomb), "caption": True},
        {"id": "junk", "image": str(junk), "caption": True},
        ok,
    ]
    peak_kb, recs = batch_peak_kb(release, reqs, tmp_path, "hostile")
    assert [r.get("id") for r in recs] == ["big", "bomb", "junk", "ok"]
    assert "12000x12000 = 144000000 pixels > limit 64000000" in recs[0]["error"]
    assert str(big) in recs[0]["error"]
    assert str(bomb) in recs[1]["error"] and str(junk) in recs[2]["error"]
    assert recs[3]["kind"] == "caption"
    assert peak_kb < base_kb + 100_000  # a decode of big.png alone is 432 MB of pixels
    # Above Pillow's own limit, with ours raised: its DecompressionBombError is a record too.
    src, out = tmp_path / "pillow.jsonl", tmp_path / "pillow.out.jsonl"
    src.write_text(json.dumps(reqs[1]) + "\n" + json.dumps(ok) + "\n")
    argv = [str(release), "--batch", str(src), "--output", str(out)]
    assert generate_main([*argv, "--max-image-pixels", "10000000000"]) == 3
    recs = [json.loads(line) for line in out.read_text().splitlines()]
    assert "over Pillow's own limit" in recs[0]["error"] and recs[1]["kind"] == "caption"


@pytest.mark.parametrize("capped_by", ["tokenize", "row"])
def test_images_are_encoded_within_tokenizes_block_cap(release, tmp_path, capped_by):
    """A release whose token data capped image blocks (tokenize --max-block-tokens), or whose
    rows were shorter than an image's block would be, encodes the images it captions as its
    training images were: made smaller until the block fits, aspect kept."""
    import shutil

    import torch

    from data.layout import image_block_len
    from tools.generate_requests import Generator
    from train.release import Release

    photo = tmp_path / "wide.png"
    rng = np.random.default_rng(0)
    Image.fromarray(rng.integers(0, 255, (96, 160, 3), np.uint8)).save(photo)
    capped = tmp_path / "capped"
    shutil.copytree(release, capped)
    config = json.loads((capped / "config.json").read_text())
    config["tokenize"]["max_block_tokens"] = 0
    config["packing"]["seq_len"] = 1 << 20
    (capped / "config.json").write_text(json.dumps(config))
    uncapped = Generator(Release(capped), torch.device("cpu")).encode_image(photo).shape
    cap = image_block_len(*uncapped) // 2
    if capped_by == "tokenize":
        config["tokenize"]["max_block_tokens"] = cap
    else:
        config["packing"]["seq_len"] = cap
    (capped / "config.json").write_text(json.dumps(config))
    height, width = Generator(Release(capped), torch.device("cpu")).encode_image(photo).shape
    assert image_block_len(height, width) <= cap < image_block_len(*uncapped)
    assert abs(width / height - uncapped[1] / uncapped[0]) < 0.5  # the aspect kept, about


def test_an_output_that_cannot_be_written_is_refused_before_sampling(release, tmp_path, capsys):
    """--out or --output naming a folder (or under a file) is one line naming the path, exit 2,
    before the release is loaded; a batch line drawing to a folder is an error record."""
    a_file = tmp_path / "a_file"
    a_file.write_text("")
    for argv in (
        ["--draw", "a red square", "--out", str(tmp_path)],
        ["--draw", "a red square", "--out", str(a_file / "x.png")],
        ["--batch", str(a_file), "--output", str(tmp_path)],
    ):
        assert generate_main([str(release), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("earlyfuse-generate: error: ") and "cannot write there" in err
        assert err.count("\n") == 1 and "Traceback" not in err
    src = tmp_path / "req.jsonl"
    src.write_text(json.dumps({"id": "d", "draw": "sky", "out": str(tmp_path), "size": "2x2"}))
    assert generate_main([str(release), "--batch", str(src)]) == 3
    rec = json.loads(capsys.readouterr().out)
    assert rec["id"] == "d" and rec["error"].startswith(f"{tmp_path}: cannot write there")


def test_a_requests_file_saved_with_a_bom_and_crlf_runs_every_line(
    release, tmp_path, capsys, monkeypatch
):
    """Windows editors start a UTF-8 file with a BOM and end lines with CRLF: the first request
    was an error record ("Unexpected UTF-8 BOM")."""
    import io

    lines = [
        {"id": "a", "prompt": "The", "max_new_tokens": 2},
        {"id": "b", "prompt": "x", "max_new_tokens": 2},
    ]
    text = "\ufeff" + "".join(json.dumps(r) + "\r\n" for r in lines)
    src = tmp_path / "requests.jsonl"
    src.write_bytes(text.encode("utf-8"))
    assert generate_main([str(release), "--batch", str(src)]) == 0
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()] == ["a", "b"]
    monkeypatch.setattr("sys.stdin", io.StringIO(text))
    assert generate_main([str(release), "--batch", "-"]) == 0
    assert [json.loads(x)["id"] for x in capsys.readouterr().out.splitlines()] == ["a", "b"]


def test_a_whole_number_of_a_request_is_a_json_number(release, tmp_path, capsys):
    """`true` was taken as 1 token, and `"max_size": "5"` or `2.5` failed deep in the sampler
    ("TypeError: can only concatenate str ..."): each is now refused by its key; 2.0 is 2."""
    out = str(tmp_path / "d.png")
    reqs = [
        {"id": "t", "prompt": "x", "max_new_tokens": True},
        {"id": "s", "draw": "x", "out": out, "max_size": "5"},
        {"id": "h", "draw": "x", "out": out, "max_size": 2.5},
        {"id": "k", "prompt": "x", "top_k": "3", "temperature": 1},
        {"id": "ok", "draw": "x", "out": out, "max_size": 2.0},
        # A real-valued key given a word: Python's "could not convert string to float: 'hot'"
        {"id": "w", "prompt": "x", "temperature": "hot"},
    ]
    src = tmp_path / "requests.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    assert generate_main([str(release), "--batch", str(src)]) == 3
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("error") for r in recs[:4]] == [
        "max_new_tokens must be a whole number, got True",
        "max_size must be a whole number, got '5'",
        "max_size must be a whole number, got 2.5",
        "top_k must be a whole number, got '3'",
    ]
    assert recs[4]["kind"] == "draw" and max(recs[4]["grid"]) <= 2
    assert recs[5]["error"] == "temperature must be a number, got 'hot'"


def test_batch_results_into_a_closed_pipe_end_quietly(release, tmp_path):
    """`earlyfuse-generate REL --batch FILE | head -1`: the reader leaving is no error (it was a
    BrokenPipeError traceback, exit 1), as for `earlyfuse-prep stats DIR | head`."""
    import os
    import signal

    src = tmp_path / "requests.jsonl"
    src.write_text(json.dumps({"id": "a", "prompt": "x", "max_new_tokens": 2}) + "\n")
    read_end, write_end = os.pipe()
    os.close(read_end)  # the reader is gone before the first result is written
    script = Path(sys.executable).parent / "earlyfuse-generate"
    proc = subprocess.run(
        [str(script), str(release), "--batch", str(src)],
        stdout=write_end,
        stderr=subprocess.PIPE,
        text=True,
        timeout=120,
    )
    os.close(write_end)
    assert proc.stderr == "" and proc.returncode == 128 + signal.SIGPIPE


def test_a_run_folder_or_a_visual_tokenizer_given_for_a_release_is_named(release, capsys, tmp_path):
    """The run folder beside the release, the release's visual_tokenizer/ and its Hugging Face
    export were "missing config.json" and "format None" alone."""
    run = release.parent / "run"
    assert generate_main([str(run), "--prompt", "x"]) == 2
    assert capsys.readouterr().err == (
        f"earlyfuse-generate: error: {run / 'config.json'}: missing; {run} is a run folder: "
        f"release it first (earlyfuse-convert release {run} OUT)\n"
    )
    assert generate_main([str(release / "visual_tokenizer"), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.endswith(": a visual tokenizer's folder, not a release\n")
    hf = tmp_path / "hf"  # what earlyfuse-convert hf writes: a config.json of model_type
    hf.mkdir()
    (hf / "config.json").write_text(json.dumps({"model_type": "qwen3"}))
    assert generate_main([str(hf), "--prompt", "x"]) == 2
    assert capsys.readouterr().err.endswith(
        ": a Hugging Face model folder (qwen3), not a release; give the release it was exported "
        "from\n"
    )


def test_batch_output_that_is_its_requests_file_is_refused(release, tmp_path, capsys):
    """`--batch req.jsonl --output req.jsonl` replaced the requests with the results."""
    src = tmp_path / "req.jsonl"
    text = json.dumps({"id": "a", "prompt": "x", "max_new_tokens": 2}) + "\n"
    src.write_text(text)
    with pytest.raises(SystemExit) as stop:
        generate_main(
            [
                str(release),
                "--batch",
                str(src),
                "--output",
                f"{tmp_path}/../{tmp_path.name}/req.jsonl",
            ]
        )
    assert stop.value.code == 2 and "is the --batch file" in capsys.readouterr().err
    assert src.read_text() == text


def test_a_refused_run_leaves_no_folder_behind(release, tmp_path, capsys):
    """The folders of --out and --output were made before the release was loaded: a run refused
    then (a path that is no release, a value out of range) left them behind, empty."""
    for argv in (
        [str(tmp_path / "no_release"), "--draw", "sky", "--out", str(tmp_path / "a/b/x.png")],
        [str(tmp_path / "no_release"), "--batch", "-", "--output", str(tmp_path / "a/r.jsonl")],
        [str(release), "--draw", "sky", "--out", str(tmp_path / "a/x.png"), "--top-p", "2"],
    ):
        assert generate_main(argv) == 2
        assert capsys.readouterr().err.startswith("earlyfuse-generate: error: ")
        assert list(tmp_path.iterdir()) == []
    # a run that goes through makes them as it writes its file
    argv = ["--draw", "sky", "--out", str(tmp_path / "a/b/x.png"), "--size", "2x2"]
    assert generate_main([str(release), *argv]) == 0 and (tmp_path / "a/b/x.png").is_file()
    src = tmp_path / "req.jsonl"
    src.write_text(json.dumps({"prompt": "x", "max_new_tokens": 1}) + "\n")
    assert (
        generate_main([str(release), "--batch", str(src), "--output", str(tmp_path / "c/r")]) == 0
    )
    assert json.loads((tmp_path / "c/r").read_text())["kind"] == "text"


def test_an_out_pillow_writes_no_image_under_is_refused_before_sampling(release, tmp_path, capsys):
    """`--out x.xyz` (or `.psd`, which Pillow only reads, or `.xbm`, 1-bit only) was a PNG under
    that name; a name without an ending is a PNG (test_draw_writes_a_png_that_decodes)."""
    for name in ("x.xyz", "x.psd", "x.xbm"):
        out = tmp_path / name
        assert generate_main([str(release), "--draw", "sky", "--out", str(out)]) == 2
        err = capsys.readouterr().err
        assert err.startswith(f"earlyfuse-generate: error: {out}: not an image name Pillow writes")
        assert " .jpg " in err and " .png " in err and ".psd" not in err.split(";")[1]
        assert err.count("\n") == 1 and not out.exists()
    src = tmp_path / "req.jsonl"
    src.write_text(json.dumps({"id": "d", "draw": "sky", "out": str(tmp_path / "d.xyz")}))
    assert generate_main([str(release), "--batch", str(src)]) == 3
    assert "not an image name Pillow writes" in json.loads(capsys.readouterr().out)["error"]
    assert generate_main([str(release), "--draw", "sky", "--out", str(tmp_path / "d.JPG")]) == 0
    assert Image.open(tmp_path / "d.JPG").format == "JPEG"


def test_batch_on_stdin_answers_on_stdout(release, tmp_path, capsys, monkeypatch):
    """`--batch - --output -` was refused as the same file: stdin and stdout are two."""
    import io

    monkeypatch.chdir(tmp_path)
    monkeypatch.setattr("sys.stdin", io.StringIO(json.dumps({"id": "a", "prompt": "x"}) + "\n"))
    assert (
        generate_main([str(release), "--batch", "-", "--output", "-", "--max-new-tokens", "2"]) == 0
    )
    assert json.loads(capsys.readouterr().out)["id"] == "a"
    assert list(tmp_path.iterdir()) == []  # no file named "-"


def test_a_folder_that_takes_no_file_is_refused_before_sampling(release, capsys):
    """Root's permission bits say /proc may be written: the drawing was sampled, then failed."""
    for argv in (
        ["--draw", "sky", "--out", "/proc/x.png"],
        ["--batch", "-", "--output", "/proc/r"],
    ):
        assert generate_main([str(release), *argv]) == 2
        err = capsys.readouterr().err
        assert err.startswith("earlyfuse-generate: error: /proc/") and "cannot write there" in err
        assert err.count("\n") == 1


@pytest.mark.parametrize(
    "argv", [["--prompt", "x", "--output", "r.jsonl"], ["--prompt", "x", "--out", "x.png"]]
)
def test_an_output_flag_of_another_request_is_refused(release, tmp_path, capsys, argv):
    """`--prompt x --output r.jsonl` printed the text and wrote no file (--output is --batch's),
    as `--prompt x --out x.png` (--draw's) did."""
    with pytest.raises(SystemExit) as stop:
        generate_main([str(release), *(str(tmp_path / a) if "." in a else a for a in argv)])
    assert stop.value.code == 2 and "go together; --output JSONL needs --batch" in (
        capsys.readouterr().err
    )


@pytest.mark.parametrize(
    "argv",
    [
        ["--prompt", "x", "--size", "2x2"],
        ["--prompt", "x", "--max-size", "3"],
        ["--prompt", "x", "--guidance", "3"],
        ["--image", "x.png", "--caption", "--guidance", "0"],
        ["--batch", "r.jsonl", "--size", "2x2"],
    ],
)
def test_a_draw_option_given_to_another_request_is_refused(release, tmp_path, capsys, argv):
    """`--prompt x --size 2x2` continued the text and ignored the size, as `--guidance 3` did on
    a caption; a batch's lines carry their own sizes, so `--batch --size` ignored it too."""
    with pytest.raises(SystemExit) as stop:
        generate_main([str(release), *(str(tmp_path / a) if "." in a else a for a in argv)])
    assert stop.value.code == 2 and "are --draw's (--guidance: or --batch's)" in (
        capsys.readouterr().err
    )


def test_a_draw_key_on_another_batch_line_is_its_error(release, tmp_path, capsys):
    reqs = [
        {"id": "s", "prompt": "x", "size": "2x2", "max_new_tokens": 2},
        {"id": "g", "prompt": "x", "guidance": 3, "max_new_tokens": 2},
        {"id": "o", "prompt": "x", "out": str(tmp_path / "a.png"), "max_new_tokens": 2},
        {"id": "ok", "prompt": "x", "max_new_tokens": 2},
    ]
    src = tmp_path / "requests.jsonl"
    src.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    assert generate_main([str(release), "--batch", str(src), "--guidance", "2"]) == 3
    recs = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert [r.get("error") for r in recs] == [
        "'size' is a draw request's key (this line draws nothing)",
        "'guidance' is a draw request's key (this line draws nothing)",
        "'out' is a draw request's key (this line draws nothing)",
        None,
    ]


def test_a_batch_line_the_machine_fails_exits_1_not_3(release, tmp_path, capsys, monkeypatch):
    """A line's own error (a bad value, a missing image) is exit code 3, the batch done with its
    failures listed; one the machine causes (out of memory, a full disk) is 1, as for any command."""
    from tools.generate_requests import Generator

    real = Generator.request

    def request(self, req, defaults):
        if req.get("prompt") == "boom":
            raise MemoryError("out of memory on the device")
        return real(self, req, defaults)

    monkeypatch.setattr(Generator, "request", request)
    src = tmp_path / "req.jsonl"
    lines = [{"prompt": "a", "max_new_tokens": 2}, {"prompt": "b", "top_p": 7}]
    src.write_text("\n".join(map(json.dumps, lines)) + "\n")
    assert generate_main([str(release), "--batch", str(src)]) == 3
    src.write_text(src.read_text() + json.dumps({"prompt": "boom"}) + "\n")
    assert generate_main([str(release), "--batch", str(src)]) == 1
    out = [json.loads(line) for line in capsys.readouterr().out.splitlines()]
    assert out[-1]["error"] == "MemoryError: out of memory on the device" and "text" in out[-3]
