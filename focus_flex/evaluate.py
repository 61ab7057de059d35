"""Evaluating Focus adapters: perplexity against the fraction of attention computed.

Protocol (used by ``focus-flex retrofit`` and ``focus-flex eval``):

* **Windows.** Held-out documents (for the shipped corpus: the ``eval`` books, never used in training)
  are cut into non-overlapping windows of exactly ``context`` tokens inside one document
  (:func:`focus_flex.data.token_windows`); ``max_windows`` keeps an evenly spaced, fixed subset.
* **Perplexity.** Every window is scored on its own from its first token (chunked, not sliding):
  ``ppl = exp(sum of next-token NLL / number of predicted tokens)`` over all windows, each window
  predicting its tokens 2..context. Every mode sees the same windows.
* **Modes.** ``full``: the model's own attention. ``focus``: hard top-k routing, the inference path
  (:func:`~focus_flex.attention.focus_attention`, its default kernel). ``soft``: the soft-routing training path
  (dense). ``window``: window + sinks only, the window widened until its density reaches ``focus``'s measured
  density. ``random``: untrained random centroids with the same groups, top-k and sinks, the window widened
  (or narrowed) until their pattern's density on the first window reaches ``focus``'s (:func:`random_window`).
* **Density**: the fraction of causal query-key pairs a mode computes, counted exactly from the hard
  memberships of every Focus layer and query head (:func:`far_pairs_by_distance`), averaged over Focus
  layers, heads and windows. ``full`` and ``soft`` (dense: every pair gets a score) count 1.0.
  **Balance**: largest key group over the mean key group (1.0 = perfectly balanced,
  :func:`routing.group_balance`), averaged the same way.
"""

from __future__ import annotations

import contextlib
import json
import math
import os
import time
from collections.abc import Iterator
from dataclasses import asdict, dataclass, replace
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from focus_flex import flash, routing
from focus_flex.adapter import FocusAdapter, FocusMask, has_focus
from focus_flex.attention import default_kernel, with_dense_tail
from focus_flex.attention import dense_decode as dense_decode_step
from focus_flex.config import DECODE_MAX_QUERIES, FocusConfig, tail_queries
from focus_flex.data import check_windows

MODES = ("full", "focus", "soft", "window", "random")
WINDOW_ONLY = "focus_window_only"  # transformers attention implementation of the window-only baseline
RANDOM_SEED = 1234  # seed of the random-groups baseline's centroids
RESULTS_JSON, RESULTS_MD, PLOT_PNG = "results.json", "results.md", "perplexity_vs_density.png"


# ---- densities -----------------------------------------------------------------------------------


def window_pairs(n: int, window: int, sinks: int, tail: int = 0) -> int:
    """Causal pairs ``(i, j)``, ``j <= i < n``, with ``i - j < window or j < sinks``, or ``i`` one of the last
    ``tail`` queries (a dense tail: all their causal pairs)."""
    tail = min(tail, n)
    m = n - tail  # the queries before the tail
    w = min(window, m)
    band = w * m - w * (w - 1) // 2
    return band + sum(max(0, m - j - w) for j in range(min(sinks, m))) + tail * (2 * n - tail + 1) // 2


def window_density(n: int, window: int, sinks: int, tail: int = 0) -> float:
    """Fraction of the ``n (n + 1) / 2`` causal pairs that window + sinks attention computes (with the last ``tail``
    queries attending densely)."""
    return window_pairs(n, window, sinks, tail) / (n * (n + 1) / 2)


def matching_window(n: int, sinks: int, density: float, tail: int = 0) -> int:
    """Smallest window whose window + sinks (+ dense ``tail``) density over n tokens is at least ``density``."""
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if window_density(n, mid, sinks, tail) >= density else (mid + 1, hi)
    return lo


DIAGONAL_COUNTING = 256  # distinct query bitmasks above which far pairs are counted by diagonals, not FFTs


