"""`earlyfuse-convert hf`: a release of a real debug run becomes a transformers Qwen3 model whose
logits match ours on a mixed-modality batch (fp32, max |diff| <= 1e-4), whose tokenizer encodes
text to our ids, and a model with a feature Qwen3 lacks is refused with the feature named."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch

from data.loader import SourceConfig
from data.loader.table_load import load_table
from tools.convert import main as convert_main
from train.release import Release

transformers = pytest.importorskip("transformers")


@pytest.fixture(scope="module")
def release(debug_release):
    return debug_release


def documents(tokens, source: str, n: int, length: int) -> list[np.ndarray]:
    import io

    t = load_table(SourceConfig(name=source, shards=[str(tokens / source)]))
    out = []
    for i in range(n):
        with open(t.shards[t.shard[i]], "rb") as f:
            f.seek(t.ids_at[i][0])
            out.append(np.load(io.BytesIO(f.read(t.ids_at[i][1])), allow_pickle=False)[:length])
    return out


def test_hf_export_gives_our_logits_on_text_images_and_video(
    release, tiny_tokens, tmp_path, capsys
):
    out = tmp_path / "hf"
    assert convert_main(["hf", str(release), str(out)]) == 0
    assert "Qwen3ForCausalLM" in capsys.readouterr().out
    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    assert type(hf).__name__ == "Qwen3ForCausalLM"
    rel = Release(release)
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
    text = "def f(x):\n    return x  # Grüße 🙂"
    assert tok.encode(text, add_special_tokens=False) == rel.text_tokenizer().encode(text)
    assert (tok.bos_token_id, tok.eos_token_id, tok.pad_token_id) == (1, 2, 0)
    assert json.loads((out / "vocab_layout.json").read_text()) == lay.to_dict()


def test_a_feature_qwen3_lacks_is_refused_by_name(release, tmp_path, capsys):
    bad = tmp_path / "rel"
    shutil.copytree(release, bad)
    cfg = json.loads((bad / "config.json").read_text())
    cfg["model"]["rope"]["mrope_sections"] = [4, 2, 2]
    cfg["model"]["grid_embedding"] = True
    (bad / "config.json").write_text(json.dumps(cfg))
    assert convert_main(["hf", str(bad), str(tmp_path / "hf")]) == 1
    err = capsys.readouterr().err
    assert "does not map onto Qwen3" in err and "rope.mrope_sections=[4, 2, 2] (M-RoPE" in err
    assert "grid_embedding=true (row/column embeddings" in err
    assert not (tmp_path / "hf").exists()


def test_hf_greedy_text_generation_equals_earlyfuse_generate(release, tmp_path):
    """AutoTokenizer starts the prompt with <|bos|>, generation_config.json suppresses every
    non-text id, so transformers' greedy generate gives earlyfuse-generate's tokens."""
    from tools.generate_requests import Generator

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
        want = ours._run(
            [ours.text.bos_id, *ours.text.encode(prompt)],
            [0] * ids.shape[1],
            constraint=ours._text_constraint(),
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
