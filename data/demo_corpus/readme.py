"""`OUT/README.md`: what the corpus holds, where each part came from, under which licence."""

from __future__ import annotations

import pathlib
import platform

from ._common import write_text
from .photos import Photo

MARKER = "# earlyfuse demo corpus"  # first line; `build` only ever replaces a folder that starts so


def render(summary: dict, photos: list[Photo]) -> str:
    p = summary["parts"]
    photo_lines = "\n".join(f"- `{ph.file}`: {ph.source}" for ph in photos)
    return f"""{MARKER}

A small, real, offline multimodal corpus built by `earlyfuse-prep demo-corpus`
(seed {summary["seed"]}, scale {summary["scale"]}, split {summary.get("split", "all")},
Python {platform.python_version()}).
Nothing was downloaded: every part comes from files that Python and the `[demo]` extra
install, or is generated. The same seed and package versions give byte-identical files.
Split `train` and split `heldout` share no real material (modules, docstrings, help topics,
photos and the clips made from them, digits: divided by a fixed hash of each item's group);
split `all` has all of it.

| part | ingest as | contents |
|---|---|---|
| `code/` | `code:OUT/code` | {p["code"]["files"]} Python standard-library modules, copied unchanged (relative paths kept; tests, IDLE, site-packages, files over 60 KB and non-UTF-8 files skipped) |
| `text/` | `text:OUT/text` | `pydoc_topics.jsonl`: the `help()` topics of `pydoc_data`; `docstrings.jsonl`: stdlib module docstrings over 200 characters ({p["text"]["documents"]} documents) |
| `photos/` | `images:OUT/photos` | {p["photos"]["images"]} photographs shipped by scikit-image and scikit-learn, original bytes, each with a `.txt` caption written for it |
| `digits/` | `images:OUT/digits/digits.csv` | {p["digits"]["images"]} of scikit-learn's handwritten digits (8x8, bundled csv.gz) enlarged to 32x32 PNG; captions from the labels |
| `scenes/` | `images:OUT/scenes/scenes.jsonl`, `interleaved:OUT/scenes/drawings.jsonl` | {p["scenes"]["images"]} generated pictures of 1-3 shapes; captions state shape, colour and grid position, checkable with `data.demo_corpus.check_scene`; `scenes.jsonl` puts the picture first (captioning), `drawings.jsonl` ({p["scenes"].get("drawings", 0)} of them) the caption first (drawing), each row with its facts |
| `clips/` | `videos:OUT/clips` | {p["clips"]["clips"]} H.264 mp4 clips (libx264, yuv420p, 5/8/12/24 fps): moving shapes, pans and zooms across the photos; `captions.jsonl` states the motion, checkable with `data.demo_corpus.check_clip` |
| `interleaved/` | `interleaved:OUT/interleaved/docs.jsonl`, with `--allow-outside-paths` (its media paths lead to the sibling folders: `../photos/…`) | {p["interleaved"]["documents"]} documents: OBELICS-style `texts`/`images` lists, and native `segments` (with videos) |
| `wds/` | `wds:OUT/wds` | one img2dataset-style shard of {p["wds"]["samples"]} scenes as JPEG (`KEY.jpg`, `KEY.txt`, `KEY.json`) |

Total: {summary["files"]} files, {summary["bytes"] / 1e6:.1f} MB.

## Sources and licences

- **Python standard library and its documentation** (`code/`, `text/`): © Python Software
  Foundation, under the PSF License Agreement (Python {platform.python_version()}).
- **scikit-image sample images** (`photos/`): the package's `skimage/data/README.txt` states
  no sources; the docstrings of `skimage.data` do, per file (below). scikit-image itself is
  BSD-3-Clause.
- **scikit-learn sample images** (`photos/china.jpg`, `photos/flower.jpg`): per
  `sklearn/datasets/images/README.txt`, Creative Commons Attribution 2.0
  (https://creativecommons.org/licenses/by/2.0/), "Some rights reserved" by danielbuechele
  (china.jpg) and by vultilion (flower.jpg) on Flickr, retrieved 21 August 2011 by Robert
  Layton. Attribution must be kept when redistributing.
- **scikit-learn handwritten digits** (`digits/`): the test set of the UCI ML "Optical
  Recognition of Handwritten Digits" data set (creator E. Alpaydin, 1998; 8x8 block counts
  of 32x32 NIST-preprocessed bitmaps), as scikit-learn bundles it (`sklearn/datasets/descr/digits.rst`);
  the UCI repository distributes it under CC BY 4.0. Enlarged back to 32x32 here.
- **Generated parts** (`scenes/`, `clips/` shapes, `interleaved/` prose, `wds/`): made by
  this builder, no third-party content apart from the photos the pans and zooms show.

Per photograph:

{photo_lines}
"""


def build_readme(out: pathlib.Path, summary: dict, photos: list[Photo]) -> int:
    return write_text(out / "README.md", render(summary, photos))
