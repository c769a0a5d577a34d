"""Benchmarks of the model, on CPU, in one run (docs/benchmarks.md, "Model", has the method):
forward+backward time of ``model.Transformer`` against ``RefModel``, a plain-PyTorch transformer
of the same architecture given the same weights; and the peak memory of the chunked fused CE
against unchunked CE at a 64k vocabulary, each variant in a fresh process.

    .venv/bin/python tools/bench/bench_model.py [--threads 1] [--quick]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from model.attention import AttentionConfig  # noqa: E402
from model.layers import FFNConfig  # noqa: E402
from model.loss import chunked_linear_cross_entropy  # noqa: E402
from model.transformer import TransformerConfig  # noqa: E402
from tools.bench import machine, medians, rounds, status_mib  # noqa: E402


# --- a plain reference transformer --------------------------------------------------------
class RefBlock(nn.Module):
    def __init__(self, d, h, kv, ffn):
        super().__init__()
        self.h, self.kv, self.hd = h, kv, d // h
        self.n1, self.n2 = nn.RMSNorm(d, eps=1e-5), nn.RMSNorm(d, eps=1e-5)
        self.qn, self.kn = nn.RMSNorm(self.hd, eps=1e-5), nn.RMSNorm(self.hd, eps=1e-5)
        self.wq = nn.Linear(d, h * self.hd, bias=False)
        self.wk = nn.Linear(d, kv * self.hd, bias=False)
        self.wv = nn.Linear(d, kv * self.hd, bias=False)
        self.wo = nn.Linear(h * self.hd, d, bias=False)
        self.w1, self.w3 = nn.Linear(d, ffn, bias=False), nn.Linear(d, ffn, bias=False)
        self.w2 = nn.Linear(ffn, d, bias=False)

    def forward(self, x, cos, sin):
        B, T, D = x.shape
        y = self.n1(x)
        q = self.qn(self.wq(y).view(B, T, self.h, self.hd)).transpose(1, 2)
        k = self.kn(self.wk(y).view(B, T, self.kv, self.hd)).transpose(1, 2)
        v = self.wv(y).view(B, T, self.kv, self.hd).transpose(1, 2)

        def rot(t):
            a, b = t.chunk(2, -1)
            return t * cos + torch.cat([-b, a], -1) * sin

        q, k = rot(q), rot(k)
        k, v = k.repeat_interleave(self.h // self.kv, 1), v.repeat_interleave(self.h // self.kv, 1)
        a = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + self.wo(a.transpose(1, 2).reshape(B, T, D))
        y = self.n2(x)
        return x + self.w2(F.silu(self.w1(y)) * self.w3(y))


class RefModel(nn.Module):
    def __init__(self, V, d, L, h, kv, ffn):
        super().__init__()
        self.emb = nn.Embedding(V, d)
        self.blocks = nn.ModuleList(RefBlock(d, h, kv, ffn) for _ in range(L))
        self.norm = nn.RMSNorm(d, eps=1e-5)
        self.head = nn.Linear(d, V, bias=False)
        self.hd = d // h

    def forward(self, ids, labels):
        T = ids.shape[1]
        inv = 1.0 / (10_000.0 ** (torch.arange(0, self.hd, 2).float() / self.hd))
        ang = torch.arange(T).float()[:, None] * inv
        cos, sin = torch.cat([ang, ang], -1).cos(), torch.cat([ang, ang], -1).sin()
        x = self.emb(ids)
        for block in self.blocks:
            x = block(x, cos, sin)
        logits = self.head(self.norm(x)).float()
        return F.cross_entropy(
            logits.view(-1, logits.shape[-1]), labels.view(-1), ignore_index=-100
        )


def copy_weights(ours, ref):
    with torch.no_grad():
        ref.emb.weight.copy_(ours.tok_embeddings.weight)
        ref.head.weight.copy_(ours.output.weight)
        for our_layer, ref_block in zip(ours.layers, ref.blocks):
            for name in ("wq", "wk", "wv", "wo"):
                getattr(ref_block, name).weight.copy_(getattr(our_layer.attention, name).weight)
            for name in ("w1", "w2", "w3"):
                getattr(ref_block, name).weight.copy_(
                    getattr(our_layer.feed_forward.mlp, name).weight
                )


def fwd_bwd(model: nn.Module, loss_of) -> Callable[[], float]:
    """Seconds of one forward and backward of ``loss_of()``, the gradients cleared first."""

    def timed() -> float:
        model.zero_grad(set_to_none=True)
        started = time.perf_counter()
        loss_of().backward()
        return time.perf_counter() - started

    return timed


def bench_speed(quick: bool) -> dict:
    shape = {"vocab": 5166, "dim": 256, "layers": 4, "heads": 4, "kv_heads": 2, "ffn": 704}
    B, T = (2, 128) if quick else (4, 256)
    cfg = TransformerConfig(
        vocab_size=shape["vocab"],
        text_vocab_size=4096,
        visual_offset=4166,
        dim=shape["dim"],
        n_layers=shape["layers"],
        attention=AttentionConfig(
            n_heads=shape["heads"], n_kv_heads=shape["kv_heads"], backend="sdpa"
        ),
        ffn=FFNConfig(hidden_dim=shape["ffn"]),
    )
    torch.manual_seed(0)
    ours = cfg.build()
    ref = RefModel(*(shape[key] for key in ("vocab", "dim", "layers", "heads", "kv_heads", "ffn")))
    copy_weights(ours, ref)
    ids = torch.randint(0, shape["vocab"], (B, T))
    labels = torch.cat([ids[:, 1:], torch.full((B, 1), -100)], 1)
    docs = (torch.arange(T) // (T // 4)).expand(B, T)  # 4 documents per row
    with torch.no_grad():
        loss_ours, loss_ref = ours(ids, labels=labels).loss.item(), ref(ids, labels).item()
    # the same function (ours adds the 1e-5 z-loss)
    assert abs(loss_ours - loss_ref) < 1e-2, (loss_ours, loss_ref)
    warm, iters = (2, 4) if quick else (3, 15)
    steps = {
        "ref": fwd_bwd(ref, lambda: ref(ids, labels)),
        "ours": fwd_bwd(ours, lambda: ours(ids, labels=labels).loss),
        "docs": fwd_bwd(ours, lambda: ours(ids, labels=labels, doc_ids=docs).loss),
    }
    rounds(steps, warm)
    med = medians(rounds(steps, iters))
    return {
        "config": {**shape, "batch": B, "seq": T, "params": ours.num_params()},
        "loss_ours": loss_ours,
        "loss_ref": loss_ref,
        "ref_s": med["ref"],
        "ours_s": med["ours"],
        "ours_4docs_s": med["docs"],
        "ratio": med["ours"] / med["ref"],
        "ratio_4docs": med["docs"] / med["ref"],
    }


# --- CE memory, one variant per fresh process ----------------------------------------------
def ce_child(chunk: int, N: int, D: int, V: int) -> None:
    torch.manual_seed(0)
    hidden = torch.randn(N, D, requires_grad=True)
    weight = torch.randn(V, D).mul_(D**-0.5).requires_grad_()
    targets = torch.randint(0, V, (N,))
    weight.grad = torch.zeros_like(weight)  # the parameter's .grad exists in training either way
    hidden.grad = torch.zeros_like(hidden)
    before = status_mib("VmRSS")
    try:  # the kernel's peak-RSS mark (VmHWM) reset, so that the setup does not count
        Path("/proc/self/clear_refs").write_text("5")
        reset = True
    except OSError:  # not allowed here: the peak then includes the setup
        reset = False
    started = time.perf_counter()
    if chunk < 0:  # the usual plain PyTorch: full fp32 logits, F.cross_entropy, no z-loss
        loss = F.cross_entropy((hidden @ weight.t()).float(), targets)
    else:
        loss = chunked_linear_cross_entropy(
            hidden, weight, targets, z_loss_coef=1e-5, chunk_size=chunk
        )[0]
    loss.backward()
    seconds = time.perf_counter() - started
    peak = status_mib("VmHWM")
    print(
        json.dumps(
            {
                "chunk": chunk,
                "extra_peak_bytes": (peak - before) * 2**20,
                "seconds": seconds,
                "loss": loss.item(),
                "peak_reset": reset,
            }
        )
    )


def bench_ce_memory(quick: bool) -> dict:
    N, D, V = (1024, 256, 65536) if quick else (2048, 256, 65536)
    runs: list[dict] = []
    out = {"tokens": N, "dim": D, "vocab": V, "full_fp32_logits_bytes": N * V * 4, "runs": runs}
    for chunk in (-1, 0, 1024, 256):
        child = subprocess.run(
            [sys.executable, __file__, "--ce-child", str(chunk), str(N), str(D), str(V)],
            capture_output=True,
            text=True,
            check=True,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
        )
        runs.append(json.loads(child.stdout.strip().splitlines()[-1]))
    plain, unchunked = runs[0]["extra_peak_bytes"], runs[1]["extra_peak_bytes"]
    for run in runs:
        run["ratio_to_plain"] = run["extra_peak_bytes"] / plain
        run["ratio_to_unchunked"] = run["extra_peak_bytes"] / unchunked
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--ce-child":
        torch.set_num_threads(1)
        ce_child(*map(int, sys.argv[2:6]))
        return
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", type=int, default=1)
    parser.add_argument("--quick", action="store_true", help="smaller sizes (a smoke run)")
    parser.add_argument("--json", type=Path, help="also write the results here")
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    res = {
        "machine": f"{machine()}, torch {torch.__version__}",
        "threads": args.threads,
    }
    res["speed"] = speed = bench_speed(args.quick)
    print(f"machine: {res['machine']}; torch threads: {args.threads}")
    config = speed["config"]
    print(
        f"fwd+bwd, {config['params'] / 1e6:.2f}M params (dim {config['dim']}, {config['layers']} layers, vocab {config['vocab']}), "
        f"batch {config['batch']}x{config['seq']}:"
    )
    print(
        f"  reference {speed['ref_s'] * 1e3:.1f} ms, ours {speed['ours_s'] * 1e3:.1f} ms  -> ratio {speed['ratio']:.3f}"
    )
    print(
        f"  ours with 4 documents per row (dense block-diagonal mask): {speed['ours_4docs_s'] * 1e3:.1f} ms "
        f"-> ratio {speed['ratio_4docs']:.3f}"
    )
    res["ce_memory"] = ce_memory = bench_ce_memory(args.quick)
    print(
        f"CE peak memory, {ce_memory['tokens']} label tokens, dim {ce_memory['dim']}, vocab {ce_memory['vocab']} "
        f"(full fp32 logits = {ce_memory['full_fp32_logits_bytes'] / 2**20:.0f} MiB), fwd+bwd:"
    )
    names = {-1: "plain F.cross_entropy", 0: "ours, unchunked (chunk_size=0)"}
    for run in ce_memory["runs"]:
        name = names.get(run["chunk"], f"ours, chunk_size={run['chunk']}")
        print(
            f"  {name:31s} extra peak RSS {run['extra_peak_bytes'] / 2**20:7.1f} MiB  "
            f"vs plain {run['ratio_to_plain']:.3f}  vs unchunked {run['ratio_to_unchunked']:.3f}  "
            f"time {run['seconds']:.2f} s"
        )
    if args.json:
        args.json.write_text(json.dumps(res, indent=2) + "\n")


if __name__ == "__main__":
    main()
