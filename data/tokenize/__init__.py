"""``earlyfuse-prep tokenize``: raw shards -> token shards (ids, modality, spans), one token
shard per raw shard, with index, manifest and rejects like the raw folder."""