def far_pairs_by_distance(q_member: torch.Tensor, k_member: torch.Tensor, sinks: int) -> torch.Tensor:
    """Group-sharing pairs of one unpadded prefill at each distance, per query head ``[B, Hq, N]`` (float64).

    Entry ``d`` counts the pairs ``(i, j = i - d)`` with ``j >= sinks`` whose query and key share a group, so the
    hard pattern at window ``w`` computes the window/sink pairs plus entries ``d >= w`` (:func:`pattern_density`).
    q_member ``[B, Hq, N]`` and k_member ``[B, Hkv, N]`` are int64 group bitmasks (:func:`routing.hard_membership`).
    Per distinct query bitmask, the cross-correlation (FFT) of the positions of the queries that have it with the
    positions of the keys that share a group with it: O(U N log N) for U distinct query bitmasks (U <= G at top-1).
    Where queries join many groups nearly every bitmask is distinct (U ~ N): there the pairs are counted diagonal by
    diagonal, O(N^2) cheap vector operations.
    """
    (b, hq, n), hkv = q_member.shape, k_member.shape[1]
    rep, size = hq // hkv, 2 * n  # zero-padded to 2N: no wrap-around
    out = torch.zeros(b, hq, n, dtype=torch.float64)
    keys = k_member.cpu().clone()
    keys[..., :sinks] = 0  # sinks are attended anyway: not far pairs
    for bi in range(b):
        for h in range(hkv):  # the query heads of a KV head together: each key spectrum is computed once
            own = q_member[bi, h * rep:(h + 1) * rep].cpu()
            values, inverse = torch.unique(own, return_inverse=True)
            if len(values) > DIAGONAL_COUNTING:
                for d in range(n):
                    out[bi, h * rep:(h + 1) * rep, d] = ((own[:, d:] & keys[bi, h, :n - d]) != 0).sum(-1)
                continue
            spectrum = torch.zeros(rep, n + 1, dtype=torch.complex128)
            for s in range(0, len(values), 64):  # [rep, 64, N] indicators at a time
                v = values[s:s + 64]
                shared = torch.fft.rfft(((keys[bi, h][None, :] & v[:, None]) != 0).double(), size)  # [u, N + 1]
                queries = (inverse[:, None, :] == torch.arange(s, s + len(v))[None, :, None]).double()
                spectrum += (torch.fft.rfft(queries, size) * shared.conj()).sum(1)
            out[bi, h * rep:(h + 1) * rep] = torch.fft.irfft(spectrum, size)[..., :n].round()
    return out


def far_density(far: torch.Tensor, n: int, window: int, sinks: int, tail: int = 0) -> torch.Tensor:
    """Density over ``n`` tokens of the hard pattern at ``window``, from the :func:`far_pairs_by_distance` counts
    ``far [..., N - tail]`` of the first ``n - tail`` tokens; the last ``tail`` queries attend every earlier key (a
    dense tail: all their causal pairs)."""
    return (far[..., window:].sum(-1) + window_pairs(n, window, sinks, tail)) / (n * (n + 1) / 2)


def pattern_density(q_member: torch.Tensor, k_member: torch.Tensor, window: int, sinks: int,
                    tail: int = 0) -> torch.Tensor:
    """Exact density of the hard Focus pattern of one unpadded prefill, per query head ``[B, Hq]``.

    q_member ``[B, Hq, N]`` and k_member ``[B, Hkv, N]`` are int64 group bitmasks (:func:`routing.hard_membership`).
    Allowed pairs = window/sink pairs + far pairs (``sinks <= j <= i - window``) sharing a group, and every causal
    pair of the last ``tail`` queries (``FocusConfig.tail(N)``).
    """
    n = q_member.shape[-1]
    far = far_pairs_by_distance(q_member[..., :n - tail], k_member[..., :n - tail], sinks)
    return far_density(far, n, window, sinks, tail)


def matching_pattern_window(far: torch.Tensor, n: int, sinks: int, density: float, tail: int = 0) -> int:
    """Smallest window whose hard pattern over ``n`` tokens, with the far pairs of its first ``n - tail`` counted in
    ``far [N - tail]`` and a dense ``tail``, reaches ``density``."""
    lo, hi = 1, n
    while lo < hi:
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if far_density(far, n, mid, sinks, tail) >= density else (mid + 1, hi)
    return lo


# ---- the window-only baseline --------------------------------------------------------------------


def window_mask(lq: int, lk: int, window: int, sinks: int, tail: int = 0,
                device: torch.device | None = None) -> torch.Tensor:
    """Window-only attention as a dense bool mask ``[Lq, Lk]`` for queries at positions ``[Lk - Lq, Lk)``: key ``j``
    for query ``i`` iff ``j <= i`` and (``i - j < window`` or ``j < sinks`` or ``i`` is one of the last ``tail``)."""
    i = torch.arange(lk - lq, lk, device=device)[:, None]
    j = torch.arange(lk, device=device)[None, :]
    return (j <= i) & ((i - j < window) | (j < sinks) | (i >= lk - tail))


