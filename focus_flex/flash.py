"""The CPU fast path (``kernel="flash"``): Focus as the paper's two standard attention passes, merged exactly.

Per batch row (padding dropped) and KV head, with its query heads stacked, two parts of the pattern:

* **local** — each query attends its sinks and its window::

      keys:   sinks  | window span of a tile of queries
      query0  x x x x  x x x x . . . .
      query1  x x x x  . x x x x . . .
      query2  x x x x  . . x x x x . .

* **far** — query copies and keys listed per group, sorted by position; a copy may see a prefix of its group's keys
  (beyond the window, past the sinks) that grows with its position: per group, a causal staircase over ~1/G of the
  pairs.

Where it builds (:mod:`focus_flex.native`), ``csrc/prefill.c`` runs both parts in one call per batch row and KV head:
every computed pair is one in registers, the far plan is two counting sorts, the far part merges into the local
part's output in place, and the only buffers are a log-sum-exp per row, the plan's integer lists and a few tiles per
thread; a pair sharing several groups (query and key top-k both above 1) is computed in the first of them, and where
queries and keys join so many groups that copies would visit a pair about once or more per shared group
(:attr:`FocusConfig.one_pass <focus_flex.config.FocusConfig.one_pass>`) both parts are one causal pass that tests the
group bitmasks.
Elsewhere (no C compiler, float16, a head dim that is not a multiple of 16 or above 256) the same parts run as chunks
of PyTorch's CPU flash attention, which returns the log-sum-exp:

* local: query chunks attend ``[sinks | the window span of the chunk]`` under one additive mask that is the same for
  every chunk (only the first chunks, near the sinks, get their own); ~``(chunk + window) / window`` times the
  allowed pairs;
* far: a chunk of a group's query copies attends the prefix every row of the chunk sees (one unmasked call), then the
  few keys after it under a small staircase mask; results merge into the local part's every ``FAR_BLOCK`` copies.

A query in several groups has a far copy per group; a key in several groups is listed in each. The PyTorch parts
would count a pair sharing several groups more than once, so top-k > 1 for both queries and keys runs in C only.
"""

from __future__ import annotations

from typing import NamedTuple

import numpy as np
import torch

from focus_flex import native, routing
from focus_flex.config import FocusConfig

# Chunk sizes trade call overhead against masked work; docs/speed.md ("Tuning constants") has their measurements.
LOCAL_CHUNK = 64  # query positions per local chunk
FAR_CHUNK = 512  # query copies per far call
FAR_BLOCK = 4096  # far query copies gathered and merged at a time (temporaries ~1 MB per buffer at head dim 64)
FAR_TAIL = 512  # at most this many keys under a far chunk's staircase mask (its template: (FAR_TAIL + 1) ** 2 floats)
LOCAL_BATCH = 32  # local chunks per flash call (gathered keys: ~2.6 MB per tensor)
_flash = torch.ops.aten._scaled_dot_product_flash_attention_for_cpu


def supported(device: torch.device, config: FocusConfig, qkv: tuple[torch.Tensor, ...] | None = None) -> bool:
    """Whether this path can run: CPU tensors, and no pair can share two groups or the C kernel runs (for these
    ``qkv`` if given, else for some inputs: its library is built)."""
    if device.type != "cpu":
        return False
    if config.query_top_k == 1 or config.key_top_k == 1:
        return True
    return native.prefill_applies(*qkv) if qkv is not None else native.library() is not None


