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

from focus_flex import routing
from focus_flex.config import FocusConfig
from focus_flex.masks import EXTRA, PAD, REAL, block_mask_from_bools, far_mask_mod, local_mask_mod

DECODE_MAX_QUERIES = 16  # up to this many queries, the fast path gathers keys instead of calling flex


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
    bits = (member.unsqueeze(-1) >> torch.arange(num_groups, device=member.device)) & 1
    return bits.topk(k, dim=-1).indices


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
        q_member = routing.hard_membership(q, centroids, config.tau, config.query_top_k)
    if k_member is None:
        k_member = routing.hard_membership(k, centroids, config.tau, config.key_top_k)
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
    bias = torch.where(near[:, None], torch.zeros((), device=q.device), overlap.log())
    bias = bias.masked_fill(~allowed, float("-inf")).to(q.dtype)
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


def _block_view(x: torch.Tensor, bs: int) -> torch.Tensor:
    """``[..., N]`` -> ``[..., N / bs, bs]`` (N a multiple of bs)."""
    return x.unflatten(-1, (x.shape[-1] // bs, bs))


def _masked_min_max(x: torch.Tensor, ok: torch.Tensor, bs: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-block min and max of x over entries where ok, ``[..., N]`` -> ``[..., N / bs]`` each."""
    big = torch.iinfo(torch.int64).max // 4
    xb, okb = _block_view(x, bs), _block_view(ok, bs)
    return xb.masked_fill(~okb, big).amin(-1), xb.masked_fill(~okb, -big).amax(-1)


def _keys_with_extra(k: torch.Tensor, v: torch.Tensor, length: int,
                     block_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Pad keys to ``length`` and append one block whose first key is the LSE-carrying extra key.

    Values get two flag channels: D is 1 for every original key, D+1 is 1 for the extra key, so
    the output reports the softmax mass of the real keys and of the extra key (DESIGN.md §4 (a)).
    """
    b, h, n, d = k.shape
    total = length + block_size
    kk = k.new_zeros(b, h, total, d)
    kk[:, :, :n] = k
    vv = v.new_zeros(b, h, total, d + 2)
    vv[:, :, :n, :d] = v
    vv[:, :, :n, d] = 1
    vv[:, :, length, d + 1] = 1
    return kk, vv


def _flex_with_lse(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, stabilizer: torch.Tensor,
                   kind: torch.Tensor, scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """One compiled flex call returning (normalised output ``[B, H, L, D]`` fp32, lse ``[B, H, L]``).

    The extra key scores ``stabilizer`` (per query, ideally near the row's log-sum-exp), so the
    two flag channels r_real, r_extra give ``lse = C + log r_real - log r_extra`` exactly; a row with
    no real key gets lse = -inf and output 0.
    """
    d = q.shape[-1]
    per_head = kind.dim() == 3  # [B, Hq, N] (far call) or [B, N] (local call)

    def score_mod(score, b, h, q_idx, kv_idx):
        kd = kind[b, h, kv_idx] if per_head else kind[b, kv_idx]
        return torch.where(kd == EXTRA, stabilizer[b, h, q_idx], score)

    out = compiled_flex()(q, k, v, score_mod=score_mod, block_mask=mask, scale=scale,
                          enable_gqa=q.shape[1] != k.shape[1])
    real, extra = out[..., d].float(), out[..., d + 1].float().clamp_min(torch.finfo(torch.float32).tiny)
    lse = stabilizer + real.log() - extra.log()
    o = torch.where(real[..., None] > 0, out[..., :d].float() / real[..., None], 0.0)
    return o, lse


@dataclass
class FocusPlan:
    """Everything the two flex calls need, built from routing in O(N log N + (N / block)^2)."""

    local_mask: BlockMask
    far_mask: BlockMask
    local_kind: torch.Tensor  # [B, Lk_tot]
    far_kind: torch.Tensor  # [B, Hq, Nk_tot] (per query head: mods never divide head indices)
    q_src: torch.Tensor  # [B, Hq, Nq_pad] query index of every sorted query copy
    k_src: torch.Tensor  # [B, Hkv, Nk_pad] key index of every sorted key copy
    q_len_pad: int
    k_len_pad: int

    def density(self, causal_blocks: float) -> dict[str, float]:
        """Computed blocks per (batch, head) relative to ``causal_blocks``, for each call and in total."""
        from focus_flex.masks import block_density

        local, far = block_density(self.local_mask, causal_blocks), block_density(self.far_mask, causal_blocks)
        return {"local": local, "far": far, "total": local + far}


def plan_attention(q: torch.Tensor, k: torch.Tensor, centroids: torch.Tensor, config: FocusConfig, *,
                   valid: torch.Tensor, q_groups: torch.Tensor | None = None,
                   k_groups: torch.Tensor | None = None) -> FocusPlan:
    """Route tokens, sort copies by group and build both block masks (no O(N^2) work)."""
    bs, w, s, g_count = config.block_size, config.window, config.sink_tokens, config.num_groups
    b, hq, lq, _ = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    dev = q.device
    if q_groups is None:
        q_groups = routing.top_groups(routing.scores(q, centroids, config.tau), config.query_top_k)
    if k_groups is None:
        k_groups = routing.top_groups(routing.scores(k, centroids, config.tau), config.key_top_k)
    pos = token_positions(valid)
    q_valid, q_pos = valid[:, lk - lq:], pos[:, lk - lq:]

    # Local call: tokens in order.
    lq_pad, lk_pad = bucket(lq, bs), bucket(lk, bs)
    q_abs = torch.arange(lq_pad, device=dev) + (lk - lq)
    qp = _pad_to(q_pos, lq_pad, 1, -1)
    qv = _pad_to(q_valid, lq_pad, 1, False)
    kp = _pad_to(pos, lk_pad + bs, 1, -1)
    kind = _pad_to(valid.to(torch.int8) * REAL, lk_pad + bs, 1, PAD)
    kind[:, lk_pad] = EXTRA
    kr = kind == REAL
    kidx = torch.arange(lk_pad + bs, device=dev).expand(b, -1)
    q_pmin, q_pmax = _masked_min_max(qp, qv, bs)
    q_amin, q_amax = _masked_min_max(q_abs.expand(b, -1), qv, bs)
    k_pmin, k_pmax = _masked_min_max(kp, kr, bs)
    k_imin, k_imax = _masked_min_max(kidx, kr, bs)
    k_any, k_all = _block_view(kr, bs).any(-1), _block_view(kr, bs).all(-1)
    qa, ka = (lambda t: t[:, :, None]), (lambda t: t[:, None, :])
    near_blk = (ka(k_pmax) > qa(q_pmin) - w) | (ka(k_pmin) < s)
    blocks = ka(k_any) & qa(_block_view(qv, bs).any(-1)) & (ka(k_imin) <= qa(q_amax)) & near_blk
    full = ka(k_all) & (ka(k_imax) <= qa(q_amin)) & ((ka(k_pmin) > qa(q_pmax) - w) | (ka(k_pmax) < s)) & blocks
    blocks[:, :, -1] = _block_view(qv, bs).any(-1)  # the extra key's block
    local_mask = block_mask_from_bools(blocks[:, None], full[:, None],
                                       local_mask_mod(q_abs, qp, kp, kind, w, s), lq_pad, lk_pad + bs, bs)

    # Far call: copies sorted by (group, position); padded tokens get the sentinel group G.
    def sorted_copies(groups: torch.Tensor, tok_valid: torch.Tensor, tok_pos: torch.Tensor):
        bb, hh, n, kk = groups.shape
        grp = torch.where(tok_valid[:, None, :, None], groups, g_count).reshape(bb, hh, n * kk)
        src = torch.arange(n, device=dev).repeat_interleave(kk).expand(bb, hh, -1)
        order = torch.argsort(grp * n + src, dim=-1)
        n_pad = bucket(n * kk, bs)
        grp = _pad_to(grp.gather(-1, order), n_pad, 2, g_count)
        src = _pad_to(src.gather(-1, order), n_pad, 2, 0)
        cpos = tok_pos[:, None, :].expand(bb, hh, -1).gather(-1, src)
        return grp, src, cpos, grp < g_count, n_pad

    qg, q_src, qcp, qok, nq_pad = sorted_copies(q_groups, q_valid, q_pos)
    kg, k_src, kcp, kok, nk_pad = sorted_copies(k_groups, valid, pos)
    # Key metadata is repeated per query head (a few bytes per copy; the keys themselves are not).
    rep = hq // hkv
    far_kind = torch.where(kok, REAL, PAD).to(torch.int8)
    far_kind = _pad_to(far_kind, nk_pad + bs, 2, PAD).repeat_interleave(rep, 1)
    far_kind[:, :, nk_pad] = EXTRA
    kg_t = _pad_to(kg, nk_pad + bs, 2, g_count).repeat_interleave(rep, 1)
    kcp_t = _pad_to(kcp, nk_pad + bs, 2, -1).repeat_interleave(rep, 1)
    kok_t = far_kind == REAL
    dedup = config.query_top_k > 1 and config.key_top_k > 1
    q_mem = k_mem = None
    if dedup:
        q_mem = routing.membership(q_groups).gather(-1, q_src)
        k_mem = _pad_to(routing.membership(k_groups).gather(-1, k_src), nk_pad + bs, 2, 0).repeat_interleave(rep, 1)
    far_mod = far_mask_mod(qg, qcp, kg_t, kcp_t, far_kind, w, s, q_mem, k_mem)

    qg_min, qg_max = _masked_min_max(qg, qok, bs)
    qp_min, qp_max = _masked_min_max(qcp, qok, bs)
    kg_min, kg_max = _masked_min_max(kg_t, kok_t, bs)
    kp_min, kp_max = _masked_min_max(kcp_t, kok_t, bs)
    kb_all = _block_view(kok_t, bs).all(-1)
    qa, ka = (lambda t: t[..., :, None]), (lambda t: t[..., None, :])
    q_any = _block_view(qok, bs).any(-1)
    blocks = ((ka(kg_min) <= qa(qg_max)) & (ka(kg_max) >= qa(qg_min)) & (ka(kp_min) <= qa(qp_max) - w)
              & (ka(kp_max) >= s) & qa(q_any))
    full = (blocks & (not dedup) & qa(qg_min == qg_max) & (ka(kg_min) == qa(qg_min))
            & (ka(kg_max) == qa(qg_min)) & ka(kb_all) & (ka(kp_max) <= qa(qp_min) - w) & (ka(kp_min) >= s))
    blocks[..., -1] = q_any
    full[..., -1] = False
    far_mask = block_mask_from_bools(blocks, full, far_mod, nq_pad, nk_pad + bs, bs)
    return FocusPlan(local_mask, far_mask, kind, far_kind, q_src, k_src, lq_pad, lk_pad)


def _self_scores(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, num_sinks: int, scale: float) -> torch.Tensor:
    """Stabiliser for the local call: max of each query's score with itself and with the sink tokens."""
    b, hq, lq, _ = q.shape
    lk, rep = k.shape[2], hq // k.shape[1]
    kq = k[:, :, lk - lq:].repeat_interleave(rep, 1)
    c = (q.float() * kq.float()).sum(-1) * scale
    if num_sinks:
        pos = token_positions(valid)
        sink_idx = torch.searchsorted(pos, torch.arange(num_sinks, device=q.device).expand(b, -1).contiguous())
        sink_idx = sink_idx.clamp_max(lk - 1)
        ks = k.gather(2, sink_idx[:, None, :, None].expand(-1, k.shape[1], -1, k.shape[3])).repeat_interleave(rep, 1)
        sc = torch.einsum("bhqd,bhsd->bhqs", q.float(), ks.float()) * scale
        c = torch.maximum(c, sc.amax(-1))
    return c


def _gather_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pattern: torch.Tensor,
                      scale: float) -> torch.Tensor:
    """Few queries (decode): attend only the allowed keys, gathered. pattern ``[B, Hq, Lq, Lk]``."""
    b, hq, lq, d = q.shape
    rep = hq // k.shape[1]
    count = pattern.sum(-1)
    m = max(int(count.max()), 1)
    idx = torch.argsort((~pattern).to(torch.int8), dim=-1, stable=True)[..., :m]  # allowed keys first
    bi = torch.arange(b, device=q.device)[:, None, None, None]
    hi = (torch.arange(hq, device=q.device) // rep)[None, :, None, None]
    kg, vg = k[bi, hi, idx], v[bi, hi, idx]  # [B, Hq, Lq, M, D]
    s = torch.einsum("bhqd,bhqmd->bhqm", q.float(), kg.float()) * scale
    s = s.masked_fill(torch.arange(m, device=q.device) >= count[..., None], float("-inf"))
    p = torch.nan_to_num(s.softmax(-1), nan=0.0)
    return torch.einsum("bhqm,bhqmd->bhqd", p, vg.float()).to(q.dtype)


def focus_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                    config: FocusConfig, *, attention_mask: torch.Tensor | None = None, scale: float | None = None,
                    k_member: torch.Tensor | None = None) -> torch.Tensor:
    """The fast path: same result as :func:`reference_attention`, on compiled FlexAttention.

    Prefill: a local call (window + sinks, tokens in order) and a far call (copies sorted by group),
    both block-sparse, merged exactly through their log-sum-exps. Decode (Lq <= 16): the allowed keys
    are gathered (window + sinks + same-group keys), O(Lk) work. ``k_member`` (int64 bitmask
    ``[B, Hkv, Lk]``) lets a KV cache pass key routing it already computed. Inference only: compiled
    flex has no backward on CPU; train with :func:`soft_attention`.
    """
    valid = check_inputs(q, k, v, centroids, config, attention_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    b, hq, lq, d = q.shape
    lk = k.shape[2]
    if k_member is not None and k_member.shape != k.shape[:3]:
        raise ValueError(f"k_member {tuple(k_member.shape)} must be [B, Hkv, Lk] = {tuple(k.shape[:3])}")
    if lq <= DECODE_MAX_QUERIES:
        pattern = focus_pattern(q, k, centroids, config, attention_mask=valid, k_member=k_member)
        return _gather_attention(q, k, v, pattern, scale)

    k_groups = None
    if k_member is not None:
        k_groups = groups_from_membership(k_member, config.key_top_k, config.num_groups)
    plan = plan_attention(q, k, centroids, config, valid=valid, k_groups=k_groups)
    bs = config.block_size
    # Local call.
    ql = _pad_to(q, plan.q_len_pad, 2)
    kl, vl = _keys_with_extra(k, v, plan.k_len_pad, bs)
    stab = _pad_to(_self_scores(q, k, valid, config.sink_tokens, scale), plan.q_len_pad, 2)
    o_loc, lse_loc = _flex_with_lse(ql, kl, vl, plan.local_mask, stab, plan.local_kind, scale)
    o_loc, lse_loc = o_loc[:, :, :lq], lse_loc[:, :, :lq]
    # Far call on sorted copies; its extra key scores the local lse (the natural scale of the row).
    qf = q.gather(2, plan.q_src[..., None].expand(-1, -1, -1, d))
    kf = k.gather(2, plan.k_src[..., None].expand(-1, -1, -1, d))
    vf = v.gather(2, plan.k_src[..., None].expand(-1, -1, -1, d))
    kf, vf = _keys_with_extra(kf, vf, kf.shape[2], bs)
    stab_far = torch.where(torch.isfinite(lse_loc), lse_loc, 0.0).gather(2, plan.q_src)
    o_far, lse_far = _flex_with_lse(qf, kf, vf, plan.far_mask, stab_far, plan.far_kind, scale)
    # Exact merge: softmax over the union = weights exp(lse_part - lse_total).
    m = lse_loc.scatter_reduce(2, plan.q_src, lse_far, "amax")
    m = torch.where(torch.isfinite(m), m, 0.0)
    w_loc = torch.exp(lse_loc - m)
    w_far = torch.exp(lse_far - m.gather(2, plan.q_src))
    num = (w_loc[..., None] * o_loc).scatter_add(2, plan.q_src[..., None].expand(-1, -1, -1, d),
                                                   w_far[..., None] * o_far)
    den = w_loc.scatter_add(2, plan.q_src, w_far)
    out = torch.where(den[..., None] > 0, num / den.clamp_min(1e-30)[..., None], 0.0)
    out = out.masked_fill(~valid[:, None, lk - lq:, None], 0.0)  # padded queries (the local call lets them in)
    return out.to(q.dtype)


def causal_blocks(n: int, block_size: int) -> float:
    """Number of blocks of a causal mask over n tokens (the dense baseline of a density)."""
    nb = math.ceil(n / block_size)
    return nb * (nb + 1) / 2
