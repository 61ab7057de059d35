"""Decode on a KV cache in O(selected keys): per-group key lists that grow with the cache.

A :class:`KeyIndex` holds the key routing of one layer's KV cache: per (batch row, KV head, group), the positions
of that group's keys in increasing order, each list a segment of one flat pool with room to grow. Appending a token
costs O(1) (amortised: the pool is rebuilt with an eighth more room per group when a list fills up, nothing is
re-concatenated per step). :func:`indexed_attention` then attends a few new queries to their sinks and window
(contiguous slices) plus the far keys of their groups (slices of those lists), so the work per step is proportional
to the selected keys, not to the cache length. Exact: the same result as
:func:`focus_flex.attention.reference_attention` when no key is padding.
"""

from __future__ import annotations

import functools
import itertools
import operator
import warnings

import numpy as np
import torch
import torch.nn.functional as F

from focus_flex import native, routing
from focus_flex.config import FocusConfig
from focus_flex.threads import using

_END = np.iinfo(np.int32).max  # fills unused pool slots
APPEND_CHUNK = 4096  # keys routed into the lists at a time
SLACK = 64  # free slots a buffer gets on top of an eighth of its size when it grows
DECODE_PARALLEL_KEYS = 1 << 18  # keys a C decode step reads (about) before it splits them between threads


def _room(needed: np.ndarray | int) -> np.ndarray | int:
    """Slots to allocate for ``needed`` entries: an eighth more plus :data:`SLACK`, so that a buffer grown one
    entry at a time is reallocated geometrically rarely (O(1) amortised per entry)."""
    return needed + needed // 8 + SLACK


def _grow(buffer: np.ndarray, needed: int) -> np.ndarray:
    """``buffer`` ``[..., C]`` with room for at least ``needed`` entries on the last dim (new slots zero)."""
    if needed <= buffer.shape[-1]:
        return buffer
    grown = np.zeros(buffer.shape[:-1] + (_room(needed),), buffer.dtype)
    grown[..., :buffer.shape[-1]] = buffer
    return grown


def _to(positions: np.ndarray, device: torch.device) -> torch.Tensor:
    """Host positions -> a tensor on ``device`` (on CPU, the same memory)."""
    return torch.from_numpy(positions).to(device)


