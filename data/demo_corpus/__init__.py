"""Offline demo corpus: a small, real multimodal corpus built from what Python and the `[demo]`
extra install.

    from data.demo_corpus import build
    build(pathlib.Path("demo_raw"), seed=0, scale=1.0)   # ~ seconds on 2 cores

One module per part (`stdlib_code`, `prose`, `photos`, `digits`, `scenes`, `clips`,
`interleaved`, `wds`, `readme`), each writing one folder of the raw-input layout that
`earlyfuse-prep ingest` consumes; `build` runs them. Notable choices:

- deterministic: every item is drawn from a generator seeded by (seed, part, index), all
  writers avoid timestamps (PNG without metadata, libx264 single-threaded and bitexact, tar
  with fixed mtime/owner), so the same seed gives byte-identical files;
- checkable captions: generated scenes and clips state facts that `check_scene` /
  `check_clip` verify from pixels, so tests (and later probes) know the captions are true;
- no heavy imports: skimage/sklearn are located on disk, never imported; PyAV only for clips.
"""

from .build import build
from .clips import check_clip
from .scenes import caption_facts, check_scene

__all__ = ["build", "caption_facts", "check_clip", "check_scene"]
