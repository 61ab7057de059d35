"""The Focus plan of the flex path: routing -> the two calls' layouts -> their block masks, in tensor ops only.

No host synchronisation and no data-dependent shape: every size is a function of (batch, heads, length bucket), so
the plan runs inside ``torch.compile(fullgraph=True)`` and, on a GPU, is queued behind the model's other kernels.
All batch rows and heads are planned at once.

* **local** (:class:`LocalPlan`) — copies of the sinks in the first key block, then the tokens in their own order;
  queries shifted by less than a block so that query blocks line up with key blocks. Each (query block, key block)
  tile is classed from per-block position ranges as skipped, partial or full
  (:func:`~focus_flex.masks.tile_block_mask`), so padding anywhere (left, right, holes) only costs its blocks.
  In one pass (:attr:`~focus_flex.config.FocusConfig.one_pass`: queries and keys in so many groups that a far pair
  shares about one or more) this call is the whole pattern: its mask also keeps far pairs whose group bitmasks meet,
  over every causal tile, and there is no far call.
* **far** (:class:`FarPlan`) — one copy of a token per group it is in, sorted by (group, position) per head; query
  copy i may see the key slots ``[lo_i, hi_i)`` (its group, beyond the window, past the sinks), found by
  ``searchsorted``. A query block computes the hull of its rows' ranges; blocks inside every row's range are full.

With ``extra_key`` the layouts carry one more key per query, for backends whose flex returns no log-sum-exp
(:func:`focus_flex.attention.flex_prefill`): a slot after the sinks' copies in the local keys, and per group a slot
in front of the group's far keys.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, and_masks, or_masks

from focus_flex import routing
from focus_flex.config import FocusConfig
from focus_flex.masks import (
    NO_KEY,
    at_positions,
    block_density,
    causal,
    far_mask_mod,
    first_shared_group,
    key_flag,
    local_mask_mod,
    range_block_mask,
    same_group,
    tile_block_mask,
)

MIN_BUCKET_BLOCKS = 4  # short inputs all share one compiled shape; their padding blocks are empty


def bucket(n: int, block_size: int) -> int:
    """Padded length for n tokens: block_size * (2^a or 3 * 2^(a-1)) blocks, at least :data:`MIN_BUCKET_BLOCKS`, at
    most 1.5x n (+1 block).

    Found by comparisons only, so a symbolic length (a ``torch.compile`` trace with a dynamic length) gets guards
    that hold exactly within its bucket: lengths in one bucket share one graph.
    """
    blocks = MIN_BUCKET_BLOCKS  # a power of two
    while blocks * block_size < n:  # 4, 6, 8, 12, 16, 24, ... blocks
        blocks = blocks * 3 // 2 if blocks & (blocks - 1) == 0 else blocks * 4 // 3
    return blocks * block_size


def token_positions(valid: torch.Tensor) -> torch.Tensor:
    """Position of every token counting real tokens only, ``[B, L]`` (a left pad gets -1)."""
    return valid.long().cumsum(-1) - 1


def route(x: torch.Tensor, centroids: torch.Tensor, k: int) -> torch.Tensor:
    """Top-k groups ``[B, H, L, k]`` of every vector of x ``[B, H, L, D]``, in plain tensor ops (traceable, any
    device): the groups :func:`focus_flex.routing.hard_groups` chooses."""
    return routing.top_groups(routing._dots(x, F.normalize(centroids.float(), dim=-1)), k)


def _pad_to(x: torch.Tensor, length: int, dim: int, value: float = 0) -> torch.Tensor:
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, length - x.shape[dim]]
    return F.pad(x, pad, value=value)


def _ceil_div(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.div(x + (n - 1), n, rounding_mode="floor")


def _floor_div(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.div(x, n, rounding_mode="floor")


def _blocks(x: torch.Tensor, block_size: int) -> torch.Tensor:
    """``[..., L]`` -> ``[..., L / block_size, block_size]``: the rows of each query block."""
    return x.unflatten(-1, (-1, block_size))


@dataclass
class LocalPlan:
    """The local call's layout. Keys: ``sink_slots`` slots first, holding copies of the sinks (key ``sinks[b, j]``
    in slot j) and the extra key (slot ``extra``; None: no extra key), then key j of the Lk keys in slot
    ``sink_slots + j``. Queries: query i of the Lq queries in slot ``offset + i`` of ``q_len``."""

    mask: BlockMask
    sinks: torch.Tensor  # [B, s] key index of each sink copy (Lk where the row has fewer real tokens)
    sink_slots: int
    offset: int
    q_len: int
    kv_len: int
    extra: int | None


@dataclass
class FarPlan:
    """The far call over copies sorted by (group, position), per head.

    Query copy i (of ``Nq`` slots, padded) is a copy of query ``q_src[.., i]`` and may see key slots
    ``[lo_i, hi_i)``; key slot j holds key ``k_src[.., j]`` (-1: an extra key or padding).
    """

    mask: BlockMask
    q_src: torch.Tensor  # [B, Hq, Nq] query of every copy (padding: 0)
    q_real: torch.Tensor  # [B, Hq, Nq] bool: the copy is a real query's
    lo: torch.Tensor  # [B, Hq, Nq] first key slot of the copy's far range
    hi: torch.Tensor  # [B, Hq, Nq] end of that range (hi == lo: no far key)
    k_src: torch.Tensor  # [B, Hkv, Nk] key of every key slot (-1: none)
    extra: torch.Tensor | None  # [B, Hkv, Nk] bool: the groups' extra-key slots (None: no extra keys)

    @property
    def pairs(self) -> int:
        """Far (query, key) pairs the layout lists, over all its heads (a host read: for statistics only;
        with query and key top-k both above 1, a pair sharing s groups is listed s times)."""
        return int((self.hi - self.lo).sum())


@dataclass
class FocusPlan:
    """Both flex calls' layouts and block masks (one pass: the local call's only, ``far`` None)."""

    local: LocalPlan
    far: FarPlan | None

    @property
    def local_mask(self) -> BlockMask:
        return self.local.mask

    @property
    def far_mask(self) -> BlockMask | None:
        return None if self.far is None else self.far.mask

    def density(self, causal_blocks: float) -> dict[str, float]:
        """Computed blocks per (batch, head) relative to ``causal_blocks``, for each call and in total."""
        local = block_density(self.local.mask, causal_blocks)
        far = 0.0 if self.far is None else block_density(self.far.mask, causal_blocks)
        return {"local": local, "far": far, "total": local + far}


def local_plan(valid: torch.Tensor, lq: int, config: FocusConfig, extra_key: bool,
               members: tuple[torch.Tensor, torch.Tensor] | None = None) -> LocalPlan:
    """Plan the local call (window + sinks) of the last ``lq`` of the ``[B, Lk]`` tokens ``valid`` marks real.

    The sinks are copied into the first key block (with the extra key), where every query block finds them in one
    partial tile; in the token slots they are empty. Tiles are classed from per-block ranges of the positions they
    hold (conservatively: a computed tile may hold no allowed pair where padding leaves holes; a full tile never
    holds a forbidden pair of real tokens). With ``members``, the group bitmasks of the queries ``[B, Hq, Lq]`` and
    keys ``[B, Hkv, Lk]``, the call is the whole pattern (one pass): far pairs whose bitmasks meet are kept too, and
    every causal tile is computed.
    """
    bs, w, s = config.block_size, config.window, config.sink_tokens
    b, lk = valid.shape
    dev = valid.device
    sink_slots = bs * -(-(s + int(extra_key)) // bs)
    offset = (lk - lq) % bs  # query slot 0 sits at token lk - lq - offset, a block boundary
    q_len = bucket(offset + lq, bs)
    kv_len = sink_slots + bucket(lk, bs)
    pos = token_positions(valid)
    sinks = torch.searchsorted(pos, torch.arange(s, device=dev).expand(b, s).contiguous())  # the j-th real token
    q_pos = torch.where(valid[:, lk - lq:], pos[:, lk - lq:], -1)
    q_pos = F.pad(q_pos, (offset, q_len - offset - lq), value=-1)  # [B, q_len]
    k_pos = torch.cat([torch.where(sinks < lk, torch.arange(s, device=dev), NO_KEY),
                       torch.full((b, sink_slots - s), NO_KEY, device=dev),
                       _pad_to(torch.where(valid & (pos >= s), pos, NO_KEY), kv_len - sink_slots, 1, NO_KEY)], 1)
    # Position ranges per block: queries [qmin, qmax] (none: qmin > qmax), real keys [kmin, kmax].
    qb, kb = q_pos.unflatten(1, (-1, bs)), k_pos.unflatten(1, (-1, bs))
    qmin = torch.where(qb >= 0, qb, NO_KEY).amin(-1)[:, :, None]
    qmax = qb.amax(-1)[:, :, None]
    real = kb < NO_KEY
    kmin = kb.amin(-1)[:, None, :]
    kmax = torch.where(real, kb, -1).amax(-1)[:, None, :]
    every = real.all(-1)[:, None, :]
    # Some pair may be allowed: causal for some pair, and in the window or a sink for some pair.
    some = (kmin <= qmax) & ((kmax > qmin - w) | (kmin < s))
    # Every pair of real tokens allowed: all keys real, causal for all pairs, window (or sinks) for all pairs.
    full = every & (qmax >= 0) & (kmax <= qmin) & ((qmax - kmin < w) | (kmax < s))
    mod = at_positions(local_mask_mod(w, s), q_pos, k_pos)
    if members is not None:  # one pass: every causal tile, far pairs of a shared group too
        some = kmin <= qmax
        q_member, k_member = members
        q_member = F.pad(q_member, (offset, q_len - offset - lq))
        k_member = _pad_to(F.pad(k_member, (sink_slots, 0)), kv_len, 2)
        k_member = k_member.repeat_interleave(q_member.shape[1] // k_member.shape[1], 1)
        mod = or_masks(mod, and_masks(at_positions(causal, q_pos, k_pos), same_group(q_member, k_member)))
    partial = some & ~full
    extra = None
    if extra_key:
        extra = s
        partial = partial | ((torch.arange(kv_len // bs, device=dev) == extra // bs) & (qmax >= 0))
        mod = or_masks(mod, key_flag((torch.arange(kv_len, device=dev) == extra).expand(b, -1)))
    mask = tile_block_mask(partial[:, None], full[:, None], mod, q_len, kv_len, bs)
    return LocalPlan(mask, sinks, sink_slots, offset, q_len, kv_len, extra)


def far_plan(q_groups: torch.Tensor, k_groups: torch.Tensor, valid: torch.Tensor, config: FocusConfig,
             extra_key: bool) -> FarPlan:
    """Plan the far call (same group, beyond the window, past the sinks) from the groups of the queries
    ``[B, Hq, Lq, kq]`` and keys ``[B, Hkv, Lk, kk]`` (queries: the last Lq of the ``[B, Lk]`` tokens)."""
    bs, w, s, g_count = config.block_size, config.window, config.sink_tokens, config.num_groups
    b, hq, lq, kq = q_groups.shape
    hkv, lk, kk = k_groups.shape[1], k_groups.shape[2], k_groups.shape[3]
    rep, dev = hq // hkv, valid.device
    stride = lk + 1  # sort key of a copy: group * stride + position + 1; a group's extra key: group * stride
    big = (g_count + 1) * stride  # padded tokens sort last
    pos = token_positions(valid)
    q_valid, q_pos = valid[:, lk - lq:], pos[:, lk - lq:]
    kcomp = torch.where(valid[:, None, :, None], k_groups * stride + pos[:, None, :, None] + 1, big).flatten(2)
    nk_pad = bucket(lk * kk, bs)
    if extra_key:  # per group, an extra key in front of its keys; the extra keys never change the bucket
        kcomp = torch.cat([kcomp, (torch.arange(g_count, device=dev) * stride).expand(b, hkv, -1)], -1)
        nk_pad += bs * -(-g_count // bs)
    ksorted, korder = kcomp.sort(-1)
    is_extra = korder >= lk * kk
    k_src = _pad_to(torch.where(is_extra | (ksorted >= big), -1, _floor_div(korder, kk)), nk_pad, 2, -1)

    qcomp = torch.where(q_valid[:, None, :, None], q_groups * stride + q_pos[:, None, :, None] + 1, big).flatten(2)
    qsorted, qorder = qcomp.sort(-1)
    q_real = qsorted < big
    base = _floor_div(qsorted, stride) * stride  # the sort key of the copy's group start

    def find(values: torch.Tensor, right: bool = False) -> torch.Tensor:
        flat = values.reshape(b, hkv, rep * values.shape[-1])  # the query heads of a KV head share its keys
        return torch.searchsorted(ksorted, flat, right=right).view_as(values)

    q_pos_sorted = qsorted - base - 1
    lo = torch.where(q_real, find(base + 1 + s), 0)
    hi = torch.maximum(torch.where(q_real, find(base + 1 + q_pos_sorted - w, right=True), 0), lo)
    first = torch.where(q_real, find(base), -1) if extra_key else lo  # first slot a copy may see
    nq_pad = bucket(lq * kq, bs)
    q_src = _pad_to(_floor_div(qorder, kq), nq_pad, 2, 0)
    first, lo, hi = _pad_to(first, nq_pad, 2, -1), _pad_to(lo, nq_pad, 2, 0), _pad_to(hi, nq_pad, 2, 0)
    q_real, q_pos_sorted = _pad_to(q_real, nq_pad, 2, False), _pad_to(q_pos_sorted, nq_pad, 2, -1)

    # The mask_mod's tables, per query head: group bit and position of every slot.
    k_real = _pad_to(ksorted < big, nk_pad, 2, False)
    k_group = _pad_to(_floor_div(ksorted, stride), nk_pad, 2, 0)
    k_bit = torch.where(k_real, torch.ones_like(k_group) << k_group, 0).repeat_interleave(rep, 1)
    k_pos = _pad_to(ksorted - _floor_div(ksorted, stride) * stride - 1, nk_pad, 2, NO_KEY)
    k_pos = torch.where(k_real & (k_src >= 0), k_pos, NO_KEY).repeat_interleave(rep, 1)
    q_bit = torch.where(q_real, torch.ones_like(q_src) << _pad_to(_floor_div(base, stride), nq_pad, 2, 0), 0)
    q_pos_sorted = torch.where(q_real, q_pos_sorted, -1)
    mod = at_positions(far_mask_mod(w, s), q_pos_sorted, k_pos)
    extra = None
    if extra_key:
        extra = _pad_to(is_extra, nk_pad, 2, False)
        mod = or_masks(mod, key_flag(extra.repeat_interleave(rep, 1)))
    mods = [same_group(q_bit, k_bit), mod]
    # Per query block: the hull of the rows' [first, hi); blocks inside every row's [lo, hi) are full.
    start = _floor_div(_blocks(torch.where(q_real, first, nk_pad), bs).amin(-1), bs)
    end = _ceil_div(_blocks(torch.where(q_real, torch.maximum(hi, first + 1) if extra_key else hi, 0), bs).amax(-1),
                    bs)
    if kq > 1 and kk > 1:  # a pair sharing several groups counts only in the lowest one: no full blocks
        full_start = full_end = end
        q_member = routing.membership(q_groups).gather(-1, q_src)
        k_member = routing.membership(k_groups).gather(-1, k_src.clamp_min(0)).masked_fill(k_src < 0, 0)
        mods.append(first_shared_group(q_bit, q_member, k_member.repeat_interleave(rep, 1)))
    else:
        full_start = _ceil_div(_blocks(torch.where(q_real, lo, 0), bs).amax(-1), bs)
        full_end = _floor_div(_blocks(torch.where(q_real, hi, nk_pad), bs).amin(-1), bs)
    mask = range_block_mask(_blocks(q_real, bs).any(-1), 0, start, end, full_start, full_end, and_masks(*mods), nq_pad,
                            nk_pad, bs)
    return FarPlan(mask, q_src, q_real, lo, hi, k_src, extra)


def focus_plan(q_groups: torch.Tensor, k_groups: torch.Tensor, valid: torch.Tensor, config: FocusConfig,
               extra_key: bool) -> FocusPlan:
    """Both calls' plans from the groups of the queries ``[B, Hq, Lq, kq]`` and keys ``[B, Hkv, Lk, kk]``; one
    pass (:attr:`FocusConfig.one_pass`): the local call's, holding the whole pattern (no extra key: nothing to
    merge)."""
    if config.one_pass:
        members = (routing.membership(q_groups), routing.membership(k_groups))
        return FocusPlan(local_plan(valid, q_groups.shape[2], config, False, members), None)
    return FocusPlan(local_plan(valid, q_groups.shape[2], config, extra_key),
                     far_plan(q_groups, k_groups, valid, config, extra_key))
