"""Focus attention: the reference (the semantics), the soft training path and the fast path.

Shapes everywhere: q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (GQA: Hq a multiple of Hkv),
centroids ``[Hkv, G, D]``; queries are the **last** Lq of the Lk keys (Lq == Lk for a prefill,
Lq == 1 for decode with a KV cache). ``attention_mask`` is an optional ``[B, Lk]`` key padding mask
(True/1 = real token). Positions count real tokens only, so a left-padded row behaves exactly like
the unpadded sequence. Rows of padded queries come out as zeros.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import BlockMask, flex_attention

from focus_flex import flash, routing
from focus_flex.config import FocusConfig
from focus_flex.decode import KeyIndex, indexed_attention
from focus_flex.masks import block_density, far_mask_mod, local_mask_mod, range_block_mask
from focus_flex.threads import outer, small_work, using

DECODE_MAX_QUERIES = 16  # up to this many queries, the fast path gathers keys instead of calling flex
LSE_SAFE = 1e-30  # flag channels below this are not trusted: such rows take an exact fallback


# ---- input checks and shared helpers -------------------------------------------------------------


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                 config: FocusConfig, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Validate shapes/dtypes; return the ``[B, Lk]`` bool key-validity mask."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, L, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    (b, hq, lq, d), (bk, hkv, lk, dk) = q.shape, k.shape
    if k.shape != v.shape[:3] + (dk,) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [B, Hkv, Lk]")
    if bk != b or dk != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: batch and head_dim must match and "
                         f"the number of query heads must be a multiple of the number of KV heads")
    if lq > lk:
        raise ValueError(f"q has {lq} positions but k only {lk}: queries must be the last Lq of the Lk keys")
    if min(b, hq, lq, d) == 0:
        raise ValueError(f"q {tuple(q.shape)} is empty: Focus attention needs at least one query of one head")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise TypeError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if centroids.shape != (hkv, config.num_groups, d):
        raise ValueError(f"centroids {tuple(centroids.shape)} do not fit: expected [Hkv={hkv}, "
                         f"G={config.num_groups}, D={d}] for k {tuple(k.shape)} and this config")
    if attention_mask is None:
        return torch.ones(b, lk, dtype=torch.bool, device=k.device)
    if attention_mask.shape != (b, lk):
        raise ValueError(f"attention_mask must be a [batch, key_length] = [{b}, {lk}] padding mask (1 = token, "
                         f"0 = padding); got shape {tuple(attention_mask.shape)}. 4-D or custom masks are not "
                         f"supported by Focus attention.")
    if attention_mask.dtype != torch.bool and attention_mask.dtype.is_floating_point:
        raise TypeError("attention_mask must be bool or integer (1 = token, 0 = padding), not an additive float mask")
    return attention_mask.to(device=k.device, dtype=torch.bool)


def token_positions(valid: torch.Tensor) -> torch.Tensor:
    """Position of every token counting real tokens only, ``[B, L]`` (a left pad gets -1)."""
    return valid.long().cumsum(-1) - 1


def groups_from_membership(member: torch.Tensor, k: int, num_groups: int) -> torch.Tensor:
    """Inverse of :func:`routing.membership`: bitmask ``[...]`` -> the k group ids ``[..., k]``."""
    return routing.member_bits(member, num_groups).topk(k, dim=-1).indices


def focus_pattern(q: torch.Tensor, k: torch.Tensor, centroids: torch.Tensor, config: FocusConfig, *,
                  attention_mask: torch.Tensor | None = None, q_member: torch.Tensor | None = None,
                  k_member: torch.Tensor | None = None) -> torch.Tensor:
    """The Focus pattern as a dense bool ``[B, Hq, Lq, Lk]`` (DESIGN.md §2). O(Lq * Lk).

    Query i may attend key j iff j <= i, both are real tokens, and
    ``pos_i - pos_j < window or pos_j < sink_tokens or groups(q_i) ∩ groups(k_j) ≠ ∅``.
    """
    valid = check_inputs(q, k, k, centroids, config, attention_mask)
    lq, lk, hq = q.shape[2], k.shape[2], q.shape[1]
    if q_member is None:
        q_member = routing.hard_membership(q, centroids, config.query_top_k)
    if k_member is None:
        k_member = routing.hard_membership(k, centroids, config.key_top_k)
    k_member = k_member.repeat_interleave(hq // k.shape[1], dim=1)
    pos = token_positions(valid)
    q_pos, q_valid = pos[:, lk - lq:], valid[:, lk - lq:]
    idx = torch.arange(lk, device=k.device)
    causal = idx[None, :] <= idx[lk - lq:, None]  # [Lq, Lk]
    near = (q_pos[:, :, None] - pos[:, None, :]) < config.window  # [B, Lq, Lk]
    sink = (pos < config.sink_tokens)[:, None, :]
    same = (q_member[..., :, None] & k_member[..., None, :]) != 0  # [B, Hq, Lq, Lk]
    real = (q_valid[:, :, None] & valid[:, None, :] & causal)[:, None]
    return real & ((near | sink)[:, None] | same)


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                        config: FocusConfig, *, attention_mask: torch.Tensor | None = None,
                        scale: float | None = None) -> torch.Tensor:
    """The oracle: SDPA with the dense :func:`focus_pattern` as its mask. Returns ``[B, Hq, Lq, D]``."""
    mask = focus_pattern(q, k, centroids, config, attention_mask=attention_mask)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def attention_weights(q: torch.Tensor, k: torch.Tensor, centroids: torch.Tensor, config: FocusConfig, *,
                      attention_mask: torch.Tensor | None = None, scale: float | None = None) -> torch.Tensor:
    """The attention probabilities of the hard pattern, ``[B, Hq, Lq, Lk]`` (what ``output_attentions=True`` returns):
    the softmax of the scaled scores over the keys :func:`focus_pattern` allows, 0 elsewhere. Dense, O(Lq * Lk)."""
    mask = focus_pattern(q, k, centroids, config, attention_mask=attention_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.float() @ keys.float().transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).nan_to_num(0.0).to(q.dtype)  # a row with no allowed key (padding): zeros


def soft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                   config: FocusConfig, *, attention_mask: torch.Tensor | None = None,
                   scale: float | None = None) -> torch.Tensor:
    """Training path: differentiable in the centroids, dense (fine up to a few thousand tokens).

    Local and sink pairs get no bias; a far pair (i, j) gets ``log min(1, sum_g a_ig b_jg)`` with
    a, b the soft top-k memberships of :func:`routing.soft_membership`. As routing sharpens, a and b
    become the hard top-k indicators and the bias becomes 0 / -inf: exactly :func:`focus_pattern`.
    Future and padded keys get -inf, so nothing leaks from the future.
    """
    valid = check_inputs(q, k, v, centroids, config, attention_mask)
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    a = routing.soft_membership(routing.scores(q, centroids, config.tau), config.query_top_k)
    kb = routing.soft_membership(routing.scores(k, centroids, config.tau), config.key_top_k)
    kb = kb.repeat_interleave(hq // k.shape[1], dim=1)
    overlap = torch.einsum("bhqg,bhkg->bhqk", a, kb).clamp(1e-6, 1.0)
    pos = token_positions(valid)
    q_pos = pos[:, lk - lq:]
    idx = torch.arange(lk, device=k.device)
    causal = idx[None, :] <= idx[lk - lq:, None]
    near = ((q_pos[:, :, None] - pos[:, None, :]) < config.window) | (pos < config.sink_tokens)[:, None, :]
    allowed = (valid[:, lk - lq:, None] & valid[:, None, :] & causal)[:, None]
    if torch.is_grad_enabled():
        bias = torch.where(near[:, None], torch.zeros((), device=q.device), overlap.log())
        bias = bias.masked_fill(~allowed, float("-inf")).to(q.dtype)
    else:  # evaluation: the same bias, built in place (a few [B, Hq, Lq, Lk] buffers fewer)
        bias = overlap.log_().masked_fill_(near[:, None], 0.0).masked_fill_(~allowed, float("-inf")).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
    return out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)


# ---- the fast path -------------------------------------------------------------------------------

_compiled_flex = None
RECOMPILE_LIMIT = 64  # distinct (batch, heads, length bucket, dtype) shapes kept compiled


def compiled_flex():
    """``torch.compile(flex_attention)``, created on first use.

    Shapes are static: dynamic-shape CPU codegen of flex templates fails to compile on torch 2.13
    for some shape sequences. Lengths are padded to buckets instead (:func:`bucket`), and padded
    blocks are empty in the block masks, so they cost no attention work. Dynamo's recompile limit
    is raised so that many buckets never silently fall back to eager (dense) flex.
    """
    global _compiled_flex
    if _compiled_flex is None:
        cfg = torch._dynamo.config
        cfg.recompile_limit = max(cfg.recompile_limit, RECOMPILE_LIMIT)
        cfg.accumulated_recompile_limit = max(cfg.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)
        _compiled_flex = torch.compile(flex_attention, dynamic=False)
    return _compiled_flex


MIN_BUCKET_BLOCKS = 4  # short inputs all share one compiled shape; their padding blocks are empty


def bucket(n: int, block_size: int) -> int:
    """Padded length for n tokens: block_size * (2^a or 3 * 2^(a-1)) blocks, at most 1.5x n (+1 block)."""
    blocks = max(MIN_BUCKET_BLOCKS, -(-n // block_size))
    p = 1 << (blocks - 1).bit_length()  # next power of two
    return block_size * (3 * p // 4 if 3 * p // 4 >= blocks and p >= 4 else p)


def _pad_to(x: torch.Tensor, length: int, dim: int, value: float = 0) -> torch.Tensor:
    pad = [0, 0] * (x.dim() - 1 - dim % x.dim()) + [0, length - x.shape[dim]]
    return F.pad(x, pad, value=value)


def _ceil_div(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.div(x + (n - 1), n, rounding_mode="floor")


def _floor_div(x: torch.Tensor, n: int) -> torch.Tensor:
    return torch.div(x, n, rounding_mode="floor")


def _rows(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out[b, h, i] = x[b, h, src[b, h, i]]``, zero where ``src < 0``; x ``[B, H, L, D]``, src ``[B, H or 1, M]``."""
    src = src.expand(x.shape[0], x.shape[1], -1)
    out = x.gather(2, src.clamp_min(0)[..., None].expand(-1, -1, -1, x.shape[-1]))
    return out.masked_fill_((src < 0)[..., None], 0)