def local_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, start: int, config: FocusConfig, scale: float,
               out: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Sinks + window for queries at positions ``[start, start + Lq)`` of one unpadded sequence.

    q ``[R, Lq, D]`` (the query heads of one KV head), k/v ``[Lk, D]``. Returns the output ``[R, Lq, D]`` (float32,
    or written into ``out`` if given: Lq a multiple of ``LOCAL_CHUNK``, any strides) and the float32 lse
    ``[R, Lq]``.
    Sinks (positions < sink_tokens) count only as sinks, never as window keys. Chunks go ``LOCAL_BATCH`` at a
    time, so the gathered keys stay a few MB.
    """
    r, lq, d = q.shape
    lk, s, w, c = k.shape[0], config.sink_tokens, config.window, LOCAL_CHUNK
    s_eff = min(s, lk)
    nc = -(-lq // c)
    qp = (q if nc * c == lq else torch.nn.functional.pad(q, (0, 0, 0, nc * c - lq))).view(r, nc, c, d)
    out = torch.empty(r, nc, c, d) if out is None else out.view(r, nc, c, d)
    lse = torch.empty(r, nc, c)
    is_sink = torch.arange(s_eff + c + w - 1) < s_eff
    # Chunks whose window span reaches below the sinks get their own mask; from there on one mask fits all.
    own = min(max(-(-(s + w - 1 - start) // c), 0), nc)
    for c0, c1, shared in ((0, own, False), (own, nc, True)):
        for b0 in range(c0, c1, LOCAL_BATCH):
            b1 = min(b0 + LOCAL_BATCH, c1)
            first = start + torch.arange(b0, b1) * c  # position of each chunk's first query
            kpos = torch.cat([torch.arange(s_eff).expand(b1 - b0, -1),  # a chunk's keys: sinks, its window span
                              first[:, None] - w + 1 + torch.arange(c + w - 1)], 1)
            kc, vc = (x.index_select(0, kpos.clamp(0, lk - 1).flatten()).view(b1 - b0, 1, -1, d) for x in (k, v))
            qpos, kp = first[:, None, None] + torch.arange(c)[:, None], kpos[:, None, :]  # [n, c, 1], [n, 1, K]
            if shared:
                qpos, kp = qpos[:1], kp[:1]
            allowed = (kp <= qpos) & (is_sink | ((qpos - kp < w) & (kp >= s)))
            mask = torch.zeros((), dtype=q.dtype).masked_fill(~allowed, float("-inf")).repeat(1, r, 1)[:, None]
            # A call's rows: the chunk's queries of every head, so one tile serves R heads ([n, 1, R * c, D]).
            qc = qp[:, b0:b1].transpose(0, 1).reshape(b1 - b0, 1, r * c, d)
            o, l_ = _flash(qc, kc, vc, 0.0, False, attn_mask=mask, scale=scale)[:2]
            out[:, b0:b1], lse[:, b0:b1] = o.view(-1, r, c, d).transpose(0, 1), l_.view(-1, r, c).transpose(0, 1)
    return out.view(r, nc * c, d)[:, :lq], lse.view(r, nc * c)[:, :lq]


def window_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, window: int, sinks: int,
                     scale: float) -> torch.Tensor:
    """Window + sinks attention of an unpadded CPU prefill (the window-only baseline at its own cost): the local part
    alone, per batch row and KV head, O(Lq (window + sinks)) pairs instead of a masked dense SDPA's O(Lq Lk). In C
    where :func:`native.prefill_applies` (a far plan whose queries and keys share no group), else
    :func:`local_part`.

    q ``[B, Hq, Lq, D]`` at positions ``[Lk - Lq, Lk)``, k/v ``[B, Hkv, Lk, D]`` -> ``[B, Hq, Lq, D]``: query i attends
    key j iff ``j <= i`` and (``i - j < window`` or ``j < sinks``).
    """
    (b, hq, lq, _), (hkv, lk) = q.shape, k.shape[1:3]
    rep, threads = hq // hkv, torch.get_num_threads()
    config = FocusConfig(num_groups=2, window=window, sink_tokens=sinks)
    fused = native.prefill_applies(q, k, v)
    if fused:  # queries in group 0, keys in group 1: no far pair
        plan = native.prefill_plan(torch.zeros(rep, lq, 1, dtype=torch.long), torch.ones(lk, 1, dtype=torch.long),
                                   config)
    out = torch.empty_like(q)
    for i in range(b):
        for j in range(hkv):
            hs = slice(j * rep, (j + 1) * rep)
            if fused:
                native.prefill(q[i, hs], k[i, j], v[i, j], plan, config, scale, out[i, hs], threads)
            else:
                out[i, hs] = local_part(q[i, hs], k[i, j], v[i, j], lk - lq, config, scale)[0].to(q.dtype)
    return out


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
        """Far (query, key) pairs the plan lists (with query and key top-k both above 1 the PyTorch parts do not run
        such a plan: a pair sharing s groups is listed s times)."""
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
    return FarPlan(_source_of(korder, kk), _source_of(qorder, kq), lo, hi, bounds)


def _source_of(order: torch.Tensor, k: int) -> torch.Tensor:
    """The row behind each sorted copy, for copies made ``k`` per row (flat index ``row * k + j``)."""
    return order if k == 1 else torch.div(order, k, rounding_mode="floor")


def far_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FarPlan, scale: float, out: torch.Tensor,
             lse: torch.Tensor) -> None:
    """Add the same-group pairs beyond the window and past the sinks to a partial result, in place.

    q ``[R, Lq, D]``, k/v ``[Lk, D]``; ``out`` ``[R, Lq, D]`` (normalised, any float dtype, any layout whose rows of
    D are contiguous and D apart, e.g. transformers' ``[L, H, D]`` memory) and ``lse`` ``[R * Lq]`` (float32) hold
    the local part (every row has a key). Group by group, chunks of its sorted query copies attend the keys every
    row of the chunk sees, then the rest under a staircase mask. Results are merged into ``out`` and ``lse`` every
    ``FAR_BLOCK`` copies, so the temporaries stay a few MB however many copies a group has.
    """
    d = q.shape[-1]
    lo, hi = plan.lo.numpy(), plan.hi.numpy()  # views: scalar reads without a Python int per copy
    # Copies are sorted by position within a group, so hi grows: the ones with far keys are a suffix [a, b).
    ends = [(a0, b) for a0, b in zip(plan.bounds[:-1], plan.bounds[1:], strict=True) if a0 < b]
    suffixes = [(a, b) for a, b in ((_after(hi, lo[a0], a0, b), b) for a0, b in ends) if a < b]
    chunks = [_far_chunks(hi, a, b) for a, b in suffixes]
    # A tail mask is a staircase (row i sees the first n_i keys): rows of one template, picked by n_i.
    width = max((hi[r1 - 1] - hi[r0] for group in chunks for r0, r1 in group), default=0)
    n = torch.arange(width + 1)
    stairs = torch.zeros((), dtype=q.dtype).masked_fill(n[None, :width] >= n[:, None], float("-inf"))
    q_flat, q_rows = _row_view(q if _has_row_view(q) else q.contiguous(), plan.q_row)
    out_flat, out_rows = _row_view(out, plan.q_row)
    for (a, b), group in zip(suffixes, chunks, strict=True):
        k_lo, k_hi = lo[a], hi[b - 1]  # the group's keys any of its copies sees
        ks, vs = (x.index_select(0, plan.k_src[k_lo:k_hi])[None, None] for x in (k, v))  # the flash op's layout
        for block in _far_blocks(group):
            b0, b1 = block[0][0], block[-1][1]
            qs = q_flat.index_select(0, q_rows[b0:b1])[None, None]  # [1, 1, copies, D]
            po, pl = qs.new_zeros(2, 1, 1, b1 - b0, d), torch.full((2, 1, 1, b1 - b0), float("-inf"))  # full, tail
            for r0, r1 in block:
                k0, k1, k2 = lo[r0] - k_lo, hi[r0] - k_lo, hi[r1 - 1] - k_lo
                sl = (slice(None), slice(None), slice(r0 - b0, r1 - b0))
                po[0][sl], pl[0][sl] = _flash(qs[sl], ks[..., k0:k1, :], vs[..., k0:k1, :], 0.0, False,
                                              scale=scale)[:2]
                rt = _after(hi, hi[r0], r0, r1)  # rows [rt, r1) also see some of the keys [k1, k2)
                if rt < r1:
                    sl = (slice(None), slice(None), slice(rt - b0, r1 - b0))
                    mask = stairs[:, :k2 - k1].index_select(0, plan.hi[rt:r1] - (k_lo + k1))
                    po[1][sl], pl[1][sl] = _flash(qs[sl], ks[..., k1:k2, :], vs[..., k1:k2, :], 0.0, False,
                                                  attn_mask=mask, scale=scale)[:2]
            _merge_into(out_flat, out_rows[b0:b1], lse, plan.q_row[b0:b1], po.view(2, -1, d), pl.view(2, -1))


def _row_view(x: torch.Tensor, index: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[R, L, D]`` as a view ``[n, D]`` of its memory's rows, and the row of each ``x[i // L, i % L]`` for i
    in ``index``; a write through the view lands in ``x``. Needs rows of D contiguous and D apart
    (:func:`_has_row_view`)."""
    r, lq, d = x.shape
    if not _has_row_view(x):
        raise ValueError(f"strides {x.stride()} of a [R, L, D] = {tuple(x.shape)} tensor do not make rows of D")
    head, pos = x.stride(0) // d, x.stride(1) // d
    rows = index if (head, pos) == (lq, 1) else torch.div(index, lq, rounding_mode="floor") * head + index % lq * pos
    return x.as_strided(((r - 1) * head + (lq - 1) * pos + 1, d), (d, 1)), rows


def _has_row_view(x: torch.Tensor) -> bool:
    """Whether ``[R, L, D]`` ``x`` is rows of D, contiguous and D apart: every layout transformers hands attention."""
    d = x.shape[-1]
    return x.stride(2) == 1 and x.stride(0) % d == 0 and x.stride(1) % d == 0


def _far_blocks(chunks: list[tuple[int, int]]) -> list[list[tuple[int, int]]]:
    """Consecutive chunks of one group, at most ``FAR_BLOCK`` copies a block (a chunk longer than that alone)."""
    blocks: list[list[tuple[int, int]]] = []
    for r0, r1 in chunks:
        if blocks and r1 - blocks[-1][0][0] <= FAR_BLOCK:
            blocks[-1].append((r0, r1))
        else:
            blocks.append([(r0, r1)])
    return blocks


def _far_chunks(hi: np.ndarray, a: int, b: int) -> list[tuple[int, int]]:
    """Split a group's copies ``[a, b)`` (hi ascending) into chunks of at most ``FAR_CHUNK`` copies whose tail keys
    (seen by some rows of the chunk but not its first) number at most ``FAR_TAIL``: where a group's keys are dense
    and its queries sparse, a fixed number of rows would see thousands of tail keys, most of them masked."""
    chunks, r0 = [], a
    while r0 < b:
        r1 = min(r0 + FAR_CHUNK, _after(hi, hi[r0] + FAR_TAIL, r0, b))  # > r0: row r0 itself qualifies
        chunks.append((r0, r1))
        r0 = r1
    return chunks


def _after(sorted_: np.ndarray, x: int, a: int, b: int) -> int:
    """The first index in ``[a, b)`` whose value exceeds ``x`` (``sorted_[a:b]`` ascending; b if none)."""
    return a + int(sorted_[a:b].searchsorted(x, side="right"))


def _merge_into(out: torch.Tensor, out_rows: torch.Tensor, lse: torch.Tensor, lse_rows: torch.Tensor,
                parts: torch.Tensor, part_lse: torch.Tensor) -> None:
    """``out[out_rows]`` (any float dtype; merged in float32) and ``lse[lse_rows]`` (float32, finite), the same n
    query rows, united with parts ``[P, n, D]`` / ``[P, n]`` of them (normalised outputs, lse -inf where empty),
    exactly, in place. Rows must not repeat."""
    cur = lse.index_select(0, lse_rows)
    new = torch.logaddexp(cur, torch.logsumexp(part_lse, 0))
    acc = out.index_select(0, out_rows).float().mul_((cur - new).exp_()[:, None])
    for o, l_ in zip(parts, part_lse, strict=True):
        acc.addcmul_(o, (l_ - new).exp_()[:, None])
    out.index_copy_(0, out_rows, acc.to(out.dtype))
    lse.index_copy_(0, lse_rows, new)


def flash_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                    k_groups: torch.Tensor | None, valid: torch.Tensor, config: FocusConfig,
                    scale: float, q_groups: torch.Tensor | None = None) -> torch.Tensor:
    """Focus prefill on CPU. q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]``, centroids ``[Hkv, G, D]``, valid
    ``[B, Lk]`` (real tokens); ``k_groups`` ``[B, Hkv, Lk, top-k]`` and ``q_groups`` ``[B, Hq, Lq, top-k]`` are
    routings done by the caller (a KV cache's, or of centered vectors; None: route q and k here). Exact: the result
    of :func:`focus_flex.attention.reference_attention`.

    Routes one batch row and KV head at a time where the C routing runs, so the group tensors stay one head's. The
    output has q's memory layout where q's is dense with contiguous rows of D, as SDPA's does: transformers hands q
    as a ``[B, L, H, D]`` projection viewed as ``[B, H, L, D]``, and turns the output back for free.
    """
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    rep = hq // hkv
    layout = torch.preserve_format if q.stride(-1) == 1 else torch.contiguous_format  # rows of D: see _row_view
    out = (torch.empty_like if bool(valid.all()) else torch.zeros_like)(q, memory_format=layout)  # padded rows: 0
    fused, threads = native.prefill_applies(q, k, v), torch.get_num_threads()
    if not fused and config.query_top_k > 1 and config.key_top_k > 1:
        raise ValueError(f"query_top_k={config.query_top_k} and key_top_k={config.key_top_k} run on the flash path "
                         "only through its C kernel, which does not take these inputs (native.prefill_applies says "
                         "why); use kernel='flex'")
    # Routing per batch row and KV head where it is the C routing (a vector's group does not depend on the vectors
    # routed with it); PyTorch's scores can, in their last bits, so there the whole tensors are routed at once, as
    # reference_attention does.
    q_all = q_groups
    if q_all is None and not (config.query_top_k == 1 and native.routes(q, centroids)):
        q_all = routing.hard_groups(q, centroids, config.query_top_k)
    if k_groups is None and not (config.key_top_k == 1 and native.routes(k, centroids)):
        k_groups = routing.hard_groups(k, centroids, config.key_top_k)
    for i in range(b):
        keys = valid[i].nonzero()[:, 0]
        queries = valid[i, lk - lq:].nonzero()[:, 0]
        n, m = keys.shape[0], queries.shape[0]
        if m == 0:
            continue
        dense = n == lk and m == lq
        for j in range(hkv):
            hs = slice(j * rep, (j + 1) * rep)
            qj, kj, vj = q[i, hs], k[i, j], v[i, j]
            qg = None if q_all is None else q_all[i, hs]
            kg = None if k_groups is None else k_groups[i, j]
            if not dense:  # drop the padding: positions become indices
                qj, kj, vj = qj[:, queries], kj[keys], vj[keys]
                qg, kg = (None if qg is None else qg[:, queries]), (None if kg is None else kg[keys])
            if qg is None:
                qg = routing.hard_groups(qj[None], centroids[j:j + 1], config.query_top_k)[0]
            if kg is None:
                kg = routing.hard_groups(kj[None, None], centroids[j:j + 1], config.key_top_k)[0, 0]
            # Where the output's layout allows, write into it: no float32 copy of a head's result (the PyTorch parts
            # merge in float32 and round once; with query top-1, a row is merged once).
            in_place = dense and (fused or m % LOCAL_CHUNK == 0)
            res = out[i, hs] if in_place else None
            if fused:  # the C kernel: both parts
                res = torch.empty_like(qj) if res is None else res
                native.prefill(qj, kj, vj, native.prefill_plan(qg, kg, config), config, scale, res, threads)
            else:
                res, lse = local_part(qj, kj, vj, n - m, config, scale, res)
                far_part(qj, kj, vj, far_plan(qg, kg, n - m, config), scale, res, lse.reshape(rep * m))
                del lse
            if not in_place:
                out[i, hs, queries] = res.to(q.dtype)
            del res  # before the next head allocates its own
    return out
