"""Compiled helpers that bring documents of a checked shard (data/loader/shard_check.py) into
the compiled loop's arrays (data/loader/stream_arrays.py) a run at a time: their packing units
(``fill_units``, which ``pack_kernel.units_of`` runs for one document too) and their tokens
copied out of the shard's memory map: a loop over the run, with no Python object per document."""

from __future__ import annotations

import numpy as np
from numba import njit


@njit(cache=True, inline="always")
def _text_unit(units, u_at, start, end):
    units[u_at, 0], units[u_at, 1] = start, end
    units[u_at, 2:] = 0
    return u_at + 1


@njit(cache=True)
def fill_units(units, u_at, sel, lengths, bstart, bcount, blocks, unit0, n_units):
    """Write the units of the run's documents at ``sel`` (one shard's; ``blocks``: its blocks
    table) from ``u_at`` on (rows as ``pack_kernel.units_of``'s: text between the visual blocks,
    blocks in order of start); ``unit0``/``n_units`` get where they lie and how many. Returns the
    next free unit row."""
    for doc in sel:
        length, first, count = lengths[doc], bstart[doc], bcount[doc]
        unit0[doc] = u_at
        pos = 0
        if count:  # most documents have none
            for in_order in np.argsort(blocks[first : first + count, 0], kind="mergesort"):
                block = first + in_order
                start, end = blocks[block, 0], blocks[block, 1]
                if start > pos:
                    u_at = _text_unit(units, u_at, pos, start)
                units[u_at, 0], units[u_at, 1], units[u_at, 2] = start, end, 1
                units[u_at, 3:] = blocks[block, 2:5]
                u_at += 1
                pos = end
        if pos < length:
            u_at = _text_unit(units, u_at, pos, length)
        n_units[doc] = u_at - unit0[doc]
    return u_at


@njit(cache=True, inline="always")
def copy_run(dst, src, count):
    """``src`` into ``dst``, both ``count`` long (False, nothing copied, when either is not). An
    element loop over views indexed from 0, not a slice assignment (which checks the two sides
    for overlap per call, a cost that weighs most on short documents and pieces)."""
    if dst.shape[0] != count or src.shape[0] != count:
        return False
    for at in range(dst.shape[0]):
        dst[at] = src[at]
    return True


@njit(cache=True)
def gather_tokens(mapped, sel, ids_at, mod_at, lengths, dst, ids_out, mod_out):
    """Copy the int32 ids and uint8 modalities of the run's documents at ``sel`` (one shard's)
    out of its map (``mapped``: its bytes) to ``dst`` onwards in the staging arrays
    (``copy_run``)."""
    for doc in sel:
        length_n, ids_from, mod_from, dst_at = lengths[doc], ids_at[doc], mod_at[doc], dst[doc]
        src_ids = mapped[ids_from : ids_from + 4 * length_n].view(np.int32)
        src_mod = mapped[mod_from : mod_from + length_n]
        if not (
            copy_run(ids_out[dst_at : dst_at + length_n], src_ids, length_n)
            and copy_run(mod_out[dst_at : dst_at + length_n], src_mod, length_n)
        ):
            raise ValueError("gather_tokens: a document lies outside its shard or the staging")