class KeyIndex:
    """Key routing of a growing KV cache: per-group position lists of its ``[B, Hkv, L]`` keys.

    It lives on the host, in NumPy arrays: a decode step reads and writes it element by element, which NumPy does
    at a fraction of a tensor op's overhead (the device path keeps its index on the device: :mod:`focus_flex.cache`).
    The list of (b, h, g) is ``pool[starts[b, h, g]:][:counts[b, h, g]]`` (int32 positions, ascending; see
    :meth:`keys`), with room for ``capacity[b, h, g]`` entries: 4 bytes per key and group it is in, plus an eighth.
    Positions are cache indices, so the fast path (:func:`indexed_attention`) assumes no padding; the group bitmasks
    (:attr:`member`: built from the lists when a padded batch first asks for them, then kept up to date) serve any
    path.
    """

    def __init__(self, batch: int, heads: int, num_groups: int, device: torch.device | str):
        self.num_groups, self.device = num_groups, torch.device(device)
        self.batch, self.heads, self.length = batch, heads, 0
        self.pool = np.full(0, _END, dtype=np.int32)
        self.starts, self.capacity, self.counts = (np.zeros((batch, heads, num_groups), np.int64) for _ in range(3))
        self._member: np.ndarray | None = None  # [B, Hkv, >= length] group bitmasks, once asked for

    @property
    def shape(self) -> tuple[int, int, int]:
        """``(B, Hkv, length)``: the keys routed so far."""
        return self.batch, self.heads, self.length

    def keys(self, i: int, h: int, g: int) -> np.ndarray:
        """The positions of the keys of (batch row i, KV head h) in group g, ascending (a view)."""
        start = self.starts[i, h, g]
        return self.pool[start:start + self.counts[i, h, g]]

    @property
    def member(self) -> torch.Tensor:
        """Group bitmasks of the keys so far, ``[B, Hkv, length]`` on the cache's device (int32 up to 31 groups, else
        int64; on CPU a view of the index's memory). The first call builds them from the lists (O(length x key
        top-k)); from then on appends keep them up to date (padded batches ask at every step)."""
        if self._member is None:
            member = np.zeros(self.shape, np.int32 if self.num_groups <= 31 else np.int64)
            for i, h, g in np.ndindex(self.counts.shape):
                member[i, h, self.keys(i, h, g)] |= member.dtype.type(1) << g
            self._member = member
        return _to(self._member[:, :, :self.length], self.device)

    def far(self, i: int, h: int, g: int, lo: int, hi: int) -> np.ndarray:
        """The positions in ``[lo, hi)`` of the keys of (batch row i, KV head h) in group g, ascending (a view)."""
        keys = self.keys(i, h, g)
        return keys[keys.searchsorted(lo):keys.searchsorted(hi)]

    def extend(self, keys: torch.Tensor, centroids: torch.Tensor, config: FocusConfig) -> None:
        """Route the keys ``[B, Hkv, L, D]`` that follow the current ones and add them.

        Long extensions (a prefill, a first look at a full cache) go in chunks, so the routing temporaries stay a
        few MB instead of several times the keys' size.
        """
        for chunk in keys.split(APPEND_CHUNK, dim=2) if keys.shape[2] > APPEND_CHUNK else (keys,):
            self.append(routing.hard_groups(chunk, centroids, config.key_top_k))

    def _fit(self, counts: np.ndarray) -> None:
        """Make room for lists of ``counts`` entries: where one does not fit, rebuild the pool with every list given
        its :func:`_room` (so rebuilds come geometrically rarer as the cache grows)."""
        if (counts <= self.capacity).all():
            return
        capacity = _room(counts)
        starts = np.cumsum(capacity, axis=None).reshape(capacity.shape) - capacity
        pool = np.full(int(capacity.sum()), _END, dtype=np.int32)
        for at in np.ndindex(counts.shape):
            pool[starts[at]:starts[at] + self.counts[at]] = self.keys(*at)
        self.pool, self.starts, self.capacity = pool, starts, capacity

    def append(self, groups: torch.Tensor) -> None:
        """Add the keys that follow the current ones, given their groups ``[B, Hkv, L, k]``."""
        n = groups.shape[2]
        member = routing.membership(groups) if n > 1 or self._member is not None else None  # [B, Hkv, L]
        if self._member is not None:
            self._member = _grow(self._member, self.length + n)
            self._member[:, :, self.length:self.length + n] = member.cpu().numpy()
        if n == 1:  # a decode step: a few scalar writes (vectorising one key costs more in op overhead)
            for i, heads in enumerate(groups[:, :, 0].tolist()):
                for h, chosen in enumerate(heads):
                    for g in chosen:
                        c = self.counts[i, h, g]
                        if c == self.capacity[i, h, g]:
                            counts = self.counts.copy()
                            counts[i, h, g] += 1
                            self._fit(counts)
                        self.pool[self.starts[i, h, g] + c] = self.length
                        self.counts[i, h, g] = c + 1
            self.length += 1
            return
        bits = routing.member_bits(member, self.num_groups).cpu().numpy()  # [B, Hkv, L, G]
        slot = bits.cumsum(2) + self.counts[:, :, None, :] - 1  # list slot of each key in each of its groups
        counts = self.counts + bits.sum(2)
        self._fit(counts)
        b, h, i, g = bits.nonzero()
        self.pool[self.starts[b, h, g] + slot[b, h, i, g]] = self.length + i
        self.counts = counts
        self.length += n


def _far_end(lk: int, lq: int, config: FocusConfig) -> int:
    """Where the far keys of the last ``lq`` of ``lk`` keys end: they lie in ``[sinks, end)``; keys from ``end`` on
    are in the window of some query."""
    return max(config.sink_tokens, lk - lq - config.window + 1)


def _local(lk: int, lq: int, config: FocusConfig) -> tuple[np.ndarray, int]:
    """Positions of the sinks and of the window of the last ``lq`` of ``lk`` keys, and :func:`_far_end`."""
    end, sinks = _far_end(lk, lq, config), min(config.sink_tokens, lk)
    return np.concatenate((np.arange(sinks, dtype=np.int32), np.arange(end, lk, dtype=np.int32))), end