@dataclass
class LocalLayout:
    """Local call over compacted tokens (padding dropped, so positions are indices).

    Keys: ``[sinks | extra key | padding]`` (whole blocks) then the tokens; queries are shifted by less than a
    block so that query blocks line up with key blocks.
    """

    mask: BlockMask
    q_rows: torch.Tensor  # [B, Lq_pad] query behind each layout row (-1: none)
    q_slot: torch.Tensor  # [B, Lq] layout row of each query (-1: padded query)
    k_src: torch.Tensor  # [B, Lk_tot] key behind each key slot (-1: none)
    q_base: torch.Tensor  # [B] position of layout row 0
    sink_slots: int  # slots before the first token
    extra: int  # slot of the extra (LSE-carrying) key
    shift: int | None  # no padding: queries sit at rows [shift, shift + Lq) and tokens are not permuted


@dataclass
class FarLayout:
    """Far call over copies sorted by (group, position).

    Key copies are per KV head and every group's segment starts with its own extra key; query copy i attends the
    key slots ``[lo_i, hi_i)`` (its group, beyond the window, past the sinks) and its group's extra key.
    """

    mask: BlockMask
    q_src: torch.Tensor  # [B, Hq, Nq_pad] query of every sorted query copy (padding: 0)
    q_real: torch.Tensor  # [B, Hq, Nq_pad] the copy is a real query's (not padding)
    lo: torch.Tensor  # [B, Hq, Nq_pad] first key slot of the copy's far range
    hi: torch.Tensor  # [B, Hq, Nq_pad] end of that range (hi == lo: no far key)
    k_src: torch.Tensor  # [B, Hkv, Nk_pad] key of every key slot (-1: extra key or padding)
    extra: torch.Tensor  # [B, Hkv, Nk_pad] bool: the extra-key slots

    @property
    def has_keys(self) -> torch.Tensor:
        return self.hi > self.lo

    @property
    def pairs(self) -> int:
        """Far (query, key) pairs the layout allows, over all its heads."""
        return int((self.hi - self.lo).sum())


