"""The release folder: a trained model outside its training run. This module reads and checks one
(``earlyfuse-generate``, the exporters, ``train.init_from``); tools/convert_release.py writes one
(``earlyfuse-convert release``). It lives in train/ because a run starts from a release
(train/init_from.py) and nothing may import tools/ (docs/design.md). Format in
docs/checkpoints.md.

    OUT/config.json            format, version, task, the model config with its vocabulary sizes,
                               dtype, tensor count, source run and step, fingerprints, sha256 of files
    OUT/model.safetensors      the transformer's full weights (fp32 or bf16)        [task lm]
    OUT/vocab_layout.json      the id space                                         [task lm]
    OUT/tokenizer.json         the text tokenizer (byte-level BPE)                  [task lm]
    OUT/visual_tokenizer/      config.json + model.safetensors (the FSQ autoencoder)

Design choices:
- Weights only as safetensors: no pickle ever reaches a release, and reading one runs no code.
- ``config.json`` records the sha256 of every file, so a corrupted byte in the middle of a file
  (which safetensors itself would load without complaint) is an error naming the file.
- Tensor names and shapes are checked against the model the config builds (on the meta
  device, no memory), and every tensor must be finite; a mismatch names the tensor.
- A vtok run releases just its visual tokenizer (``task: vtok``): the same folder that
  ``earlyfuse-prep tokenize`` takes as ``OUT/visual_tokenizer``.
- ``check_compatible`` decides whether a release can start a run: the ids must mean the same
  (layout and text tokenizer fingerprints) and every tensor must fit; config fields that differ
  without changing a shape (e.g. ``rope.theta``) are reported and the run's own values win.
"""

from __future__ import annotations

import dataclasses
import json
import math
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from data.names import LAYOUT_FILE, TOKENIZER_FILE, VISUAL_TOKENIZER_DIR
from data.shards.index import file_sha256
from data.tokenize.docs import BLOCK_OPTIONS, block_flags, number
from model.weights import nonfinite_tensor

if TYPE_CHECKING:
    from data.vocab import VocabLayout
    from model.transformer import TransformerConfig

FORMAT = "earlyfuse-release"
VERSION = 1
CONFIG = "config.json"
WEIGHTS = "model.safetensors"
LAYOUT = LAYOUT_FILE  # the names data/ gives these files, so a release folder is also
TOKENIZER = TOKENIZER_FILE  # a tokenizer folder (earlyfuse-prep tokenize takes it)
VISUAL = VISUAL_TOKENIZER_DIR
DTYPES = {
    "fp32": torch.float32,
    "float32": torch.float32,
    "bf16": torch.bfloat16,
    "bfloat16": torch.bfloat16,
}


def tokenizer_files(folder: Path) -> tuple[str, ...]:
    """The files a release copies from a tokenizer folder (its vocab_layout.json is the
    checkpoint's): the visual tokenizer's too when the folder has one (``has_visual_tokenizer``,
    the rule its fingerprints follow); a folder without visual_tokenizer/ is of text and code
    alone, be it a token folder's tokenizers/ or a copy of one elsewhere."""
    from data.tokenize.vtok_files import has_visual_tokenizer

    visual = (f"{VISUAL}/{CONFIG}", f"{VISUAL}/{WEIGHTS}") if has_visual_tokenizer(folder) else ()
    return (TOKENIZER, *visual)


class ReleaseError(ValueError):
    """A release (or the run it is made from) that cannot be used; the message names the file."""


def check_tokenizer_files(folder: Path) -> None:
    """A ReleaseError unless ``folder`` holds every file a release copies from it."""
    need = [folder / name for name in (LAYOUT, *tokenizer_files(folder))]
    missing = [str(path) for path in need if not path.is_file()]
    if missing:
        raise ReleaseError(
            f"{folder}: tokenizer files missing: {', '.join(missing)} (pass --tokenizers DIR "
            "with tokenizer.json, vocab_layout.json and visual_tokenizer/, or --no-tokenizers)"
        )