@contextlib.contextmanager
def window_only(model: nn.Module, window: int, sinks: int, layers: list[int] | None = None, *,
                dense_decode: bool = False, dense_tail: int = 0) -> Iterator[None]:
    """While active, ``layers`` (default: all) attend only to the last ``window`` tokens and the first ``sinks``
    (positions are indices, so inputs must not be left-padded); with ``dense_decode``, decode steps (as
    :attr:`FocusConfig.dense_decode`) attend every earlier token, and with ``dense_tail`` so do the last queries of a
    prefill (as :attr:`FocusConfig.dense_tail`). An unpadded prefill on CPU computes only those pairs
    (:func:`flash.window_attention`); other calls run SDPA with a dense bool mask."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        (lq, d), lk = query.shape[2:], key.shape[2]
        windowed = (layers is None or module.layer_idx in layers) and not dense_decode_step(dense_decode, lq)
        padding = attention_mask.padding
        if (windowed and query.device.type == "cpu" and lq > DECODE_MAX_QUERIES and attention_mask.is_causal
                and not dropout and (padding is None or bool(padding.all()))):
            scale = d ** -0.5 if scaling is None else scaling
            out = flash.window_attention(query, key, value, window, sinks, scale)
            out = with_dense_tail(out, query, key, value, FocusConfig(dense_tail=dense_tail), None, scale)
            return out.transpose(1, 2).contiguous(), None
        mask = attention_mask.dense()
        if windowed:
            band = window_mask(lq, lk, window, sinks, tail_queries(dense_tail, lq), query.device)[None, None]
            mask = band if mask is None else mask & band
        return sdpa_attention_forward(module, query, key, value, mask, dropout=dropout, scaling=scaling, **kwargs)

    AttentionInterface.register(WINDOW_ONLY, attention)
    AttentionMaskInterface.register(WINDOW_ONLY, FocusMask)
    original = model.config._attn_implementation
    model.set_attn_implementation(WINDOW_ONLY)
    try:
        yield
    finally:
        model.set_attn_implementation(original)


# ---- perplexity ----------------------------------------------------------------------------------


@dataclass
class ModeResult:
    """One row of the results table."""

    mode: str
    perplexity: float
    nll: float  # mean next-token negative log-likelihood (nats)
    tokens: int  # predicted tokens
    density: float  # fraction of causal pairs computed
    balance: float | None  # largest / mean key group (None: no groups)
    seconds: float
    note: str = ""


class RoutingMeter:
    """Forward hook on an adapter: density and key-group balance of every Focus layer it runs."""

    def __init__(self, adapter: FocusAdapter):
        self.adapter, self.density, self.balance = adapter, [], []
        self.far: list[torch.Tensor] = []  # per call: far pairs by distance [N - tail] (the tail attends densely)
        self.handle = adapter.register_forward_hook(self)

    @staticmethod
    def memberships(adapter: FocusAdapter, args: tuple) -> tuple[FocusConfig, torch.Tensor, torch.Tensor]:
        """The configuration of the Focus layer called with ``args`` and its hard memberships (group bitmasks):
        queries ``[B, Hq, N]``, keys ``[B, Hkv, N]``."""
        _, slot, query, key, _, padding = args[:6]
        c, cfg = adapter.centroids[slot].detach(), adapter.layer_config(slot)
        query, key = adapter.routed(slot, query, key, padding)
        return cfg, routing.hard_membership(query, c, cfg.query_top_k), routing.hard_membership(key, c, cfg.key_top_k)

    @torch.no_grad()
    def __call__(self, adapter: FocusAdapter, args: tuple, output: Any) -> None:
        cfg, qm, km = self.memberships(adapter, args)
        n = qm.shape[2]
        t = cfg.tail(n)
        far = far_pairs_by_distance(qm[..., :n - t], km[..., :n - t], cfg.sink_tokens)
        density = far_density(far, n, cfg.window, cfg.sink_tokens, t)  # [B, Hq]
        group = qm.shape[1] // km.shape[1]
        for h in cfg.dense_kv_heads(cfg.layers[args[1]]):  # dense heads compute every causal pair
            density[:, h * group:(h + 1) * group] = 1.0
        self.density.append(density.mean().item())
        self.far.append(far.mean((0, 1)))  # averaged over batch and heads
        self.balance.append(routing.group_balance(km, cfg.num_groups).mean().item())

    def remove(self) -> None:
        """Stop counting; what was counted stays. Safe in a ``finally`` that an exception reaches before any layer ran
        (unlike :meth:`close`)."""
        self.handle.remove()

    def means(self) -> tuple[float, float]:
        """The mean density and key-group balance over the layer calls counted."""
        return sum(self.density) / len(self.density), sum(self.balance) / len(self.balance)

    def close(self) -> tuple[float, float]:
        """Stop counting; :meth:`means`."""
        self.remove()
        return self.means()


@torch.no_grad()
def window_nll(model: nn.Module, windows: torch.Tensor, *, desc: str = "", progress: bool = False) -> tuple[float, int]:
    """Summed next-token NLL and number of predicted tokens over ``windows [N, L]`` (one forward each)."""
    device = next(model.parameters()).device
    total, count = 0.0, 0
    for x in tqdm(windows, desc=desc, disable=not progress, leave=False):
        x = x[None].to(device)
        logits = model(input_ids=x, use_cache=False).logits[0, :-1].float()
        total += F.cross_entropy(logits, x[0, 1:], reduction="sum").item()
        count += x.shape[1] - 1
    return total, count


def check_modes(modes: tuple[str, ...] | list[str]) -> None:
    """What :func:`evaluate` can run: known modes, and ``window`` and ``random`` only with ``focus``."""
    unknown = sorted(set(modes) - set(MODES))
    if unknown:
        raise ValueError(f"{unknown} unknown: choose from {MODES}")
    for baseline in ("window", "random"):
        if baseline in modes and "focus" not in modes:
            raise ValueError(f"{baseline} needs focus too (its window is set so that its density matches focus's "
                             "measured density)")


def evaluate(model: nn.Module, adapter: FocusAdapter, windows: torch.Tensor, *, modes: tuple[str, ...] = MODES,
             progress: bool = True) -> list[ModeResult]:
    """Perplexity, density and balance of ``modes`` on ``windows [N, L]`` (module docstring for the protocol).

    ``adapter`` must not be attached. ``window`` and ``random`` need ``focus`` (they match its measured density).
    """
    check_modes(modes)
    windows = check_windows(windows, model)
    if has_focus(model):
        raise RuntimeError("A Focus adapter is attached to this model, so 'full' would not be the model's own "
                           "attention: detach it before evaluate() (which attaches each mode's adapter itself).")
    results: dict[str, ModeResult] = {}
    was_training, mode = model.training, adapter.mode
    model.eval()  # no dropout: every mode scores the same deterministic model
    try:
        _evaluate_modes(model, adapter, windows, modes, progress, results)
    finally:
        model.train(was_training)
        adapter.mode = mode
    return list(results.values())


def _evaluate_modes(model: nn.Module, adapter: FocusAdapter, windows: torch.Tensor, modes: tuple[str, ...],
                    progress: bool, results: dict[str, ModeResult]) -> None:
    """:func:`evaluate`'s runs, each into ``results``."""
    cfg, n = adapter.config, windows.shape[1]
    tail = cfg.tail(n)  # the prefill's dense tail, the same for the baselines

    def run(mode: str, density: float | None, balance: float | None, note: str = "", focus: FocusAdapter | None = None,
            fast: str = "fast") -> None:
        t0 = time.perf_counter()
        meter = None
        if focus is not None:
            focus.mode = fast
            focus.attach(model)
            meter = RoutingMeter(focus)
        try:
            total, count = window_nll(model, windows, desc=mode, progress=progress)
        finally:
            if focus is not None:
                meter.remove()
                focus.detach(model)
        if meter is not None:
            measured, balance = meter.means()
            density = measured if density is None else density
        results[mode] = ModeResult(mode, math.exp(total / count), total / count, count, float(density), balance,
                                   time.perf_counter() - t0, note)

    for mode in [m for m in MODES if m in modes]:
        if mode == "full":
            run("full", 1.0, None, "the model's own attention")
        elif mode == "focus":
            kernel = default_kernel(next(model.parameters()).device, cfg)
            routed = f"queries top-{cfg.query_top_k}, keys top-{cfg.key_top_k}" + "".join(
                f"; layer {a}: {q}, {k}" for a, q, k in cfg.layer_top_k)
            dense = f", KV heads {' '.join(f'{a}.{b}' for a, b in cfg.dense_heads)} dense" if cfg.dense_heads else ""
            run("focus", None, None, f"hard routing ({routed}{dense}), fast path ({kernel} kernel)", adapter)
        elif mode == "soft":
            run("soft", 1.0, None, "soft routing (training path), dense", adapter, fast="soft")
        elif mode == "window":
            w = matching_window(n, cfg.sink_tokens, results["focus"].density, tail)
            with window_only(model, w, cfg.sink_tokens, cfg.layers, dense_tail=cfg.dense_tail):
                run("window", window_density(n, w, cfg.sink_tokens, tail), None,
                    f"window {w} + {cfg.sink_tokens} sinks" + (f" + dense tail {tail}" if tail else ""))
        else:
            rnd = FocusAdapter(cfg, seed=RANDOM_SEED).to(next(model.parameters()).device)
            w = random_window(model, rnd, windows[:1], results["focus"].density, progress)
            rnd = FocusAdapter(replace(cfg, window=w), rnd.centroids.detach())
            run("random", None, None, f"untrained random centroids (seed {RANDOM_SEED}), window {w} + "
                f"{cfg.sink_tokens} sinks" + (f" + dense tail {tail}" if tail else "")
                + " (matched to focus's density on the first window)", rnd)


