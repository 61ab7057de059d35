"""The CPU fast path: Focus as standard flash-attention calls over chunks (the paper's decomposition).

On CPU, compiled FlexAttention computes a block several times slower than PyTorch's own CPU flash kernel, so here
the two parts of the pattern run as plain flash-attention calls that touch (almost) only allowed pairs, and merge
exactly through their log-sum-exps. Per batch row (padding dropped) and KV head, with its query heads stacked:

* **local** — query chunks attend ``[sinks | the window span of the chunk]``. Relative to the chunk, the allowed pairs
  are the same for every chunk, so one additive mask serves them all (only the first chunks, near the sinks, get
  their own). Pairs computed: about ``(chunk + window) / window`` times the allowed ones::

      keys:   sinks  | window span of the chunk
      query0  x x x x  x x x x . . . .
      query1  x x x x  . x x x x . . .
      query2  x x x x  . . x x x x . .

* **far** — query copies and key copies sorted by (group, position); a chunk of query copies of one group may see a
  prefix of its group's keys (beyond the window, past the sinks) that grows down the chunk. The prefix every row of
  the chunk sees is one unmasked call; the few keys after it are a second call with a small staircase mask.

A query in several groups has a far copy per group; a key in several groups has a copy per group. A pair sharing
several groups would be counted more than once, so top-k > 1 for both queries and keys is left to the flex path.
"""

from __future__ import annotations

import bisect
from typing import NamedTuple

import torch

from focus_flex.config import FocusConfig

LOCAL_CHUNK = 64  # query positions per local chunk (measured at window 256: 64 beats 32 and 128)
FAR_CHUNK = 512  # query copies per far call (measured: 512 beats 256 and 1024 at 8K-32K)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def supported(q: torch.Tensor, config: FocusConfig) -> bool:
    """Whether this path can run: a CPU tensor, and no pair can share two groups."""
    return q.device.type == "cpu" and (config.query_top_k == 1 or config.key_top_k == 1)