# --- checking weights ------------------------------------------------------------------------------
def meta_module(task: str, cfg):
    """The network a config builds, on the meta device (shapes without memory)."""
    if task == "lm":
        return cfg.build("meta")
    with torch.device("meta"):
        return cfg.build()


def check_state(
    state: dict[str, torch.Tensor], reference: dict[str, torch.Tensor], where: str, hint: str = ""
) -> None:
    """Same tensor names and shapes as ``reference`` and all finite, or a ReleaseError naming the
    first offending tensor (``hint`` is appended, e.g. a config diff)."""
    tail = f"\n{hint}" if hint else ""
    missing = [tensor_name for tensor_name in reference if tensor_name not in state]
    extra = [tensor_name for tensor_name in state if tensor_name not in reference]
    if missing or extra:
        what = (
            f"tensor {missing[0]!r} is missing"
            if missing
            else f"tensor {extra[0]!r} is not in the model"
        )
        raise ReleaseError(
            f"{where}: {what} ({len(state)} tensors found, the model has {len(reference)}; "
            f"missing {missing[:5]}, unexpected {extra[:5]}){tail}"
        )
    for name, ref in reference.items():
        tensor = state[name]
        if tuple(tensor.shape) != tuple(ref.shape):
            raise ReleaseError(
                f"{where}: tensor {name!r} has shape {list(tensor.shape)}, the model expects "
                f"{list(ref.shape)}{tail}"
            )
    if (bad := nonfinite_tensor(state)) is not None:
        raise ReleaseError(
            f"{where}: tensor {bad!r} holds NaN or Inf values (the run diverged before this step?)"
        )


def flat(nested: dict, prefix: str = "") -> dict:
    """``{"a": {"b": 1}}`` -> ``{"a.b": 1}``: config sections as dotted keys."""
    out = {}
    for key, value in nested.items():
        if isinstance(value, dict):
            out.update(flat(value, f"{prefix}{key}."))
        else:
            out[f"{prefix}{key}"] = value
    return out


# Settings of training or of the kernels, not of the function the weights compute: never reported.
NOT_ARCHITECTURE = {
    "activation_checkpoint_every",
    "init_std",
    "attention.backend",
    "attention.compile_flex",
    "loss.chunk_size",
    "loss.z_loss_coef",
    "loss.ignore_index",
    "moe.capacity_factor",
    "moe.load_balance_coef",
    "moe.router_z_coef",
    "l1",
    "l2",
    "grad",
    "entropy",
}


def config_diff(first: dict, second: dict, section: str, names=("release", "run")) -> list[str]:
    """The architecture fields that differ between two configs, one line each."""
    flat_first, flat_second = flat(first), flat(second)
    return [
        f"  {section}.{key}: {names[0]} {flat_first.get(key)!r}, {names[1]} {flat_second.get(key)!r}"
        for key in sorted(set(flat_first) | set(flat_second))
        if key not in NOT_ARCHITECTURE and flat_first.get(key) != flat_second.get(key)
    ]