def _flat_rows(x: torch.Tensor) -> tuple[torch.Tensor, list[int]]:
    """``[B, H, L, D]`` as one ``[rows, D]`` view of its memory, and the row of each ``x[i, h, 0]`` (in (i, h) order),
    so that one op reads the rows of every (batch row, head). A KV cache is such a view already (its rows are D
    apart); anything else is copied first."""
    b, h, _, d = x.shape
    if x.stride(-1) != 1 or x.stride(-2) != d or x.stride(0) % d or x.stride(1) % d:
        x = x.contiguous()
    starts = [i * x.stride(0) // d + j * x.stride(1) // d for i in range(b) for j in range(h)]
    return x.as_strided((max(starts) + x.shape[2], d), (d, 1)), starts


@functools.cache
def _quiet_csr() -> None:
    """Take, silenced, the warning PyTorch gives once per process that sparse CSR tensors are in beta (their one use
    here, a sampling pattern for ``sampled_addmm``, has been stable since PyTorch 1.13)."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "Sparse CSR tensor support is in beta", UserWarning)
        torch.sparse_csr_tensor(torch.zeros(1, dtype=torch.int64), torch.zeros(0, dtype=torch.int64), torch.zeros(0),
                                size=(0, 0), check_invariants=False)


def _sampled_scores(q_rows: torch.Tensor, keys: torch.Tensor, rows: np.ndarray, cols: np.ndarray) -> torch.Tensor:
    """``<q_rows[r], keys[c]>`` for the pairs of a CSR pattern (row r owns ``cols[rows[r]:rows[r + 1]]``), flat
    ``[pairs]``: one ``sampled_addmm``, which reads each key row once and writes no copy of it."""
    _quiet_csr()
    dev = q_rows.device
    pattern = torch.sparse_csr_tensor(_to(rows, dev), _to(cols, dev), q_rows.new_zeros(len(cols)),
                                      size=(q_rows.shape[0], keys.shape[0]), check_invariants=False)
    return torch.sparse.sampled_addmm(pattern, q_rows, keys.T, beta=0.0).values()


def _one_group_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                         config: FocusConfig, index: KeyIndex, scale: float, threads: int,
                         q_route: torch.Tensor | None = None) -> torch.Tensor:
    """:func:`indexed_attention` for one query with top-1 query routing (a default decode step).

    Each query row's keys are then its sinks and window plus the far part of exactly one group list, with no
    overlap (a list holds a key once; far keys are not local) and none masked (every local key is causal and near).
    On CPU with float32 or bfloat16 caches, that is one call of the C step (:mod:`focus_flex.native`). Otherwise
    the scores of all rows of a layer are one sampled matmul over a flat view of the cache's key rows, the softmax
    is taken per row segment, and one ``embedding_bag`` sums each row's value rows weighted by its probabilities.
    Either way keys and values are read in place, never gathered into copies (except keys in other dtypes than
    float32 on the PyTorch path: gathered and converted once).
    """
    b, hq, _, d = q.shape
    hkv, rep, dev = k.shape[1], hq // k.shape[1], q.device
    s, groups = config.sink_tokens, routing.hard_groups(q if q_route is None else q_route, centroids, 1)
    if native.applies(k, v):  # the same step, fused in C (it knows the local keys)
        # One thread unless a row reads many keys: waking a second thread costs up to milliseconds when another
        # process holds the core, more than a step's work on one.
        keys = b * hkv * (k.shape[2] // config.num_groups + config.window)
        parts = threads if keys >= DECODE_PARALLEL_KEYS else 1
        out = native.decode_step(q.reshape(b * hq, d), groups.reshape(-1), scale, k, v, index, s,
                                 _far_end(k.shape[2], 1, config), parts)
        return out.reshape(b, hq, 1, d).to(q.dtype)
    local, end = _local(k.shape[2], 1, config)
    groups = groups.reshape(b * hkv, rep).tolist()  # [B * Hkv][rows]
    far = {(j, g): index.far(*divmod(j, hkv), g, s, end) for j, gs in enumerate(groups) for g in gs}
    keys = [(j, np.concatenate((local, far[j, g]))) for j, gs in enumerate(groups) for g in gs]  # row by row
    sizes = [len(x) for _, x in keys]
    rows = np.fromiter(itertools.accumulate(sizes, initial=0), np.int64, len(sizes) + 1)  # CSR row starts
    (kf, k_at), (vf, v_at) = _flat_rows(k), _flat_rows(v)

    def flat(starts: list[int]) -> np.ndarray:  # every row's keys as rows of a flat view
        return np.concatenate([x + starts[j] for j, x in keys], dtype=np.int64)

    k_pos = flat(k_at)
    q_rows = q.reshape(b * hq, d).float() * scale
    with using(threads):
        if kf.dtype == torch.float32:
            scores = _sampled_scores(q_rows, kf, rows, k_pos)
        else:  # (sampled_addmm computes in the keys' dtype: gather them in float32 first)
            scores = _sampled_scores(q_rows, kf.index_select(0, _to(k_pos, dev)).float(), rows,
                                     np.arange(len(k_pos)))
    p = torch.cat([x.softmax(0) for x in scores.split_with_sizes(sizes)])
    v_pos = k_pos if k_at == v_at else flat(v_at)
    with using(threads):
        out = F.embedding_bag(_to(v_pos, dev), vf, _to(rows[:-1], dev), mode="sum", per_sample_weights=p.to(v.dtype))
    return out.reshape(b, hq, 1, d).to(q.dtype)


def _candidate_member(index: KeyIndex, i: int, h: int, groups: list[int], far: list[np.ndarray], sinks: int,
                      end: int, overlap: bool) -> np.ndarray:
    """Group bitmasks (int64, only the bits of ``groups``) of the candidates of (batch row i, KV head h): the local
    keys (the first ``sinks`` positions, then ``[end, length)``), then the far lists ``far`` of ``groups``, in that
    order. Read off the lists: O(candidates), where the whole cache's :attr:`KeyIndex.member` would be O(length).
    ``overlap``: keys sit in several groups, so a far key may be in several of these lists."""
    local = np.zeros(sinks + index.length - end, np.int64)
    for g in groups:
        local[index.far(i, h, g, 0, sinks)] |= 1 << g
        local[index.far(i, h, g, end, index.length) - end + sinks] |= 1 << g
    seg = np.repeat(np.array([1 << g for g in groups], np.int64), [len(x) for x in far])
    if overlap and len(groups) > 1:
        keys, which = np.unique(np.concatenate(far), return_inverse=True)
        bits = np.zeros(len(keys), np.int64)
        np.bitwise_or.at(bits, which, seg)
        seg = bits[which]
    return np.concatenate((local, seg))


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, ok: torch.Tensor,
            out: torch.Tensor, threads: int) -> None:
    """Rows ``q`` ``[R, D]`` (float32, scaled) attend keys ``k[pos]`` / values ``v[pos]`` (k, v ``[L, D]``) where
    ``ok`` ``[R, M]``; every row has an allowed key. Writes the float32 ``[R, D]`` result into ``out``. The gather
    (memory-bound) runs on ``threads`` intra-op threads, the rest on the caller's."""
    with using(threads):
        kg, vg = k.index_select(0, pos).float(), v.index_select(0, pos).float()
    scores = torch.mm(q, kg.T).masked_fill_(~ok, float("-inf"))
    torch.mm(scores.softmax(-1), vg, out=out)


def indexed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                      config: FocusConfig, index: KeyIndex, scale: float, threads: int = 1,
                      q_route: torch.Tensor | None = None) -> torch.Tensor:
    """Few queries (the last Lq of Lk keys, no padding) against sinks + window + their groups' far keys.

    q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` with ``index`` routing exactly those Lk keys. Per (batch row, KV
    head), the candidates are the sinks and the window of the queries (slices) and the far keys of the groups of
    any of its query rows (GQA heads x queries; slices of the group lists, a key in several of them counted once).
    They are gathered once for all these rows, and each row masks the rest with the Focus rule; the softmax runs in
    float32; the gathers use ``threads`` intra-op threads. Returns ``[B, Hq, Lq, D]``. O(rows x candidates) work,
    none of it proportional to Lk. One query with top-1 query routing (the default decode step) needs no mask: see
    :func:`_one_group_attention`. ``q_route``: the vectors routed in place of q (centered routing; None: q).
    """
    b, hq, lq, d = q.shape
    q_route = q if q_route is None else q_route
    if lq == 1 and config.query_top_k == 1:
        return _one_group_attention(q, k, v, centroids, config, index, scale, threads, q_route)
    hkv, lk = k.shape[1], k.shape[2]
    rows = hq // hkv * lq  # query rows per KV head, ordered (head in group, query)
    s, w, dev = config.sink_tokens, config.window, k.device
    q_member = routing.hard_membership(q_route, centroids, config.query_top_k).reshape(b, hkv, rows)
    local_np, end = _local(lk, lq, config)
    local = _to(local_np, dev)
    q_pos = torch.arange(lk - lq, lk, device=dev).repeat(rows // lq)[:, None]  # [rows, 1]
    causal, near = local <= q_pos, (q_pos - local < w) | (local < s)  # [rows, local keys]
    unions = [[functools.reduce(operator.or_, m) for m in heads] for heads in q_member.tolist()]  # [B][Hkv]
    qr = q.reshape(b, hkv, rows, d).float() * scale
    out = qr.new_empty(b, hkv, rows, d)
    nl = local.shape[0]
    q_member = q_member[..., None]  # [B, Hkv, rows, 1]
    for i in range(b):
        for h in range(hkv):
            groups = [g for g in range(index.num_groups) if unions[i][h] >> g & 1]
            far = [index.far(i, h, g, s, end) for g in groups]
            pos = _to(np.concatenate([local_np, *far]), dev)
            k_member = _to(_candidate_member(index, i, h, groups, far, min(s, lk), end, config.key_top_k > 1), dev)
            ok = (k_member & q_member[i, h]) != 0  # same group: all a far key needs
            ok[:, :nl] = (ok[:, :nl] | near) & causal
            if config.key_top_k > 1 and len(groups) > 1:  # a far key in several listed groups: keep its lowest
                seg = _to(np.repeat(np.array(groups), [len(x) for x in far]), dev)
                shared = k_member[nl:] & unions[i][h]
                ok[:, nl:] &= (shared & -shared) == (1 << seg)
            _attend(qr[i, h], k[i, h], v[i, h], pos, ok, out[i, h], threads)
    return out.reshape(b, hq, lq, d).to(q.dtype)