def random_window(model: nn.Module, random: FocusAdapter, windows: torch.Tensor, density: float,
                  progress: bool = False) -> int:
    """Window at which ``random``'s hard pattern reaches ``density`` on ``windows [N, L]``.

    Untrained centroids route queries and keys to different groups, so at the same window they compute fewer pairs
    than trained ones; one forward with ``random`` attached counts its far pairs at every distance, then the window
    is searched exactly on those counts (:func:`matching_pattern_window`; the adapter's dense heads count fully, so the
    groups' share of ``density`` excludes them). Routing downstream of a wider window
    shifts a little, so the density measured in the run itself is what gets reported.
    """
    random.attach(model)
    meter = RoutingMeter(random)
    try:
        window_nll(model, windows, desc="random: matching the density", progress=progress)
    finally:
        meter.remove()
        random.detach(model)
    far, n, cfg = torch.stack(meter.far).mean(0), windows.shape[1], random.config
    dense = len(cfg.dense_heads) / (len(cfg.layers) * cfg.num_kv_heads)  # share of heads that attend fully
    return matching_pattern_window(far, n, cfg.sink_tokens, (density - dense) / max(1 - dense, 1e-9),
                                   cfg.tail(n))


# ---- reporting -----------------------------------------------------------------------------------


def results_markdown(results: list[ModeResult], protocol: str = "") -> str:
    """A markdown table: perplexity, change against ``full``, density and balance of every mode."""
    full = next((r for r in results if r.mode == "full"), None)
    lines = ["| mode | perplexity | vs full | density | balance | note |", "|---|---|---|---|---|---|"]
    for r in results:
        delta = f"{100 * (r.perplexity / full.perplexity - 1):+.2f}%" if full else "-"
        bal = f"{r.balance:.2f}" if r.balance is not None else "-"
        lines.append(f"| {r.mode} | {r.perplexity:.3f} | {delta} | {100 * r.density:.1f}% | {bal} | {r.note} |")
    return "\n".join(lines) + ("\n\n" + protocol.strip() if protocol else "") + "\n"


