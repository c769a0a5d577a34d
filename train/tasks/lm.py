"""Task ``lm``: the early-fusion transformer on packed rows of token shards.

Every step logs, from sums and counts reduced over micro-batches and ranks: the loss of each
modality (``loss/<m>``), normalised CE (``loss_norm/<m>`` = CE / ln V_m, 1.0 = chance over the
modality's own range of ids), label tokens per modality (``tokens/<m>``), log Z and final
hidden norm per modality and the code-minus-text logit gap (``monitor/...``), and the delivered
mix by source (``mix/<source>``) and visual blocks the loader dropped for being longer than a row
(``data/dropped_blocks``, per source and modality as ``data/dropped_blocks/<source>/<m>``; the
run totals in final.json when any was dropped or ``data.allow_block_drops`` is set). Validation runs over the held-out
sources (``data.validation``) and reports loss and perplexity per modality.

Beside every loss stands the unigram baseline (data/unigram.py: the training tokens' own
frequencies per modality, add-one smoothed, counted once at start): ``unigram/<m>`` on the
training batches, ``val/unigram/<m>`` and ``val/margin/<m>`` (baseline minus loss: positive means
the model predicts better than token frequencies alone) on the held-out set. Validation is one
exact pass over the whole held-out set (data/loader/heldout.py, the pass ``earlyfuse-eval``
makes: the same tokens and CE), every data-parallel rank evaluating its share, unless
``train.eval_batches`` caps it (then the figures say so: ``val/batches``, ``val/complete``).

With ``train.sequence_parallel`` > 1 the loader goes by data-parallel rank (an SP group reads the
same rows), each rank trains and scores its shard of them (``shard_row``, the loss reduced over
the group by ``reduce_loss``), and every figure above counts each row once: per-token sums come
from each rank's shard, per-row ones from the group's first rank (docs/long_context.md).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
from contextlib import contextmanager, suppress
from pathlib import Path

import numpy as np
import torch

from data.loader import LoaderConfig, build_loader, store
from data.loader.dataset import check_tokenizers
from data.loader.fit import check_blocks_fit, oversize_blocks
from data.loader.heldout import HeldoutPass, RankShare
from data.loader.table import TokenTable
from data.names import LAYOUT_FILE
from data.tokenize.vtok_files import has_visual_tokenizer
from data.unigram import Unigram
from data.vocab import MODALITY_NAMES, Modality, VocabLayout
from model.attention import AttentionConfig
from model.flops import flops_per_token
from model.sequence_parallel import apply_sequence_parallel, reduce_loss, shard_row
from train.config import RunConfig
from train.config_check import ConfigError
from train.dist import DistInfo, all_reduce_sum
from train.monitor import chance_levels
from train.monitor.lm_probes import LMProbes
from train.names import CHECKPOINT_TOKENIZERS_FILE, MODEL_INPUTS
from train.streams import TableCache, TokenStream
from train.tasks.base import StepOutput
from train.tasks.documents import KEY as DOCS_NEW
from train.tasks.documents import MASS as DOCS_MASS
from train.tasks.documents import DocumentCounter

log = logging.getLogger(__name__)
DROPPABLE = ("image", "video")  # modalities whose blocks the loader can drop (batch dropped_blocks)


def tokenizer_folder(cfg: RunConfig, tables: TableCache | None = None) -> Path:
    """The run's tokenizer folder: ``data.tokenizers`` when given, else the tokenizers/ copy that
    the first source with local token shards names (``TokenTable.layout_url``; a remote one is not
    fetched), the first one holding a visual tokenizer when a source of text and code alone (made
    without one) comes before it, so that the release can encode and decode the images the model
    learned. A ConfigError (earlyfuse-train: its message, no traceback) naming every place tried
    when there is none."""
    if cfg.data.tokenizers:
        return Path(cfg.data.tokenizers)
    tables = tables or TableCache()
    tried: list[str] = []
    unreadable: list[str] = []
    text_only: list[Path] = []
    for src in [*cfg.data.sources, *cfg.data.validation]:
        try:
            table = tables.get([src])[0]
        except (OSError, ValueError) as e:
            tried.append(str(e))
            unreadable.append(str(e))
            continue
        if table.kind == "raw" or store.kind(table.layout_url) != "local":
            tried.append(f"source {src.name}: {'raw' if table.kind == 'raw' else 'remote'} shards")
            continue
        folder = Path(table.layout_url).parent
        if has_visual_tokenizer(folder):
            return folder
        if folder.is_dir():
            text_only.append(folder)
            continue
        tried.append(f"{folder} (named by {table.manifest_url}, missing)")
    if text_only:
        return text_only[0]
    if unreadable and len(unreadable) == len(tried):  # the data itself is what to name first
        more = len(unreadable) - 1
        raise ConfigError(
            unreadable[0] + (f" ({more} more source(s) unreadable too)" if more else "")
        )
    raise ConfigError(
        "cannot find the token data's tokenizers/ folder (tried: "
        f"{'; '.join(tried) or 'no data.sources'}); set data.tokenizers to it"
    )


def layout_of_data(cfg: RunConfig, tables: TableCache | None = None) -> tuple[VocabLayout, Path]:
    """The vocabulary layout of the run's tokens and the folder it is in (``tokenizer_folder``).
    A folder found beside the token shards must be the one they were made with: one replaced
    after tokenize would give the model another vocabulary than the ids (the loader would skip
    every document holding an id past it and pass the rest as tokens of another vocabulary).
    ``data.tokenizers``, when set, is checked against the shards by the loader."""
    tables = tables or TableCache()
    folder = tokenizer_folder(cfg, tables)
    if not cfg.data.tokenizers:
        found = dataclasses.replace(cfg.data, tokenizers=str(folder))
        made = []
        for src in cfg.data.sources:  # one that cannot be read is the loader's to refuse
            with suppress(OSError, ValueError):
                made += [table for table in tables.get([src]) if table.kind == "tokens"]
        try:
            check_tokenizers(found, made)
        except ValueError as e:
            raise ConfigError(
                f"{folder}, found beside the token shards: {e}; were the tokenizers replaced "
                "after tokenize? Put back the ones the shards were made with, or tokenize again"
            ) from None
    try:
        return VocabLayout.load(folder / LAYOUT_FILE), folder
    except ValueError as e:  # data.tokenizers naming no tokenizer folder
        raise ConfigError(f"data.tokenizers: {e}") from None


def source_tokenizers(tables: list) -> list[dict]:
    """What the token sources' manifests record of the tokenizers their tokens were made with,
    one entry a source: ``{"source", "manifest", "text", "layout", "visual"}`` (a raw source has
    none). Saved with every checkpoint (``extra_files``), so that a release can still check its
    tokenizers once the token shards are moved or deleted (``tokens_made_with_other``)."""
    return [
        {"source": t.name, "manifest": t.manifest_url, **json.loads(t.tokenizer_fingerprint)}
        for t in tables
        if t.kind == "tokens"
    ]


def tokens_made_with_other(
    cfg: RunConfig, fingerprints: dict, checkpoint: Path | None = None
) -> str:
    """How the first of the run's token sources was made with other tokenizers than
    ``fingerprints`` (a release's): "source text (…/manifest.json): visual tokenizer differs";
    "" when none was. The ``checkpoint`` folder's tokenizers.json, when it has one, is what the
    model learned from (the shards may since be moved, deleted or tokenized again): each source
    it records is checked against it, naming both fingerprints; other sources by their token
    manifests, as is every source of a checkpoint saved without that record (one that cannot be
    read then checks nothing). A folder without a visual tokenizer (text and code alone) is not
    that of a source made with one: the model learned images or videos such a release could
    neither read nor draw."""
    from data.tokenize.vtok_files import TOKENIZER_PARTS, tokenizers_differ

    record = Path(checkpoint or ".") / CHECKPOINT_TOKENIZERS_FILE
    recorded = json.loads(record.read_text()) if checkpoint and record.is_file() else []
    tables = TableCache()
    for src in [*cfg.data.sources, *cfg.data.validation]:
        made, where = [entry for entry in recorded if entry["source"] == src.name], ""
        if made:
            where = f" as {record} records it"
        else:
            with suppress(OSError, ValueError):  # shards that cannot be read check nothing
                made = source_tokenizers(tables.get([src]))
        for entry in made:
            theirs = {k: entry.get(k) for k in TOKENIZER_PARTS}
            differ = tokenizers_differ(json.dumps(theirs), fingerprints)
            if differ and where:  # no manifest to look at: the fingerprints themselves
                both = [
                    f"{k}: {theirs[k]} recorded, {fingerprints.get(k)} in the folder"
                    for k in TOKENIZER_PARTS
                    if theirs[k] != fingerprints.get(k)
                    and None not in (theirs[k], fingerprints.get(k))
                ]
                differ += f" ({'; '.join(both)})"
            if entry.get("visual") and fingerprints.get("visual") is None:
                differ = "made with a visual tokenizer, the folder has no visual_tokenizer/"
            if differ:
                return f"source {entry['source']} ({entry['manifest']}{where}): {differ}"
    return ""


CODE_BUCKETS = 64


def code_buckets(batch: dict, layout: VocabLayout) -> dict[str, torch.Tensor]:
    """The visual codes the step trains on, image and video labels apart, each counted in
    ``CODE_BUCKETS`` buckets (code mod 64): sums the monitor reduces over ranks and turns into the
    entropy of the codes delivered (``monitor/data_code_entropy/<m>``). A visual tokenizer that
    has degenerated onto a few codes shows at once, before any model probe could."""
    labels = batch["labels"].reshape(-1)
    label_modality = batch["label_modality"].reshape(-1)
    image, video = label_modality == int(Modality.IMAGE), label_modality == int(Modality.VIDEO)
    code = (labels - layout.visual_offset) % CODE_BUCKETS
    # One pass: a video code's bucket lies CODE_BUCKETS further on. Counted where the labels are,
    # without a shape that depends on them (boolean indexing, bincount): anything else goes to one
    # spare bucket, dropped.
    visual = (image | video) & (labels >= layout.visual_offset)
    bucket = torch.where(visual, code + video * CODE_BUCKETS, 2 * CODE_BUCKETS)
    counts = torch.zeros(2 * CODE_BUCKETS + 1, dtype=torch.float32, device=labels.device)
    counts.index_add_(0, bucket, torch.ones_like(bucket, dtype=torch.float32))
    # Every key on every step: the sums are reduced over ranks as one vector of sorted keys.
    return {
        f"code_bucket/{name}/{i:02d}": counts[k * CODE_BUCKETS + i]
        for k, name in enumerate(("image", "video"))
        for i in range(CODE_BUCKETS)
    }


def one_doc_rows(batch: dict) -> bool | None:
    """The loader's word on whether every row holds one document (a host array: read without
    waiting for the device); None for a batch without it (the model then finds out itself)."""
    flag = batch.get("one_doc_rows")
    return None if flag is None else bool(flag.numpy())


UNIGRAM_MAX_TOKENS = 50_000_000  # per source: the baseline reads at most this many tokens of each


def leave_out_unreadable_sources(
    sources: list, tables: list, unreadable: list[tuple[str, str, str]], is_main: bool
) -> None:
    """Bad data never stops a run, and a source none of whose documents can be read would: the
    loader skips each one it meets and stops after ``data.max_consecutive_errors`` in a row, at
    the first step and again on every restart. The start-up pass over every training document
    (the unigram baseline) finds such a source; it is left out of the mix (its weight set to 0:
    the loader's state keeps its place, so a resume decides the same) with one warning naming
    it. When no source is left, the run is refused here, before any training."""
    bad: dict[str, int] = {}
    for source, _key, _why in unreadable:
        bad[source] = bad.get(source, 0) + 1
    dead = [
        (src, table)
        for src, table in zip(sources, tables)
        if src.weight > 0 and len(table) and bad.get(table.name, 0) >= len(table)
    ]
    if not dead:
        return
    names = ", ".join(f"{table.name} ({len(table)} documents)" for _, table in dead)
    example = next(f"{key}: {why}" for source, key, why in unreadable if source == dead[0][1].name)
    if len(dead) == sum(1 for src in sources if src.weight > 0):
        raise ConfigError(
            f"no training source has a readable document: every document of {names} failed its "
            f"check (the first: {example}); repair or re-make the shards (earlyfuse-prep verify)"
        )
    for src, _ in dead:
        src.weight = 0.0
    if is_main:
        log.warning(
            f"data: source(s) {names} left out of the mix: not one of their documents can be "
            f"read (the first: {example}); the run trains on the other sources, in the ratio "
            "of their weights. Repair or re-make those shards (earlyfuse-prep verify)"
        )


def vocab_sizes(lay: VocabLayout) -> list[int]:
    """Ids each modality predicts among, for normalised CE: text and code the BPE, images and
    video the codes, structure its markers."""
    return [lay.text_size, lay.text_size, lay.num_codes, lay.num_codes, len(lay.structure)]


def probe_sources(data: LoaderConfig, tables: TableCache, unigram: Unigram | None) -> list:
    """The sources the probes read: the validation sources, unless they hold no image while the
    training tokens do (the training sources then): the cross-modal dependence probe reads
    captioned images and the generated-code rule judges drawings by real images' codes; on
    held-out text, code or clips (a long-context stage's) both would be off without a word."""
    if not data.validation:
        return data.sources
    if unigram is None or not unigram.counts[int(Modality.IMAGE)].any():
        return data.validation
    for table in tables.get(data.validation):  # a token table's manifest counts its blocks
        if not isinstance(table, TokenTable) or any(
            int(shard["image"]["blocks"]) for shard in table.shard_blocks
        ):
            return data.validation
    return data.sources


def long_row_notes(data: LoaderConfig, attention: AttentionConfig, tables: list) -> list[str]:
    """Lines for settings that do nothing at these rows, each meant for longer ones perhaps: a
    window as long as the row, clips tokenized for shorter rows (their frames are not
    re-encoded to use a longer row; tokenize again for that)."""
    out = []
    for key, layers in (
        ("local_window", "the local layers see"),
        ("sliding_window", "every layer sees"),
    ):
        if getattr(attention, key) >= data.seq_len:
            out.append(
                f"note: model.attention.{key}={getattr(attention, key)} >= data.seq_len="
                f"{data.seq_len}: {layers} the whole row, as without a window"
            )
    for t in tables:
        if t.kind != "tokens":  # raw shards: no manifest of clip lengths, tokenized by this run
            continue
        cap = (t.tokenize_options or {}).get("video_max_tokens")
        longest = max((int(s["video"]["longest"]) for s in t.shard_blocks), default=0)
        # Rows that could hold clips twice as long, and a clip long enough to have met the cap
        if cap and 2 * cap <= data.seq_len and longest > cap // 2:
            out.append(
                f"note: source {t.name}'s clips were tokenized to at most {cap} tokens each (the "
                f"longest {longest}), rows hold {data.seq_len}: for longer clips tokenize again "
                f"with --doc-budget {data.seq_len} (docs/long_context.md)"
            )
    return out


class LMTask:
    unit = "tok"

    def __init__(self, cfg: RunConfig, dist: DistInfo) -> None:
        if cfg.data is None or not cfg.data.sources:
            raise ConfigError("task lm needs data.sources (token shard folders); see configs/data/")
        self.cfg, self.dist = cfg, dist
        self.tables = TableCache()  # every index read once, shared by all loaders of the run
        self.documents = DocumentCounter()  # documents new to each modality, per batch
        self.layout, self.tok_folder = layout_of_data(cfg, self.tables)
        try:
            self.model_cfg = cfg.model.with_layout(self.layout)
        except ValueError as e:
            raise ConfigError.alike(str(e)) from None
        if self.model_cfg.attention.backend == "flex" and dist.device.type == "cpu":
            raise ConfigError(  # said now, not by the first step's backward
                "model.attention.backend=flex: FlexAttention has no backward on CPU in this torch; "
                "use auto (sdpa on a CPU, flex on CUDA) or sdpa"
            )
        sources, held_out = self.tables.get(cfg.data.sources), self.tables.get(cfg.data.validation)
        what = ["source"] * len(sources) + ["data.validation source"] * len(held_out)
        try:  # every source whose blocks outgrow the rows, held-out or not, in one message
            check_blocks_fit(cfg.data, sources + held_out, what=what)
        except ValueError as e:  # a user's data, said as the loader's own check says it
            raise ConfigError(str(e)) from None
        for src, table in zip(cfg.data.validation, held_out):
            if table.kind == "raw":  # found now, not at the first evaluation hours later
                raise ConfigError(
                    f"data.validation source {src.name} holds raw shards: validation makes one "
                    "exact pass, which needs the token counts of token shards; tokenize it "
                    "(earlyfuse-prep tokenize) and name the token folder"
                )
        try:  # one vocabulary, before any document is read: held-out ids mean what training ids do
            check_tokenizers(cfg.data, self.tables.get(cfg.data.sources + cfg.data.validation))
        except ValueError as e:
            raise ConfigError(str(e)) from None
        self.source_names = [s.name for s in cfg.data.sources]
        self._said_drops = False  # blocks dropped though allow_block_drops is false: said once
        self._val = None
        self._probe_sources: list | None = None  # probe_stream's sources, decided once
        tables = self.tables.get(cfg.data.sources)
        if all(t.kind == "tokens" for t in tables):
            unreadable: list[tuple[str, str, str]] = []
            self.unigram: Unigram | None = Unigram.from_tables(
                tables, self.layout, max_tokens=UNIGRAM_MAX_TOKENS, skipped=unreadable
            )
            self._unigram_lp = self.unigram.log_probs()
            leave_out_unreadable_sources(cfg.data.sources, tables, unreadable, dist.is_main)
        else:  # raw sources are tokenized online: no token counts before training
            self.unigram = None
        if dist.is_main:
            for line in long_row_notes(cfg.data, self.model_cfg.attention, tables):
                log.info(line)

    def build_model(self):
        model = self.model_cfg.build()
        if self.dist.sp_degree > 1:  # attention swaps sequence for heads; state dict unchanged
            apply_sequence_parallel(model, self.dist.sp_group)
        return model

    def shard(self, inputs: dict) -> dict:
        """This rank's shard of whole rows (positions, labels and the mask made on the whole row,
        model/sequence_parallel.py); the rows as they are without sequence parallelism."""
        if self.dist.sp_degree == 1:
            return inputs
        return shard_row(inputs, self.model_cfg, rank=self.dist.sp_rank, degree=self.dist.sp_degree)

    @contextmanager
    def whole_rows(self, module):
        """The probes run whole rows on every rank, sequence parallelism off meanwhile: their
        hooks read whole attention maps and generation's KV cache holds the whole sequence."""
        if self.dist.sp_degree == 1:
            yield
            return
        apply_sequence_parallel(module, None)
        try:
            yield
        finally:
            apply_sequence_parallel(module, self.dist.sp_group)

    def stream(self, data: LoaderConfig, *, every_rank_alike: bool = False) -> TokenStream:
        """A loader of this rank over ``data``'s sources (validation reads its own way:
        ``evaluate``); ``every_rank_alike``: every rank reads the whole of them, the same rows."""
        # By data-parallel rank: the ranks of one sequence-parallel group read the same rows.
        try:
            loader = build_loader(
                data,
                rank=0 if every_rank_alike else self.dist.data_rank,
                world_size=1 if every_rank_alike else self.dist.data_size,
                micro_batch=self.cfg.train.micro_batch,
                pad_id=0,
                tables=self.tables.get(data.sources),
            )
        except ValueError as e:  # its start-up checks: data or settings that cannot be used
            raise ConfigError(str(e)) from None
        return TokenStream(loader)

    def batches(self) -> TokenStream:
        stream = self.stream(self.cfg.data)
        self._loader = stream.loader  # its dropped-block counts go to final.json (finish)
        return stream

    def probe_stream(self) -> TokenStream:
        """The probes' rows: the validation sources when the run has them (else the training
        sources; also when they hold no image or video and the training data does:
        ``probe_sources``), through a loader of their own (no workers; the training stream is
        untouched)."""
        d = self.cfg.data
        first = False
        if self._probe_sources is None:  # decided once, said once
            first = True
            self._probe_sources = probe_sources(d, self.tables, self.unigram)
            if self._probe_sources is not d.validation and d.validation and self.dist.is_main:
                log.info(
                    "probes: data.validation holds no image, the training data does: "
                    "the probes read the training sources (the cross-modal dependence and the "
                    "generated codes' yardstick need images)"
                )
        # Rows of at most monitor.probe_seq_len: a long-context stage's probes at its full rows
        # would take more memory than its training steps. Blocks longer than them are dropped.
        cut = 0 < self.cfg.monitor.probe_seq_len < d.seq_len
        if cut and first and self.dist.is_main:
            self._say_probe_drops(self.cfg.monitor.probe_seq_len)
        data = dataclasses.replace(
            d,
            sources=self._probe_sources,
            validation=[],
            num_workers=0,
            mode="infinite",
            seq_len=self.cfg.monitor.probe_seq_len if cut else d.seq_len,
            allow_block_drops=cut or d.allow_block_drops,
        )
        # A held-out source can hold fewer documents than there are ranks, and a rank's split of
        # it would then be empty (the loader refuses that, at the first probe, mid-run): every
        # rank reads the whole set then. The probes' figures are means over the rows of all
        # ranks, so the same rows on every rank give one rank's figures.
        few = min(len(table) for table in self.tables.get(data.sources)) < self.dist.data_size
        return self.stream(data, every_rank_alike=few)

    def _say_probe_drops(self, probe_len: int) -> None:
        """One line naming the probe sources' visual blocks too long for the probe rows (token
        shards cannot be re-encoded shorter; raw sources are, to fit): the probes never see
        them, so a long-video stage's clips would be missing from its probes unsaid."""
        said = []
        for table in self.tables.get(self._probe_sources or []):
            if not isinstance(table, TokenTable):
                continue
            for modality, (over, total, most) in oversize_blocks(table, probe_len).items():
                if over:
                    said.append(f"{table.name}: {over} of its {total} {modality} blocks")
                    said[-1] += f" (the longest {most})"
        if said:
            log.info(
                "probes: visual blocks longer than monitor.probe_seq_len=%d are left out of the "
                "probe rows (raise it, up to data.seq_len, or 0 for the run's rows, to probe "
                "them): %s",
                probe_len,
                "; ".join(said),
            )

    def forward(self, engine, batch: dict) -> StepOutput:
        dev = self.dist.device
        host = batch
        batch = {**batch, **{key: batch[key].to(dev, non_blocking=True) for key in MODEL_INPUTS}}
        sharded = self.dist.sp_degree > 1
        inputs = self.shard({k: batch[k] for k in MODEL_INPUTS})
        if not sharded:  # a shard brings its whole row's mask; else the loader's word on its rows
            inputs["one_doc_rows"] = one_doc_rows(host)
        # What the labels hold is counted before the model is queued, from the CPU batch.
        # Sequence-parallel: this rank's shard, so that the sums over all ranks count a row once.
        labelled = inputs if sharded else host
        buckets = code_buckets(labelled, self.layout)
        if self.unigram is not None:
            uni, _ = self.unigram.nll_sums(
                labelled["labels"], labelled["label_modality"], self._unigram_lp
            )
        # ``local``: this rank's sums and counts (its shard's under sequence parallelism), summed
        # over all ranks by the trainer; ``res``: the loss, reduced over the SP group.
        local = engine(**inputs)
        res = reduce_loss(local, self.dist.sp_group) if sharded else local
        # Figures of the whole rows (the mix, dropped blocks, tokens for throughput) come from the
        # first rank of an SP group only: its other ranks read the same rows.
        row_share = 1 if self.dist.sp_rank == 0 else 0
        sums = {}
        for i, name in enumerate(MODALITY_NAMES):
            sums[f"ce_sum/{name}"] = local.ce_sum[i]
            sums[f"count/{name}"] = local.count[i]
            sums[f"logz_sum/{name}"] = local.logz_sum[i]
            sums[f"hnorm_sum/{name}"] = local.hidden_norm_sum[i]
            sums[f"gap_sum/{name}"] = local.logit_gap_sum[i]
        for i, name in enumerate(self.source_names):
            sums[f"mix_tokens/{name}"] = batch["tokens_by_source"][i] * row_share
            for j, mod in enumerate(DROPPABLE):
                sums[f"dropped/{name}/{mod}"] = batch["dropped_blocks"][i, j] * row_share
        if self.unigram is not None:
            for i, name in enumerate(MODALITY_NAMES):
                sums[f"uni_sum/{name}"] = uni[i]
        if local.moe_expert_load is not None:  # [layers, modality, expert] assignments
            load = local.moe_expert_load.detach().sum(0)
            for i, name in enumerate(MODALITY_NAMES):
                for e in range(load.shape[1]):
                    sums[f"moe_load/{name}/{e}"] = load[i, e]
        sums.update(buckets)
        sums.update({k: v * row_share for k, v in self.documents.count(host).items()})
        sums["z_loss_sum"] = res.z_loss.detach()
        sums["aux_loss_sum"] = res.aux_loss.detach()
        sums["moe_dropped"] = local.moe_dropped.detach()
        # The loader's count, on the host: no wait for the device
        units = int(host["num_real_tokens"].numpy()) * row_share
        return StepOutput(loss=res.loss, sums=sums, units=units)

    def metrics(self, s: dict[str, float]) -> dict[str, float]:
        out = {
            "train/z_loss": s["z_loss_sum"] / s["micro"],
            "train/aux_loss": s["aux_loss_sum"] / s["micro"],
            "train/moe_dropped": s["moe_dropped"],
        }
        sizes = vocab_sizes(self.layout)
        for i, name in enumerate(MODALITY_NAMES):
            n = s[f"count/{name}"]
            out[f"tokens/{name}"] = n
            if DOCS_NEW + name in s:  # the stagnation rule's count (train/tasks/documents.py)
                out[f"data/docs_new/{name}"] = s[DOCS_NEW + name]
                out[f"data/docs_mass/{name}"] = s[DOCS_MASS + name]
            if n:
                ce = s[f"ce_sum/{name}"] / n
                out[f"loss/{name}"] = ce
                out[f"loss_norm/{name}"] = ce / math.log(sizes[i])
                if f"uni_sum/{name}" in s:
                    out[f"unigram/{name}"] = s[f"uni_sum/{name}"] / n
                out[f"monitor/logz/{name}"] = s[f"logz_sum/{name}"] / n
                out[f"monitor/hidden_norm/{name}"] = s[f"hnorm_sum/{name}"] / n
                out[f"monitor/logit_gap/{name}"] = s[f"gap_sum/{name}"] / n
        # MoE: busiest expert's share over the mean share (1 = balanced)
        for name in MODALITY_NAMES:
            load = [v for k, v in s.items() if k.startswith(f"moe_load/{name}/")]
            if load and sum(load) > 0:
                out[f"monitor/moe_max_load/{name}"] = max(load) * len(load) / sum(load)
        for name in ("image", "video"):
            codes = [s.get(f"code_bucket/{name}/{i:02d}", 0.0) for i in range(CODE_BUCKETS)]
            n_codes = sum(codes)
            if n_codes > 0:
                h = -sum(c / n_codes * math.log(c / n_codes) for c in codes if c)
                out[f"monitor/data_codes/{name}"] = n_codes
                out[f"monitor/data_code_entropy/{name}"] = h / math.log(
                    min(CODE_BUCKETS, max(n_codes, 2))
                )
        total = sum(s[f"mix_tokens/{source}"] for source in self.source_names) or 1.0
        for source in self.source_names:
            out[f"mix/{source}"] = s[f"mix_tokens/{source}"] / total
        dropped = {k[len("dropped/") :]: v for k, v in s.items() if k.startswith("dropped/") and v}
        if dropped or self.cfg.data.allow_block_drops:
            out["data/dropped_blocks"] = float(sum(dropped.values()))
            out.update({f"data/dropped_blocks/{k}": v for k, v in dropped.items()})
        if (
            dropped
            and not (self.cfg.data.allow_block_drops or self._said_drops)
            and self.dist.is_main
        ):
            self._said_drops = True  # the start's check read the manifests' block summaries
            log.warning(
                f"data: visual blocks longer than data.seq_len were dropped ({', '.join(dropped)}) "
                "although the manifests said every block fits: a manifest disagrees with its "
                "shards' indexes (earlyfuse-prep verify; tokenize again). Counted in "
                "data/dropped_blocks (metrics.jsonl, final.json)"
            )
        return out

    def flops_per_unit(self) -> float:
        return float(flops_per_token(self.model_cfg, self.cfg.data.seq_len))

    def evaluate(self, engine, step: int) -> dict[str, float]:
        """One exact pass over the held-out sources (data/loader/heldout.py: the batches
        ``earlyfuse-eval`` evaluates), this rank's share of it, capped at ``train.eval_batches``
        batches a rank."""
        if not self.cfg.data.validation:
            return {}
        heldout = HeldoutPass(
            self.tables.get(self.cfg.data.validation),
            seq_len=self.cfg.data.seq_len,
            batch_rows=self.cfg.train.micro_batch,
            whole_documents=self.cfg.data.whole_documents,
            ranges=np.asarray(self.layout.modality_ranges(), np.int64),
        )
        share = RankShare(
            heldout,
            rank=self.dist.data_rank,
            world_size=self.dist.data_size,
            limit=self.cfg.train.eval_batches,
        )
        ce = torch.zeros(len(Modality), dtype=torch.float64)
        cnt = torch.zeros(len(Modality), dtype=torch.float64)
        uni = torch.zeros(len(Modality), dtype=torch.float64)
        sharded = self.dist.sp_degree > 1
        for part in share:
            batch = heldout.tensors(part)
            # Sequence-parallel: each rank of a group scores its shard of the same rows; the sums
            # over all ranks count every row once.
            inputs = self.shard({k: batch[k].to(self.dist.device) for k in MODEL_INPUTS})
            if not sharded:
                inputs["one_doc_rows"] = one_doc_rows(batch)
            res = engine(**inputs)
            if part is None:  # a blank batch: run so that every rank runs as often
                continue
            ce += res.ce_sum.detach().double().cpu()
            cnt += res.count.detach().double().cpu()
            if self.unigram is not None:
                labelled = inputs if sharded else batch
                uni += self.unigram.nll_sums(
                    labelled["labels"].cpu(), labelled["label_modality"].cpu(), self._unigram_lp
                )[0]
        # Batches counted once per SP group (its ranks evaluate the same rows)
        first = float(self.dist.sp_rank == 0)
        flags = torch.tensor(
            [share.evaluated * first, (not share.complete) * first], dtype=torch.float64
        )
        # One reduction, on the device (NCCL reduces device tensors only)
        sums = all_reduce_sum(torch.cat([ce, cnt, uni, flags]).to(self.dist.device)).cpu()
        ce, cnt, uni, flags = sums.split([len(ce), len(cnt), len(uni), len(flags)])
        out = {}
        for i, name in enumerate(MODALITY_NAMES):
            if cnt[i] > 0:
                out[f"val/loss/{name}"] = float(ce[i] / cnt[i])
                out[f"val/ppl/{name}"] = math.exp(min(50.0, float(ce[i] / cnt[i])))
                if self.unigram is not None:
                    out[f"val/unigram/{name}"] = float(uni[i] / cnt[i])
                    out[f"val/margin/{name}"] = float((uni[i] - ce[i]) / cnt[i])
                out[f"val/tokens/{name}"] = float(cnt[i])
        if cnt.sum() > 0:
            out["val/loss"] = float(ce.sum() / cnt.sum())
            if self.unigram is not None:
                out["val/unigram"] = float(uni.sum() / cnt.sum())
        # Whether this was the whole held-out set or its first batches (train.eval_batches), and
        # the batches evaluated on all ranks together.
        out["val/complete"] = float(flags[1] == 0)
        out["val/batches"] = float(flags[0])
        # What a complete pass leaves out all the same: held-out documents that fail their checks
        # (each logged by iter_documents) and visual blocks longer than a row. Every rank packs
        # the whole pass, so the counts are the same on every rank; a capped pass reads only
        # part of the set, and its counts would be of that part.
        if out["val/complete"]:
            out["val/skipped"] = float(sum(c.skipped for c in heldout.counts))
            out["val/dropped_blocks"] = float(sum(c.dropped_blocks for c in heldout.counts))
        return out

    def chance_levels(self) -> dict[str, float]:
        return chance_levels(vocab_sizes(self.layout))

    def probes(self, monitor_cfg, engine):
        return LMProbes(monitor_cfg, self.cfg, self, self.dist, engine)

    def finish(self, engine, run_dir: Path) -> dict[str, float]:
        """Over all ranks: the run's dropped visual blocks (the loader's counts survive resumes)
        and, in epoch mode, the documents of the epoch not trained on in full (``held_back``)."""
        loader = getattr(self, "_loader", None)
        out: dict[str, float] = {}
        if loader is None:
            return out
        # the ranks of a sequence-parallel group read one loader's rows: the first one counts
        share = 1.0 if self.dist.sp_rank == 0 else 0.0
        if self.cfg.data.mode == "epoch":
            held = torch.tensor([float(loader.held_back()) * share], device=self.dist.device)
            out["data/held_back"] = float(all_reduce_sum(held).item())
            if out["data/held_back"] and self.dist.is_main:
                log.info(
                    f"data: {out['data/held_back']:.0f} document(s) of the epoch were not "
                    "delivered in full: held back so that every consumer (rank x worker) yields "
                    "as many batches as the one with the fewest, or not reached when the run "
                    'ended first (docs/loader.md, "Modes"; data/held_back in final.json)'
                )
        keys = [(n, m) for n in self.source_names for m in DROPPABLE]
        counts = loader.dropped_blocks()
        local = torch.tensor([float(counts.get(n, {}).get(m, 0)) * share for n, m in keys])
        total = all_reduce_sum(local.to(self.dist.device)).cpu().tolist()
        out.update({f"data/dropped_blocks/{n}/{m}": v for (n, m), v in zip(keys, total) if v})
        if any(total) or self.cfg.data.allow_block_drops:
            out["data/dropped_blocks"] = float(sum(total))
        return out

    def state_dict(self) -> dict:
        return {"documents": self.documents.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        self.documents.load_state_dict(state["documents"])

    def extra_files(self) -> dict[str, str]:
        # Beside the layout, in the checkpoint's manifest: the tokenizers its token data was made
        # with, which a release checks --tokenizers against once the shards are gone.
        tables = self.tables.get([*self.cfg.data.sources, *self.cfg.data.validation])
        return {
            LAYOUT_FILE: json.dumps(self.layout.to_dict(), indent=2, sort_keys=True) + "\n",
            CHECKPOINT_TOKENIZERS_FILE: json.dumps(source_tokenizers(tables), indent=1) + "\n",
        }
