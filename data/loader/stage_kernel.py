"""Compiled helpers that bring documents of a checked shard (data/loader/shard_check.py) into
the compiled loop's arrays (data/loader/fast_stream.py) a run at a time: their packing units
(``packer.units_of``) and their tokens copied out of the shard's memory map. Per document
in Python this was ~10 us (views, units, a ``Doc``); here it is a loop over the run."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True)
def fill_units(units, u_at, lengths, bstart, bcount, blocks, unit0, n_units, nblk):
    """Write each document's units from ``u_at`` on (``packer.units_of``: text between the
    visual blocks, blocks in order of start); ``u0``/``nu``/``nblk`` get where they lie, how
    many and how many are blocks. Returns the next free unit row."""
    for doc in range(lengths.shape[0]):
        length, count = lengths[doc], bcount[doc]
        unit0[doc] = u_at
        if count == 0:
            nblk[doc] = 0
            if length:
                units[u_at, 0], units[u_at, 1] = 0, length
                units[u_at, 2] = units[u_at, 3] = units[u_at, 4] = units[u_at, 5] = 0
                u_at += 1
            n_units[doc] = u_at - unit0[doc]
            continue
        first = bstart[doc]
        order = np.argsort(blocks[first : first + count, 0], kind="mergesort")
        pos = 0
        for in_order in order:
            block = first + in_order
            start, end = blocks[block, 0], blocks[block, 1]
            if start > pos:
                units[u_at, 0], units[u_at, 1] = pos, start
                units[u_at, 2] = units[u_at, 3] = units[u_at, 4] = units[u_at, 5] = 0
                u_at += 1
            units[u_at, 0], units[u_at, 1], units[u_at, 2] = start, end, 1
            units[u_at, 3], units[u_at, 4], units[u_at, 5] = (
                blocks[block, 2],
                blocks[block, 3],
                blocks[block, 4],
            )
            u_at += 1
            pos = end
        if pos < length:
            units[u_at, 0], units[u_at, 1] = pos, length
            units[u_at, 2] = units[u_at, 3] = units[u_at, 4] = units[u_at, 5] = 0
            u_at += 1
        n_units[doc] = u_at - unit0[doc]
        nblk[doc] = count
    return u_at


@njit(cache=True)
def gather_tokens(mapped, ids_at, mod_at, lengths, dst, ids_out, mod_out):
    """Copy each document's int32 ids and uint8 modalities out of a shard's map (``mapped``:
    its bytes) to ``dst`` onwards in the staging arrays."""
    for doc in range(lengths.shape[0]):
        length_n, ids_from, mod_from, dst_at = lengths[doc], ids_at[doc], mod_at[doc], dst[doc]
        ids_out[dst_at : dst_at + length_n] = mapped[ids_from : ids_from + 4 * length_n].view(
            np.int32
        )
        mod_out[dst_at : dst_at + length_n] = mapped[mod_from : mod_from + length_n]
