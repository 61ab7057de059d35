"""Routing: which centroid groups a query or key vector belongs to.

Centroids are per layer and per key/value head, ``[Hkv, G, D]``; the query heads of a GQA group
share their KV head's centroids. Everything here is O(N * G * D): no pairwise work.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from focus_flex import native

Rotary = Callable[[torch.Tensor], tuple[torch.Tensor, torch.Tensor]]  # positions [B, L] -> cos, sin [B, L, D]


def rotate_half(x: torch.Tensor) -> torch.Tensor:
    """The rotary encoding's pairing of dimensions: ``[a, b] -> [-b, a]`` over the last dim's halves."""
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The rotary encoding ``R(p) x = x cos + rotate_half(x) sin`` (cos, sin broadcast against x)."""
    return x * cos + rotate_half(x) * sin


def unrotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """The vector before the rotary encoding: the inverse of :func:`rotate` (exact also when cos and sin carry the
    same attention scaling factor s, ``cos^2 + sin^2 = s^2``)."""
    return (x * cos - rotate_half(x) * sin) / (cos * cos + sin * sin)


@dataclass(frozen=True)
class Centering:
    """Routing on mean-removed vectors: a query or key ``x`` at position ``p`` is routed as ``x - R(p) mu``.

    ``mu`` is the mean of the vectors *before* the rotary encoding ``R(p)`` (per query head, and per KV head), so the
    large component that every query (or key) of a head shares, rotated with the position, no longer decides the
    group: the groups follow content, not position (docs/passkey.md). Attention itself is unchanged.
    query_mean ``[Hq, D]``, key_mean ``[Hkv, D]``; ``rotary`` gives the model's cos, sin at positions (None: the
    model encodes no position in q and k, e.g. GPT-2, and ``R`` is the identity).
    """

    query_mean: torch.Tensor
    key_mean: torch.Tensor
    rotary: Rotary | None

    def _offset(self, mean: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """``R(p) mu`` for positions ``pos [B, L]``: ``[B, H, L, D]`` float32 (or ``[1, H, 1, D]`` without rotary)."""
        m = mean.float()[None, :, None, :]
        if self.rotary is None:
            return m
        cos, sin = self.rotary(pos.clamp_min(0))  # (left padding has position -1: routed anyhow, never attended)
        return rotate(m, cos.float()[:, None], sin.float()[:, None])

    def queries(self, q: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Routing vectors of queries ``[B, Hq, L, D]`` at positions ``[B, L]`` (float32)."""
        return q.float() - self._offset(self.query_mean, pos)

    def keys(self, k: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Routing vectors of keys ``[B, Hkv, L, D]`` at positions ``[B, L]`` (float32)."""
        return k.float() - self._offset(self.key_mean, pos)


def _dots(x: torch.Tensor, c: torch.Tensor) -> torch.Tensor:
    """``<x, c_g>`` in float32: x ``[B, H, L, D]``, c ``[Hkv, G, D]`` (H a multiple of Hkv) -> ``[B, H, L, G]``.

    The query heads of each KV head are a view of x, never a copy (x is often a slice or a transposed view).
    """
    (b, h, n, d), hkv = x.shape, c.shape[0]
    if h % hkv:
        raise ValueError(f"{h} heads cannot share {hkv} KV-head centroid sets (not a multiple).")
    if n == 1:  # a decode step: [B, Hkv, H/Hkv, D] is a view, and a plain batched matmul costs fewer ops
        return (x.float().reshape(b, hkv, h // hkv, d) @ c.transpose(-1, -2)).reshape(b, h, 1, -1)
    return (x.float().unflatten(1, (hkv, h // hkv)) @ c.transpose(-1, -2)[:, None]).flatten(1, 2)


def scores(x: torch.Tensor, centroids: torch.Tensor, tau: float) -> torch.Tensor:
    """Routing scores ``<x/|x|, C_g/|C_g|> / tau``.

    x: ``[B, H, L, D]``; centroids: ``[Hkv, G, D]`` with H a multiple of Hkv. Returns ``[B, H, L, G]``
    in float32 (routing decisions must not depend on the activation dtype's rounding).
    """
    return _dots(F.normalize(x.float(), dim=-1), F.normalize(centroids.float(), dim=-1)) / tau


def top_groups(s: torch.Tensor, k: int) -> torch.Tensor:
    """Hard groups: indices of the k highest scores, ``[..., G]`` -> ``[..., k]`` (int64).

    Ties break the same way everywhere: top-1 is the first maximum (found with ``max``, cheaper than ``argmax``),
    as in the C routing of :func:`hard_groups`.
    """
    return s.max(-1, keepdim=True).indices if k == 1 else s.topk(k, dim=-1).indices


ROUTE_FLOATS = 1 << 18  # float32 temporaries of one routing chunk (1 MB): a float32 copy of x if needed, its scores


def hard_groups(x: torch.Tensor, centroids: torch.Tensor, k: int) -> torch.Tensor:
    """The top-k groups of every vector, ``[B, H, L, D]`` -> ``[B, H, L, k]``: :func:`top_groups` of ``<x, C_g/|C_g|>``.

    That is the order of :func:`scores` (their other factors, 1/|x| and 1/tau, are positive per vector), without
    normalising x: decode routes a few vectors per layer and step, and there the op count is the cost. Top-1 on CPU
    is one C pass (:func:`focus_flex.native.route_top1`: no temporaries, and a vector's group never depends on the
    vectors routed with it); otherwise a chunk of positions at a time, so the float32 temporaries stay about
    :data:`ROUTE_FLOATS` at any length.
    """
    (b, h, n, d), g = x.shape, centroids.shape[1]
    c = F.normalize(centroids.float(), dim=-1)
    if k == 1 and (fast := native.route_top1(x, c)) is not None:  # every path routes here: the same groups everywhere
        return fast
    chunk = max(64, ROUTE_FLOATS // (b * h * (g + (d if x.dtype != torch.float32 else 0))))
    if n <= chunk:
        return top_groups(_dots(x, c), k)
    out = torch.empty(b, h, n, k, dtype=torch.long, device=x.device)
    for i in range(0, n, chunk):  # each chunk's buffers have the same sizes: the allocator reuses them
        out[:, :, i:i + chunk] = top_groups(_dots(x[:, :, i:i + chunk], c), k)
    return out


def membership(groups: torch.Tensor) -> torch.Tensor:
    """Groups ``[..., k]`` -> int64 bitmask ``[...]`` with bit g set iff g is among the groups (G <= 63)."""
    return (torch.ones_like(groups) << groups).sum(-1)  # top-k indices are distinct, so sum == OR


def member_bits(member: torch.Tensor, num_groups: int) -> torch.Tensor:
    """Inverse of :func:`membership`: bitmask ``[...]`` -> 0/1 indicator ``[..., G]`` (same integer dtype)."""
    return (member.unsqueeze(-1) >> torch.arange(num_groups, device=member.device)) & 1


def hard_membership(x: torch.Tensor, centroids: torch.Tensor, k: int) -> torch.Tensor:
    """Bitmask of the top-k groups of every vector: ``[B, H, L, D]`` -> ``[B, H, L]`` int64."""
    return membership(hard_groups(x, centroids, k))


def soft_membership(s: torch.Tensor, k: int | torch.Tensor) -> torch.Tensor:
    """Differentiable top-k indicator, ``[..., G]`` -> ``[..., G]`` in (0, 1).

    ``sigmoid(s_g - t)`` with the threshold t halfway between the k-th and (k+1)-th score. Scores carry 1/tau, so
    as routing sharpens (tau -> 0, or scores separate) this tends to the exact top-k indicator of :func:`top_groups`.
    With k == G every group is kept. t is detached: the gradient moves each group's own score against a fixed bar,
    so it is the derivative of the loss with t held, not of the loss (with t differentiable, distillation trains
    worse hard routing: docs/quality.md, "The soft top-k's threshold"). k may differ per row: an int64 tensor
    ``[...]`` of counts in ``[1, G]`` (:func:`mass_counts`).
    """
    g = s.shape[-1]
    if isinstance(k, int):
        if k >= g:
            return torch.ones_like(s)
        k = torch.full(s.shape[:-1], k, dtype=torch.long, device=s.device)
    most = min(int(k.max()) + 1, g)
    top = s.detach().topk(most, dim=-1).values
    top = torch.cat([top, top.new_full((*top.shape[:-1], 1), -math.inf)], -1)  # past the last group: keep all
    pair = top.gather(-1, torch.stack([k - 1, k.clamp_max(most)], -1))
    threshold = 0.5 * (pair[..., 0] + pair[..., 1])
    return torch.sigmoid(s - threshold.unsqueeze(-1))


def probabilities(s: torch.Tensor) -> torch.Tensor:
    """Routing probabilities over groups, ``softmax`` of the scores."""
    return s.softmax(-1)


def mass_counts(s: torch.Tensor, mass: float, most: int) -> torch.Tensor:
    """How many groups each row takes, in order of routing probability (``softmax`` of the scores s ``[..., G]``),
    until they hold ``mass`` of it: ``[...]`` int64 in ``[1, most]``. Rows whose routing is sure take one group,
    rows that hesitate take the groups they hesitate between."""
    top = probabilities(s.detach()).topk(min(most, s.shape[-1]), dim=-1).values
    return ((top.cumsum(-1) - top) < mass).sum(-1)  # the first group always; each next one while the mass is short


def mass_membership(x: torch.Tensor, centroids: torch.Tensor, tau: float, mass: float, most: int) -> torch.Tensor:
    """Bitmask ``[B, H, L]`` of each vector's likeliest groups until they hold ``mass`` of its routing probability
    (:func:`mass_counts` of :func:`scores`)."""
    s = scores(x, centroids, tau)
    groups = top_groups(s, min(most, s.shape[-1]))
    take = torch.arange(groups.shape[-1], device=s.device) < mass_counts(s, mass, most).unsqueeze(-1)
    return ((torch.ones_like(groups) << groups) * take).sum(-1)


def sinkhorn(s: torch.Tensor, iters: int = 3) -> torch.Tensor:
    """Balanced assignment: rows sum to 1, every group receives the same total mass.

    s: ``[..., N, G]`` scores. Alternating row/column normalisation in log space (Sinkhorn-Knopp),
    as in SwAV; the result is a soft assignment in which no group swallows the sequence. Padded
    tokens should be removed (or given -inf scores) by the caller.
    """
    log_p = s.float().log_softmax(-1)
    n, g = s.shape[-2], s.shape[-1]
    for _ in range(iters):
        log_p = log_p - log_p.logsumexp(-2, keepdim=True) + torch.log(torch.tensor(n / g))  # columns: N/G each
        log_p = log_p - log_p.logsumexp(-1, keepdim=True)  # rows: 1 each
    return log_p.exp()


def group_balance(member: torch.Tensor, num_groups: int, valid: torch.Tensor | None = None) -> torch.Tensor:
    """Largest group size over mean group size (1.0 = perfectly balanced), per ``[B, H]``.

    member: int64 bitmask ``[B, H, L]``; valid: optional bool ``[B, L]`` of real tokens.
    """
    bits = member_bits(member, num_groups)
    if valid is not None:
        bits = bits * valid[:, None, :, None]
    sizes = bits.sum(-2).float()
    return sizes.max(-1).values / sizes.mean(-1).clamp_min(1e-9)
