"""``python -m benchmarks.passkey_oracle``: where a Focus adapter loses the passkeys full attention retrieves.

For every prompt that full attention answers correctly in ``--full-results`` (a ``passkey.json`` of
``focus-flex eval --task passkey --modes full``; ``--lengths``, ``--depths`` and ``--key-numbers`` narrow them), the
adapter answers it with its hard pattern (reference path: dense SDPA with the pattern as mask) plus one kind of extra
pairs:

* ``none`` — nothing added: the adapter as it is;
* ``decode`` — the generation steps attend every earlier token: the library's ``FocusConfig.dense_decode``, run on
  the fast path;
* ``tail`` — as ``decode``, and the prompt's last ``--tail`` tokens (the question and the answer's start) too;
* ``needle`` — every query attends the needle's tokens;
* ``needle-rows`` — the needle's own queries attend every earlier token;
* ``denominator`` — no pairs added, but the pairs the pattern drops still count in each row's softmax normaliser
  (full attention's probabilities on the kept pairs, not renormalised to them: the dropped keys act as a sink whose
  value is zero);
* ``best-pairs`` — in every head the pattern's far pairs (neither window nor sink nor tail) are replaced by as many
  far pairs of highest full-attention probability, chosen over the head's whole prefill: what a routing that picked
  the best pairs at Focus's cost would keep (its threshold is estimated from a sample of the head's pairs, so its
  density is Focus's to within a few tenths of a percent; both are printed with the attention mass they keep);
  ``--best-density F`` chooses as many as make F of each head's causal pairs instead; ``--oracle-layers L ...`` chooses
  them in those layers only, the others keep Focus's pattern (this and the next two variants);
* ``best-error`` — as ``best-pairs``, but the far pairs that move the head's output most when dropped one at a time
  (pair (i, j) alone moves row i's output by ``p_ij |o_i - v_j| / (1 - p_ij)``, o the full attention output): the
  pairs an objective on the layer's output error would keep, rather than those of highest probability;
* ``best-rows`` — as ``best-pairs``, but each query keeps as many far pairs as the pattern gives it, its likeliest:
  as many pairs in every row as Focus, chosen by full attention;
* ``summaries`` — every query also attends one summary per block of ``SUMMARY_BLOCK`` keys that lies wholly before
  its window (the block's mean key with a logit bias of log(block), its mean value): a cheap view of all the far
  context besides the groups;
* ``moments`` — every query also attends, per block of ``--moment-block`` keys, one summary of the block's keys its
  pattern drops: their log-sum-exp estimated from the moments of its scores on them (``log n + mean`` with
  ``--moment-order 1``; ``+ var / 2``, the Gaussian estimate, with 2, capped at ``log n + max``) and their
  softmax-weighted value estimated likewise (their mean value; with order 2 tilted by the scores' covariance with
  the values: exact when keys and values are jointly Gaussian). A block store of ``n``, ``sum k``, ``sum v`` (and for
  order 2 ``sum k k^T``, ``sum k v^T``) gives these numbers, a query subtracting its own kept pairs, all but order 2's
  cap; ``--moment-order 0`` is an oracle: the dropped keys' exact log-sum-exp with their mean value.
  ``--oracle-layers`` restricts it to those layers.

A variant that recovers the keys says which queries lose them. ``--layers`` keeps Focus in those layers only (the
others attend fully): which layers' patterns lose them; ``--dense-heads L.H ...`` sets the adapter's
``FocusConfig.dense_heads`` (KV head H of layer L attends fully): which heads' patterns lose them; ``--dense-rows A B``
makes the prompt's queries at positions ``[A, B)`` attend fully in every layer, on any path: whose rows lose them;
``--wide-layers L ... --wide-top-k Q K`` sets the adapter's ``FocusConfig.layer_top_k`` (those layers route their
queries into Q groups and keys into K): whether more groups there are enough; ``--adaptive-layers L ...
--adaptive-mass P`` gives each of those layers' queries its likeliest groups until they hold P of its routing
probability (at most ``--adaptive-most``; keys keep the adapter's ``key_top_k``), on the reference path: whether the
extra groups are needed only where routing is unsure.
Each answer is printed with the key's log-probability (all its tokens; its first, the space before the digits) and
the density of the adapter's hard pattern on its prefill (the Focus layers' causal pairs, dense heads and tail
counted, the adaptive layers' added pairs too, a variant's extra pairs not). ``--dense-tail N`` sets the adapter's
``FocusConfig.dense_tail`` (the prompt's last N queries attend every token) and ``--dense-decode`` /
``--no-dense-decode`` its ``FocusConfig.dense_decode`` in every variant but ``decode`` (default: the adapter's own).
Nothing here changes the library: the extra pairs are added by wrapping
:func:`focus_flex.attention.reference_attention` (dense rows: :class:`focus_flex.FocusAdapter`'s forward) for the
duration of the run.
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import math
import time
from collections.abc import Callable
from unittest import mock

import torch
import torch.nn.functional as F
from torch import nn

import focus_flex.adapter
from benchmarks.bench import machine_info
from focus_flex import FocusAdapter, FocusConfig, routing
from focus_flex.attention import (
    dense_decode,
    focus_pattern,
    key_validity,
    near_pairs,
    reference_attention,
    routed,
    tail_rows,
)
from focus_flex.cli import keep_freed_memory, layer_head
from focus_flex.models import load_model
from focus_flex.passkey import PrefillMeter, answer_key, load_passkey, score

VARIANTS = ("none", "decode", "tail", "needle", "needle-rows", "denominator", "summaries", "moments", "best-pairs",
            "best-error", "best-rows")
BEST_VARIANTS = ("best-pairs", "best-error", "best-rows")  # far pairs chosen by full attention (:func:`best_pairs`)
BEST_PAIRS_SAMPLE = 1 << 21
SUMMARY_BLOCK = 64


@contextlib.contextmanager
def widened_reference(widen: Callable[..., torch.Tensor]):
    """The reference path with its mask passed through ``widen(mask, q, k, centroids, config)`` (it returns the mask
    to attend with: the Focus pattern ``[B, Hq, Lq, Lk]`` and whatever pairs it adds)."""

    def attention(q, k, v, centroids, config, *, attention_mask=None, scale=None, centering=None):
        mask = focus_pattern(q, k, centroids, config, attention_mask=attention_mask, centering=centering)
        mask = widen(mask, q, k, centroids, config, attention_mask=attention_mask)
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

    with mock.patch.object(focus_flex.adapter, "reference_attention", attention):
        yield


@contextlib.contextmanager
def full_denominator():
    """The reference path with full attention's probabilities on the Focus pattern's pairs (the dropped pairs stay
    in the normaliser and add no value), one head at a time."""

    def attention(q, k, v, centroids, config, *, attention_mask=None, scale=None, centering=None):
        mask = focus_pattern(q, k, centroids, config, attention_mask=attention_mask, centering=centering)
        lq, lk, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
        causal = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        if attention_mask is not None:
            causal = causal & attention_mask.bool()[:, None, :]
        out = torch.empty_like(q)
        for h in range(q.shape[1]):
            scores = (q[:, h] @ k[:, h // group].transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
            p = scores.masked_fill(~causal, float("-inf")).softmax(-1).masked_fill(~mask[:, h], 0.0)
            out[:, h] = p @ v[:, h // group]
        return out

    with mock.patch.object(focus_flex.adapter, "reference_attention", attention):
        yield


@contextlib.contextmanager
def block_summaries(block: int = SUMMARY_BLOCK):
    """The reference path with, for every query, the Focus pattern plus one summary key per block of ``block`` keys
    wholly before its window and after the sinks (mean key, logit + log(block); mean value), one head at a time; rows
    the pattern makes dense get none."""

    def attention(q, k, v, centroids, config, *, attention_mask=None, scale=None, centering=None):
        if attention_mask is not None and not bool(attention_mask.all()):
            raise NotImplementedError("the summaries variant takes unpadded prompts")
        mask = focus_pattern(q, k, centroids, config, attention_mask=attention_mask, centering=centering)
        lq, lk, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
        nb = lk // block
        starts = torch.arange(nb) * block
        rows = torch.arange(lk - lq, lk)[:, None]
        # a block is summarised for query i when all of it lies in [sinks, i - window]
        seen = (starts[None, :] >= config.sink_tokens) & (starts[None, :] + block - 1 <= rows - config.window)
        causal = (torch.arange(lk)[None, :] <= rows).sum(-1)  # [Lq] keys each query may attend
        scale = scale or q.shape[-1] ** -0.5
        out = torch.empty_like(q)
        for h in range(q.shape[1]):
            kh, vh = k[:, h // group], v[:, h // group]
            # rows the pattern already makes dense (a dense tail, dense decode steps) attend every key: no summaries
            seen_h = seen & (mask[:, h].sum(-1) < causal)[..., None]  # [B, Lq, blocks]
            k_sum = kh[:, :nb * block].unflatten(1, (nb, block)).mean(2)
            v_sum = vh[:, :nb * block].unflatten(1, (nb, block)).mean(2)
            scores = torch.cat([(q[:, h] @ kh.transpose(-1, -2) * scale).masked_fill(~mask[:, h], float("-inf")),
                                (q[:, h] @ k_sum.transpose(-1, -2) * scale + math.log(block)).masked_fill(
                                    ~seen_h, float("-inf"))], -1)
            out[:, h] = scores.softmax(-1) @ torch.cat([vh, v_sum], 1)
        return out

    with mock.patch.object(focus_flex.adapter, "reference_attention", attention):
        yield


@contextlib.contextmanager
def prefill_reference(prefill: Callable[..., torch.Tensor], layers: list[int] | None, name: str):
    """The reference path with each prefill of ``layers`` (model layers; None: every Focus layer) computed by
    ``prefill(q, k, v, mask, config, scale)`` (``mask`` the Focus pattern ``[1, Hq, Lq, Lk]``, ``scale`` resolved);
    decode steps that attend densely and the other layers keep the reference path. One prompt without padding
    (``name`` says which variants refuse others)."""
    current = []  # the model layer whose attention runs, set by the adapter's forward

    def attention(q, k, v, centroids, config, *, attention_mask=None, scale=None, centering=None):
        if q.shape[0] != 1 or attention_mask is not None and not attention_mask.all():
            raise ValueError(f"{name} take one prompt without padding")
        if dense_decode(config.dense_decode, q.shape[2]) or layers is not None and current[-1] not in layers:
            return reference_attention(q, k, v, centroids, config, scale=scale, centering=centering)
        mask = focus_pattern(q, k, centroids, config, centering=centering)
        return prefill(q, k, v, mask, config, scale or q.shape[-1] ** -0.5)

    focus_forward = FocusAdapter.forward

    def forward(self, module, slot, *args):
        current.append(self.config.layers[slot])
        try:
            return focus_forward(self, module, slot, *args)
        finally:
            current.pop()

    with mock.patch.object(focus_flex.adapter, "reference_attention", attention), \
            mock.patch.object(FocusAdapter, "forward", forward):
        yield


@contextlib.contextmanager
def moment_summaries(block: int, order: int, layers: list[int] | None = None):
    """The reference path with, for every query and block of ``block`` keys, one summary of the keys the Focus
    pattern drops there: logit ``log n + mean(s) [+ var(s) / 2, at most max(s)]`` and value ``mean(v) [+ cov(s, v)]``
    (``order`` 1 [2]) over the dropped scores ``s`` (``order`` 0: their exact ``logsumexp(s)``, value ``mean(v)``);
    rows the pattern makes dense get none; in ``layers`` only (model layers; default every Focus layer). One head at a
    time; one prompt without padding."""
    if order not in (0, 1, 2):
        raise ValueError(f"moment summaries have order 0, 1 or 2; got {order}")

    def prefill(q, k, v, mask, config, scale):
        lq, lk, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
        real = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        out = torch.empty_like(q)
        for h in range(q.shape[1]):
            vh = v[0, h // group]
            scores = (q[0, h] @ k[0, h // group].T) * scale
            keep = mask[0, h]
            dropped = real & ~keep & (keep.sum(-1, keepdim=True) < real.sum(-1, keepdim=True))
            logits, values = [scores.masked_fill(~keep, float("-inf"))], []
            for b in range(0, lk, block):
                d = dropped[:, b:b + block].float()
                s = scores[:, b:b + block]
                n = d.sum(-1)
                value = d @ vh[b:b + block]
                if order == 0:  # an oracle: the dropped keys' exact log-sum-exp
                    logit = s.masked_fill(d == 0, float("-inf")).logsumexp(-1)
                else:
                    mean = (s * d).sum(-1) / n.clamp(min=1)
                    logit = n.log() + mean
                if order == 2:
                    dev = (s - mean[:, None]) * d
                    top = s.masked_fill(d == 0, float("-inf")).amax(-1)
                    logit = torch.minimum(logit + (dev * dev).sum(-1) / n.clamp(min=1) / 2, n.log() + top)
                    value = value + dev @ vh[b:b + block]
                logits.append(logit[:, None])  # n = 0: -inf, no summary
                values.append(value / n.clamp(min=1)[:, None])
            p = torch.cat(logits, -1).softmax(-1)
            out[0, h] = p[:, :lk] @ vh + torch.einsum("qb,bqd->qd", p[:, lk:], torch.stack(values))
        return out

    with prefill_reference(prefill, layers, "the moments variant"):
        yield


@contextlib.contextmanager
def best_pairs(stats: dict[str, list[float]] | None = None, density: float | None = None, per_row: bool = False,
               by_error: bool = False, layers: list[int] | None = None):
    """The reference path with each head's far pairs chosen by full attention's probabilities (``best-pairs``), or
    with ``by_error`` by how far dropping each alone moves its row's output (``best-error``), one head at a time;
    appends each prefill head's density and kept attention mass, Focus's and the chosen pattern's, to ``stats``.
    ``density``: as many far pairs as make that share of each head's causal pairs (default: as many as the Focus
    pattern keeps there). With ``per_row`` every query keeps as many far pairs as the Focus pattern gives it, its
    likeliest (``best-rows``). ``layers``: choose them in these model layers only; the other Focus layers attend with
    the Focus pattern (and add no stats). Batch 1 without padding; the head-wide threshold is exact up to
    ``BEST_PAIRS_SAMPLE`` pairs per head."""
    if per_row and density is not None:
        raise ValueError("best-rows keeps the Focus pattern's count in each row: it takes no density")
    stats = collections.defaultdict(list) if stats is None else stats

    def prefill(q, k, v, mask, config, scale):
        lq, lk, group = q.shape[2], k.shape[2], q.shape[1] // k.shape[1]
        pos = torch.arange(lk)
        real = torch.ones(lq, lk, dtype=torch.bool).tril(lk - lq)
        local = real & (near_pairs(pos[lk - lq:], pos, config) | tail_rows(lq, config, q.device))
        far = real & ~local
        sample = None
        if lq * lk > BEST_PAIRS_SAMPLE:
            sample = torch.randint(lq * lk, (BEST_PAIRS_SAMPLE,), generator=torch.Generator().manual_seed(0))
        out = torch.empty_like(q)
        for h in range(q.shape[1]):
            scores = (q[0, h] @ k[0, h // group].T) * scale
            logp = scores.masked_fill(~real, float("-inf")).log_softmax(-1)
            p = logp.exp()
            score = logp
            if by_error:  # log(p |o - v| / (1 - p)): dropping the pair alone moves its row's output by that much
                values = v[0, h // group]
                score = logp + torch.cdist(p @ values, values).log() - torch.log1p(-p.clamp(max=1 - 1e-6))
            candidates = score.masked_fill(~far, float("-inf"))
            if per_row:
                counts = (mask[0, h] & far).sum(-1, keepdim=True)  # [Lq, 1]
                top = candidates.topk(int(counts.max()), dim=-1).indices
                chosen = local | torch.zeros_like(local).scatter(-1, top, torch.arange(top.shape[-1]) < counts)
            else:
                kept = int((mask[0, h] & far).sum()) if density is None else max(0, round(
                    density * int(real.sum())) - int(local.sum()))
                pool = candidates.flatten() if sample is None else candidates.flatten()[sample]
                rank = max(1, round(kept / candidates.numel() * pool.numel()))
                threshold = pool.topk(rank).values[-1] if kept else float("inf")
                chosen = local | far & (score >= threshold)
            for name, m in (("focus", mask[0, h]), ("best", chosen)):
                stats[f"{name} density"].append(float(m.sum() / real.sum()))
                stats[f"{name} mass"].append(float((p * m).sum() / lq))
            out[0, h] = logp.masked_fill(~chosen, float("-inf")).softmax(-1) @ v[0, h // group]
        return out

    with prefill_reference(prefill, layers, "best-pairs, best-error and best-rows"):
        yield


@contextlib.contextmanager
def extra_pairs(variant: str, prompt_len: int, needle: tuple[int, int], tail: int,
                stats: dict[str, list[float]] | None = None, density: float | None = None,
                layers: list[int] | None = None, moments: tuple[int, int] = (256, 2)):
    """The reference path with ``variant``'s pairs allowed on top of the Focus pattern (``tail``, ``needle``,
    ``needle-rows``), or instead of its far pairs (``best-pairs``, ``best-error``, ``best-rows``: :func:`best_pairs`
    with ``stats``, ``density`` and ``layers``), or with summaries (``moments``: :func:`moment_summaries` with
    ``moments`` = (block, order) and ``layers``); the others run the library as it is."""

    def widen(mask, q, k, centroids, config, *, attention_mask=None):
        lq, lk = q.shape[2], k.shape[2]
        rows, cols = torch.arange(lk - lq, lk)[:, None], torch.arange(lk)[None, :]
        causal = cols <= rows
        if variant == "tail":
            return mask | ((rows >= prompt_len - tail) & causal)
        if variant == "needle-rows":
            return mask | ((rows >= needle[0]) & (rows < needle[1]) & causal)
        return mask | ((cols >= needle[0]) & (cols < needle[1]) & causal)

    if variant in BEST_VARIANTS:
        with best_pairs(stats, density, per_row=variant == "best-rows", by_error=variant == "best-error",
                        layers=layers):
            yield
        return
    if variant == "moments":
        with moment_summaries(*moments, layers=layers):
            yield
        return
    if variant in ("denominator", "summaries"):
        with full_denominator() if variant == "denominator" else block_summaries():
            yield
        return
    if variant not in ("tail", "needle", "needle-rows"):
        yield
        return
    with widened_reference(widen):
        yield


@contextlib.contextmanager
def dense_rows(start: int, stop: int):
    """Every Focus layer's prefill output with the rows of the queries at positions ``[start, stop)`` replaced by full
    causal attention (on whichever path the adapter runs; unpadded prompts)."""
    focus_forward = FocusAdapter.forward

    def forward(self, module, slot, query, key, value, padding, scaling, cache_layer=None):
        out = focus_forward(self, module, slot, query, key, value, padding, scaling, cache_layer)
        lq, lk = query.shape[2], key.shape[2]
        if lq != lk or start >= min(stop, lq):  # decode steps, or no such rows
            return out
        if padding is not None and not bool(padding.all()):
            raise NotImplementedError("--dense-rows takes unpadded prompts")
        b = min(stop, lq)
        mask = torch.ones(b - start, b, dtype=torch.bool, device=query.device).tril(start)
        out = out.clone()
        out[:, :, start:b] = F.scaled_dot_product_attention(query[:, :, start:b], key[:, :, :b], value[:, :, :b],
                                                            attn_mask=mask, scale=scaling, enable_gqa=True)
        return out

    with mock.patch.object(FocusAdapter, "forward", forward):
        yield


@contextlib.contextmanager
def in_layers(layers: list[int], change: Callable[[FocusAdapter], tuple[str, object]]):
    """While active, the adapter runs the Focus layers ``layers`` with its attribute ``name`` set to ``value``
    (``change(adapter)`` gives both), restored after each call; the other layers as they are."""

    def call(self, module, slot, *args):
        if self.config.layers[slot] not in layers:
            return nn.Module.__call__(self, module, slot, *args)
        name, value = change(self)
        own = getattr(self, name)
        setattr(self, name, value)
        try:
            return nn.Module.__call__(self, module, slot, *args)
        finally:
            setattr(self, name, own)

    with mock.patch.object(FocusAdapter, "__call__", call):
        yield


@contextlib.contextmanager
def adaptive_layers(layers: list[int], mass: float, most: int, stats: dict[str, list[float]]):
    """The Focus layers ``layers`` route each query into its likeliest groups until they hold ``mass`` of its routing
    probability (at most ``most``; keys keep the adapter's ``key_top_k``), on the reference path; the other layers
    keep the adapter's own path and routing. ``stats`` gets, per layer run, the mean number of groups per query
    (``groups``) and the pairs the wider pattern adds, as a share of the layer's causal pairs (``added``). It replaces
    the reference path everywhere, so the other layers must not run on it (no other variant); no layers: no change."""
    if not layers:
        yield
        return

    def attention(q, k, v, centroids, config, *, attention_mask=None, scale=None, centering=None):
        if dense_decode(config.dense_decode, q.shape[2]):
            return reference_attention(q, k, v, centroids, config, attention_mask=attention_mask, scale=scale,
                                       centering=centering)
        valid = key_validity(k, attention_mask)
        q_route, _ = routed(q, k, valid, centering)
        q_member = routing.mass_membership(q_route, centroids, config.tau, mass, most)
        base = focus_pattern(q, k, centroids, config, attention_mask=attention_mask, centering=centering)
        base_pairs = base.sum().item()
        del base
        mask = focus_pattern(q, k, centroids, config, attention_mask=attention_mask, centering=centering,
                             q_member=q_member)
        causal = q.shape[1] * (valid.sum(-1).float() * (valid.sum(-1).float() + 1) / 2).sum().item()
        stats["groups"].append(routing.member_bits(q_member, config.num_groups).sum(-1).float().mean().item())
        stats["added"].append((mask.sum().item() - base_pairs) / causal)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
        return out.masked_fill(~mask.any(-1, keepdim=True), 0.0)

    with in_layers(layers, lambda a: ("mode", "reference")), \
            mock.patch.object(focus_flex.adapter, "reference_attention", attention):
        yield


def layer_subset(adapter: FocusAdapter, layers: list[int]) -> FocusAdapter:
    """The same centroids (and means) on ``layers`` only, a subset of the adapter's Focus layers."""
    missing = sorted(set(layers) - set(adapter.slot))
    if missing:
        raise SystemExit(f"--layers {missing}: not Focus layers of the adapter ({adapter.config.layers})")
    slots = [adapter.slot[layer] for layer in sorted(layers)]
    center = adapter.config.center
    if isinstance(center, list):  # centered on some layers: those of them in the subset
        center = [layer for layer in center if layer in layers]
    cfg = adapter.config  # its per-layer settings of the subset's layers only
    config = FocusConfig.from_dict({**cfg.to_dict(), "layers": sorted(layers), "center": center,
                                    "dense_heads": [h for h in cfg.dense_heads if h[0] in layers],
                                    "layer_top_k": [t for t in cfg.layer_top_k if t[0] in layers]})
    means = {} if not config.center else {"query_means": adapter.query_means.detach()[slots],
                                          "key_means": adapter.key_means.detach()[slots]}
    return FocusAdapter(config, adapter.centroids.detach()[slots], **means)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapter", default="hub/smollm2-135m-instruct-focus-retrieval")
    parser.add_argument("--full-results", required=True, help="passkey.json with full attention's answers")
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--depths", type=int, nargs="+", default=None, help="needle depths (default: all)")
    parser.add_argument("--variants", nargs="+", choices=VARIANTS, default=list(VARIANTS))
    parser.add_argument("--best-density", type=float, default=None,
                        help="best-pairs, best-error: that share of each head's causal pairs (default: the Focus "
                        "pattern's)")
    parser.add_argument("--oracle-layers", type=int, nargs="+", default=None,
                        help="best-pairs, best-error, best-rows: choose the pairs in these layers only, Focus's "
                             "pattern in the other Focus layers (default: every Focus layer); moments: summarise in "
                             "these layers only")
    parser.add_argument("--moment-block", type=int, default=256, help="moments: keys per summarised block")
    parser.add_argument("--moment-order", type=int, choices=(0, 1, 2), default=2,
                        help="moments: 1 (count and mean), 2 (and variance, covariance), 0 (exact log-sum-exp)")
    parser.add_argument("--haystacks", nargs="+", default=None, help="only these haystacks (default: all)")
    parser.add_argument("--phrasings", nargs="+", default=None, help="only these phrasings (default: all)")
    parser.add_argument("--key-numbers", type=int, nargs="+", default=None,
                        help="only the prompts of these key numbers in their cell (default: all)")
    parser.add_argument("--tail", type=int, default=24, help="prompt tokens the tail variant adds")
    parser.add_argument("--dense-tail", type=int, default=None,
                        help="FocusConfig.dense_tail for every variant (default: the adapter's)")
    parser.add_argument("--dense-decode", action=argparse.BooleanOptionalAction, default=None,
                        help="FocusConfig.dense_decode for every variant but decode, which has it (default: the "
                             "adapter's own)")
    parser.add_argument("--layers", type=int, nargs="+", default=None,
                        help="Focus in these layers only, full attention in the others (default: all)")
    parser.add_argument("--dense-heads", type=layer_head, nargs="+", default=None, metavar="L.H",
                        help="FocusConfig.dense_heads: KV head H of layer L attends fully, e.g. 3.0 3.2 7.1 "
                             "(default: the adapter's)")
    parser.add_argument("--wide-layers", type=int, nargs="+", default=[],
                        help="Focus layers whose queries and keys go into --wide-top-k groups")
    parser.add_argument("--wide-top-k", type=int, nargs=2, default=None, metavar=("Q", "K"),
                        help="groups per query and per key in --wide-layers")
    parser.add_argument("--adaptive-layers", type=int, nargs="+", default=[],
                        help="Focus layers whose queries take groups until they hold --adaptive-mass of their routing "
                             "probability")
    parser.add_argument("--adaptive-mass", type=float, default=0.5,
                        help="adaptive layers: the routing probability a query's groups hold")
    parser.add_argument("--adaptive-most", type=int, default=10, help="adaptive layers: at most this many groups")
    parser.add_argument("--dense-rows", type=int, nargs=2, default=None, metavar=("A", "B"),
                        help="the prompt's queries at positions [A, B) attend fully in every layer")
    args = parser.parse_args()
    if args.best_density is not None and not 0 < args.best_density <= 1:
        parser.error(f"--best-density is a share of the causal pairs in (0, 1]; got {args.best_density}")
    if args.best_density is not None and not set(args.variants) <= {"best-pairs", "best-error"}:
        parser.error("--best-density sets the budget of the best-pairs and best-error variants: pass --variants "
                     "best-pairs or best-error")
    if args.oracle_layers is not None and not set(args.variants) <= {*BEST_VARIANTS, "moments"}:
        parser.error("--oracle-layers says where the best-pairs, best-error, best-rows and moments variants change "
                     "the pattern: pass --variants best-pairs, best-error, best-rows or moments")
    if bool(args.wide_layers) != (args.wide_top_k is not None):
        parser.error("--wide-layers and --wide-top-k go together")
    if not 0 < args.adaptive_mass <= 1 or args.adaptive_most < 1:
        parser.error(f"--adaptive-mass is a probability in (0, 1] and --adaptive-most at least 1; got "
                     f"{args.adaptive_mass} and {args.adaptive_most}")
    if args.adaptive_layers and not set(args.variants) <= {"none", "decode"}:
        parser.error("--adaptive-layers runs its layers on the reference path it replaces: pass --variants none or "
                     "decode with it")
    if set(args.adaptive_layers) & set(args.wide_layers):
        parser.error("a layer is either wide or adaptive: --wide-layers and --adaptive-layers overlap")
    keep_freed_memory()  # the focus-flex command's allocator setting: the dense [L, L] temporaries stay in the heap
    print(" | ".join(f"{k}: {v}" for k, v in machine_info().items()))
    model, tokenizer = load_model()
    model.eval()
    adapter = FocusAdapter.from_pretrained(args.adapter)
    if args.layers is not None:
        adapter = layer_subset(adapter, args.layers)
    if args.oracle_layers is not None and not set(args.oracle_layers) <= set(adapter.config.layers):
        raise SystemExit(f"--oracle-layers {sorted(set(args.oracle_layers) - set(adapter.config.layers))}: not Focus "
                         f"layers of the adapter ({adapter.config.layers})")
    if args.dense_tail is not None:
        adapter.config.dense_tail = args.dense_tail
    if args.dense_heads is not None:
        adapter.config.dense_heads = args.dense_heads
    if args.wide_layers:
        adapter.config.layer_top_k = [[layer, *args.wide_top_k] for layer in args.wide_layers]
    solved = [r for r in load_passkey(args.full_results) if r.mode == "full" and r.correct and r.length in args.lengths
              and (args.depths is None or r.depth in args.depths)
              and (args.key_numbers is None or r.key_number in args.key_numbers)
              and (args.haystacks is None or r.haystack in args.haystacks)
              and (args.phrasings is None or r.phrasing in args.phrasings)]
    if not solved:
        raise SystemExit(f"full attention retrieves no key at lengths {args.lengths} (depths {args.depths or 'all'}, "
                         f"key numbers {args.key_numbers or 'all'}, haystacks {args.haystacks or 'all'}, phrasings "
                         f"{args.phrasings or 'all'}) in {args.full_results}")
    own_dense_decode = adapter.config.dense_decode if args.dense_decode is None else args.dense_decode
    adapter.attach(model)
    totals = {}
    for variant in args.variants:
        adapter.mode = "fast" if variant in ("none", "decode") else "reference"  # the others patch the reference
        adapter.config.dense_decode = variant == "decode" or own_dense_decode
        hits, densities = 0, []
        for r in solved:
            prompt = r.prompt.build(tokenizer, r.key)
            t0 = time.perf_counter()
            stats = collections.defaultdict(list)
            adaptive = collections.defaultdict(list)
            meter = PrefillMeter(adapter)
            try:
                with extra_pairs(variant, len(prompt.input_ids), prompt.needle, args.tail, stats,
                                 args.best_density, args.oracle_layers, (args.moment_block, args.moment_order)), \
                        dense_rows(*(args.dense_rows or (0, 0))), \
                        adaptive_layers(args.adaptive_layers, args.adaptive_mass, args.adaptive_most, adaptive):
                    answer, logprobs = answer_key(model, tokenizer, prompt.input_ids, r.key)
            finally:
                meter.remove()
            # the adaptive layers' added pairs, as a share of every Focus layer's causal pairs
            densities.append(meter.means()[0] + sum(adaptive["added"]) / len(adapter.config.layers))
            correct = score(answer, r.key)
            hits += correct
            print(f"{variant:6s} {r.haystack:6s} {r.length:5d} {r.depth:3d}% key {r.key_number} {r.key}: {answer!r} "
                  f"{'correct' if correct else 'wrong'}, key log-prob {sum(logprobs):.2f} (its first token "
                  f"{logprobs[0]:.2f}), density {100 * densities[-1]:.1f}% ({time.perf_counter() - t0:.0f} s)",
                  flush=True)
            if adaptive:
                print("       adaptive layers: groups per query " + ", ".join(f"{g:.2f}" for g in adaptive["groups"]),
                      flush=True)
            if stats:
                print("       prefill heads, mean: " + ", ".join(
                    f"{name} {100 * sum(x) / len(x):.1f}%" for name, x in stats.items()), flush=True)
        totals[variant] = f"{hits}/{len(solved)} (density {100 * sum(densities) / len(densities):.1f}%)"
    c = adapter.config
    print(f"keys full attention retrieves, retrieved by the adapter (Focus layers {c.layers}, oracle layers "
          f"{args.oracle_layers or 'all'}, dense tail "
          f"{c.dense_tail}, dense decode {own_dense_decode}, dense KV heads {c.dense_heads or 'none'}, dense rows "
          f"{args.dense_rows or 'none'}, layers {args.wide_layers or 'none'} with groups per query and key "
          f"{args.wide_top_k}, layers {args.adaptive_layers or 'none'} with groups holding {args.adaptive_mass} of a "
          f"query's routing probability, at most {args.adaptive_most}) plus:", totals)


if __name__ == "__main__":
    main()