# --- reading ---------------------------------------------------------------------------------------
class Release:
    """A release folder, checked on open (format, version, files present)."""

    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        cfg_path = self.path / CONFIG
        if not self.path.is_dir():
            raise ReleaseError(
                f"{self.path}: not a folder (a release is the folder `earlyfuse-convert release` wrote)"
            )
        try:
            self.config = json.loads(cfg_path.read_text())
        except FileNotFoundError:
            what = "not a release folder"
            if (self.path / "checkpoints").is_dir():  # a run folder given for its release
                what = f"a run folder: release it first (earlyfuse-convert release {self.path} OUT)"
            raise ReleaseError(f"{cfg_path}: missing; {self.path} is {what}") from None
        except (OSError, ValueError) as e:
            raise ReleaseError(f"{cfg_path}: unreadable or corrupted ({e})") from None
        if self.config.get("format") != FORMAT:
            vtok = {"levels", "factor"} <= set(self.config)  # a release's visual_tokenizer/ given
            hf = "model_type" in self.config  # earlyfuse-convert hf's output given
            raise ReleaseError(
                f"{cfg_path}: format {self.config.get('format')!r}, expected {FORMAT!r}"
                + (": a visual tokenizer's folder, not a release" if vtok else "")
                + (
                    f": a Hugging Face model folder ({self.config['model_type']}), not a release; "
                    "give the release it was exported from"
                    if hf
                    else ""
                )
            )
        if self.config.get("version") != VERSION:
            raise ReleaseError(
                f"{cfg_path}: release version {self.config.get('version')!r}, this earlyfuse "
                f"reads version {VERSION}: convert the checkpoint again with this version"
            )
        self.task = self.config.get("task")
        if self.task not in ("lm", "vtok"):
            raise ReleaseError(f"{cfg_path}: task {self.task!r}, expected 'lm' or 'vtok'")
        if not isinstance(self.config.get("files"), dict) or not self.config["files"]:
            # every release records its files' sha256: without the record nothing is checked
            raise ReleaseError(f"{cfg_path}: no 'files' record of the release's files and sha256")
        missing = [
            file_name for file_name in self.config["files"] if not (self.path / file_name).is_file()
        ]
        if missing:
            raise ReleaseError(f"{self.path}: files missing: {', '.join(missing)}")
        self.model_cfg: TransformerConfig | None = None  # lm releases only
        self.layout: VocabLayout | None = None
        if self.task == "lm":
            from data.vocab import VocabLayout
            from model.transformer import TransformerConfig

            try:
                self.model_cfg = TransformerConfig(**self.config["model"])
            except (KeyError, TypeError, ValueError) as e:
                raise ReleaseError(f"{cfg_path}: bad 'model' section ({e})") from None
            try:
                self.layout = VocabLayout.load(self.path / LAYOUT)
            except ValueError as e:
                raise ReleaseError(str(e)) from None
            if self.layout.size != self.model_cfg.vocab_size:
                raise ReleaseError(
                    f"{self.path / LAYOUT}: {self.layout.size} ids, but config.json's model has "
                    f"vocab_size {self.model_cfg.vocab_size}"
                )

    @property
    def transformer_config(self) -> TransformerConfig:
        """The language model's config; a ReleaseError for a release that holds none."""
        if self.model_cfg is None:
            raise ReleaseError(f"{self.path}: a {self.task} release holds no language model")
        return self.model_cfg

    @property
    def vocab_layout(self) -> VocabLayout:
        """The id space of the language model; a ReleaseError for a release without one."""
        if self.layout is None:
            raise ReleaseError(f"{self.path}: a {self.task} release holds no vocabulary layout")
        return self.layout

    @property
    def step(self) -> int | None:
        return self.config.get("source", {}).get("step")

    def tokenize_command(self, keys=tuple(BLOCK_OPTIONS)) -> str:
        """The command that tokenizes data as this model's training data was: its tokenizers and
        the block budgets (``keys`` of them) its token manifest recorded (``config.json``'s
        ``tokenize``)."""
        flags = block_flags(self.config.get("tokenize") or {}, keys)
        return (
            f"earlyfuse-prep tokenize --tokenizer {self.path} --visual-tokenizer "
            f"{self.path / VISUAL}" + (f" {flags}" if flags else "")
        )

    def budget_differences(self, table, keys=tuple(BLOCK_OPTIONS)) -> list[str]:
        """The block budgets ``table``'s manifest records that differ from the training data's,
        for the blocks it holds (an image budget matters only where there are images): its
        images and videos are then of sizes the model did not train on, and its figures do not
        compare with the run's. Empty: the same, or nothing recorded to compare."""
        mine = self.config.get("tokenize") or {}
        theirs = getattr(table, "tokenize_options", None) or {}
        held = {
            m
            for got in getattr(table, "shard_blocks", [])
            for m in ("image", "video")
            if int(got[m]["blocks"])
        }
        out = []
        for key in keys:
            # the block bound shapes any visual block; a document's budget is shared out to its
            # videos (its text and images keep theirs)
            concerns = {
                "max_block_tokens": {"image", "video"},
                "doc_budget": {"video"},
            }.get(key, {key.split("_")[0]})
            if not concerns & held or key not in mine or key not in theirs:
                continue
            if theirs[key] != mine[key]:
                out.append(f"{key} {number(theirs[key])}, the training data's {number(mine[key])}")
        return out

    def check_token_tables(self, tables, what: str) -> None:
        """Token tables to score this model on must be made with its tokenizers: another
        tokenizer's ids fall inside the vocabulary and run, but mean other things to the model,
        and the figures look like figures. Refuses naming the source, its manifest and the
        tokenizers that differ (the fingerprints ``config.json`` and each token manifest record).
        A release without fingerprints (made from a checkpoint without its record) checks nothing."""
        from data.tokenize.vtok_files import tokenizers_differ

        mine = self.config.get("tokenizers") or {}
        for table in tables:
            if differ := tokenizers_differ(table.tokenizer_fingerprint, mine):
                raise ReleaseError(
                    f"{what}: source {table.name} ({table.manifest_url}) was tokenized with other "
                    f"tokenizers than {self.path} ({differ}): its ids mean other "
                    f"things to this model. Tokenize it with the release's own ({self.tokenize_command()})"
                )

    def verify_files(self) -> None:
        """Every file's sha256 against config.json (catches corruption inside a file)."""
        for name, digest in self.config["files"].items():
            if file_sha256(self.path / name) != digest:
                raise ReleaseError(
                    f"{self.path / name}: sha256 differs from the one recorded in {CONFIG}; "
                    "the file is corrupted or was changed after the release was written"
                )

    def state_dict(
        self, dtype: torch.dtype | None = torch.float32, *, verify: bool = True
    ) -> dict[str, torch.Tensor]:
        """The weights (the transformer's for lm, the visual tokenizer's for vtok), checked."""
        if verify:
            self.verify_files()
        if self.task == "lm":
            path = self.path / WEIGHTS
            from model.weights import load_safetensors

            state = load_safetensors(path, ReleaseError)
            check_state(state, meta_module("lm", self.model_cfg).state_dict(), str(path))
        else:  # read and checked by the one loader of a visual tokenizer folder
            state = self.visual_tokenizer(verify=False).state_dict()
        return (
            {tensor_name: tensor.to(dtype) for tensor_name, tensor in state.items()}
            if dtype is not None
            else state
        )

    def build_model(
        self,
        device: torch.device | str = "cpu",
        dtype: torch.dtype = torch.float32,
        *,
        verify: bool = True,
    ):
        """The transformer with the release's weights, in eval mode."""
        if self.task != "lm":
            raise ReleaseError(f"{self.path}: a {self.task} release holds no language model")
        state = self.state_dict(dtype=dtype, verify=verify)
        model = self.transformer_config.build("meta")
        if any(True for _ in model.buffers()):  # a buffer not in the state dict needs a real init
            model = self.transformer_config.build(device)
        else:
            model = model.to_empty(device=device)
        model.load_state_dict(state, strict=True)
        return model.to(device=device, dtype=dtype).eval()

    def text_tokenizer(self):
        from data.text_tokenizer import TextTokenizer

        if not (self.path / TOKENIZER).is_file():
            raise ReleaseError(
                f"{self.path}: no {TOKENIZER} (released with --no-tokenizers); text cannot be "
                "encoded or decoded"
            )
        try:
            return TextTokenizer.load(self.path)
        except ValueError as e:
            raise ReleaseError(str(e)) from None

    def visual_config(self):
        from model.visual_tokenizer import VisualTokenizerConfig

        config_path = self.path / VISUAL / CONFIG
        if not config_path.is_file():
            raise ReleaseError(
                f"{self.path}: no {VISUAL}/ (released with --no-tokenizers, or its model was "
                "trained on tokens of text and code alone); images cannot be encoded or decoded"
            )
        try:
            return VisualTokenizerConfig(**json.loads(config_path.read_text()))
        except (OSError, ValueError, TypeError) as e:
            raise ReleaseError(f"{config_path}: unreadable visual tokenizer config ({e})") from None

    def visual_tokenizer(self, device: torch.device | str = "cpu", *, verify: bool = True):
        """The visual tokenizer, loaded and checked by ``data.tokenize.visual``'s loader (files,
        the sha256 recorded here when ``verify``, FSQ levels against the layout, tensors); its
        errors are ReleaseErrors, as every other problem with a release is."""
        from data.tokenize.visual import VisualTokenizerError, load_visual_tokenizer

        self.visual_config()  # a release without one: says it was released with --no-tokenizers
        prefix = f"{VISUAL}/"
        recorded = {
            name.removeprefix(prefix): digest
            for name, digest in self.config.get("files", {}).items()
            if name.startswith(prefix)
        }
        try:
            return load_visual_tokenizer(
                self.path / VISUAL, self.layout, device, sha256=recorded if verify else None
            )
        except VisualTokenizerError as e:
            raise ReleaseError(str(e)) from None


