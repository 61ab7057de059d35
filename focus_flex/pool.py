"""Decode on the device: a layer's keys and values paged by group, read by one FlexAttention call per step.

A :class:`GroupPool` holds, per (batch row, KV head), copies of the layer's keys and values in slots of
``block_size``::

    | sinks | window ring | group pages (page j: block_size keys of one group, ascending) ...   | trash |
      the first            the last >= window                                                  writes of
      sink tokens          tokens (slot = position % ring)                                      padding

A new key is written into the ring, into the sink slots if it is a sink, and into a page of each of its groups (a
page is taken from the pool when its group's last one is full). A decode query then attends, in one FlexAttention
call, the sink and ring blocks plus the pages of its own groups; the ``mask_mod`` (:func:`pool_mask_mod`) keeps from
them exactly what the Focus pattern allows. The work per step is proportional to the keys selected (sinks + window
+ the query's groups), the shapes depend only on (batch, heads, capacity), and the index (pages, counts) never leaves
the device: the step can be captured whole (CUDA graphs, ``torch.compile(fullgraph=True)``). Memory: ``key_top_k``
copies of every key and value, plus a ring of about ``window`` and a partial page per group.

The transformers KV cache that carries a pool per Focus layer is :mod:`focus_flex.cache`.
"""

from __future__ import annotations

import torch
from torch.nn.attention.flex_attention import BlockMask, and_masks, or_masks

from focus_flex import attention, routing
from focus_flex.config import FocusConfig
from focus_flex.masks import (
    NO_KEY,
    KVHeadTable,
    at_positions,
    causal,
    far_mask_mod,
    key_in_first_shared_group,
    key_slots,
    outside,
    same_group,
    sinks,
    sliding_window,
)
from focus_flex.plan import route


