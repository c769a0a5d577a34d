"""The streaming loader: token shards of several sources -> mixed, packed rows of ``seq_len``.

from data.loader import LoaderConfig, SourceConfig, build_loader
loader = build_loader(cfg, rank=0, world_size=1)
for batch in loader: ...            # dict of tensors [B, seq_len]
state = loader.state_dict()         # kilobytes; load_state_dict(state) resumes exactly
batch = next(pack_documents([doc], len(doc.ids)))  # evaluation, probes: documents packed alone
"""

from data.loader.config import LoaderConfig, SourceConfig
from data.loader.dataset import PackedLoader, build_loader
from data.loader.pack_documents import pack_documents

__all__ = ["LoaderConfig", "PackedLoader", "SourceConfig", "build_loader", "pack_documents"]
