"""Focus masks as FlexAttention ``mask_mod``s and ``BlockMask``s.

The pattern (DESIGN.md §2) is the union of three pieces, each a tiny ``mask_mod``::

    causal            sliding_window(3)    sinks(1)           same_group (colours = groups)
    x . . . . .       x . . . . .          x . . . . .        a . . . . .
    x x . . . .       x x . . . .          x . . . . .        . b . . . .
    x x x . . .       x x x . . .          x . . . . .        a . a . . .
    x x x x . .       . x x x . .          x . . . . .        . b . b . .
    x x x x x .       . . x x x .          x . . . . .        a . a . a .
    x x x x x x       . . . x x x          x . . . . .        . b . b . b

    focus = causal & (sliding_window | sinks | same_group)

Written this way (attention-gym style) the pieces are only a picture: a plain ``mask_mod`` over
token order has no block sparsity when groups are interleaved. The fast path therefore runs two
FlexAttention calls with their own layouts (:mod:`focus_flex.attention`):

* **local** — tokens in order; ``causal & (sliding_window | sinks)``: a band of blocks.
* **far** — token copies sorted by (group, position); ``same_group & causal & ~window & ~sinks``:
  block-diagonal, one causal triangle per group, so ~1/G of the causal blocks.

Both block masks are built from block indices directly (``BlockMask.from_kv_blocks``): the work is
O((N / block)^2) integers, never an O(N^2) mask. Lengths and offsets live in index tensors, never
in Python ints closed over by a ``mask_mod``, so new lengths do not force recompiles.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
from torch.nn.attention.flex_attention import BlockMask, and_masks, or_masks

MaskMod = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]

def causal(b, h, q_idx, kv_idx):
    """Key not after the query."""
    return kv_idx <= q_idx


def sliding_window(window: int) -> MaskMod:
    """The last ``window`` tokens, the query included."""

    def mask_mod(b, h, q_idx, kv_idx):
        return q_idx - kv_idx < window

    return mask_mod


def sinks(num_sinks: int) -> MaskMod:
    """The first ``num_sinks`` tokens of the sequence (attention sinks)."""

    def mask_mod(b, h, q_idx, kv_idx):
        return kv_idx < num_sinks

    return mask_mod


def same_group(q_member: torch.Tensor, k_member: torch.Tensor) -> MaskMod:
    """Query and key share at least one group; memberships are int64 bitmasks ``[B, H, L]``."""

    def mask_mod(b, h, q_idx, kv_idx):
        return (q_member[b, h, q_idx] & k_member[b, h, kv_idx]) != 0

    return mask_mod


def focus_mask_mod(window: int, num_sinks: int, q_member: torch.Tensor, k_member: torch.Tensor) -> MaskMod:
    """The whole Focus pattern over token order (no padding): for pictures and small checks."""
    return and_masks(causal, or_masks(sliding_window(window), sinks(num_sinks), same_group(q_member, k_member)))


# ---- the two layouts of the fast path -----------------------------------------------------------


def local_mask_mod(q_base: torch.Tensor, window: int, num_sinks: int, sink_slots: int) -> MaskMod:
    """Local call over compacted tokens: causal & (window | sinks), pure index arithmetic.

    Key slots ``[0, num_sinks)`` hold the sinks, slot ``num_sinks`` the extra (LSE) key, which every query sees;
    token t sits at slot ``sink_slots + t`` (tokens below ``num_sinks`` count only as sinks). Query row r holds
    position ``q_base[b] + r``.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        p = q_idx + q_base[b]
        t = kv_idx - sink_slots
        sink = (kv_idx < num_sinks) & (kv_idx <= p)
        near = (t >= num_sinks) & (t <= p) & (p - t < window)
        return sink | near | (kv_idx == num_sinks)

    return mask_mod


def far_mask_mod(lo: torch.Tensor, hi: torch.Tensor, extra: torch.Tensor, q_grp: torch.Tensor | None = None,
                 q_mem: torch.Tensor | None = None, k_mem: torch.Tensor | None = None) -> MaskMod:
    """Far call, copies sorted by (group, position): query copy i sees key slots ``[lo_i, hi_i)`` and ``extra_i``.

    ``lo``/``hi``/``extra`` are ``[B, Hq, Nq]``: per-row lookups only, so the mod stays cheap. When queries and keys
    both have top-k > 1, a pair is counted only in the lowest group they share (``q_grp``, and ``q_mem``/``k_mem``
    bitmasks ``[B, Hq, N]``), so nothing is counted twice.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        ok = (kv_idx >= lo[b, h, q_idx]) & (kv_idx < hi[b, h, q_idx])
        if q_mem is not None:
            g = q_grp[b, h, q_idx]
            lower = (torch.ones_like(g) << g) - 1
            ok = ok & ((q_mem[b, h, q_idx] & k_mem[b, h, kv_idx] & lower) == 0)
        return ok | (kv_idx == extra[b, h, q_idx])

    return mask_mod


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
    ex = lambda t: t[..., None]  # noqa: E731
    idx = torch.where(j < ex(a), j, torch.where(j < ex(a + b), ex(start - a) + j, ex(full_end - a - b) + j))
    idx = torch.where(j < ex(a + b + c), idx, 0)
    full_idx = torch.where(j < ex(f), ex(full_start) + j, 0)
    i32 = torch.int32
    return BlockMask.from_kv_blocks((a + b + c).to(i32), idx.to(i32), f.to(i32), full_idx.to(i32),
                                    BLOCK_SIZE=block_size, mask_mod=mask_mod, seq_lengths=(q_len, kv_len),
                                    compute_q_blocks=False)


def block_density(mask: BlockMask, dense_blocks: float) -> float:
    """Computed blocks (partial + full) over ``dense_blocks`` (e.g. the causal block count)."""
    n = mask.kv_num_blocks.sum() + (mask.full_kv_num_blocks.sum() if mask.full_kv_num_blocks is not None else 0)
    b, h = mask.kv_num_blocks.shape[:2]
    return float(n) / (b * h * dense_blocks)
