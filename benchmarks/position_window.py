"""``python -m benchmarks.position_window``: a window that grows with the query's position, measured before it is
built (docs/passkey.md, point 58).

The queries of a prefill run in chunks of ``STEP`` positions; the chunk starting at position ``a`` attends with the
window ``clamp(a // divisor, min_window, config.window)`` (a decode-sized or tail-short last chunk joins the one
before it), each chunk one call of the library's fast path for "the last Lq of Lk queries". The density of each
Focus prefill is counted exactly on dense masks under the same windows. Everything else is ``focus-flex``::

    python -m benchmarks.position_window --min-window 128 --divisor 8 eval hub/smollm2-135m-instruct-focus \\
        --task passkey --lengths 2048 --dense-tail 32 --output-dir runs/pw

Batch 1 and unpadded inputs only (what ``eval`` runs); other calls take the library's path unchanged.
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import sys
from collections.abc import Iterator
from typing import Any

import torch

import focus_flex.adapter
from focus_flex import routing
from focus_flex.attention import focus_attention
from focus_flex.config import DECODE_MAX_QUERIES, FocusConfig
from focus_flex.evaluate import RoutingMeter

STEP = 128  # queries per chunk


def chunks(n: int, window: int, min_window: int, divisor: int, tail: int) -> list[tuple[int, int, int]]:
    """The prefill's query chunks ``(start, end, window)`` over ``n`` positions; from the first chunk at the full
    ``window``, one chunk to the end."""
    out, a = [], 0
    while a < n:
        w = min(window, max(min_window, a // divisor))
        b = n if w == window else min(n, a + STEP)
        out.append([a, b, w])
        a = b
    while len(out) > 1 and out[-1][1] - out[-1][0] <= max(DECODE_MAX_QUERIES, tail):
        out[-2][1] = out.pop()[1]
    return [(a, b, w) for a, b, w in out]


def position_windows(n: int, window: int, min_window: int, divisor: int, tail: int) -> torch.Tensor:
    """The window of each of ``n`` query positions ``[n]`` (:func:`chunks`)."""
    w = torch.empty(n, dtype=torch.long)
    for a, b, x in chunks(n, window, min_window, divisor, tail):
        w[a:b] = x
    return w


def chunked_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                      config: FocusConfig, min_window: int, divisor: int, **kwargs: Any) -> torch.Tensor:
    """:func:`focus_attention` of an unpadded batch-1 prefill (``q [1, Hq, N, D]``, ``k, v [1, Hkv, N, D]``) with the
    window of :func:`chunks`; the dense tail in the last chunk. Any other call: :func:`focus_attention` as is."""
    lq, lk, mask = q.shape[2], k.shape[2], kwargs.get("attention_mask")
    if lq != lk or lq <= DECODE_MAX_QUERIES or q.shape[0] != 1 or (mask is not None and not bool(mask.all())):
        return focus_attention(q, k, v, centroids, config, **kwargs)
    kwargs = {**kwargs, "attention_mask": None, "key_index": None}
    out = []
    for a, b, w in chunks(lk, config.window, min_window, divisor, config.dense_tail):
        part = dataclasses.replace(config, window=w, dense_tail=config.dense_tail if b == lk else 0)
        out.append(focus_attention(q[:, :, a:b], k[:, :, :b], v[:, :, :b], centroids, part, **kwargs))
    return torch.cat(out, 2)


def pattern_density(q_member: torch.Tensor, k_member: torch.Tensor, windows: torch.Tensor, sinks: int, tail: int,
                    dense_kv_heads: list[int]) -> float:
    """Fraction of the causal pairs of one prefill that the pattern with a window per query position computes, over
    its query heads: group bitmasks ``q_member [Hq, N]``, ``k_member [Hkv, N]``, ``windows [N]``; the last ``tail``
    queries and the query heads of ``dense_kv_heads`` attend every earlier key."""
    (hq, n), hkv = q_member.shape, k_member.shape[0]
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = j <= i
    near = causal & ((i - j < windows[:, None]) | (j < sinks) | (i >= n - tail))
    total = 0
    for h in range(hq):
        kv = h // (hq // hkv)
        if kv in dense_kv_heads:
            total += n * (n + 1) // 2
        else:
            total += int((near | (causal & ((q_member[h][:, None] & k_member[kv][None, :]) != 0))).sum())
    return total / (hq * n * (n + 1) / 2)


@contextlib.contextmanager
def position_window(min_window: int, divisor: int) -> Iterator[None]:
    """While active, attached adapters run :func:`chunked_attention` and :class:`RoutingMeter` counts its pattern."""
    def attention(q, k, v, centroids, config, **kwargs):
        return chunked_attention(q, k, v, centroids, config, min_window, divisor, **kwargs)

    @torch.no_grad()
    def meter(self: RoutingMeter, adapter: Any, args: tuple, output: Any) -> None:
        _, slot, query, _, _, padding = args[:6]
        if query.shape[0] != 1 or (padding is not None and not bool(padding.all())):
            raise ValueError("benchmarks.position_window counts the density of unpadded batch-1 prefills only")
        cfg, qm, km = self.memberships(adapter, args)
        qm, km = qm[0].cpu(), km[0].cpu()
        n = qm.shape[1]
        windows = position_windows(n, cfg.window, min_window, divisor, cfg.dense_tail)
        self.density.append(pattern_density(qm, km, windows, cfg.sink_tokens, cfg.tail(n),
                                            cfg.dense_kv_heads(cfg.layers[slot])))
        self.far.append(torch.zeros(n))  # not counted by distance: the random-groups baseline is not supported
        self.balance.append(routing.group_balance(km[None], cfg.num_groups).mean().item())

    saved = focus_flex.adapter.focus_attention, RoutingMeter.__call__
    focus_flex.adapter.focus_attention, RoutingMeter.__call__ = attention, meter
    try:
        yield
    finally:
        focus_flex.adapter.focus_attention, RoutingMeter.__call__ = saved


def main(argv: list[str] | None = None) -> int:
    from focus_flex.cli import main as focus_flex_main

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], allow_abbrev=False)
    p.add_argument("--min-window", type=int, default=128, help="the window of the first positions")
    p.add_argument("--divisor", type=int, default=8, help="past them, the window is the position / divisor")
    args, rest = p.parse_known_args(argv)
    if args.min_window < 1 or args.divisor < 1:
        p.error("--min-window and --divisor must be >= 1")
    given = argparse.ArgumentParser(add_help=False, allow_abbrev=False)
    given.add_argument("--task", default="perplexity")
    given.add_argument("--modes", nargs="+")
    task = given.parse_known_args(rest)[0]
    if task.task == "perplexity" and (task.modes is None or "random" in task.modes):
        p.error("perplexity: name the --modes, without random (its window is matched on distances, which a window "
                "per position does not have), e.g. --modes focus window")
    with position_window(args.min_window, args.divisor):
        return focus_flex_main(rest)


if __name__ == "__main__":
    sys.exit(main())
