"""Intra-op thread counts for the fast path's two kinds of CPU work.

Latency-bound work (many small ops: routing, planning, decode) runs on one thread: OpenMP barriers of small ops
cost more than they save. Large memory-bound copies inside such a block (a decode step's key gathers) run on the
threads the caller had: :func:`outer`.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import torch

_outer: list[int] = []  # thread counts that using() replaced, outermost first


@contextlib.contextmanager
def using(n: int) -> Iterator[None]:
    """Run the block with ``n`` intra-op threads (restored afterwards)."""
    old = torch.get_num_threads()
    if n == old:
        yield
        return
    torch.set_num_threads(n)
    _outer.append(old)
    try:
        yield
    finally:
        _outer.pop()
        torch.set_num_threads(old)


def outer() -> int:
    """The intra-op thread count outside any :func:`small_work` block: for the large memory-bound copies inside one
    (a decode step's key gathers are bound by memory bandwidth, which more threads do use)."""
    return _outer[0] if _outer else torch.get_num_threads()


def small_work(device: torch.device) -> contextlib.AbstractContextManager[None]:
    """Run latency-bound work on one intra-op thread on CPU (elsewhere, unchanged).

    Each parallel region of a small op waits for every thread, so when another process holds a core a tiny op on
    two threads waits for the scheduler instead of computing (docs/speed.md, "Threads").
    """
    return using(1 if device.type == "cpu" else torch.get_num_threads())
