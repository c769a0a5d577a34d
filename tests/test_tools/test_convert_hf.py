"""`earlyfuse-convert hf`: a release of a real debug run becomes a transformers Qwen3 model whose
logits match ours on a mixed-modality batch (fp32, max |diff| <= 1e-4), whose tokenizer encodes
text to our ids, and a model with a feature Qwen3 lacks is refused with the feature named. A
model with row/column embeddings of image codes exports as Qwen3 plus remote code
(tools/hf_remote/modeling_earlyfuse.py) with our logits and our greedy tokens."""

from __future__ import annotations

import json
import shutil
from typing import Any

import numpy as np
import pytest
import torch

from data.loader import SourceConfig
from data.loader.table_load import load_table
from data.tokenize.docs import block_flags
from tools.convert import main as convert_main
from train.release import Release

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def release(debug_release):
    return debug_release


def test_a_bf16_release_exports_in_bf16(release, tmp_path):
    """The release's own precision: a bf16 release was exported as fp32, twice its size."""
    from safetensors import safe_open

    from tools.convert_release import make_release

    half = tmp_path / "bf16"
    make_release(release.parent / "run", half, dtype="bf16", log=lambda *a: None)
    assert convert_main(["hf", str(half), str(tmp_path / "hf")]) == 0
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    assert config.get("dtype", config.get("torch_dtype")) == "bfloat16", config
    # loaded as it is stored it computes in bf16, and its greedy tokens part from ours
    assert (
        "`dtype=torch.float32` in `from_pretrained`" in (tmp_path / "hf" / "README.md").read_text()
    )
    with safe_open(str(tmp_path / "hf" / "model.safetensors"), "pt") as f:
        assert {f.get_slice(k).get_dtype() for k in f.keys()} == {"BF16"}
    bf16 = Release(half).state_dict(dtype=None)["tok_embeddings.weight"]
    hf = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "hf")
    assert torch.equal(hf.model.embed_tokens.weight.data, bf16)


def documents(tokens, source: str, n: int, length: int) -> list[np.ndarray]:
    import io

    t = load_table(SourceConfig(name=source, shards=[str(tokens / source)]))
    out = []
    for i in range(n):
        offset, size = t.locate_members(i)[5:7]  # of the ids member
        with open(t.shards[t.shard_of(i)], "rb") as f:
            f.seek(offset)
            out.append(np.load(io.BytesIO(f.read(size)), allow_pickle=False)[:length])
    return out


def test_hf_export_gives_our_logits_on_text_images_and_video(
    release, tiny_tokens, tmp_path, capsys
):
    out = tmp_path / "hf"
    assert convert_main(["hf", str(release), str(out)]) == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    # Without grid embeddings: plain Qwen3, no remote code.
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "qwen3" and "auto_map" not in config
    # The context length serving tools read (vLLM's max_model_len): the rows it trained on.
    assert config["max_position_embeddings"] == 256
    assert not list(out.glob("*.py"))
    readme = (out / "README.md").read_text()
    assert "trust_remote_code" not in readme
    # The rows the run trained on (experiment=debug, train.micro_batch=2), said beside the model.
    assert "packed rows of 256 tokens, 2 rows a micro-batch, text split across rows" in readme
    rel = Release(release)
    # ... and the block budgets its images and videos were tokenized with
    assert "--image-max-pixels" in block_flags(rel.config["tokenize"])
    assert f"tokenized by `{rel.tokenize_command()}` (the release" in readme
    ours = rel.build_model().eval()
    lay = rel.layout
    # One document per row (HF has no document masking): captioned scenes and clips, cut to 96 tokens.
    rows = documents(tiny_tokens, "scenes", 2, 96) + documents(tiny_tokens, "clips", 2, 96)
    ids = torch.tensor(np.stack(rows), dtype=torch.long)
    assert (ids >= lay.visual_offset).any() and (ids < lay.text_size).any()  # mixed: codes and text
    with torch.no_grad():
        a = ours(ids)
        b = hf(input_ids=ids).logits.float()
    diff = (a - b).abs().max().item()
    assert diff <= 1e-4, diff
    # The tokenizer: our ids for text, the specials named.
    tok = transformers.AutoTokenizer.from_pretrained(out)
    text = "def f(x):\n    return x  # Grüße 🙂 <|eos|> written in the text stays text"
    assert tok.encode(text, add_special_tokens=False) == rel.text_tokenizer().encode(text)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert json.loads((out / "vocab_layout.json").read_text()) == lay.to_dict()