def local_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, config: FocusConfig,
               scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Sinks + window for queries at positions ``[start, start + Lq)`` of one unpadded sequence.

    q ``[R, Lq, D]`` (the query heads of one KV head), k/v ``[Lk, D]``. Returns output ``[R, Lq, D]`` and lse
    ``[R, Lq]`` (float32). Sinks (positions < sink_tokens) count only as sinks, never as window keys.
    """
    r, lq, d = q.shape
    lk, s, w, c = k.shape[0], config.sink_tokens, config.window, LOCAL_CHUNK
    s_eff = min(s, lk)
    nc = -(-lq // c)
    first = start + torch.arange(nc) * c  # position of each chunk's first query
    kpos = torch.cat([torch.arange(s_eff).expand(nc, -1),  # keys of a chunk: sinks, then its window span
                      first[:, None] - w + 1 + torch.arange(c + w - 1)], 1)
    src = kpos.clamp(0, lk - 1)
    kc, vc = (x.index_select(0, src.flatten()).view(nc, 1, -1, d) for x in (k, v))  # [nc, 1, keys, D]
    # A call's rows: the chunk's queries of every head, so one tile serves R heads ([nc, 1, R * c, D]).
    qc = torch.nn.functional.pad(q, (0, 0, 0, nc * c - lq)).view(r, nc, c, d).transpose(0, 1).reshape(nc, 1, r * c, d)
    # Chunks whose window span reaches below the sinks get their own mask; from there on one mask fits all.
    head = min(int(((first - w + 1) < s).sum()) + 1, nc)
    qpos, kp = first[:head, None, None] + torch.arange(c)[:, None], kpos[:head, None, :]  # [head, c, 1], [head, 1, K]
    is_sink = torch.arange(kpos.shape[1]) < s_eff
    allowed = (kp <= qpos) & (is_sink | ((qpos - kp < w) & (kp >= s)))
    mask = torch.zeros((), dtype=q.dtype).masked_fill(~allowed, float("-inf")).repeat(1, r, 1)[:, None]
    out, lse = q.new_empty(nc, 1, r * c, d), torch.empty(nc, 1, r * c)
    for lo, hi, m in ((0, head - 1, mask[:head - 1]), (head - 1, nc, mask[head - 1:])):
        if hi > lo:
            out[lo:hi], lse[lo:hi] = _flash(qc[lo:hi], kc[lo:hi], vc[lo:hi], 0.0, False, attn_mask=m, scale=scale)[:2]
    out = out.view(nc, r, c, d).transpose(0, 1).reshape(r, nc * c, d)[:, :lq]
    return out, lse.view(nc, r, c).transpose(0, 1).reshape(r, nc * c)[:, :lq]


class FarPlan(NamedTuple):
    """Where every far query copy looks, for one sequence and KV head (no O(N^2) work: two sorts, searchsorted).

    Query copies and key copies are sorted by (group, position); copy c (of query row ``q_row[c]``) sees the sorted
    keys ``[lo[c], hi[c])``: its group's keys past the sinks and beyond the window. The copies of group g are
    ``[bounds[g], bounds[g + 1])``.
    """

    k_src: torch.Tensor  # [key copies] key behind each sorted key copy
    q_row: torch.Tensor  # [copies] flat (head, query) row, into R * Lq, of each sorted query copy
    lo: torch.Tensor  # [copies]
    hi: torch.Tensor  # [copies] (hi == lo: no far key)
    bounds: list[int]  # [G + 1]

    @property
    def pairs(self) -> int:
        """Far (query, key) pairs the plan allows."""
        return int((self.hi - self.lo).sum())


def far_plan(q_groups: torch.Tensor, k_groups: torch.Tensor, start: int, config: FocusConfig) -> FarPlan:
    """q_groups ``[R, Lq, kq]`` of queries at positions ``[start, start + Lq)``, k_groups ``[Lk, kk]``."""
    lk, kk, kq = k_groups.shape[0], k_groups.shape[-1], q_groups.shape[-1]
    stride = lk + 1  # sort key of a copy: group * stride + position
    kkey, korder = (k_groups * stride + torch.arange(lk)[:, None]).flatten().sort()
    qpos = start + torch.arange(q_groups.shape[1])[None, :, None]
    qkey, qorder = (q_groups * stride + qpos).flatten().sort(stable=True)
    group = q_groups.flatten().index_select(0, qorder)
    lo = torch.searchsorted(kkey, group * stride + config.sink_tokens)
    hi = torch.maximum(torch.searchsorted(kkey, qkey - config.window, right=True), lo)
    bounds = torch.searchsorted(group, torch.arange(config.num_groups + 1)).tolist()
    copy_of = lambda order, k: order if k == 1 else torch.div(order, k, rounding_mode="floor")  # noqa: E731
    return FarPlan(copy_of(korder, kk), copy_of(qorder, kq), lo, hi, bounds)


def far_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FarPlan,
             scale: float) -> tuple[torch.Tensor, torch.Tensor]:
    """Same-group pairs beyond the window and past the sinks: q ``[R, Lq, D]``, k/v ``[Lk, D]``.

    Per query copy of ``plan``, two parts (the keys every row of its chunk sees, then the rest): outputs
    ``[2, copies, D]`` and lse ``[2, copies]`` (float32, -inf: no key).
    """
    d = q.shape[-1]
    # As [1, 1, L, D]: the flash op's layout, so that a chunk is a single slice.
    qs = q.reshape(-1, d).index_select(0, plan.q_row)[None, None]
    ks, vs = k.index_select(0, plan.k_src)[None, None], v.index_select(0, plan.k_src)[None, None]
    copies = qs.shape[2]
    out, lse = qs.new_empty(2, 1, 1, copies, d), torch.full((2, 1, 1, copies), float("-inf"))
    lo, hi = plan.lo.tolist(), plan.hi.tolist()
    hi_col = plan.hi[:, None]
    for g in range(len(plan.bounds) - 1):
        # Copies are sorted by position within a group, so hi grows: the ones with far keys are a suffix.
        a0, b = plan.bounds[g], plan.bounds[g + 1]
        a = bisect.bisect_right(hi, lo[a0], a0, b) if b > a0 else b
        out[..., a0:a, :] = 0  # rows with lse -inf must hold finite numbers: the merge weighs them by 0
        for r0 in range(a, b, FAR_CHUNK):
            r1 = min(r0 + FAR_CHUNK, b)
            k0, k1, k2 = lo[r0], hi[r0], hi[r1 - 1]
            rows = (slice(None), slice(None), slice(r0, r1))
            out[0][rows], lse[0][rows] = _flash(qs[rows], ks[..., k0:k1, :], vs[..., k0:k1, :], 0.0, False,
                                                scale=scale)[:2]
            rt = bisect.bisect_right(hi, k1, r0, r1)  # rows [rt, r1) also see some of the keys [k1, k2)
            out[1, ..., r0:rt, :] = 0
            if rt < r1:
                rows = (slice(None), slice(None), slice(rt, r1))
                mask = torch.where(torch.arange(k1, k2) < hi_col[rt:r1], 0.0, float("-inf")).to(q.dtype)
                out[1][rows], lse[1][rows] = _flash(qs[rows], ks[..., k1:k2, :], vs[..., k1:k2, :], 0.0, False,
                                                    attn_mask=mask, scale=scale)[:2]
    return out.view(2, copies, d), lse.view(2, copies)


def merge(out_loc: torch.Tensor, lse_loc: torch.Tensor, out_far: torch.Tensor, lse_far: torch.Tensor,
          q_row: torch.Tensor) -> torch.Tensor:
    """Exact union of the local part (output ``[rows, D]``, lse ``[rows]``) and the far parts (``[P, copies, D]``,
    ``[P, copies]``, copy ``c`` of every part belonging to row ``q_row[c]``), all normalised outputs with their
    float32 lse (-inf: empty). Returns float32 ``[rows, D]`` (``out_loc`` itself when it is float32)."""
    m = lse_loc
    for lse in lse_far:
        m = m.scatter_reduce(0, q_row, lse, "amax")
    w_loc = (lse_loc - m).exp_()
    den, num = w_loc.clone(), out_loc.float().mul_(w_loc[:, None])
    for out, lse in zip(out_far, lse_far, strict=True):
        w = (lse - m[q_row]).exp_()
        den.index_add_(0, q_row, w)
        num.index_add_(0, q_row, out.float().mul_(w[:, None]))  # float32 parts: scaled in place
    return num.div_(den[:, None])


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, q_groups: torch.Tensor,
                    k_groups: torch.Tensor, valid: torch.Tensor, config: FocusConfig, scale: float) -> torch.Tensor:
    """Focus prefill on CPU. q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]``, groups ``[B, H, L, top-k]``, valid
    ``[B, Lk]`` (real tokens). Exact: the result of :func:`focus_flex.attention.reference_attention`."""
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    rep = hq // hkv
    out = q.new_empty(b, hq, lq, d) if bool(valid.all()) else q.new_zeros(b, hq, lq, d)  # padded query rows: 0
    for i in range(b):
        keys = valid[i].nonzero()[:, 0]
        queries = valid[i, lk - lq:].nonzero()[:, 0]
        n, m = keys.shape[0], queries.shape[0]
        dense = n == lk and m == lq
        for j in range(hkv):
            hs = slice(j * rep, (j + 1) * rep)
            qj, kj, vj, qg, kg = q[i, hs], k[i, j], v[i, j], q_groups[i, hs], k_groups[i, j]
            if not dense:  # drop the padding: positions become indices
                qj, qg, kj, vj, kg = qj[:, queries], qg[:, queries], kj[keys], vj[keys], kg[keys]
            if m == 0:
                continue
            o_loc, lse_loc = local_part(qj, kj, vj, n - m, config, scale)
            plan = far_plan(qg, kg, n - m, config)
            o_far, lse_far = far_part(qj, kj, vj, plan, scale)
            res = merge(o_loc.reshape(rep * m, d), lse_loc.reshape(rep * m), o_far, lse_far, plan.q_row)
            res = res.view(rep, m, d).to(q.dtype)
            if dense:
                out[i, hs] = res
            else:
                out[i, hs, queries] = res
    return out
