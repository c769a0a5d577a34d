"""The model compiles without graph breaks and without host syncs, and compiled equals eager.

``backend="aot_eager"`` runs Dynamo and AOTAutograd (the parts that find graph breaks, host
syncs and data-dependent shapes) without Inductor's code generation, so it needs no C compiler
and takes seconds; ``fullgraph=True`` turns any graph break into an error. Inductor itself runs
in the slow test at the end (and on a GPU in tests/test_gpu/).
"""

from __future__ import annotations

import dataclasses

import pytest
import torch

from model.attention import AttentionConfig, build_attention_mask
from model.rope import RopeConfig
from model.transformer import positions_from_doc_ids

pytestmark = pytest.mark.usefixtures("one_thread")

# fp32 on CPU: compiled and eager run the same kernels in another grouping; they agree to
# rounding (a few ulp of values of order 1).
ATOL, RTOL = 1e-5, 1e-5


def configs(kit):
    """The shapes a run uses: plain, M-RoPE, bidirectional image blocks, activation checkpoints."""
    return {
        "plain": kit.tiny_config(),
        "mrope": kit.tiny_config(rope=RopeConfig(mrope_sections=[2, 1, 1])),
        "bidir": kit.tiny_config(
            attention=AttentionConfig(n_heads=4, n_kv_heads=2, bidirectional_images=True)
        ),
        "checkpointed": kit.tiny_config(activation_checkpoint_every=1),
    }


# Ops whose output shape or value the host must read back from the device: each one is a sync
SYNC_OPS = ("nonzero", "_local_scalar_dense", "bincount", "masked_select", "unique", "item")


class SyncFreeBackend:
    """``aot_eager`` that also records the ATen ops of every forward and backward graph it is
    given, so a test can assert that none of them makes the host wait for the device."""

    def __init__(self) -> None:
        from functorch.compile import make_boxed_func
        from torch._dynamo.backends.common import aot_autograd

        self.boxed = make_boxed_func

        self.ops: set[str] = set()
        self.graphs = 0
        self.backend = aot_autograd(fw_compiler=self.record, bw_compiler=self.record)

    def record(self, gm, example_inputs):
        self.graphs += 1
        for node in gm.graph.nodes:
            if node.op == "call_function":
                self.ops.add(str(node.target).split(".")[1] if "." in str(node.target) else "")
        return self.boxed(gm.forward)

    def syncs(self) -> set[str]:
        return {op for op in self.ops if op in SYNC_OPS}


def run(model, batch) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    res = model(**batch)
    res.loss.backward()
    grads = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    return torch.stack([res.loss.detach(), res.ce, res.z_loss]), grads


@pytest.mark.parametrize("name", ["plain", "mrope", "bidir", "checkpointed"])
def test_compiled_blocks_and_loss_equal_eager(kit, mixed_batch, name):
    torch.manual_seed(0)
    cfg = configs(kit)[name]
    eager = cfg.build()
    compiled = cfg.build()
    compiled.load_state_dict(eager.state_dict())
    backend = SyncFreeBackend()
    compiled.compile_blocks(backend=backend.backend)  # fullgraph: a graph break raises
    torch._dynamo.reset()
    want_values, want_grads = run(eager, mixed_batch)
    got_values, got_grads = run(compiled, mixed_batch)
    # forward and backward of one block graph (shared by both layers) and of the loss head
    assert backend.graphs >= 4 and not backend.syncs(), backend.syncs()
    torch.testing.assert_close(got_values, want_values, atol=ATOL, rtol=RTOL)
    assert set(got_grads) == set(want_grads)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=ATOL, rtol=RTOL, msg=key)


