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

# Key kinds in the padded layouts used by the fast path.
PAD, REAL, EXTRA = 0, 1, 2


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


def local_mask_mod(q_abs: torch.Tensor, q_pos: torch.Tensor, k_pos: torch.Tensor, k_kind: torch.Tensor,
                   window: int, num_sinks: int) -> MaskMod:
    """Local call, tokens in order: causal & (window | sinks) over positions of real tokens.

    q_abs ``[Lq_pad]``: index of each query among the keys (queries are the last Lq keys);
    q_pos ``[B, Lq_pad]``, k_pos ``[B, Lk_tot]``: positions counting only non-padded tokens;
    k_kind ``[B, Lk_tot]``: PAD / REAL / EXTRA (the one LSE-carrying key, always visible).
    """

    def mask_mod(b, h, q_idx, kv_idx):
        kind = k_kind[b, kv_idx]
        dist = q_pos[b, q_idx] - k_pos[b, kv_idx]
        near = (dist < window) | (k_pos[b, kv_idx] < num_sinks)
        return ((kind == REAL) & (kv_idx <= q_abs[q_idx]) & near) | (kind == EXTRA)

    return mask_mod


def far_mask_mod(q_grp: torch.Tensor, q_pos: torch.Tensor, k_grp: torch.Tensor, k_pos: torch.Tensor,
                 k_kind: torch.Tensor, window: int, num_sinks: int,
                 q_mem: torch.Tensor | None = None, k_mem: torch.Tensor | None = None) -> MaskMod:
    """Far call, copies sorted by (group, position): same group, beyond the window, not a sink.

    Per-copy tensors ``[B, Hq, Nq]`` (queries) and ``[B, Hq, Nk]`` (keys, repeated per query head of
    their KV head, so that the mod never divides head indices): group id, position of the
    source token, kind. A token in several groups has one copy per group; when both queries and keys
    have top-k > 1, a pair is counted only in the lowest group they share (``q_mem``/``k_mem``
    bitmasks), so nothing is counted twice.
    """

    def mask_mod(b, h, q_idx, kv_idx):
        g = q_grp[b, h, q_idx]
        kind = k_kind[b, h, kv_idx]
        kp = k_pos[b, h, kv_idx]
        ok = (kind == REAL) & (k_grp[b, h, kv_idx] == g) & (q_pos[b, h, q_idx] - kp >= window) & (kp >= num_sinks)
        if q_mem is not None:
            lower = (torch.ones_like(g) << g) - 1
            ok = ok & ((q_mem[b, h, q_idx] & k_mem[b, h, kv_idx] & lower) == 0)
        return ok | (kind == EXTRA)

    return mask_mod


def block_mask_from_bools(blocks: torch.Tensor, full: torch.Tensor, mask_mod: MaskMod, q_len: int, kv_len: int,
                          block_size: int) -> BlockMask:
    """BlockMask from block-level booleans ``[B, H, nq, nk]``: ``blocks`` = may hold a pair,
    ``full`` = every pair allowed (``mask_mod`` is skipped there). O(nq * nk) work."""
    partial = blocks & ~full

    def indices(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        counts = x.sum(-1, dtype=torch.int32)
        order = torch.argsort((~x).to(torch.int8), dim=-1, stable=True).to(torch.int32)
        return counts, order

    kv_num, kv_idx = indices(partial)
    full_num, full_idx = indices(full)
    return BlockMask.from_kv_blocks(kv_num, kv_idx, full_num, full_idx, BLOCK_SIZE=block_size,
                                    mask_mod=mask_mod, seq_lengths=(q_len, kv_len))


def block_density(mask: BlockMask, dense_blocks: float) -> float:
    """Computed blocks (partial + full) over ``dense_blocks`` (e.g. the causal block count)."""
    n = mask.kv_num_blocks.sum() + (mask.full_kv_num_blocks.sum() if mask.full_kv_num_blocks is not None else 0)
    b, h = mask.kv_num_blocks.shape[:2]
    return float(n) / (b * h * dense_blocks)