@dataclass
class FocusPlan:
    """Both flex calls' layouts and block masks, built in O(N log N + (N / block)^2) integer work."""

    local: LocalLayout
    far: FarLayout

    @property
    def local_mask(self) -> BlockMask:
        return self.local.mask

    @property
    def far_mask(self) -> BlockMask:
        return self.far.mask

    def density(self, causal_blocks: float) -> dict[str, float]:
        """Computed blocks per (batch, head) relative to ``causal_blocks``, for each call and in total."""
        local, far = block_density(self.local.mask, causal_blocks), block_density(self.far.mask, causal_blocks)
        return {"local": local, "far": far, "total": local + far}


def _plan_local(valid: torch.Tensor, lq: int, config: FocusConfig) -> LocalLayout:
    bs, w, s = config.block_size, config.window, config.sink_tokens
    b, lk = valid.shape
    dev = valid.device
    sink_slots = bs * -(-(s + 1) // bs)
    n = valid.sum(-1)
    m = valid[:, lk - lq:].sum(-1)
    shift = (n - m) % bs
    q_base = n - m - shift  # position of layout row 0: a whole number of blocks
    lq_pad = bucket(int((shift + m).max()), bs)
    kv_len = sink_slots + bucket(lk, bs)
    dense = bool(valid.all())
    # Which query / key sits in each layout slot.
    q_order = torch.argsort((~valid[:, lk - lq:]).to(torch.int8), dim=-1, stable=True)  # real queries first
    k_order = torch.argsort((~valid).to(torch.int8), dim=-1, stable=True)
    j = torch.arange(lq_pad, device=dev) - shift[:, None]
    q_rows = torch.where((j >= 0) & (j < m[:, None]), q_order.gather(1, j.clamp(0, lq - 1)), -1)
    rank = torch.arange(lq, device=dev).expand(b, -1)
    q_slot = torch.full((b, lq), -1, dtype=torch.long, device=dev).scatter_(
        1, q_order, torch.where(rank < m[:, None], rank + shift[:, None], -1))
    slot = torch.arange(kv_len, device=dev)
    t = torch.where(slot < sink_slots, slot, slot - sink_slots)  # token index (sink slot j holds token j)
    used = torch.where(slot < sink_slots, slot < s, t >= s) & (t < n[:, None])
    k_src = torch.where(used, k_order.gather(1, t.clamp_max(lk - 1).expand(b, -1)), -1)
    # Block ranges of each query block, whose real rows hold positions [pmin, pmax].
    rows = torch.arange(lq_pad // bs, device=dev) * bs
    lo_row, hi_row = torch.maximum(rows, shift[:, None]), torch.minimum(rows + bs, (shift + m)[:, None]) - 1
    pmin, pmax = q_base[:, None] + lo_row, q_base[:, None] + hi_row
    tlo = (pmin - w + 1).clamp_min(s)
    start = _floor_div(sink_slots + tlo, bs)
    end = torch.where(tlo <= pmax, _floor_div(sink_slots + pmax, bs) + 1, start)
    full_start = _ceil_div(sink_slots + (pmax - w + 1).clamp_min(s), bs)
    full_end = _floor_div(sink_slots + pmin + 1, bs)
    mask = range_block_mask((lo_row <= hi_row)[:, None], sink_slots // bs, start[:, None], end[:, None],
                            full_start[:, None], full_end[:, None], local_mask_mod(q_base, w, s, sink_slots),
                            lq_pad, kv_len, bs)
    return LocalLayout(mask, q_rows, q_slot, k_src, q_base, sink_slots, s, int(shift[0]) if dense else None)


def _plan_far(q_groups: torch.Tensor, k_groups: torch.Tensor, valid: torch.Tensor, config: FocusConfig) -> FarLayout:
    bs, w, s, g_count = config.block_size, config.window, config.sink_tokens, config.num_groups
    b, hq, lq, kq = q_groups.shape
    hkv, lk, kk = k_groups.shape[1], k_groups.shape[2], k_groups.shape[3]
    rep, dev = hq // hkv, valid.device
    stride = lk + 1  # sort key of a copy: group * stride + position + 1; a group's extra key: group * stride
    big = (g_count + 1) * stride  # padded tokens sort last
    pos = token_positions(valid)
    q_valid, q_pos = valid[:, lk - lq:], pos[:, lk - lq:]
    kcomp = torch.where(valid[:, None, :, None], k_groups * stride + pos[:, None, :, None] + 1, big).flatten(2)
    extras = (torch.arange(g_count, device=dev) * stride).expand(b, hkv, -1)
    ksorted, korder = torch.cat([kcomp, extras], -1).sort(-1)
    is_extra = korder >= lk * kk
    nk_pad = bucket(lk * kk, bs) + bs * -(-g_count // bs)  # the extra keys never change the bucket
    k_src = _pad_to(torch.where(is_extra | (ksorted >= big), -1, _floor_div(korder, kk)), nk_pad, 2, -1)
    extra = _pad_to(is_extra, nk_pad, 2, False)

    qcomp = torch.where(q_valid[:, None, :, None], q_groups * stride + q_pos[:, None, :, None] + 1, big).flatten(2)
    qsorted, qorder = qcomp.sort(-1)
    q_real = qsorted < big
    base = _floor_div(qsorted, stride) * stride
    q_pos_sorted = qsorted - base - 1

    def find(values: torch.Tensor, right: bool = False) -> torch.Tensor:
        flat = values.reshape(b, hkv, rep * values.shape[-1])  # the query heads of a KV head share its keys
        return torch.searchsorted(ksorted, flat, right=right).view_as(values)

    ex = torch.where(q_real, find(base), -1)
    lo = torch.where(q_real, find(base + 1 + s), 0)
    hi = torch.maximum(torch.where(q_real, find(base + 1 + q_pos_sorted - w, right=True), 0), lo)
    nq_pad = bucket(lq * kq, bs)
    q_src = _pad_to(_floor_div(qorder, kq), nq_pad, 2, 0)
    ex, lo, hi = _pad_to(ex, nq_pad, 2, -1), _pad_to(lo, nq_pad, 2, 0), _pad_to(hi, nq_pad, 2, 0)
    q_real = _pad_to(q_real, nq_pad, 2, False)
    # Per query block: compute the hull of the rows' [ex, hi); blocks inside every row's [lo, hi) are full.
    blk = lambda x: x.unflatten(-1, (nq_pad // bs, bs))  # noqa: E731
    start = _floor_div(blk(torch.where(q_real, ex, nk_pad)).amin(-1), bs)
    end = _ceil_div(blk(torch.where(q_real, torch.maximum(hi, ex + 1), 0)).amax(-1), bs)
    q_grp = q_mem = k_mem = None
    if kq > 1 and kk > 1:  # a pair sharing several groups counts only in the lowest one: no full blocks
        full_start = full_end = end
        q_grp = _pad_to(_floor_div(base, stride), nq_pad, 2, 0)
        q_mem = routing.membership(q_groups).gather(-1, q_src)
        k_mem = routing.membership(k_groups).gather(-1, k_src.clamp_min(0)).masked_fill(k_src < 0, 0)
        k_mem = k_mem.repeat_interleave(rep, 1)  # per query head: mods never divide head indices
    else:
        full_start = _ceil_div(blk(torch.where(q_real, lo, 0)).amax(-1), bs)
        full_end = _floor_div(blk(torch.where(q_real, hi, nk_pad)).amin(-1), bs)
    mask = range_block_mask(blk(q_real).any(-1), 0, start, end, full_start, full_end,
                            far_mask_mod(lo, hi, ex, q_grp, q_mem, k_mem), nq_pad, nk_pad, bs)
    return FarLayout(mask, q_src, q_real, lo, hi, k_src, extra)


def plan_attention(q: torch.Tensor, k: torch.Tensor, centroids: torch.Tensor, config: FocusConfig, *,
                   valid: torch.Tensor, q_groups: torch.Tensor | None = None,
                   k_groups: torch.Tensor | None = None) -> FocusPlan:
    """Route tokens and build both calls' layouts and block masks (no O(N^2) work)."""
    if q_groups is None:
        q_groups = routing.hard_groups(q, centroids, config.query_top_k)
    if k_groups is None:
        k_groups = routing.hard_groups(k, centroids, config.key_top_k)
    return FocusPlan(_plan_local(valid, q.shape[2], config), _plan_far(q_groups, k_groups, valid, config))


def _few_queries_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                           config: FocusConfig, valid: torch.Tensor, k_member: torch.Tensor | None,
                           scale: float) -> torch.Tensor:
    """Decode (few queries): each query attends only its allowed keys, gathered. Exact; O(Hq Lq Lk) bit tests.

    Query rows are grouped by KV head: the keys any of them needs are gathered once, and each row masks the rest.
    """
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    rows = hq // hkv * lq  # query rows per KV head, ordered (head in group, query)
    if k_member is None:
        k_member = routing.hard_membership(k, centroids, config.key_top_k)
    q_member = routing.hard_membership(q, centroids, config.query_top_k).reshape(b, hkv, rows)
    pos = token_positions(valid)
    q_pos, q_valid = pos[:, lk - lq:], valid[:, lk - lq:]
    j = torch.arange(lk, device=k.device)
    causal = j <= (j[lk - lq:, None])  # [Lq, Lk]
    real = valid[:, None, :] & causal & q_valid[:, :, None]  # [B, Lq, Lk]
    near = ((q_pos[:, :, None] - pos[:, None, :]) < config.window) | (pos < config.sink_tokens)[:, None, :]
    tile = lambda x: x.repeat(1, rows // lq, 1)[:, None]  # noqa: E731  [B, Lq, Lk] -> [B, 1, rows, Lk]
    allowed = (((q_member[..., None] & k_member[:, :, None, :]) != 0) | tile(near)) & tile(real)
    # Keys any query row of a KV head needs are gathered once for all of them.
    union = allowed.any(2)  # [B, Hkv, Lk]
    count = union.sum(-1)
    m = max(int(count.max()), 1)
    used = torch.arange(m, device=k.device) < count[..., None]  # [B, Hkv, m]
    idx = torch.zeros(used.shape, dtype=torch.long, device=k.device).masked_scatter_(used, union.nonzero()[:, 2])
    kg, vg = k.new_empty(b, hkv, m, d), v.new_empty(b, hkv, m, d)
    for i in range(b):  # a memcpy per row, straight into place (a KV cache is often a strided view: no reshape)
        for h in range(hkv):
            torch.index_select(k[i, h], 0, idx[i, h], out=kg[i, h])
            torch.index_select(v[i, h], 0, idx[i, h], out=vg[i, h])
    kg, vg = kg.float(), vg.float()
    s = (kg @ q.reshape(b, hkv, rows, d).float().transpose(-1, -2)).transpose(-1, -2) * scale
    ok = allowed.gather(-1, idx[:, :, None, :].expand(-1, -1, rows, -1)) & used[:, :, None, :]
    p = torch.nan_to_num(s.masked_fill(~ok, float("-inf")).softmax(-1), nan=0.0)
    return torch.einsum("bhrm,bhmd->bhrd", p, vg).reshape(b, hq, lq, d).to(q.dtype)


def _flex_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float, extra: torch.Tensor,
              threads: int, score: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
    """One compiled flex call: (raw output ``[B, H, L, D+2]``, r_real, lse, trusted), the last three ``[B, H, L]``.

    Extra-key slots (``extra``, ``[B, Hkv or 1, Lk]``) hold zero keys, so the extra key scores 0 with no score_mod;
    values carry two flag channels (real keys, extra key), so the output over the real keys is
    ``out[..., :D] / r_real`` and ``lse = log r_real - log r_extra`` (DESIGN.md §4 (a)). A row is not trusted where
    a flag under/overflowed (|lse| beyond ~69). ``score`` ``[B, H, L]`` makes the extra key score that value instead,
    through one more head-dim channel. A row with no real key gets lse = -inf.
    """
    d = q.shape[-1]
    shift: torch.Tensor | float = 0.0
    if score is not None:
        c = (score / scale).to(q.dtype)
        q = torch.cat([q, c[..., None]], -1)
        k = torch.cat([k, extra[..., None].expand(k.shape[0], k.shape[1], -1, 1).to(k.dtype)], -1)
        shift = c.float() * scale
    with using(threads):
        out = compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=q.shape[1] != k.shape[1])
    real, extra_w = out[..., d].float(), out[..., d + 1].float()
    lse = real.log() - extra_w.clamp_min(torch.finfo(torch.float32).tiny).log() + shift
    lse = torch.where(real > 0, lse, float("-inf"))
    return out, real, lse, (real >= LSE_SAFE) & (extra_w >= LSE_SAFE)


def _local_exact(ql: torch.Tensor, kl: torch.Tensor, vl: torch.Tensor, rows: torch.Tensor, lay: LocalLayout,
                 config: FocusConfig, scale: float, chunk: int = 1024) -> tuple[torch.Tensor, torch.Tensor]:
    """Exact (output, lse) of the given layout rows ``[R, 3]`` (b, h, row), from their <= sinks + window keys.

    The fallback for rows whose logits are too large for the zero-score extra key: O(R (window + sinks) D).
    """
    s, w, d = config.sink_tokens, config.window, ql.shape[-1]
    rep = ql.shape[1] // kl.shape[1]
    cand = torch.cat([torch.arange(s), torch.arange(-w + 1, 1)]).to(ql.device)  # sink slots, then t - p
    is_sink = torch.arange(s + w, device=ql.device) < s
    outs, lses = [], []
    for part in rows.split(chunk):
        b, h, r = part.unbind(-1)
        p = (lay.q_base[b] + r)[:, None]
        t = torch.where(is_sink, cand, p + cand)
        ok = torch.where(is_sink, t <= p, (t >= s) & (t >= 0))
        slot = torch.where(is_sink, t, t + lay.sink_slots).clamp(0, kl.shape[2] - 1)
        kh = (h // rep)[:, None]
        keys, vals = kl[b[:, None], kh, slot].float(), vl[b[:, None], kh, slot, :d].float()
        sc = torch.einsum("rd,rkd->rk", ql[b, h, r].float(), keys) * scale
        sc = sc.masked_fill(~ok, float("-inf"))
        lses.append(sc.logsumexp(-1))
        outs.append(torch.einsum("rk,rkd->rd", sc.softmax(-1), vals))
    return torch.cat(outs), torch.cat(lses)


def _local_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: LocalLayout, config: FocusConfig,
                scale: float, threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Window + sinks, in query order: raw output ``r_real * o`` ``[B, Hq, Lq, D]``, r_real and lse ``[B, Hq, Lq]``."""
    b, hq, lq, d = q.shape
    lk, s = k.shape[2], config.sink_tokens
    kv_len = lay.k_src.shape[1]
    if lay.shift is not None:  # no padding: plain slices
        ql = q.new_zeros(b, hq, lay.q_rows.shape[1], d)
        ql[:, :, lay.shift:lay.shift + lq] = q
        kl = k.new_zeros(b, k.shape[1], kv_len, d)
        vl = v.new_zeros(b, k.shape[1], kv_len, d + 2)
        ns = min(s, lk)
        for dst, src in ((slice(0, ns), slice(0, ns)), (slice(lay.sink_slots, lay.sink_slots + lk), slice(0, lk))):
            kl[:, :, dst], vl[:, :, dst, :d] = k[:, :, src], v[:, :, src]
            vl[:, :, dst, d] = 1
    else:
        ql, kl = _rows(q, lay.q_rows[:, None]), _rows(k, lay.k_src[:, None])
        flag = (lay.k_src >= 0)[:, None, :, None].expand(-1, k.shape[1], -1, -1).to(v.dtype)
        vl = torch.cat([_rows(v, lay.k_src[:, None]), flag, torch.zeros_like(flag)], -1)
    vl[:, :, lay.extra, d + 1] = 1
    extra = (torch.arange(kv_len, device=k.device) == lay.extra)[None, None]
    out, real, lse, trusted = _flex_lse(ql, kl, vl, lay.mask, scale, extra, threads)
    bad = ~trusted & (lay.q_rows >= 0)[:, None]
    if bool(bad.any()):
        rows = bad.nonzero()
        o_bad, lse_bad = _local_exact(ql, kl, vl, rows, lay, config, scale)
        idx = tuple(rows.T)
        out[idx + (slice(0, d),)], real[idx], lse[idx] = o_bad.to(out.dtype), 1.0, lse_bad
    if lay.shift is not None:
        rows = slice(lay.shift, lay.shift + lq)
        return out[:, :, rows, :d], real[:, :, rows], lse[:, :, rows]
    slot = lay.q_slot[:, None].expand(-1, hq, -1)
    pick = lambda x, fill: torch.where(slot >= 0, x.gather(2, slot.clamp_min(0)), fill)  # noqa: E731
    return _rows(out[..., :d], lay.q_slot[:, None]), pick(real, 0.0), pick(lse, float("-inf"))


def _far_call(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lay: FarLayout, lse_loc: torch.Tensor,
              scale: float, threads: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Same-group pairs beyond the window, per sorted query copy: raw output, r_real, lse.

    If the zero-score extra key cannot be trusted for some row, the call is redone with the extra key scoring the
    local lse. Then a flag can only underflow where one part outweighs the other by > e^69, and the merge is exact.
    """
    qf = q.gather(2, lay.q_src[..., None].expand(-1, -1, -1, q.shape[-1]))
    flags = torch.stack([lay.k_src >= 0, lay.extra], -1).to(v.dtype)
    kf, vf = _rows(k, lay.k_src), torch.cat([_rows(v, lay.k_src), flags], -1)
    out, real, lse, trusted = _flex_lse(qf, kf, vf, lay.mask, scale, lay.extra, threads)
    if bool((lay.has_keys & ~trusted).any()):
        score = torch.where(torch.isfinite(lse_loc), lse_loc, 0.0).gather(2, lay.q_src)
        out, real, lse, _ = _flex_lse(qf, kf, vf, lay.mask, scale, lay.extra, threads, score)
    return out, real, lse


def _merge(loc: tuple[torch.Tensor, ...], far: tuple[torch.Tensor, ...], lay: FarLayout,
           single_copy: bool) -> torch.Tensor:
    """Exact union of the two parts (fp32): softmax weights ``exp(lse_part - lse_total)`` on the raw outputs."""
    (out_l, real_l, lse_l), (out_f, real_f, lse_f) = loc, far
    q_src, lq, d = lay.q_src, out_l.shape[2], out_l.shape[-1]
    tiny = torch.finfo(torch.float32).tiny
    m = lse_l.scatter_reduce(2, q_src, lse_f, "amax")
    m = torch.where(torch.isfinite(m), m, 0.0)
    w_l, w_f = torch.exp(lse_l - m), torch.exp(lse_f - m.gather(2, q_src))
    den = w_l.scatter_add(2, q_src, w_f)
    den = torch.where(den > 0, den, 1.0)
    a = w_l / (den * real_l.clamp_min(tiny))  # out[..., :D] holds r_real * (normalised output)
    b = w_f / (den.gather(2, q_src) * real_f.clamp_min(tiny))
    if not single_copy:
        res = out_l * a[..., None]
        return res.scatter_add_(2, q_src[..., None].expand(-1, -1, -1, d), out_f[..., :d] * b[..., None])
    # Each query has at most one far copy: gather it instead of scattering (fp32 accumulation, in place).
    copy = torch.full(lse_l.shape[:2] + (lq + 1,), -1, dtype=torch.long, device=lse_l.device)
    ranks = torch.arange(q_src.shape[2], device=q_src.device).expand_as(q_src)
    copy = copy.scatter_(2, torch.where(lay.q_real, q_src, lq), ranks)[..., :lq]
    bq = torch.where(copy >= 0, b.gather(2, copy.clamp_min(0)), 0.0)
    res = out_f[..., :d].gather(2, copy.clamp_min(0)[..., None].expand(-1, -1, -1, d)).float()
    return res.mul_(bq[..., None]).addcmul_(out_l, a[..., None])


def default_kernel(device: torch.device, config: FocusConfig) -> str:
    """The prefill kernel :func:`focus_attention` uses unless told: ``"flash"`` on CPU where it applies, else
    ``"flex"``."""
    return "flash" if flash.supported(device, config) else "flex"


@torch.compiler.disable(reason="data-dependent plans, host loops, the C decode step: one graph break; the rest of a "
                                "compiled model stays compiled")
def focus_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                    config: FocusConfig, *, attention_mask: torch.Tensor | None = None, scale: float | None = None,
                    key_index: KeyIndex | None = None, kernel: str | None = None) -> torch.Tensor:
    """The fast path: same result as :func:`reference_attention`.

    Prefill: a local part (window + sinks, tokens in order) and a far part (copies sorted by group), merged exactly
    through their log-sum-exps. ``kernel`` runs them as block-sparse compiled FlexAttention (``"flex"``) or as chunks
    of PyTorch's CPU flash attention (``"flash"``, :mod:`focus_flex.flash`: on CPU it computes a pair ~3x faster than
    compiled flex); None picks ``"flash"`` on CPU where it applies (query or key top-k 1), else ``"flex"``.
    Decode (Lq <= 16): the allowed keys are gathered (window + sinks + same-group keys). ``key_index``
    (:class:`~focus_flex.decode.KeyIndex`) is the key routing a KV cache already computed for exactly these keys:
    with it and no padding, decode reads its per-group key lists and costs O(selected keys); otherwise decode is
    O(Lk). Gradients reach q, k and v (not the centroids: hard routing) and are exact, at dense cost: the kernels
    merge through log-sum-exps that carry none, so the backward differentiates :func:`reference_attention`.
    To train the centroids use :func:`soft_attention`.
    """
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _ReferenceGradients.apply(q, k, v, centroids.detach(), config, attention_mask, scale, key_index, kernel)
    valid = check_inputs(q, k, v, centroids, config, attention_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, hq, lq, d = q.shape
    if key_index is not None and key_index.shape != k.shape[:3]:
        raise ValueError(f"key_index routes keys [B, Hkv, Lk] = {key_index.shape}, but k is "
                         f"{tuple(k.shape[:3])}")
    if kernel not in (None, "flex", "flash"):
        raise ValueError(f"kernel={kernel!r}: use 'flex', 'flash' or None (automatic)")
    if kernel == "flash" and not flash.supported(q.device, config):
        raise ValueError(f"kernel='flash' needs CPU tensors (got {q.device.type}) and top-k 1 for queries or keys "
                         f"(got {config.query_top_k} and {config.key_top_k}); use kernel='flex'")
    if lq <= DECODE_MAX_QUERIES and key_index is not None and (attention_mask is None or bool(valid.all())):
        with small_work(q.device):
            return indexed_attention(q, k, v, centroids, config, key_index, scale, outer())
    k_member = None if key_index is None else key_index.member
    if lq <= DECODE_MAX_QUERIES:
        with small_work(q.device):
            return _few_queries_attention(q, k, v, centroids, config, valid, k_member, scale)

    # Key routing a KV cache already did; else each kernel routes the keys itself.
    k_groups = None if k_member is None else groups_from_membership(k_member, config.key_top_k, config.num_groups)
    if (kernel or default_kernel(q.device, config)) == "flash":
        return flash.flash_attention(q, k, v, centroids, k_groups, valid, config, scale)
    threads = torch.get_num_threads()
    out = torch.empty_like(q)
    rep = hq // k.shape[1]
    # Everything but the two flex kernels is small, latency-bound integer and copy work (see small_work).
    # One KV head (and its query heads) at a time keeps the temporaries at a fraction of the output's size.
    with small_work(q.device):
        for j in range(k.shape[1]):
            hs, ks = slice(j * rep, (j + 1) * rep), slice(j, j + 1)
            qj, kj, vj = q[:, hs], k[:, ks], v[:, ks]
            plan = plan_attention(qj, kj, centroids[ks], config, valid=valid,
                                  k_groups=None if k_groups is None else k_groups[:, ks])
            o_loc, real, lse = _local_call(qj, kj, vj, plan.local, config, scale, threads)
            out[:, hs] = o_loc  # parked in the output (same dtype, no rounding): frees the local call's buffers
            far = _far_call(qj, kj, vj, plan.far, lse, scale, threads)
            out[:, hs] = _merge((out[:, hs], real, lse), far, plan.far, config.query_top_k == 1)
    return out


class _ReferenceGradients(torch.autograd.Function):
    """:func:`focus_attention`'s output, :func:`reference_attention`'s gradients (the same function, computed densely:
    the fast kernels' log-sum-exps carry no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, centroids, config, attention_mask, scale, key_index, kernel):
        ctx.save_for_backward(q, k, v, centroids, attention_mask)
        ctx.config, ctx.scale = config, scale
        return focus_attention(q, k, v, centroids, config, attention_mask=attention_mask, scale=scale,
                               key_index=key_index, kernel=kernel)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, centroids, attention_mask = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3], strict=True)]
        with torch.enable_grad():
            out = reference_attention(*inputs, centroids, ctx.config, attention_mask=attention_mask, scale=ctx.scale)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in inputs), *[None] * 6)


def causal_blocks(n: int, block_size: int) -> float:
    """Number of blocks of a causal mask over n tokens (the dense baseline of a density)."""
    nb = math.ceil(n / block_size)
    return nb * (nb + 1) / 2
