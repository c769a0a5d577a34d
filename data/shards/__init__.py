"""Raw and token shards on disk: tar files in webdataset convention, their indexes, manifests."""
