"""Focus masks as FlexAttention ``mask_mod``s and ``BlockMask``s.

The pattern (docs/design.md, "The semantics") is the union of three pieces, each a tiny ``mask_mod`` over token
positions::

    causal            sliding_window(3)    sinks(1)           same_group (letters = groups)
    x . . . . .       x . . . . .          x . . . . .        a . . . . .
    x x . . . .       x x . . . .          x . . . . .        . b . . . .
    x x x . . .       x x x . . .          x . . . . .        a . a . . .
    x x x x . .       . x x x . .          x . . . . .        . b . b . .
    x x x x x .       . . x x x .          x . . . . .        a . a . a .
    x x x x x x       . . . x x x          x . . . . .        . b . b . b

    focus = causal & (sliding_window | sinks | same_group)

Over token order that mask has no block sparsity when groups are interleaved, so the flex path
(:mod:`focus_flex.plan`) splits it into two calls, each over its own layout of slots, and evaluates the same pieces
on the **positions** the layout's slots hold (:func:`at_positions`):

* **local** — tokens in order: ``causal & (sliding_window | sinks)``, a band of blocks plus the sinks' block.
* **far** — token copies sorted by (group, position): ``same_group & causal & ~sliding_window & ~sinks``,
  block-diagonal (one causal triangle per group, ~1/G of the causal blocks).

Padding needs no mask of its own: a padded key slot holds position :data:`NO_KEY` (after every query, so ``causal``
drops it) and a padded query slot position -1 (before every key). Both block masks are built from block indices
(``BlockMask.from_kv_blocks``), never from a dense mask; lengths and offsets live in index tensors, never in Python
ints closed over by a ``mask_mod``, so new lengths within a bucket do not recompile.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch
from torch.nn.attention.flex_attention import BlockMask, and_masks, or_masks

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

NO_KEY = 1 << 30  # position of an empty (padding) key slot: after every query, so no causal mask keeps it


def causal(b, h, q_idx, kv_idx):
    """Key not after the query::

        x . . .
        x x . .
        x x x .
        x x x x
    """
    return kv_idx <= q_idx


def sliding_window(window: int) -> MaskMod:
    """The last ``window`` tokens, the query included (``window=2``, with ``causal``)::

        x . . .
        x x . .
        . x x .
        . . x x
    """

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window

    return mask_mod


def sinks(num_sinks: int) -> MaskMod:
    """The first ``num_sinks`` tokens of the sequence, attention sinks (``num_sinks=1``)::

        x . . .
        x . . .
        x . . .
        x . . .
    """

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < num_sinks

    return mask_mod


def outside(mask_mod: MaskMod) -> MaskMod:
    """The complement of ``mask_mod`` (``outside(sliding_window(2))`` with ``causal``: the far pairs)::

        . . . .
        . . . .
        x . . .
        x x . .
    """

    def outside_mod(b, h, q_idx, kv_idx):
        return ~mask_mod(b, h, q_idx, kv_idx)

    return outside_mod


@torch.library.custom_op("focus_flex::table", mutates_args=())
def _table(x: torch.Tensor) -> torch.Tensor:
    """A copy of x that inductor keeps as a buffer of its own (an opaque op's output)."""
    return x.clone()


@_table.register_fake
def _(x: torch.Tensor) -> torch.Tensor:
    return torch.empty_like(x)


class KVHeadTable(NamedTuple):
    """A per-KV-head table ``[B, Hkv, L]`` that query head h reads as ``table[b, h // rep, i]`` (GQA: no copy of the
    table per query head)."""

    table: torch.Tensor
    rep: int


Table = torch.Tensor | KVHeadTable


def _lookup(table: Table) -> Callable[[torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]:
    """``table[b, i]`` for a per-row table ``[B, L]``, ``table[b, h, i]`` for a per-head one ``[B, H, L]``,
    ``table[b, h // rep, i]`` for a :class:`KVHeadTable`.

    Inside a ``torch.compile`` trace a plain table passes through :func:`_table` first: torch 2.13's CPU flex lowering
    fails ("NotImplementedError: Pointwise") on a ``mask_mod`` capturing a tensor that the same graph computes
    pointwise and has not yet stored, and an opaque op's output is always stored. A :class:`KVHeadTable` is a cache's
    stored state, read in place.
    """
    if isinstance(table, KVHeadTable):
        stored, rep = table
        return lambda b, h, i: stored[b, h // rep, i]
    if torch.compiler.is_compiling():
        table = _table(table)
    if table.dim() == 2:
        return lambda b, h, i: table[b, i]
    return lambda b, h, i: table[b, h, i]


def same_group(q_member: Table, k_member: Table) -> MaskMod:
    """Query and key share a group; memberships are int64 bitmasks ``[B, H, L]`` (bit g: group g), per slot::

        a . . . . .     (q and k in groups a/b, alternating)
        . b . . . .
        a . a . . .
        . b . b . .
    """
    q_bits, k_bits = _lookup(q_member), _lookup(k_member)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_bits(b, h, q_idx) & k_bits(b, h, kv_idx)) != 0

    return mask_mod


def first_shared_group(q_group: Table, q_member: Table, k_member: Table) -> MaskMod:
    """The query slot's group (one bit, ``q_group`` ``[B, H, Lq]``) is the lowest group query and key share.

    A query and a key both in several groups would otherwise meet once per shared group; with this only the copy of
    the lowest shared group keeps the pair. ``q_member``/``k_member``: the tokens' full bitmasks ``[B, H, L]``.
    """
    q_bit, q_bits, k_bits = _lookup(q_group), _lookup(q_member), _lookup(k_member)

    def mask_mod(b, h, q_idx, kv_idx):
        lower = q_bit(b, h, q_idx) - 1  # the bits of every group below the slot's
        return (q_bits(b, h, q_idx) & k_bits(b, h, kv_idx) & lower) == 0

    return mask_mod


def key_in_first_shared_group(k_group: Table, q_member: Table, k_member: Table) -> MaskMod:
    """The key slot's group (one bit, ``k_group``) is the lowest group query and key share: the key-side twin of
    :func:`first_shared_group`, for layouts that hold a key once per group it is in (a cache paged by group)."""
    k_bit, q_bits, k_bits = _lookup(k_group), _lookup(q_member), _lookup(k_member)

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_bits(b, h, q_idx) & k_bits(b, h, kv_idx) & (k_bit(b, h, kv_idx) - 1)) == 0

    return mask_mod


def key_slots(start: int, end: int) -> MaskMod:
    """Key slots ``[start, end)``, a region of a layout, for every query (``key_slots(1, 3)``)::

        . x x .
        . x x .
        . x x .
    """

    def mask_mod(b, h, q_idx, kv_idx):
        return (kv_idx >= start) & (kv_idx < end)

    return mask_mod


def key_flag(flags: Table) -> MaskMod:
    """Key slots where ``flags`` (bool ``[B, Lk]`` or ``[B, H, Lk]``) is set, for every query (a column)::

        . x . .
        . x . .
        . x . .
    """
    flag = _lookup(flags)

    def mask_mod(b, h, q_idx, kv_idx):
        return flag(b, h, kv_idx)

    return mask_mod


def at_positions(mask_mod: MaskMod, q_pos: Table, k_pos: Table) -> MaskMod:
    """``mask_mod`` of token positions, evaluated on slots: query slot i holds position ``q_pos[.., i]``, key slot j
    position ``k_pos[.., j]`` (tables ``[B, L]`` or ``[B, H, L]``). A layout's padding is -1 (queries) and
    :data:`NO_KEY` (keys). For example ``causal`` over keys in the order 0 1 4 2 3 (position per slot)::

        x . . . .
        x x . . .
        x x . x .
        x x . x x
        x x x x x
    """
    q_at, k_at = _lookup(q_pos), _lookup(k_pos)

    def positions_mod(b, h, q_idx, kv_idx):
        return mask_mod(b, h, q_at(b, h, q_idx), k_at(b, h, kv_idx))

    return positions_mod


def focus_mask_mod(window: int, num_sinks: int, q_member: torch.Tensor, k_member: torch.Tensor) -> MaskMod:
    """The whole Focus pattern over token order (no padding): the picture above, for small checks."""
    return and_masks(causal, or_masks(sliding_window(window), sinks(num_sinks), same_group(q_member, k_member)))


def local_mask_mod(window: int, num_sinks: int) -> MaskMod:
    """The local call's pattern over positions: ``causal & (sliding_window | sinks)``."""
    return and_masks(causal, or_masks(sliding_window(window), sinks(num_sinks)))


def far_mask_mod(window: int, num_sinks: int) -> MaskMod:
    """The far call's positional pattern: ``causal & ~sliding_window & ~sinks`` (to be and-ed with ``same_group``)."""
    return and_masks(causal, outside(sliding_window(window)), outside(sinks(num_sinks)))


# ---- block masks from block indices ---------------------------------------------------------------


def tile_block_mask(partial: torch.Tensor, full: torch.Tensor, mask_mod: MaskMod, q_len: int, kv_len: int,
                    block_size: int) -> BlockMask:
    """BlockMask from per-tile classes, bool ``[B, H, nq, nk]`` (``nk = kv_len / block_size``): ``partial`` tiles
    are computed under ``mask_mod``, ``full`` tiles without it, the rest skipped. Compacted by a cumulative sum (no
    sort, no host sync): O(B H nq nk) integer work."""
    nk = kv_len // block_size
    j = torch.arange(nk, device=partial.device, dtype=torch.int32)

    def compact(tiles: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rank = tiles.to(torch.int32).cumsum(-1, dtype=torch.int32) - 1
        slot = torch.where(tiles, rank, nk)  # unselected tiles land in a spare column, then dropped
        idx = torch.zeros(tiles.shape[:-1] + (nk + 1,), dtype=torch.int32, device=tiles.device)
        idx = idx.scatter_(-1, slot.long(), j.expand_as(slot))[..., :nk]
        return tiles.sum(-1, dtype=torch.int32), idx

    (num, idx), (full_num, full_idx) = compact(partial), compact(full)
    return BlockMask.from_kv_blocks(num, idx, full_num, full_idx, BLOCK_SIZE=block_size, mask_mod=mask_mod,
                                    seq_lengths=(q_len, kv_len), compute_q_blocks=False)


def range_block_mask(has: torch.Tensor, prefix: int, start: torch.Tensor, end: torch.Tensor,
                     full_start: torch.Tensor, full_end: torch.Tensor, mask_mod: MaskMod, q_len: int, kv_len: int,
                     block_size: int) -> BlockMask:
    """BlockMask from block ranges ``[B, H, nq]``: a query block with ``has`` computes KV blocks ``[0, prefix)``
    and ``[start, end)``, of which ``[full_start, full_end)`` are full (``mask_mod`` skipped). O(B H nq nk) ints."""
    start = start.clamp_min(prefix)
    end = torch.maximum(end, start)
    full_start = torch.minimum(torch.maximum(full_start, start), end)
    full_end = torch.minimum(torch.maximum(full_end, full_start), end)
    a = torch.where(has, prefix, 0)
    b = torch.where(has, full_start - start, 0)
    c = torch.where(has, end - full_end, 0)
    f = torch.where(has, full_end - full_start, 0)
    j = torch.arange(kv_len // block_size, device=start.device)
    a, b, c, f, start, full_start, full_end = (t[..., None] for t in (a, b, c, f, start, full_start, full_end))
    idx = torch.where(j < a, j, torch.where(j < a + b, start - a + j, full_end - a - b + j))
    idx = torch.where(j < a + b + c, idx, 0)
    full_idx = torch.where(j < f, full_start + j, 0)
    i32 = torch.int32
    return BlockMask.from_kv_blocks((a + b + c)[..., 0].to(i32), idx.to(i32), f[..., 0].to(i32), full_idx.to(i32),
                                    BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(q_len, kv_len),
                                    compute_q_blocks=False)


def block_density(mask: BlockMask, dense_blocks: float) -> float:
    """Computed blocks (partial + full) over ``dense_blocks`` (e.g. the causal block count)."""
    n = mask.kv_num_blocks.sum() + (mask.full_kv_num_blocks.sum() if mask.full_kv_num_blocks is not None else 0)
    b, h = mask.kv_num_blocks.shape[:2]
    return float(n) / (b * h * dense_blocks)
