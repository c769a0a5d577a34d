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
