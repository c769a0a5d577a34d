"""train/streams.py: resuming the LM's token stream onto a loader that cannot take its position."""

from __future__ import annotations

import pytest
from factories import tiny_loader_config

from data.loader import build_loader
from train.config_check import ConfigError
from train.streams import TokenStream


@pytest.mark.parametrize(
    ("change", "named"),
    [({"seq_len": 512}, "seq_len=256, this loader 512"), ({"mode": "epoch"}, "mode=")],
)
def test_a_position_the_loader_cannot_carry_is_a_config_error_saying_what_to_do(
    tiny_tokens, change, named
):
    """Before: another seq_len or mode under train.allow_config_change=true passed the config
    check and then the loader's ValueError stopped the run with a traceback, exit code 1."""
    saved = build_loader(tiny_loader_config(tiny_tokens), rank=0, world_size=1, micro_batch=2)
    state = saved.state_dict()
    changed = build_loader(
        tiny_loader_config(tiny_tokens, **change), rank=0, world_size=1, micro_batch=2
    )
    with pytest.raises(ConfigError, match=named) as refused:
        TokenStream(changed).resume(state, lambda: [state])
    assert "even with train.allow_config_change=true" in str(refused.value)
    assert "train.init_from" in str(refused.value)


def test_a_source_that_cannot_be_read_is_a_config_error(tiny_tokens, tmp_path):
    """The table check's ValueError (here the source's only shard, gone since tokenize) reaches
    earlyfuse-train as a ConfigError, one line and exit code 2, not a traceback."""
    import shutil

    from data.loader import SourceConfig
    from train.streams import TableCache

    code = shutil.copytree(tiny_tokens, tmp_path / "tokens") / "code"
    next(code.glob("*.tar")).unlink()
    with pytest.raises(ConfigError, match=r"source code: .*/tokens/code' matches no shard"):
        TableCache().get([SourceConfig(name="code", shards=[str(code)])])


@pytest.mark.parametrize(("ranks", "workers"), [(4, 0), (2, 2)])
def test_epoch_mode_resumed_with_new_weights_gives_every_rank_as_many_batches(
    tiny_tokens, ranks, workers
):
    """How many batches a consumer can fill depends on the mix. Before, a plain resume with new
    weights kept the count made with the old ones: here rank 0 then ran out one batch before
    the three others (10 against 11), and the ranks' steps no longer matched. With two workers
    a rank's second one has handed out no batch yet: it counts from the start."""
    import json

    from data.loader import SourceConfig
    from data.loader.dataset import PackedLoader
    from data.loader.table_load import load_table

    def loaders(weights):
        names = ("scenes", "digits", "text", "docs")
        sources = [
            SourceConfig(name=n, shards=[str(tiny_tokens / n)], weight=w)
            for n, w in zip(names, weights)
        ]
        cfg = tiny_loader_config(tiny_tokens, sources=sources, mode="epoch", num_workers=workers)
        tables = [load_table(s) for s in cfg.sources]
        return [
            PackedLoader(cfg, tables, rank=r, world_size=ranks, micro_batch=1, pad_id=0)
            for r in range(ranks)
        ]

    def take(loader, n=None):
        it, out = iter(loader), []
        for batch in it:
            out.append(batch)
            if len(out) == n:
                break
        it.close()
        return out

    old = loaders([1.0] * 4)
    for ld in old:
        take(ld, 1)
    states = [json.loads(json.dumps(ld.state_dict())) for ld in old]
    new = loaders([1.0, 1.0, 1.0, 9.0])
    got = []
    for ld, st in zip(new, states):
        TokenStream(ld).resume(st, lambda: states)
        got.append(len(take(ld)))
    assert len({ld.batch_limit for ld in new}) == 1
    assert got == [new[0].batch_limit * max(1, workers) - 1] * ranks, (got, states[0])