def block_inputs(kit, mixed_batch, cfg, backend: str):
    model = cfg.build()
    batch = mixed_batch
    mask = build_attention_mask(
        *batch["input_ids"].shape,
        batch["input_ids"].device,
        doc_ids=batch["doc_ids"],
        image_ids=batch["image_ids"],
        bidirectional_images=cfg.attention.bidirectional_images,
        backend=backend,
    )
    cos, sin = model.rope(positions_from_doc_ids(batch["doc_ids"]), batch["position_thw"])
    hidden = model.tok_embeddings(batch["input_ids"])
    return model, (hidden, cos, sin, mask, batch["modality"])


@pytest.mark.parametrize("name", ["plain", "mrope", "bidir"])
def test_a_block_has_no_graph_break_with_a_flex_block_mask(kit, mixed_batch, name):
    """FlexAttention with the document mask (and image blocks) inside one compiled block: one
    graph, no break. On CPU FlexAttention has no backward, hence no_grad."""
    torch.manual_seed(0)
    cfg = configs(kit)[name]
    torch._dynamo.reset()
    with torch.no_grad():
        model, args = block_inputs(kit, mixed_batch, cfg, "flex")
        assert args[3].block_mask is not None
        block = model.blocks()[0]
        explained = torch._dynamo.explain(block)(*args)
        assert explained.graph_break_count == 0, explained.break_reasons
        assert explained.graph_count == 1
        want, _ = block(*args)
        got, _ = torch.compile(block, fullgraph=True, backend="aot_eager")(*args)
    torch.testing.assert_close(got, want, atol=ATOL, rtol=RTOL)


def test_the_loss_head_has_no_graph_break_and_no_data_dependent_shape(kit, mixed_batch):
    torch.manual_seed(0)
    model = kit.tiny_config().build()
    hidden = torch.randn(2, 64, 32, requires_grad=True)
    label_modality = torch.cat(
        [mixed_batch["modality"][:, 1:], mixed_batch["modality"][:, -1:]], dim=1
    )
    args = (model.norm(hidden), hidden, mixed_batch["labels"], label_modality)
    torch._dynamo.reset()
    explained = torch._dynamo.explain(model.output)(*args)
    assert explained.graph_break_count == 0, explained.break_reasons
    backend = SyncFreeBackend()
    torch.compile(model.output, fullgraph=True, backend=backend.backend)(*args).loss.backward()
    assert backend.graphs == 2 and not backend.syncs(), backend.syncs()


def test_the_old_host_syncs_are_caught():
    """The tests above have teeth: the one-document check the model used to make breaks the
    graph (an error under fullgraph), and picking label positions with ``nonzero`` (a shape the
    host must read back) is seen among the graph's ops."""

    def one_document_check(doc):
        return doc * 2 if bool((doc == doc[:, :1]).all()) else doc

    def label_positions(labels):
        flat = labels.reshape(-1).float()
        return flat.index_select(0, (flat != -100).nonzero()[:, 0]).sum()

    doc = torch.zeros(2, 8, dtype=torch.long)
    torch._dynamo.reset()
    with pytest.raises(Exception, match="data-dependent|Data-dependent|graph break"):
        torch.compile(one_document_check, fullgraph=True, backend="aot_eager")(doc)
    backend = SyncFreeBackend()
    try:
        torch.compile(label_positions, fullgraph=True, backend=backend.backend)(doc)
    except Exception:  # noqa: BLE001 - a torch that cannot capture nonzero breaks the graph
        return
    assert "nonzero" in backend.syncs()


def test_one_doc_rows_flag_chooses_the_causal_path_without_reading_doc_ids(kit):
    doc = torch.tensor([[0, 0, 0, 1], [0, 0, 0, 0]])
    assert build_attention_mask(2, 4, doc.device, doc_ids=doc, backend="sdpa").dense is not None
    flagged = build_attention_mask(
        2, 4, doc.device, doc_ids=doc[:, :1].expand(2, 4), backend="sdpa"
    )
    assert flagged.causal
    told = build_attention_mask(
        2, 4, doc.device, doc_ids=torch.zeros(2, 4, dtype=torch.long), one_doc_rows=False
    )
    assert told.dense is not None  # told there are several: the document mask, as told