# --- can a release start a run? ------------------------------------------------------------------
def check_compatible(
    rel: Release,
    *,
    task: str,
    net_cfg,
    reference: dict,
    layout=None,
    tok_folder=None,
    state: dict | None = None,
    where: str = "",
) -> list[str]:
    """Can ``rel`` start a run of ``task`` whose network is ``net_cfg`` (state dict ``reference``)
    on token data made with ``layout`` and the tokenizers in ``tok_folder`` (text, layout and
    visual, each by the fingerprint the release records)? Raises naming what differs; returns
    the config fields that differ without changing a shape."""
    where = where or str(rel.path)
    if rel.task != task:
        raise ReleaseError(f"{where}: a {rel.task} release cannot start a {task} run")
    if task == "lm":
        if layout is not None and rel.vocab_layout.fingerprint() != layout.fingerprint():
            raise ReleaseError(
                f"{where}: its vocabulary layout {rel.vocab_layout.to_dict()['ranges']} differs from the "
                f"run's token data ({layout.to_dict()['ranges']}, {tok_folder}); the ids would mean "
                "different things. Tokenize the data with the release's tokenizers."
            )
        recorded = rel.config.get("tokenizers") or {}  # text, layout, visual fingerprints
        if tok_folder is not None and recorded:
            from data.tokenize.vtok_files import (
                folder_fingerprints,
                tokenizer_key,
                tokenizers_differ,
            )

            ours = tokenizer_key(folder_fingerprints(tok_folder))
            if differ := tokenizers_differ(ours, recorded):
                raise ReleaseError(
                    f"{where}: its {differ} from those the run's token data was made with "
                    f"({tok_folder}); the ids would mean different things (an image code, other "
                    "patches). Tokenize the data with the release's tokenizers."
                )
        diff = config_diff(
            dataclasses.asdict(rel.transformer_config), dataclasses.asdict(net_cfg), "model"
        )
    else:
        diff = config_diff(
            dataclasses.asdict(rel.visual_config()), dataclasses.asdict(net_cfg), "vtok"
        )
    if state is None:
        state = meta_module(
            task, rel.transformer_config if task == "lm" else rel.visual_config()
        ).state_dict()
    check_state(
        state,
        reference,
        where,
        hint=("config differences (release vs this run):\n" + "\n".join(diff)) if diff else "",
    )
    return diff


def param_count(state: dict[str, torch.Tensor]) -> int:
    return int(sum(math.prod(tensor.shape) for tensor in state.values()))