def test_the_export_names_its_rope_base_and_tokenizer_as_transformers_4x_reads_them(
    release, tiny_tokens, tmp_path
):
    """A model trained at RoPE base 500,000 (the GPU presets'): transformers 4.x reads the base
    from ``rope_theta`` at the top of config.json and, without it, loaded the export at 10,000
    with other logits, silently; 5.x saves ``rope_parameters`` only. Both names are written,
    and the model that 5.x loads from them still gives our logits."""
    rel_dir = tmp_path / "rel"
    shutil.copytree(release, rel_dir)
    cfg = json.loads((rel_dir / "config.json").read_text())
    cfg["model"]["rope"]["theta"] = 500000.0
    (rel_dir / "config.json").write_text(json.dumps(cfg))
    out = tmp_path / "hf"
    assert convert_main(["hf", str(rel_dir), str(out)]) == 0
    config = json.loads((out / "config.json").read_text())
    assert config["rope_theta"] == 500000.0 and config["torch_dtype"] == "float32"
    tok_config = json.loads((out / "tokenizer_config.json").read_text())
    assert tok_config["tokenizer_class"] == "PreTrainedTokenizerFast"
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    ours = Release(rel_dir).build_model().eval()
    ids = torch.tensor(np.stack(documents(tiny_tokens, "text", 2, 128)), dtype=torch.long)
    with torch.no_grad():
        assert (ours(ids) - hf(input_ids=ids).logits).abs().max().item() <= 1e-4
    assert transformers.AutoTokenizer.from_pretrained(out).bos_token_id == 1


