"""Decode on a KV cache in O(selected keys): per-group key lists that grow with the cache.

A :class:`KeyIndex` holds the key routing of one layer's KV cache: the group bitmask of every key and, per
(batch row, KV head, group), the positions of that group's keys in increasing order. Appending a token costs O(1)
(amortised: buffers grow geometrically, nothing is re-concatenated). :func:`indexed_attention` then attends a few
new queries to their sinks and window (contiguous slices) plus the far keys of their groups (slices of those
lists), so the work per step is proportional to the selected keys, not to the cache length. Exact: the same result
as :func:`focus_flex.attention.reference_attention` when no key is padding.
"""

from __future__ import annotations

import functools
import operator

import torch

from focus_flex import routing
from focus_flex.config import FocusConfig
from focus_flex.threads import using

_END = torch.iinfo(torch.int32).max  # fills unused list slots, so every list row stays sorted
APPEND_CHUNK = 4096  # keys routed into the lists at a time


def _grow(buffer: torch.Tensor, needed: int, fill: int) -> torch.Tensor:
    """``buffer`` ``[..., C]`` with room for at least ``needed`` entries on the last dim (new slots = ``fill``).

    Grows geometrically (by an eighth, plus a little), so appending one entry at a time costs O(1) amortised.
    """
    capacity = buffer.shape[-1]
    if needed <= capacity:
        return buffer
    grown = buffer.new_full(buffer.shape[:-1] + (needed + needed // 8 + 64,), fill)
    grown[..., :capacity] = buffer
    return grown


class KeyIndex:
    """Key routing of a growing KV cache: group bitmasks ``[B, Hkv, L]`` and per-group position lists.

    ``lists[b, h, g, :counts[b][h][g]]`` (int32) are the positions (ascending) of the keys of (b, h) in group g;
    later slots hold a large sentinel. Positions are cache indices, so the index assumes no padding for the fast path
    (:func:`indexed_attention`); the bitmasks serve any path.
    """

    def __init__(self, batch: int, heads: int, num_groups: int, device: torch.device | str):
        self.num_groups = num_groups
        self.length = 0
        member_dtype = torch.int32 if num_groups <= 31 else torch.int64  # bit 31 would be int32's sign
        self._member = torch.zeros(batch, heads, 0, dtype=member_dtype, device=device)
        self.lists = torch.full((batch, heads, num_groups, 0), _END, dtype=torch.int32, device=device)
        self.counts = [[[0] * num_groups for _ in range(heads)] for _ in range(batch)]  # [B][Hkv][G] list sizes

    @property
    def member(self) -> torch.Tensor:
        """Group bitmasks of the keys so far, ``[B, Hkv, length]`` (int32 up to 31 groups, else int64; a view)."""
        return self._member[:, :, :self.length]

    def extend(self, keys: torch.Tensor, centroids: torch.Tensor, config: FocusConfig) -> None:
        """Route the keys ``[B, Hkv, L, D]`` that follow the current ones and add them.

        Long extensions (a prefill, a first look at a full cache) go in chunks, so the routing temporaries stay a
        few MB instead of several times the keys' size.
        """
        for chunk in keys.split(APPEND_CHUNK, dim=2):
            self.append(routing.hard_groups(chunk, centroids, config.key_top_k))

    def append(self, groups: torch.Tensor) -> None:
        """Add the keys that follow the current ones, given their groups ``[B, Hkv, L, k]``."""
        n = groups.shape[2]
        self._member = _grow(self._member, self.length + n, 0)
        self._member[:, :, self.length:self.length + n] = routing.membership(groups)
        if n == 1:  # a decode step: a few scalar writes (vectorising one key costs more in op overhead)
            for i, heads in enumerate(groups[:, :, 0].tolist()):
                for h, chosen in enumerate(heads):
                    for g in chosen:
                        c = self.counts[i][h][g]
                        self.lists = _grow(self.lists, c + 1, _END)
                        self.lists[i, h, g, c] = self.length
                        self.counts[i][h][g] = c + 1
            self.length += 1
            return
        bits = routing.member_bits(routing.membership(groups), self.num_groups)  # [B, Hkv, L, G]
        counts = torch.tensor(self.counts, device=groups.device)
        slot = bits.cumsum(2).add_(counts[:, :, None, :] - 1)  # list slot of each key in each of its groups
        counts += bits.sum(2)
        self.lists = _grow(self.lists, int(counts.max()), _END)
        b, h, i, g = bits.nonzero(as_tuple=True)
        self.lists[b, h, g, slot[b, h, i, g]] = (self.length + i).to(self.lists.dtype)
        self.counts = counts.tolist()
        self.length += n


def _spans(index: KeyIndex, lo: int, hi: int) -> list[list[list[list[int]]]]:
    """``[B][Hkv][G]`` -> ``[start, stop)``: the slice of each group's list holding the positions in ``[lo, hi)``."""
    bounds = torch.tensor([lo, hi], dtype=index.lists.dtype, device=index.lists.device)
    return torch.searchsorted(index.lists, bounds.expand(*index.lists.shape[:3], 2).contiguous()).tolist()


def _attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, pos: torch.Tensor, ok: torch.Tensor,
            out: torch.Tensor, threads: int) -> None:
    """Rows ``q`` ``[R, D]`` (float32, scaled) attend keys ``k[pos]`` / values ``v[pos]`` (k, v ``[L, D]``) where
    ``ok`` ``[R, M]``; every row has an allowed key. Writes the float32 ``[R, D]`` result into ``out``. The gather
    (memory-bound) runs on ``threads`` intra-op threads, the rest on the caller's."""
    with using(threads):
        kg, vg = k.index_select(0, pos).float(), v.index_select(0, pos).float()
    scores = torch.mm(q, kg.T).masked_fill_(~ok, float("-inf"))
    torch.mm(scores.softmax(-1), vg, out=out)


def _far_keys(lists: torch.Tensor, bounds: list[list[int]], union: int) -> tuple[list[int], list]:
    """The groups in the bitmask ``union`` with far keys, and those keys' positions (``lists``: one (batch row, KV
    head)'s ``[G, capacity]`` lists)."""
    groups = [g for g, (lo, hi) in enumerate(bounds) if union >> g & 1 and hi > lo]
    return groups, [lists[g, bounds[g][0]:bounds[g][1]] for g in groups]


def indexed_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                      config: FocusConfig, index: KeyIndex, scale: float, threads: int = 1) -> torch.Tensor:
    """Few queries (the last Lq of Lk keys, no padding) against sinks + window + their groups' far keys.

    q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` with ``index`` routing exactly those Lk keys. Per (batch row, KV
    head), the candidates are the sinks and the window of the queries (slices) and the far keys of the groups of
    any of its query rows (GQA heads x queries; slices of the group lists, a key in several of them counted once).
    They are gathered once for all these rows, and each row masks the rest with the Focus rule; the softmax runs in
    float32; the gathers use ``threads`` intra-op threads. Returns ``[B, Hq, Lq, D]``. O(rows x candidates) work,
    none of it proportional to Lk.
    """
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    rows = hq // hkv * lq  # query rows per KV head, ordered (head in group, query)
    s, w, dev = config.sink_tokens, config.window, k.device
    q_member = routing.hard_membership(q, centroids, config.query_top_k).reshape(b, hkv, rows)
    near_lo = max(s, lk - lq - w + 1)  # keys from here on are near some query; far keys lie in [s, near_lo)
    local = torch.cat([torch.arange(min(s, lk), device=dev), torch.arange(near_lo, lk, device=dev)]).int()
    if lq > 1:  # (one query: every local candidate is near it or a sink, and causal)
        q_pos = torch.arange(lk - lq, lk, device=dev).repeat(rows // lq)[:, None]  # [rows, 1]
        causal, near = local <= q_pos, (q_pos - local < w) | (local < s)  # [rows, local keys]
    bounds = _spans(index, s, near_lo)
    unions = [[functools.reduce(operator.or_, m) for m in heads] for heads in q_member.tolist()]  # [B][Hkv]
    qr = q.reshape(b, hkv, rows, d).float() * scale
    out = qr.new_empty(b, hkv, rows, d)
    nl = local.shape[0]
    q_member = q_member[..., None]  # [B, Hkv, rows, 1]
    for i in range(b):
        for h in range(hkv):
            groups, far = _far_keys(index.lists[i, h], bounds[i][h], unions[i][h])
            pos = torch.cat([local, *far])
            k_member = index.member[i, h].index_select(0, pos)
            ok = (k_member & q_member[i, h]) != 0  # same group: all a far key needs
            if lq > 1:
                ok[:, :nl] = (ok[:, :nl] | near) & causal
            else:
                ok[:, :nl] = True
            if config.key_top_k > 1 and len(groups) > 1:  # a far key in several listed groups: keep its lowest
                seg = torch.tensor(groups, device=dev).repeat_interleave(torch.tensor([len(x) for x in far]).to(dev))
                shared = k_member[nl:] & unions[i][h]
                ok[:, nl:] &= (shared & -shared) == (1 << seg)
            _attend(qr[i, h], k[i, h], v[i, h], pos, ok, out[i, h], threads)
    return out.reshape(b, hq, lq, d).to(q.dtype)