def test_a_block_mask_for_another_shape_is_refused(kit, mixed_batch):
    cfg = kit.tiny_config(attention=AttentionConfig(n_heads=4, n_kv_heads=2, backend="flex"))
    model = cfg.build()
    with torch.no_grad():
        mask = build_attention_mask(2, 128, torch.device("cpu"), doc_ids=None, backend="flex")
        hidden = model.tok_embeddings(mixed_batch["input_ids"])
        cos, sin = model.rope(mixed_batch["position_ids"], None)
        with pytest.raises(ValueError, match="128 queries"):
            model.blocks()[0](hidden, cos, sin, mask, mixed_batch["modality"])


@pytest.mark.slow
def test_inductor_compiled_loss_and_grads_equal_eager(kit, mixed_batch):
    """Inductor's generated code (C++ on CPU) for the blocks and the loss: same loss and grads."""
    torch.manual_seed(0)
    cfg = dataclasses.replace(kit.tiny_config(), n_layers=1)
    eager = cfg.build()
    compiled = cfg.build()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_blocks()
    torch._dynamo.reset()
    want_values, want_grads = run(eager, mixed_batch)
    got_values, got_grads = run(compiled, mixed_batch)
    torch.testing.assert_close(got_values, want_values, atol=1e-4, rtol=1e-4)
    for key, grad in want_grads.items():
        torch.testing.assert_close(got_grads[key], grad, atol=1e-4, rtol=1e-4, msg=key)


def test_a_compiled_model_generates_as_the_eager_one(kit, mixed_batch):
    """Generation after ``compile_blocks`` (a training run's probes draw): decoding runs eager.
    Every decode step has a new shape, so the static fullgraph blocks recompiled each step until
    dynamo's recompile limit (8) stopped the run with FailOnRecompileLimitHit."""
    from model.generate import SamplingConfig, generate

    torch.manual_seed(0)
    cfg = kit.tiny_config()
    eager = cfg.build().eval()
    compiled = cfg.build().eval()
    compiled.load_state_dict(eager.state_dict())
    compiled.compile_blocks(backend="aot_eager")
    torch._dynamo.reset()
    compiled(**mixed_batch)  # a training shape compiled first, as in a run
    prompt = mixed_batch["input_ids"][:2, :5]
    sampling = SamplingConfig(max_new_tokens=12, temperature=0.0)  # past the recompile limit
    want = generate(eager, prompt, sampling=sampling)
    assert torch.equal(generate(compiled, prompt, sampling=sampling), want)


def test_a_compiled_block_keeps_a_graph_for_every_way_a_run_calls_it(kit, mixed_batch):
    """Training and evaluation, rows of several documents and of one, checkpointed and plain
    blocks (activation_checkpoint_every=2), local and global layers: each combination is a graph
    of its own, 8 here, all dynamo's default limit allows, past which fullgraph=True ends the run
    (a local/global run with every second block checkpointed died at step 62). A second batch size
    doubles them, past that limit: compile_blocks raises it."""
    from torch._dynamo.utils import counters

    torch.manual_seed(0)
    cfg = kit.tiny_config(
        n_layers=4,
        activation_checkpoint_every=2,
        attention=AttentionConfig(n_heads=4, n_kv_heads=2, local_window=8, global_every=2),
    )
    model = cfg.build()
    model.compile_blocks(backend="aot_eager")
    torch._dynamo.reset()
    counters.clear()
    one_doc = {key: value.clone() for key, value in mixed_batch.items()}
    one_doc["doc_ids"] = torch.zeros_like(one_doc["doc_ids"])
    one_doc.pop("position_ids", None)
    for batch in (mixed_batch, one_doc):
        for rows in (2, 1):
            part = {key: value[:rows] for key, value in batch.items()}
            model.train()
            model(**part).loss.backward()
            model.eval()
            with torch.no_grad():
                model(**part)
    assert counters["stats"]["unique_graphs"] > 8 + 2  # the blocks' and the loss head's