def test_a_feature_qwen3_lacks_is_refused_by_name(release, tmp_path, capsys):
    bad = tmp_path / "rel"
    shutil.copytree(release, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model"]["rope"]["mrope_sections"] = [4, 2, 2]
    cfg["model"]["reorder_norm"] = True
    cfg["model"]["attention"].update(local_window=4, global_every=2)
    cfg["model"]["rope"]["local_theta"] = 100.0
    (bad / "config.json").write_text(json.dumps(cfg))
    assert convert_main(["hf", str(bad), str(tmp_path / "hf")]) == 2
    err = capsys.readouterr().err
    assert "does not map onto Qwen3" in err and "rope.mrope_sections=[4, 2, 2] (M-RoPE" in err
    assert "reorder_norm=true" in err and "grid_embedding" not in err  # grids export (remote code)
    assert "attention.local_window=4 with attention.global_every=2 (local/global" in err
    assert "rope.local_theta=100.0 (a RoPE base per layer kind" in err
    assert not (tmp_path / "hf").exists()


def test_a_file_in_the_way_is_refused_or_replaced_with_force(release, tmp_path, capsys):
    out = tmp_path / "hf"
    out.write_text("not a folder")
    assert convert_main(["hf", str(release), str(out)]) == 2
    assert f"{out}: a file; choose another folder or pass --force to replace it" in (
        capsys.readouterr().err
    )
    assert convert_main(["hf", str(release), str(out), "--force"]) == 0
    assert (out / "config.json").is_file()


def test_weights_cut_short_by_a_file_size_limit_are_one_line(release, tmp_path):
    """safetensors' writer reports a full disk or a file-size limit as its own error ("I/O
    error: File too large (os error 27)"), not an OSError: before, a 26-line traceback. ``ulimit
    -f`` in a subprocess stands in for the full disk."""
    import signal
    import subprocess
    import sys

    def limit_file_size() -> None:
        import resource

        signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
        resource.setrlimit(resource.RLIMIT_FSIZE, (65536, 65536))

    out = tmp_path / "hf"
    run = subprocess.run(
        [sys.executable, "-m", "tools.convert", "hf", str(release), str(out)],
        capture_output=True,
        text=True,
        preexec_fn=limit_file_size,
    )
    assert run.returncode == 1 and "Traceback" not in run.stderr, run.stderr
    assert (
        f"earlyfuse-convert hf: error: {out} could not be written: a file reached the file-size "
        "limit of this process (ulimit -f: 65536 bytes); nothing was changed there"
    ) in run.stderr.splitlines()
    assert list(tmp_path.iterdir()) == []


def test_a_write_that_fails_midway_leaves_no_half_made_export(
    release, tmp_path, monkeypatch, capsys
):
    """Before: the export was written into OUT itself, so a failure after the weights (a full disk,
    Ctrl-C) left a folder that looks like a model, and --force deleted the old export first. Now
    it is built in OUT.partial and moved into place whole; a failure leaves OUT as it was."""
    import errno
    import os

    import tools.convert_hf

    def full_disk(*_):
        raise OSError(errno.ENOSPC, "No space left on device")

    def interrupted(*_):
        raise KeyboardInterrupt

    out = tmp_path / "hf"
    monkeypatch.setattr(tools.convert_hf, "readme", full_disk)  # the last file, after the weights
    assert convert_main(["hf", str(release), str(out)]) == 1
    assert f"{out} could not be written: the disk is full" in capsys.readouterr().err
    assert list(tmp_path.iterdir()) == []  # neither OUT nor OUT.partial
    monkeypatch.undo()
    assert convert_main(["hf", str(release), str(out)]) == 0
    files = {p: p.read_bytes() for p in out.rglob("*") if p.is_file()}
    assert out / "model.safetensors" in files and out / "README.md" in files
    # Readable as the umask allows, as a release's files are (safetensors writes 0600)
    mask = os.umask(0)
    os.umask(mask)
    assert {p.stat().st_mode & 0o777 for p in files} == {0o666 & ~mask}
    monkeypatch.setattr(tools.convert_hf, "readme", interrupted)
    assert convert_main(["hf", str(release), str(out), "--force"]) == 130  # Ctrl-C: one line
    assert list(tmp_path.iterdir()) == [out]
    assert {p: p.read_bytes() for p in out.rglob("*") if p.is_file()} == files


def test_hf_greedy_text_generation_equals_earlyfuse_generate(release, tmp_path):
    """AutoTokenizer starts the prompt with <|bos|>, generation_config.json suppresses every
    non-text id, so transformers' greedy generate gives earlyfuse-generate's tokens."""
    from tools.generate_requests import Generator, TextOnly, sample

    out = tmp_path / "hf"
    assert convert_main(["hf", str(release), str(out)]) == 0
    tok = transformers.AutoTokenizer.from_pretrained(out)
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    rel = Release(release)
    ours = Generator(rel, torch.device("cpu"))
    lay = rel.layout
    for prompt in ("The cat sat on", "def add(a, b):"):
        ids = tok(prompt, return_tensors="pt").input_ids
        assert ids[0, 0].item() == ours.text.bos_id
        assert ids[0, 1:].tolist() == ours.text.encode(prompt)
        got = hf.generate(ids, max_new_tokens=30)[0, ids.shape[1] :].tolist()
        want = sample(
            ours,
            [ours.text.bos_id, *ours.text.encode(prompt)],
            [0] * ids.shape[1],
            constraint=TextOnly(ours),
            stop=[ours.text.eos_id],
            max_new_tokens=30,
            temperature=0.0,
            top_k=0,
            top_p=1.0,
            seed=0,
        )
        assert got == want and len(got) >= 5, (got, want)
        assert all(t < lay.text_size and t not in (tok.pad_token_id, tok.bos_token_id) for t in got)
    gen = json.loads((out / "generation_config.json").read_text())
    assert (gen["bos_token_id"], gen["eos_token_id"], gen["pad_token_id"]) == (1, 2, 0)
    assert set(gen["suppress_tokens"]) == {0, 1, *range(lay.text_size, lay.size)}
    assert "suppress_tokens=None" in (out / "README.md").read_text()


# --- grid embeddings: Qwen3 + remote code ------------------------------------------------------


@pytest.fixture(scope="module")
def grid_export(tiny_tokens, tmp_path_factory):
    """Four steps of the debug LM with row/column embeddings of image codes, released and
    exported (the remote-code path)."""
    from trainrun import release_debug_run

    root = tmp_path_factory.mktemp("grid")
    release_debug_run(tiny_tokens, root, ("scenes", "clips"), "model.grid_embedding=true")
    assert convert_main(["hf", str(root / "rel"), str(root / "hf")]) == 0
    return root / "rel", root / "hf"


def tracked(ids: list[int], layout) -> tuple[torch.Tensor, torch.Tensor]:
    """(position_thw [1, T, 3], modality [1, T]) of one sequence, as earlyfuse-generate places it."""
    from model.rope import LayoutTracker

    tracker = LayoutTracker(layout)
    pushed = [tracker.push(token) for token in ids]
    thw = torch.tensor([position for position, _ in pushed], dtype=torch.long)
    return thw[None], torch.tensor([[int(modality) for _, modality in pushed]])


def image_block(doc: np.ndarray, layout) -> list[int]:
    """The first image block (<boi> .. <eoi>) of a document."""
    ids = doc.tolist()
    start = ids.index(layout.structure_id("<boi>"))
    return ids[start : ids.index(layout.structure_id("<eoi>"), start) + 1]


def test_remote_code_places_codes_where_our_layout_tracker_does(grid_export):
    """Rows and columns from the whole sequence, vectorised, equal h - t and w - t of our (t, h,
    w) positions for every image code, also in malformed streams (a <frame> inside an image, an
    image reopened before it closed, stray codes, rows longer than declared); video codes get
    none."""
    import random

    from data.layout import image_tokens, video_tokens
    from data.vocab import Modality

    rel, out = grid_export
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, trust_remote_code=True)
    remote = __import__(type(hf).__module__, fromlist=["image_grid_of"])
    layout = Release(rel).vocab_layout
    sid = layout.structure_id
    markers = [sid(name) for name in ("<boi>", "<eoi>", "<eol>", "<bov>", "<eov>", "<frame>")]
    pool = (
        markers * 3 + [sid("<h=3>"), sid("<w=2>"), 5, 9] + [layout.code_id(c) for c in range(8)] * 4
    )
    rng = random.Random(0)

    def block() -> list[int]:  # a well-formed image or video block of a random grid
        height, width = rng.randint(1, 6), rng.randint(1, 6)
        if rng.random() < 0.3:
            codes = np.array(
                [[[rng.randrange(8) for _ in range(width)] for _ in range(height)]] * 2
            )
            return video_tokens(codes, layout)[0].tolist()
        codes = np.array([[rng.randrange(8) for _ in range(width)] for _ in range(height)])
        return image_tokens(codes, layout)[0].tolist()

    streams = []
    for _ in range(4):  # well-formed blocks, and noise between them and inside them
        stream: list[int] = []
        while len(stream) < 400:
            stream += block() if rng.random() < 0.5 else []
            stream += [rng.choice(pool) for _ in range(rng.randint(0, 6))]
        streams.append(stream[:400])
    ids = torch.tensor(streams)
    grid = remote.image_grid_of(ids, hf.config.earlyfuse_grid)
    last = layout.max_grid - 1
    for row, stream in enumerate(streams):
        thw, modality = tracked(stream, layout)
        image = modality[0] == int(Modality.IMAGE)
        want_rows = torch.where(image, (thw[0, :, 1] - thw[0, :, 0]).clamp(0, last), 0)
        want_cols = torch.where(image, (thw[0, :, 2] - thw[0, :, 0]).clamp(0, last), 0)
        assert grid[row, :, 2].bool().tolist() == image.tolist()
        assert grid[row, :, 0].tolist() == want_rows.tolist()
        assert grid[row, :, 1].tolist() == want_cols.tolist()
        assert (modality == int(Modality.VIDEO)).any()  # video codes were there, and left out
    assert (grid[..., 0] >= 4).any() and (grid[..., 1] >= 4).any()