def plot_results(results: list[ModeResult], path: str, title: str = "") -> str:
    """PNG of perplexity against density (one labelled point per mode; ``full`` as a dashed line)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(6, 4), dpi=120)
    for r in results:
        if r.mode == "full":
            ax.axhline(r.perplexity, color="gray", ls="--", lw=1, label=f"full attention ({r.perplexity:.2f})")
        ax.scatter(100 * r.density, r.perplexity, s=40, zorder=3)
        ax.annotate(r.mode, (100 * r.density, r.perplexity), textcoords="offset points", xytext=(5, 4))
    ax.set_xlabel("density: % of causal query-key pairs computed")
    ax.set_ylabel("perplexity (held-out)")
    ax.set_title(title, fontsize=9)
    ax.grid(alpha=0.3)
    if any(r.mode == "full" for r in results):  # the one labelled line
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)
    return path


def save_results(directory: str, results: list[ModeResult], meta: dict[str, Any], protocol: str,
                 title: str = "") -> dict[str, str]:
    """Write ``results.json``, ``results.md`` and the PNG plot into ``directory``; returns their paths."""
    os.makedirs(directory, exist_ok=True)
    paths = {name: os.path.join(directory, name) for name in (RESULTS_JSON, RESULTS_MD, PLOT_PNG)}
    with open(paths[RESULTS_JSON], "w") as f:
        json.dump({**meta, "protocol": protocol, "results": [asdict(r) for r in results]}, f, indent=2)
        f.write("\n")
    with open(paths[RESULTS_MD], "w") as f:
        f.write(results_markdown(results, protocol))
    plot_results(results, paths[PLOT_PNG], title)
    return paths