def _round_up(n: int, block: int) -> int:
    return -(-n // block) * block


def pool_mask_mod(config: FocusConfig, sink_slots: int, ring: int, end: int, q_pos: torch.Tensor,
                  q_member: torch.Tensor, k_pos: KVHeadTable, k_group: KVHeadTable, k_member: KVHeadTable):
    """The Focus pattern over a pool's slots: a sink slot holds a sink, a ring slot a window key that is no sink, a
    page slot a far key of a group the query is in (counted once: in the lowest group query and key share).

    ``q_pos`` ``[B, 1]`` and ``q_member`` ``[B, Hq, 1]`` describe the query; ``k_pos``, ``k_group`` (the slot's
    page group bit, 0 outside pages) and ``k_member`` (the key's group bitmask) the slots.
    """
    w, s = config.window, config.sink_tokens
    sink_part = and_masks(key_slots(0, sink_slots), at_positions(and_masks(causal, sinks(s)), q_pos, k_pos))
    ring_part = and_masks(key_slots(sink_slots, sink_slots + ring),
                          at_positions(and_masks(causal, sliding_window(w), outside(sinks(s))), q_pos, k_pos))
    page_part = and_masks(key_slots(sink_slots + ring, end), at_positions(far_mask_mod(w, s), q_pos, k_pos),
                          same_group(q_member, k_group), key_in_first_shared_group(k_group, q_member, k_member))
    return or_masks(sink_part, ring_part, page_part)


class GroupPool:
    """Keys and values of one layer's cache, paged by group on the device (module docstring), for at most
    ``capacity`` tokens per batch row.

    State, all tensors (shapes fixed at construction):
    ``k``/``v`` ``[B, Hkv, N, D]``; per slot ``pos`` (token position, :data:`NO_KEY` if empty), ``group`` (bit of
    the page's group, 0 outside pages) and ``member`` (the key's group bitmask), ``[B, Hkv, N]``; per group its page
    list ``pages`` ``[B, Hkv, G, capacity / block_size]`` and key count ``counts`` ``[B, Hkv, G]``; the next free
    page ``next_page`` ``[B, Hkv]``; real tokens so far ``real`` ``[B]``.
    """

    def __init__(self, batch: int, kv_heads: int, head_dim: int, value_dim: int, capacity: int,
                 config: FocusConfig, dtype: torch.dtype, device: torch.device | str):
        bs, g = config.block_size, config.num_groups
        self.config, self.capacity = config, capacity
        self.sink_slots = _round_up(config.sink_tokens, bs)
        self.ring = _round_up(config.window, bs)
        self.group_pages = -(-capacity // bs)  # the most pages one group can fill
        self.num_pages = -(-capacity * config.key_top_k // bs) + g  # all groups' full pages + a partial one each
        self.page_start = self.sink_slots + self.ring
        self.trash = self.page_start + self.num_pages * bs
        n = self.trash + bs
        i64 = dict(dtype=torch.int64, device=device)
        self.k = torch.zeros(batch, kv_heads, n, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros(batch, kv_heads, n, value_dim, dtype=dtype, device=device)
        self.pos = torch.full((batch, kv_heads, n), NO_KEY, **i64)
        self.group = torch.zeros(batch, kv_heads, n, **i64)
        self.member = torch.zeros(batch, kv_heads, n, **i64)
        self.pages = torch.zeros(batch, kv_heads, g, self.group_pages, **i64)
        self.counts = torch.zeros(batch, kv_heads, g, **i64)
        self.next_page = torch.zeros(batch, kv_heads, **i64)
        self.real = torch.zeros(batch, **i64)
        if not torch.compiler.is_compiling():  # updated in place at every step: CUDA graphs may keep their addresses
            for t in self.tensors():
                torch._dynamo.mark_static_address(t)

    def tensors(self) -> list[torch.Tensor]:
        """The pool's state: every tensor it holds."""
        return [self.k, self.v, self.pos, self.group, self.member, self.pages, self.counts, self.next_page, self.real]

    @property
    def slots(self) -> int:
        return self.k.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor, groups: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
        """Add the keys ``[B, Hkv, n, D]`` (values alike) that follow the pool's, with their groups
        ``[B, Hkv, n, key_top_k]``; ``valid`` ``[B, n]`` marks real tokens (padding is written to the trash block).
        Returns their positions ``[B, n]`` (-1: padding). O(n (key_top_k + 2) D) writes, no host synchronisation."""
        c, bs = self.config, self.config.block_size
        b, hkv, n, _ = k.shape
        pos = torch.where(valid, self.real[:, None] + valid.long().cumsum(1) - 1, -1)  # [B, n]
        self.real.add_(valid.sum(1))
        # Page copies: each key's slot in its groups' lists; pages for the lists that outgrow their last one.
        bits = routing.member_bits(routing.membership(groups), c.num_groups) * valid[:, None, :, None]
        counts = self.counts + bits.sum(2)
        had, need = -(-self.counts // bs), -(-counts // bs)  # pages per group, before and after
        first = self.next_page[..., None] + (need - had).cumsum(-1) - (need - had)  # each group's first new page
        j = torch.arange(self.group_pages, device=k.device)
        new = (j >= had[..., None]) & (j < need[..., None])
        self.pages.copy_(torch.where(new, first[..., None] + j - had[..., None], self.pages))
        self.next_page.add_((need - had).sum(-1))
        slot = (self.counts[:, :, None, :] + bits.cumsum(2) - bits).gather(-1, groups)  # [B, Hkv, n, k]
        page = self.pages.flatten(2).gather(2, (groups * self.group_pages + slot // bs).flatten(2)).view_as(slot)
        self.counts.copy_(counts)
        real = valid[:, None, :, None]
        to_page = torch.where(real, self.page_start + page * bs + slot % bs, self.trash)
        # The ring keeps the last `ring` positions of each row; the sinks their own slots.
        p = pos[:, None, :, None].expand(b, hkv, n, 1)
        last = (self.real - 1)[:, None, None, None]
        in_ring = real & (p >= c.sink_tokens) & (p > last - self.ring)
        to_ring = torch.where(in_ring, self.sink_slots + p % self.ring, self.trash)
        to_sink = torch.where(real & (p < c.sink_tokens), p, self.trash)
        dest = torch.cat([to_sink, to_ring, to_page], -1).flatten(2)  # [B, Hkv, n * (k + 2)]
        copies = dest.shape[2] // n

        def write(buffer: torch.Tensor, x: torch.Tensor) -> None:  # x [B, Hkv, n(, D)], once per destination
            x = x.unsqueeze(3).expand(*x.shape[:3], copies, *x.shape[3:]).flatten(2, 3)
            index = dest if x.dim() == 3 else dest[..., None].expand(-1, -1, -1, x.shape[-1])
            buffer.scatter_(2, index, x)

        write(self.k, k)
        write(self.v, v)
        write(self.pos, p[..., 0])
        write(self.member, routing.membership(groups))
        group_bit = torch.cat([torch.zeros_like(to_ring), torch.zeros_like(to_ring), torch.ones_like(groups) << groups],
                              -1).flatten(2)
        self.group.scatter_(2, dest, group_bit)
        return pos

    def block_mask(self, q_groups: torch.Tensor, q_pos: torch.Tensor) -> BlockMask:
        """The block mask of one decode query per batch row: groups ``[B, Hq, 1, query_top_k]``, position ``[B]``
        (-1: a padding query, which sees nothing). KV blocks: the sinks', the ring's, the pages of its groups."""
        c, bs = self.config, self.config.block_size
        b, hq, _, kq = q_groups.shape
        hkv, g, dev = self.k.shape[1], c.num_groups, q_groups.device
        rep = hq // hkv
        lists = (torch.arange(hq, device=dev) // rep)[None, :, None] * g + q_groups[:, :, 0]  # [B, Hq, kq]
        lists = lists.flatten(1)
        pages = self.pages.flatten(1, 2).gather(1, lists[..., None].expand(-1, -1, self.group_pages))
        used = -(-self.counts.flatten(1).gather(1, lists) // bs)  # [B, Hq * kq] pages in use
        local = torch.arange((self.sink_slots + self.ring) // bs, device=dev).expand(b, hq, -1)
        blocks = torch.cat([local, (self.page_start // bs + pages).view(b, hq, kq * self.group_pages)], -1)
        live = torch.arange(self.group_pages, device=dev) < used[..., None]
        live = torch.cat([torch.ones_like(local, dtype=torch.bool), live.view(b, hq, -1)], -1)
        width = self.slots // bs  # flex wants a column per KV block; live blocks are distinct, so they fit
        rank = torch.where(live, live.cumsum(-1) - 1, width)  # compacted: live blocks first, in order
        kv_indices = torch.zeros(b, hq, width + 1, dtype=torch.int64, device=dev).scatter_(-1, rank, blocks)
        q_member = routing.membership(q_groups)  # [B, Hq, 1]
        mod = pool_mask_mod(c, self.sink_slots, self.ring, self.trash, q_pos[:, None], q_member,
                            KVHeadTable(self.pos, rep), KVHeadTable(self.group, rep), KVHeadTable(self.member, rep))
        num, indices = live.sum(-1, dtype=torch.int32)[:, :, None], kv_indices[:, :, None, :width].to(torch.int32)
        # (no block is full: the CPU flex kernel still wants the full-block tensors, empty)
        return BlockMask.from_kv_blocks(num, indices, torch.zeros_like(num), torch.zeros_like(indices),
                                        BLOCK_SIZE=bs, mask_mod=mod, seq_lengths=(1, self.slots),
                                        compute_q_blocks=False)

    def attend(self, q: torch.Tensor, centroids: torch.Tensor, q_pos: torch.Tensor, scale: float,
               q_route: torch.Tensor | None = None) -> torch.Tensor:
        """One decode query per batch row, ``[B, Hq, 1, D]`` at positions ``[B]`` (its own key already appended),
        against the pool: ``[B, Hq, 1, D]``, what :func:`~focus_flex.attention.reference_attention` gives over the
        whole cache. One FlexAttention call. ``q_route``: the vectors routed in place of q (None: q)."""
        q_groups = route(q if q_route is None else q_route, centroids, self.config.query_top_k)
        out, _ = attention._flex(q, self.k, self.v, self.block_mask(q_groups, q_pos), scale, lse=False)
        return out

    def clear(self) -> None:
        """Empty the pool in place (its tensors keep their addresses: a captured decode step stays valid)."""
        for t in self.tensors():
            t.zero_()
        self.pos.fill_(NO_KEY)

    def select(self, rows: torch.Tensor) -> None:
        """Keep the batch rows ``rows`` (beam search's reordering), in place."""
        for t in self.tensors():
            t.copy_(t.index_select(0, rows.to(t.device)))