def test_grid_embeddings_export_as_remote_code_with_our_logits(grid_export, tiny_tokens):
    rel_path, out = grid_export
    assert (out / "modeling_earlyfuse.py").is_file()
    config = json.loads((out / "config.json").read_text())
    assert config["model_type"] == "earlyfuse_qwen3"
    assert config["architectures"] == ["EarlyfuseForCausalLM"]
    assert config["auto_map"]["AutoModelForCausalLM"] == "modeling_earlyfuse.EarlyfuseForCausalLM"
    assert 'from_pretrained("OUT", trust_remote_code=True)' in (out / "README.md").read_text()
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, dtype=torch.float32
    ).eval()
    # Loaded from the export folder's copy, not from earlyfuse's source tree.
    assert type(hf).__name__ == "EarlyfuseForCausalLM"
    assert type(hf).__module__.startswith("transformers_modules")
    rel = Release(rel_path)
    ours = rel.build_model().eval()
    layout = rel.vocab_layout
    scenes = documents(tiny_tokens, "scenes", 3, 400)
    clip = documents(tiny_tokens, "clips", 1, 160)[0].tolist()
    text = scenes[0].tolist()[: scenes[0].tolist().index(layout.structure_id("<boi>"))]
    first, second = image_block(scenes[1], layout), image_block(scenes[2], layout)
    sequences = {
        "text, an image, text": scenes[0].tolist(),
        "two images": [*text, *first, *text[1:6], *second, *text[1:4]],
        "a video": clip,
    }
    assert scenes[0].tolist().index(layout.structure_id("<eoi>")) < len(scenes[0]) - 3
    zeroed = rel.build_model().eval()
    with torch.no_grad():
        assert zeroed.grid_rows is not None and zeroed.grid_cols is not None
        zeroed.grid_rows.weight.zero_()
        zeroed.grid_cols.weight.zero_()
    for name, sequence in sequences.items():
        ids = torch.tensor([sequence])
        thw, modality = tracked(sequence, layout)
        with torch.no_grad():
            want = ours(ids, position_thw=thw, modality=modality)
            got = hf(input_ids=ids).logits.float()
            without_grid = zeroed(ids, position_thw=thw, modality=modality)
            swapped = hf(input_ids=ids, image_grid=hf_grid(hf, ids)[..., [1, 0, 2]]).logits
        diff = (want - got).abs().max().item()
        assert diff <= 1e-4, (name, diff)
        if name == "a video":  # video codes get no grid embedding, in both
            assert (want - without_grid).abs().max().item() == 0.0
        else:  # the grid tables matter here, and rows are not columns
            assert (want - without_grid).abs().max().item() > 1e-2, name
            assert (want - swapped).abs().max().item() > 1e-2, name


def hf_grid(hf, ids: torch.Tensor) -> torch.Tensor:
    remote = __import__(type(hf).__module__, fromlist=["image_grid_of"])
    return remote.image_grid_of(ids, hf.config.earlyfuse_grid)


def test_grid_model_generates_from_what_its_tokenizer_returns(grid_export):
    """``model.generate(**tok(text, return_tensors="pt"))``, the usual call, passes the
    tokenizer's attention_mask along and gives the tokens of the ids alone."""
    _, out = grid_export
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, dtype=torch.float32
    ).eval()
    tok = transformers.AutoTokenizer.from_pretrained(out, trust_remote_code=True)
    encoded = tok("a red circle in the top left", return_tensors="pt")
    assert set(encoded) >= {"input_ids", "attention_mask"}
    got = hf.generate(**encoded, max_new_tokens=8)
    assert torch.equal(got, hf.generate(encoded["input_ids"], max_new_tokens=8))


def test_grid_model_greedy_generation_equals_earlyfuse_generate(grid_export, tiny_tokens):
    """A caption after an image (text-only, the export's generation_config) and a continuation
    inside an open image (every id allowed: codes generated against the KV cache get their rows
    and columns from the whole history) are our generate's tokens."""
    from data.vocab import Modality
    from tools.generate_requests import Generator, TextOnly, sample

    rel_path, out = grid_export
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        out, trust_remote_code=True, dtype=torch.float32
    ).eval()
    rel = Release(rel_path)
    ours = Generator(rel, torch.device("cpu"))
    layout, bos, eos = rel.vocab_layout, ours.text.bos_id, ours.text.eos_id
    scenes = documents(tiny_tokens, "scenes", 2, 400)
    first, second = image_block(scenes[0], layout), image_block(scenes[1], layout)
    sampling: dict[str, Any] = dict(temperature=0.0, top_k=0, top_p=1.0, seed=0, stop=[eos])
    for prompt in ([bos, *first], [bos, *first, *second]):
        _, modality = tracked(prompt, layout)
        ids = torch.tensor([prompt])
        got = hf.generate(ids, max_new_tokens=12)[0, len(prompt) :].tolist()
        want = sample(
            ours,
            prompt,
            modality[0].tolist(),
            constraint=TextOnly(ours),
            max_new_tokens=12,
            **sampling,
        )
        assert got == want and all(token < layout.text_size for token in got), (got, want)
    # Stop half way through the second row of the second image: codes and <eol>s come next.
    width = second[2] - layout.structure_id("<w=1>") + 1
    prompt = [bos, *first, *second[: 3 + width + 1 + width // 2]]
    _, modality = tracked(prompt, layout)
    ids = torch.tensor([prompt])
    result = hf.generate(
        ids,
        max_new_tokens=24,
        suppress_tokens=None,
        return_dict_in_generate=True,
        output_logits=True,
    )
    got = result.sequences[0, len(prompt) :].tolist()
    want = sample(
        ours, prompt, modality[0].tolist(), constraint=None, max_new_tokens=24, **sampling
    )
    assert got == want, (got, want)
    assert sum(layout.is_code(token) for token in got) >= 4, got  # it drew codes
    # Each step's logits (the KV-cached path) are our model's over the whole sequence.
    full = result.sequences
    thw, modality = tracked(full[0].tolist(), layout)
    with torch.no_grad():
        whole = ours.model(full, position_thw=thw, modality=modality)[0, len(prompt) - 1 : -1]
    steps = torch.stack(result.logits, dim=1)[0].float()
    assert (whole - steps).abs().max().item() <= 1e-4
    # By hand with a cache, codes without the history's image_grid are refused, not misplaced.
    with torch.no_grad():
        first = hf(input_ids=ids[:, :-3], use_cache=True)
        cache = getattr(first, "cache", None) or first.past_key_values
        with pytest.raises(ValueError, match="image codes after a KV cache"):
            hf(input_ids=ids[:, -3:], past_key_values=cache)
    assert int(Modality.IMAGE) in modality[0].tolist()
