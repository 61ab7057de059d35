"""Training Focus centroids on a frozen model: only ``adapter.centroids`` ever change.

Three objectives:

* ``distill`` (layer-local, the CPU default). A frozen forward pass with the model's own attention
  records every layer's post-RoPE queries, keys and values (:func:`capture_qkv`); no gradient goes through
  the model. For each layer, the full attention rows ``p_i`` of ``query_samples`` random queries are
  recomputed and the centroids are fitted so that Focus attention reproduces the layer's attention
  output: the Focus row is ``p_ij m_ij`` renormalised, with ``m_ij = 1`` for window/sink pairs and, for far
  pairs, the soft overlap ``min(1, sum_g a_ig b_jg)`` of the query's soft top-k membership ``a``
  (:func:`routing.soft_membership`) and the key's soft groups ``b``, normalised to one unit of mass; the loss
  is ``sum_i |o_i - o_i^full|^2 / sum_i |o_i^full|^2`` over the sampled rows of each head (a relative
  squared error of the layer output; the values decide which lost attention matters). With hard routing
  and keys in one group (``key_top_k = 1``) the Focus row is exactly the Focus attention row of
  :func:`focus_flex.attention.reference_attention`. With keys in k groups a far pair counts
  ``min(1, shared groups / k)`` instead of 1: a softer target than the hard pattern, kept because it trains routing
  that leads the equal-density window by as much or more than the exact weighting (``b`` with k units of mass)
  on the development split (docs/quality.md, "Far-pair weighting in distill").
* ``lm`` (end to end, the paper's setup): the adapter runs in ``"soft"`` mode and the next-token loss is
  back-propagated through the frozen model to the centroids (dense soft attention, recomputed in the backward
  pass: a 2K sequence takes about 6 GB and a minute on 2 CPU cores).
* ``kd`` (end to end, distillation of the model's output): as ``lm``, but the loss is the KL divergence from the
  model's own next-token distribution (full attention, same sequence) to the soft adapter's, averaged over the
  positions that have far keys (``>= window``); with ``repeats``, half of it over the positions that continue a
  copied span. Every layer's routing is weighed by what its errors do to the output, not by its own attention
  output alone.

Balance: every objective adds ``balance_weight`` x the SwAV-style cross-entropy between the keys' routing
probabilities and their Sinkhorn-balanced targets (:func:`routing.sinkhorn`). Key groups decide how many
far pairs a query sees (k_q groups' worth of keys), so balanced key groups bound the density and no group
swallows the sequence; queries are free to pick whichever groups hold the keys they attend to.

Groups by probability mass (``query_mass``, distill): a query's soft top-k takes its likeliest groups until they hold
that much of its routing probability, so the queries whose routing hesitates get more groups. Flatter routing then
buys more groups at no cost in the loss; ``entropy_weight`` x the queries' mean routing entropy prices it.

Rows by Fisher weight (``fisher``, distill): one backward pass of the frozen model per sequence (:func:`fisher_qkv`)
weighs every head and row of every layer by how much the model's output depends on its attention output; each
layer's rows are drawn in proportion (:func:`fisher_rows`, instead of at random and the copies' rows) and the error
is the weighted sum over heads and rows.

Data parallelism: when ``torch.distributed`` is initialised (``torchrun``, ``accelerate launch``;
:func:`init_distributed`), rank r takes sequences ``r, r + W, ...`` of each global batch, every sequence's
loss is divided by the global batch size and centroid gradients are summed with ``all_reduce``, so W
processes compute what one process computes on the whole batch. Batches are a pure function of
``(seed, step)`` and the learning rate of ``step``, so a resumed run repeats an uninterrupted one.
"""

from __future__ import annotations

import contextlib
import hashlib
import json
import math
import os
import random
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, dataclass, fields
from typing import Any, NamedTuple

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from tqdm.auto import tqdm

from focus_flex import routing
from focus_flex.adapter import FocusAdapter, has_focus, rotary_of
from focus_flex.attention import near_pairs
from focus_flex.config import FocusConfig
from focus_flex.data import check_windows

CAPTURE = "focus_capture"  # transformers attention implementation that records q/k/v
OBJECTIVES = ("distill", "lm", "kd")
INITS = ("kmeans", "random", "keep")
CHECKPOINT_DIR = "checkpoints"
STATE_NAME = "trainer_state.pt"



class LayerQKV(NamedTuple):
    """What one attention layer computed with: post-RoPE q ``[B, Hq, L, D]``, k and v ``[B, Hkv, L, D]``, and its
    score scale (None: ``head_dim ** -0.5``; e.g. Gemma-3's ``query_pre_attn_scalar`` sets another)."""

    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    scale: float | None


QKV = dict[int, LayerQKV]  # layer index -> its q, k, v and scale


@dataclass
class TrainConfig:
    """Optimisation settings (the Focus semantics live in :class:`FocusConfig`)."""

    objective: str = "distill"
    steps: int = 24
    batch_size: int = 1  # global: sequences per optimizer step, split across ranks
    seq_len: int = 2048
    lr: float = 0.05
    warmup: int = 2
    balance_weight: float = 1.0
    query_samples: int = 192  # distill: attention rows per sequence and layer
    repeats: int = 0  # distill, kd: spans copied far ahead into each training sequence (long-range repetition)
    repeat_span: int = 32  # tokens per copied span
    init: str = "kmeans"  # spherical k-means of the keys of the first sequence, "random", or "keep" (fine-tune)
    train_layers: list[int] | None = None  # Focus layers whose centroids learn (None: all); the rest stay as they start
    query_mass: float | None = None  # distill: queries take groups until they hold this much routing probability
    query_most: int = 10  # ... at most this many (query_mass only)
    entropy_weight: float = 0.0  # query_mass: weight of the queries' routing entropy (the price of their extra groups)
    fisher: bool = False  # distill: draw rows and weight heads by the Fisher weight of their output (fisher_qkv)
    seed: int = 0
    eval_every: int = 0  # dev metrics every N steps (0: at the end only)
    checkpoint_every: int = 0  # checkpoint every N steps (0: at the end only, when an output dir is given)

    def __post_init__(self) -> None:
        if self.objective not in OBJECTIVES:
            raise ValueError(f"objective={self.objective!r}; choose one of {OBJECTIVES}")
        if self.init not in INITS:
            raise ValueError(f"init={self.init!r}; choose one of {INITS}")
        for name in ("steps", "batch_size", "seq_len", "query_samples", "repeat_span", "query_most"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"{name}={getattr(self, name)!r} must be an int >= 1")
        if not isinstance(self.repeats, int) or self.repeats < 0:
            raise ValueError(f"repeats={self.repeats!r} must be an int >= 0")
        if self.train_layers is not None and (not self.train_layers or len(set(self.train_layers)) != len(
                self.train_layers) or not all(isinstance(x, int) and x >= 0 for x in self.train_layers)):
            raise ValueError(f"train_layers={self.train_layers!r} must be None (every Focus layer) or distinct layer "
                             "indices >= 0")
        if self.query_mass is not None and (self.objective != "distill" or not 0 < self.query_mass <= 1):
            raise ValueError(f"query_mass={self.query_mass!r} needs objective='distill' (it sets the soft top-k of the "
                             f"layer-local loss) and a probability in (0, 1]; got objective={self.objective!r}")
        if self.entropy_weight and (self.query_mass is None or not 0 < self.entropy_weight < math.inf):
            raise ValueError(f"entropy_weight={self.entropy_weight!r} prices the groups query_mass adds: it needs "
                             "query_mass and a finite weight > 0")
        if self.fisher and self.objective != "distill":
            raise ValueError(f"fisher=True weighs the rows of the layer-local loss: it needs objective='distill', "
                             f"got {self.objective!r} (lm and kd are end to end already)")
        if self.repeats and self.objective == "lm":
            raise ValueError("repeats needs objective='distill' or 'kd' (the copies choose which rows or positions "
                             "are distilled)")
        if not (0 < self.lr < math.inf and 0 <= self.balance_weight < math.inf and self.warmup >= 0):
            raise ValueError(f"lr={self.lr} must be finite and > 0, balance_weight={self.balance_weight} finite and "
                             f">= 0, warmup={self.warmup} >= 0")

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> TrainConfig:
        known = {f.name for f in fields(cls)}
        return cls(**{k: v for k, v in d.items() if k in known})


# ---- reproducibility, the frozen base model, distributed -----------------------------------------


def seed_everything(seed: int) -> None:
    """Seed python and torch (every device)."""
    random.seed(seed)
    torch.manual_seed(seed)


def model_checksum(model: nn.Module) -> str:
    """sha256 of every parameter and buffer of ``model`` (names, dtypes, shapes and bytes)."""
    h = hashlib.sha256()
    for name, t in sorted(model.state_dict().items()):
        t = t.detach().cpu().contiguous()
        h.update(f"{name}:{t.dtype}:{tuple(t.shape)}".encode())
        h.update(t.reshape(-1).view(torch.uint8).numpy().tobytes())
    return h.hexdigest()


def init_distributed() -> tuple[int, int]:
    """Join the process group described by the environment (``torchrun``/``accelerate launch`` set
    ``WORLD_SIZE`` etc.) if there is one and it is not joined yet; returns ``(rank, world_size)``."""
    if dist.is_available() and not dist.is_initialized() and int(os.environ.get("WORLD_SIZE", "1")) > 1:
        dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    return rank_and_world()


def rank_and_world() -> tuple[int, int]:
    if dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    return 0, 1


# ---- capturing q/k -------------------------------------------------------------------------------


@contextlib.contextmanager
def capture_qkv(model: nn.Module, outputs: dict[int, torch.Tensor] | None = None) -> Iterator[QKV]:
    """While active, forwards of ``model`` record ``{layer: LayerQKV(q, k, v, scale)}`` (post-RoPE q and k), and
    into ``outputs``, if given, each layer's attention output ``[B, L, Hq, D]`` (before the output projection) as a
    tensor that gradients can be taken with respect to.

    The model's own attention still computes the outputs: a transformers attention implementation that
    stores the tensors and delegates to ``sdpa_attention_forward``, with SDPA's mask builder.
    """
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    if has_focus(model):
        raise RuntimeError("A Focus adapter is attached: detach it to capture the model's own attention.")
    store: QKV = {}

    def attention(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
        store[module.layer_idx] = LayerQKV(query.detach(), key.detach(), value.detach(), scaling)
        out, weights = sdpa_attention_forward(module, query, key, value, attention_mask, dropout=dropout,
                                              scaling=scaling, **kwargs)
        if outputs is not None:
            if torch.is_grad_enabled() and not out.requires_grad:  # the first layer: where the gradient path starts
                out = out.detach().requires_grad_()
            outputs[module.layer_idx] = out
        return out, weights

    AttentionInterface.register(CAPTURE, attention)
    AttentionMaskInterface.register(CAPTURE, sdpa_mask)
    original = model.config._attn_implementation
    model.set_attn_implementation(CAPTURE)
    try:
        yield store
    finally:
        model.set_attn_implementation(original)


def fisher_qkv(model: nn.Module, input_ids: torch.Tensor,
               generator: torch.Generator) -> tuple[QKV, dict[int, torch.Tensor]]:
    """:func:`teacher_qkv` of ``input_ids [1, L]`` and every layer's Fisher weights ``[Hq, L]``: the squared norm of
    the gradient of ``sum_t log p(y_t)``, ``y_t`` drawn from the model's own next-token distribution, with respect
    to that layer's attention output of each head and row (before the output projection).

    Its expectation is the trace of the Fisher information of the model's output about that head's output at that
    row: the second-order weight of an error there in the KL from the model's output, through every later layer
    and position. One forward and one backward pass (no parameter gradients)."""
    outputs: dict[int, torch.Tensor] = {}
    with capture_qkv(model, outputs) as store, torch.enable_grad():
        logits = model(input_ids=input_ids.to(next(model.parameters()).device), use_cache=False).logits[0]
        logp = logits.float().log_softmax(-1)
        y = torch.multinomial(logp.detach().exp().cpu(), 1, generator=generator).to(logp.device)
        layers = sorted(outputs)
        grads = torch.autograd.grad(logp.gather(-1, y).sum(), [outputs[i] for i in layers])
    return dict(store), {i: g[0].float().pow(2).sum(-1).transpose(0, 1) for i, g in zip(layers, grads, strict=True)}


@torch.no_grad()
def teacher_qkv(model: nn.Module, input_ids: torch.Tensor) -> QKV:
    """Post-RoPE q/k and v of every layer for ``input_ids [B, L]`` (the decoder only: no LM head)."""
    with capture_qkv(model) as store:
        model.base_model(input_ids=input_ids.to(next(model.parameters()).device), use_cache=False)
    return dict(store)


# ---- centroid initialisation ---------------------------------------------------------------------


def spherical_kmeans(x: torch.Tensor, k: int, iters: int, generator: torch.Generator) -> torch.Tensor:
    """Unit centroids ``[k, D]`` of the directions of ``x [N, D]`` (k-means on the sphere, seeded from x)."""
    x = F.normalize(x.float(), dim=-1)
    c = x[torch.randperm(x.shape[0], generator=generator)[:k]].clone()
    for _ in range(iters):
        assign = (x @ c.T).argmax(-1)
        summed = torch.zeros_like(c).index_add_(0, assign, x)
        c = torch.where(summed.norm(dim=-1, keepdim=True) > 0, F.normalize(summed, dim=-1), c)
    return c


Centerings = dict[int, routing.Centering | None]  # adapter slot -> how it centers (None everywhere: no centering)


def centerings(adapter: FocusAdapter, model: nn.Module) -> Centerings:
    """Each slot's :class:`~focus_flex.routing.Centering` for q/k of ``model`` (views of the adapter's means, so later
    changes to them show), or None per slot whose layer is not centered (``config.centers``)."""
    rotary = rotary_of(model) if adapter.config.center else None
    return {slot: routing.Centering(adapter.query_means[slot], adapter.key_means[slot], rotary)
            if adapter.config.centers(layer) else None for layer, slot in adapter.slot.items()}


def routing_vectors(x: torch.Tensor, centering: routing.Centering | None, kind: str,
           pos: torch.Tensor | None = None) -> torch.Tensor:
    """What routing reads for captured queries or keys ``x [B, H, L, D]`` at positions ``pos [L]`` (default
    ``0..L-1``): x itself or, centered, ``centering.queries`` / ``centering.keys``."""
    if centering is None:
        return x
    pos = (torch.arange(x.shape[2], device=x.device) if pos is None else pos).expand(x.shape[0], -1)
    return centering.queries(x, pos) if kind == "query" else centering.keys(x, pos)


@torch.no_grad()
def calibrate_means(adapter: FocusAdapter, qkv: QKV, model: nn.Module) -> None:
    """Centered routing: set each layer's per-head mean query and key *before* the rotary encoding (undone at each
    token's position) to their means over the captured tokens ``qkv`` (positions ``0..L-1``); the layers that are not
    centered keep zero means."""
    rotary = rotary_of(model)
    for layer, slot in adapter.slot.items():
        if not adapter.config.centers(layer):
            adapter.query_means[slot] = 0
            adapter.key_means[slot] = 0
            continue
        q, k = qkv[layer].q.float(), qkv[layer].k.float()
        if rotary is not None:
            cos, sin = rotary(torch.arange(q.shape[2], device=q.device)[None])
            q, k = (routing.unrotate(x, cos[:, None], sin[:, None]) for x in (q, k))
        adapter.query_means[slot] = q.mean((0, 2)).to(adapter.query_means.device)
        adapter.key_means[slot] = k.mean((0, 2)).to(adapter.key_means.device)


@torch.no_grad()
def kmeans_init(adapter: FocusAdapter, qkv: QKV, seed: int, iters: int = 10,
                centering: Centerings | None = None) -> None:
    """Set each layer's and KV head's centroids to spherical k-means centres of its keys (needs N >= G keys), or of
    the vectors routing reads for them (``centering``)."""
    gen = torch.Generator().manual_seed(seed)
    keys_per_head, g = qkv[adapter.config.layers[0]].k[:, 0].shape[:2], adapter.config.num_groups
    if keys_per_head[0] * keys_per_head[1] < g:
        raise ValueError(f"k-means init needs at least as many keys per head as groups ({g}); one training window "
                         f"has {keys_per_head[0] * keys_per_head[1]}: use a longer --seq-len or --init random")
    for layer, slot in adapter.slot.items():
        k = routing_vectors(qkv[layer].k, (centering or {}).get(slot), "key")
        for h in range(k.shape[1]):
            keys = k[:, h].reshape(-1, k.shape[-1]).cpu()
            adapter.centroids[slot, h] = spherical_kmeans(keys, adapter.config.num_groups, iters, gen)


# ---- losses --------------------------------------------------------------------------------------


def balance_loss(s: torch.Tensor, iters: int) -> torch.Tensor:
    """SwAV-style balance: cross-entropy of ``softmax(s)`` against Sinkhorn targets; s ``[..., N, G]``."""
    target = routing.sinkhorn(s.detach(), max(iters, 1))
    return -(target * s.float().log_softmax(-1)).sum(-1).mean()


def _attention_rows(q: torch.Tensor, k: torch.Tensor, config: FocusConfig, query_idx: torch.Tensor,
                    scale: float | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Full causal attention of the queries ``query_idx`` (fp32 ``[B, Hq, Q, L]``), with the bool masks
    ``near`` (window or sink) and ``future`` (``[Q, L]`` each)."""
    n, d = q.shape[2], q.shape[3]
    scale = d ** -0.5 if scale is None else scale
    kk = k.float().repeat_interleave(q.shape[1] // k.shape[1], 1)
    pos = torch.arange(n, device=q.device)
    future = query_idx[:, None] < pos[None, :]
    near = ~future & near_pairs(query_idx, pos, config)
    logits = torch.einsum("bhqd,bhkd->bhqk", q[:, :, query_idx].float(), kk) * scale
    return logits.masked_fill(future, float("-inf")).softmax(-1), near, future


def distill_layer_loss(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                       config: FocusConfig, query_idx: torch.Tensor, scale: float | None = None,
                       centering: routing.Centering | None = None, query_mass: float | None = None,
                       query_most: int = 10, head_weights: torch.Tensor | None = None
                       ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Layer-local Focus objective of one layer: ``(output error, balance, query entropy)`` scalars (module
    docstring; the last: the mean entropy of the sampled queries' routing probabilities, in nats).

    q ``[B, Hq, L, D]``, k and v ``[B, Hkv, L, D]`` (post-RoPE, from the frozen model, positions ``0..L-1``),
    centroids ``[Hkv, G, D]``, query_idx ``[Q]``: the query positions whose attention outputs enter the error;
    ``centering``: route mean-removed vectors. ``query_mass``: each query's soft top-k takes its groups until they
    hold that much of its routing probability (:func:`routing.mass_counts`, at most ``query_most``) instead of
    ``config.query_top_k``. ``head_weights [B, Hq, Q]``: the error is ``sum r |o - o^full|^2 / sum r |o^full|^2``
    over every head and row, weighted by ``r`` (Fisher weights), instead of each head's relative error averaged.
    """
    rep = q.shape[1] // k.shape[1]
    with torch.no_grad():
        p, near, future = _attention_rows(q, k, config, query_idx, scale)
        vv = v.float().repeat_interleave(rep, 1)
        full = p @ vv  # [B, Hq, Q, D]
        far = ~(near | future)
    s_k = routing.scores(routing_vectors(k, centering, "key"), centroids, config.tau)  # [B, Hkv, L, G]
    q_route = routing_vectors(q[:, :, query_idx], centering, "query", query_idx)
    s_q = routing.scores(q_route, centroids, config.tau)
    top_k = config.query_top_k if query_mass is None else routing.mass_counts(s_q, query_mass, query_most)
    a = routing.soft_membership(s_q, top_k)
    b = routing.soft_membership(s_k, config.key_top_k)
    b = (b / b.sum(-1, keepdim=True)).repeat_interleave(rep, 1)  # one unit of mass: see the module docstring
    keep = torch.where(far, (a @ b.transpose(-1, -2)).clamp_max(1.0), near.float())
    entropy = -(routing.probabilities(s_q) * s_q.log_softmax(-1)).sum(-1).mean()
    if head_weights is None:
        err = output_error(p, keep, vv, full).mean()
    else:
        r = head_weights.to(full)
        err = (r * row_errors(p, keep, vv, full)).sum() / (r * full.pow(2).sum(-1)).sum().clamp_min(1e-12)
    return err, balance_loss(s_k, config.sinkhorn_iters), entropy


def row_errors(p: torch.Tensor, keep: torch.Tensor, v: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Squared error ``[B, H, Q]`` of attention rows ``p [B, H, Q, L]`` reweighted by ``keep`` and renormalised,
    against the full output ``full = p @ v`` ``[B, H, Q, D]`` (v ``[B, H, L, D]``)."""
    w = p * keep
    return ((w @ v) / w.sum(-1, keepdim=True) - full).pow(2).sum(-1)


def output_error(p: torch.Tensor, keep: torch.Tensor, v: torch.Tensor, full: torch.Tensor) -> torch.Tensor:
    """Relative squared error ``[B, H]`` of :func:`row_errors`: ``sum |o - o^full|^2 / sum |o^full|^2`` over rows."""
    return row_errors(p, keep, v, full).sum(-1) / full.pow(2).sum((-1, -2)).clamp_min(1e-12)


@torch.no_grad()
def hard_fidelity(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor, config: FocusConfig,
                  query_idx: torch.Tensor, scale: float | None = None, centering: routing.Centering | None = None,
                  rows: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """How well the hard Focus pattern reproduces full attention at ``query_idx``, per head ``[B, Hq]`` each:
    (full-attention mass it keeps, mean over the queries; :func:`output_error` of its outputs). ``rows``: what
    :func:`_attention_rows` gives for these arguments, when the caller has computed it."""
    p, near, future = _attention_rows(q, k, config, query_idx, scale) if rows is None else rows
    qm = routing.hard_membership(routing_vectors(q[:, :, query_idx], centering, "query", query_idx), centroids,
                                 config.query_top_k)
    km = routing.hard_membership(routing_vectors(k, centering, "key"), centroids, config.key_top_k)
    km = km.repeat_interleave(q.shape[1] // k.shape[1], 1)
    keep = (near | (((qm[..., :, None] & km[..., None, :]) != 0) & ~future)).float()
    vv = v.float().repeat_interleave(q.shape[1] // k.shape[1], 1)
    return (p * keep).sum(-1).mean(-1), output_error(p, keep, vv, p @ vv)


def first_far_row(n: int, config: FocusConfig) -> int:
    """The first of ``n`` query positions that has far keys (``window``; the last position if n <= window)."""
    return min(config.window, n - 1)


def query_positions(n: int, count: int, config: FocusConfig, generator: torch.Generator) -> torch.Tensor:
    """``count`` random query positions that have far keys (:func:`first_far_row` on)."""
    return torch.randint(first_far_row(n, config), n, (count,), generator=generator)


def fisher_rows(weights: torch.Tensor, count: int, config: FocusConfig,
                generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``count`` query positions that have far keys, drawn with replacement in proportion to their Fisher weight
    summed over the heads (``weights [Hq, L]``, :func:`fisher_qkv`), and each head's share of it ``[1, Hq, count]``:
    with these shares as head weights, the sampled error estimates the Fisher-weighted error of every row."""
    low = first_far_row(weights.shape[1], config)
    row = weights[:, low:].sum(0).cpu()
    idx = low + torch.multinomial(row / row.sum(), count, replacement=True, generator=generator)
    share = weights[:, idx.to(weights.device)] / row[idx - low].to(weights).clamp_min(1e-30)
    return idx, share[None]


def with_repeats(seq: torch.Tensor, count: int, span: int, min_gap: int,
                 generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """``seq [L]`` with ``count`` spans of ``span`` tokens copied from earlier in it, each at least ``min_gap``
    tokens after its source, and the positions ``[count * (span - 1)]`` that continue a copy.

    A model reads a repeated span back from its first occurrence (induction and retrieval heads attend sharply,
    far back): those rows are what routing must keep and what novels alone rarely show. The copies go into
    disjoint slots of the sequence's last three quarters; each source is drawn uniformly before its copy.
    """
    n = seq.shape[0]
    first = max(n // 4, min_gap + span)
    slot = (n - first) // max(count, 1)
    if count and slot < span:
        raise ValueError(f"{count} repeats of {span} tokens do not fit a {n}-token sequence after {min_gap} tokens: "
                         f"use fewer --repeats, a shorter --repeat-span or a longer --seq-len")
    out, follow = seq.clone(), []
    for r in range(count):
        target = first + r * slot + int(torch.randint(0, slot - span + 1, (1,), generator=generator))
        source = int(torch.randint(0, target - min_gap - span + 1, (1,), generator=generator))
        out[target:target + span] = out[source:source + span]
        follow.append(torch.arange(target + 1, target + span))
    return out, torch.cat(follow) if follow else torch.zeros(0, dtype=torch.long)


# ---- one step ------------------------------------------------------------------------------------


def _step_generator(seed: int, step: int, salt: int = 0) -> torch.Generator:
    return torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + salt)


def batch_indices(num_windows: int, batch_size: int, seed: int, step: int) -> list[int]:
    """Window indices of the global batch of ``step``: epochs of seeded permutations, a pure function."""
    out = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, pos = divmod(i, num_windows)
        out.append(int(torch.randperm(num_windows, generator=_step_generator(seed, epoch, 1))[pos]))
    return out


def accumulate_gradients(model: nn.Module, adapter: FocusAdapter, sequences: torch.Tensor, positions: list[int],
                         tc: TrainConfig, step: int, centering: Centerings | None = None) -> dict[str, float]:
    """Forward/backward ``sequences [b, L]`` one at a time, adding into ``adapter.centroids.grad``.

    They are this rank's share of the global batch of ``step``, at ``positions`` in it; every loss is divided
    by ``tc.batch_size``. Returns this rank's share of the step's losses.
    """
    cfg = adapter.config
    sums = {"loss": 0.0, tc.objective: 0.0, "balance": 0.0}
    global_batch = tc.batch_size
    slots = trained_slots(adapter, tc)
    for seq, position in zip(sequences, positions, strict=True):
        if tc.objective == "distill":
            gen = _step_generator(tc.seed, step, 2 + position)
            idx = query_positions(seq.shape[0], tc.query_samples, cfg, gen)
            if tc.repeats:  # half the rows where a copy is read back from far away
                seq, follow = with_repeats(seq.cpu(), tc.repeats, tc.repeat_span, cfg.window, gen)
                pick = follow[torch.randint(0, len(follow), (tc.query_samples // 2,), generator=gen)]
                idx = torch.cat([idx[:tc.query_samples - len(pick)], pick])
            if tc.fisher:
                qkv, fisher = fisher_qkv(model, seq[None], gen)
            else:
                qkv, fisher = teacher_qkv(model, seq[None]), None
            for slot in slots:  # layer-local: a layer whose centroids do not learn has nothing to distill
                q, k, v, scale = qkv[cfg.layers[slot]]
                heads = None
                if fisher is not None:  # rows drawn by their weight, heads weighted by their share of it
                    idx, heads = fisher_rows(fisher[cfg.layers[slot]], tc.query_samples, cfg, gen)
                idx = idx.to(q.device)
                err, bal, entropy = distill_layer_loss(q, k, v, adapter.centroids[slot], adapter.layer_config(slot),
                                                       idx, scale,
                                                       (centering or {}).get(slot), tc.query_mass, tc.query_most,
                                                       heads)
                main, bal, entropy = err / len(slots), bal / len(slots), entropy / len(slots)
                ((main + tc.balance_weight * bal + tc.entropy_weight * entropy) / global_batch).backward()
                sums[tc.objective] += main.item() / global_batch
                sums["balance"] += bal.item() / global_batch
                if tc.entropy_weight:
                    sums["entropy"] = sums.get("entropy", 0.0) + entropy.item() / global_batch
        else:
            follow = None
            if tc.objective == "kd" and tc.repeats:
                gen = _step_generator(tc.seed, step, 2 + position)
                seq, follow = with_repeats(seq.cpu(), tc.repeats, tc.repeat_span, cfg.window, gen)
            main, bal = lm_losses(model, adapter, seq, kd=tc.objective == "kd", follow=follow)
            ((main + tc.balance_weight * bal) / global_batch).backward()
            sums[tc.objective] += main.item() / global_batch
            sums["balance"] += bal.item() / global_batch
    sums["loss"] = sums[tc.objective] + tc.balance_weight * sums["balance"] + tc.entropy_weight * sums.get("entropy", 0)
    return sums


def trained_slots(adapter: FocusAdapter, tc: TrainConfig) -> list[int]:
    """The centroid slots that learn: those of ``tc.train_layers`` (all of the adapter's when it is None)."""
    if tc.train_layers is None:
        return list(adapter.slot.values())
    other = sorted(set(tc.train_layers) - set(adapter.slot))
    if other:
        raise ValueError(f"train_layers {other} are not Focus layers of this adapter (its layers: "
                         f"{adapter.config.layers}): train a subset of those")
    return sorted(adapter.slot[layer] for layer in tc.train_layers)


def lm_losses(model: nn.Module, adapter: FocusAdapter, seq: torch.Tensor, kd: bool = False,
              follow: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """Next-token loss of ``seq [L]`` through the attached (soft) adapter, and the mean key-balance loss of its
    layers (from the keys each Focus layer sees, collected by a forward hook on the adapter).

    ``kd``: instead of the next-token loss, ``KL(full || focus)`` of the next-token distributions at the positions
    ``>= window``, the model's own (full attention) computed first with the adapter switched off; ``follow``
    (positions that continue a copied span) take half of it.
    """
    cfg = adapter.config
    bals: list[torch.Tensor] = []
    x = seq[None].to(next(model.parameters()).device)
    if kd:
        with torch.no_grad(), _own_attention(model, adapter):
            teacher = model(input_ids=x, use_cache=False).logits[0].float().log_softmax(-1)

    def hook(module: FocusAdapter, args: tuple, output: torch.Tensor) -> None:
        _, slot, query, key, _, padding = args[:6]
        keys = module.routed(slot, query, key, padding)[1]
        bals.append(balance_loss(routing.scores(keys, module.centroids[slot], cfg.tau), cfg.sinkhorn_iters))

    handle = adapter.register_forward_hook(hook)
    try:
        if not kd:
            return model(input_ids=x, labels=x, use_cache=False).loss, torch.stack(bals).mean()
        student = model(input_ids=x, use_cache=False).logits[0].float().log_softmax(-1)
    finally:
        handle.remove()
    kl = (teacher.exp() * (teacher - student)).sum(-1)  # [L]
    far = kl[min(cfg.window, len(kl) - 1):].mean()
    if follow is None or not len(follow):
        return far, torch.stack(bals).mean()
    return 0.5 * far + 0.5 * kl[follow.to(kl.device)].mean(), torch.stack(bals).mean()


@contextlib.contextmanager
def _own_attention(model: nn.Module, adapter: FocusAdapter) -> Iterator[None]:
    """The model's own attention inside the block, the adapter (attached to ``model``) again after it."""
    adapter.detach(model)
    try:
        yield
    finally:
        adapter.attach(model)


def learning_rate(tc: TrainConfig, step: int) -> float:
    """Linear warmup, then cosine decay to 10% of ``lr`` at the last step."""
    if step < tc.warmup:
        return tc.lr * (step + 1) / (tc.warmup + 1)
    t = (step - tc.warmup) / max(1, tc.steps - tc.warmup - 1)
    return tc.lr * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * min(t, 1.0))))


# ---- dev metrics ---------------------------------------------------------------------------------


@torch.no_grad()
def dev_metrics(adapter: FocusAdapter, dev_qkv: list[QKV], num_queries: int = 256,
                centering: Centerings | None = None) -> dict[str, float]:
    """Cheap held-out check of the hard pattern on cached teacher q/k (one entry per dev sequence):
    attention mass kept (``retained``), relative output error, density and key-group balance, averaged over
    layers and heads. ``centering``: :func:`centerings` of a centered adapter."""
    from focus_flex.evaluate import pattern_density

    cfg, cent = adapter.config, adapter.centroids.detach()
    kept, err, dens, bal = [], [], [], []
    for qkv in dev_qkv:
        for layer, slot in adapter.slot.items():
            q, k, v, scale = qkv[layer]
            n = q.shape[2]
            idx = torch.linspace(min(cfg.window, n - 1), n - 1, num_queries, device=q.device).long().unique()
            c = cent[slot].to(q.device)
            center, lc = (centering or {}).get(slot), cfg.at(layer)
            fidelity = hard_fidelity(q, k, v, c, lc, idx, scale, center)
            kept.append(fidelity[0].mean())
            err.append(fidelity[1].mean())
            qm = routing.hard_membership(routing_vectors(q, center, "query"), c, lc.query_top_k)
            km = routing.hard_membership(routing_vectors(k, center, "key"), c, lc.key_top_k)
            dens.append(pattern_density(qm, km, cfg.window, cfg.sink_tokens, cfg.tail(n)).mean())
            bal.append(routing.group_balance(km, cfg.num_groups).mean())
    mean = lambda xs: float(torch.stack(xs).mean())
    return {"retained": mean(kept), "output_error": mean(err), "density": mean(dens), "balance": mean(bal)}


# ---- checkpoints ---------------------------------------------------------------------------------


def save_checkpoint(directory: str, adapter: FocusAdapter, optimizer: torch.optim.Optimizer, step: int,
                    tc: TrainConfig, history: list[dict[str, Any]]) -> str:
    """``directory/checkpoints/step-000N/``: the adapter files plus optimizer state, step and history."""
    path = os.path.join(directory, CHECKPOINT_DIR, f"step-{step:06d}")
    tmp = path + ".tmp"
    adapter.save_pretrained(tmp)
    torch.save({"step": step, "optimizer": optimizer.state_dict(), "train_config": asdict(tc),
                "history": history}, os.path.join(tmp, STATE_NAME))
    if os.path.isdir(path):
        import shutil

        shutil.rmtree(path)
    os.replace(tmp, path)
    return path


def latest_checkpoint(directory: str) -> str | None:
    """The newest ``step-*`` checkpoint under ``directory/checkpoints`` (or ``directory`` itself), if any."""
    if os.path.isfile(os.path.join(directory, STATE_NAME)):
        return directory
    root = os.path.join(directory, CHECKPOINT_DIR)
    names = sorted(n for n in os.listdir(root) if n.startswith("step-") and not n.endswith(".tmp")) \
        if os.path.isdir(root) else []
    return os.path.join(root, names[-1]) if names else None


# Settings a resumed run may change: how long it runs and how often it reports.
_RESUMABLE = {"steps", "eval_every", "checkpoint_every"}
_ROUTING = ("num_groups", "query_top_k", "key_top_k", "window", "sink_tokens", "tau", "sinkhorn_iters", "layers",
            "center", "layer_top_k", "dense_heads")


def _check_resume(ckpt: str, state: dict[str, Any], saved: FocusConfig, focus: FocusConfig, tc: TrainConfig) -> None:
    """A checkpoint continues this run only if it was made with the same settings and is not past its end."""
    was = {**asdict(TrainConfig()), **state.get("train_config", {})}  # a setting newer than the checkpoint: default
    diff = [f"{k}: {was[k]!r} there, {v!r} now" for k, v in asdict(tc).items() if k not in _RESUMABLE and was[k] != v]
    diff += [f"{k}: {getattr(saved, k)!r} there, {getattr(focus, k)!r} now" for k in _ROUTING
             if getattr(saved, k) != getattr(focus, k)]
    if diff:
        raise ValueError(f"cannot resume from {ckpt!r} with other settings ({'; '.join(diff)}): pass the same "
                         "flags (only --steps, --eval-every and --checkpoint-every may change), or start a fresh run "
                         "in another --output-dir")
    if state["step"] > tc.steps:
        raise ValueError(f"{ckpt!r} is at step {state['step']}, past --steps {tc.steps}: pass --steps >= "
                         f"{state['step']}, or start a fresh run in another --output-dir")


# ---- the loop ------------------------------------------------------------------------------------


def check_length(seq_len: int, window: int, sinks: int) -> None:
    """Training sequences reach beyond window + sinks: otherwise no pair is far and the centroids learn nothing."""
    if seq_len <= window + sinks:
        raise ValueError(f"sequences of {seq_len} tokens <= window {window} + {sinks} sinks: every pair is local, "
                         "so there is nothing for the centroids to learn; use longer sequences")


def check_batch(batch_size: int, world: int) -> None:
    """The global batch splits evenly across the ``world`` processes."""
    if batch_size % world:
        raise ValueError(f"batch_size={batch_size} must be a multiple of the number of processes ({world})")


def train(model: nn.Module, adapter: FocusAdapter, windows: torch.Tensor, tc: TrainConfig, *,
          dev_windows: torch.Tensor | None = None, output_dir: str | None = None, resume: str | None = None,
          progress: bool = True, log: Callable[[str], None] | None = None) -> list[dict[str, Any]]:
    """Train ``adapter``'s centroids on ``windows [N, L]`` (token ids) with ``model`` frozen; returns the history.

    ``dev_windows [M, L']`` are scored with :func:`dev_metrics` every ``eval_every`` steps and at the end.
    ``output_dir`` receives checkpoints (rank 0 only); ``resume`` is a checkpoint folder or an output dir
    whose latest checkpoint is loaded (adapter, optimizer, step, history). The adapter must not be attached.
    """
    check_batch(tc.batch_size, rank_and_world()[1])
    windows = check_windows(windows, model, "windows")
    dev_windows = None if dev_windows is None else check_windows(dev_windows, model, "dev_windows")
    cfg = adapter.config
    if windows.shape[1] != tc.seq_len:
        raise ValueError(f"windows have {windows.shape[1]} tokens but tc.seq_len is {tc.seq_len}: cut them to "
                         f"seq_len (focus_flex.data.token_windows(docs, tokenizer, tc.seq_len)) or set seq_len")
    check_length(windows.shape[1], cfg.window, cfg.sink_tokens)
    adapter.check_compatible(model)
    if has_focus(model):
        raise RuntimeError("A Focus adapter is attached to this model: detach it before training (train() attaches "
                           "the adapter itself where the objective needs it).")
    was_training, trainable, mode = model.training, [p.requires_grad for p in model.parameters()], adapter.mode
    try:
        return _train_frozen(model, adapter, windows, tc, dev_windows, output_dir, resume, progress, log)
    finally:  # the model and adapter as they came: training mode, trainable parameters, attention mode
        model.train(was_training)
        for p, flag in zip(model.parameters(), trainable, strict=True):
            p.requires_grad_(flag)
        adapter.mode = mode


def _train_frozen(model: nn.Module, adapter: FocusAdapter, windows: torch.Tensor, tc: TrainConfig,
                  dev_windows: torch.Tensor | None, output_dir: str | None, resume: str | None, progress: bool,
                  log: Callable[[str], None] | None) -> list[dict[str, Any]]:
    """:func:`train` with the model in eval mode and frozen."""
    rank, world = rank_and_world()
    model.eval()
    model.requires_grad_(False)
    seed_everything(tc.seed)
    device = next(model.parameters()).device
    adapter.to(device)
    frozen = sorted(set(adapter.slot.values()) - set(trained_slots(adapter, tc)))
    optimizer = torch.optim.Adam([adapter.centroids], lr=tc.lr)
    history: list[dict[str, Any]] = []
    start = 0
    ckpt = latest_checkpoint(resume) if resume else None
    if resume and ckpt is None:
        raise FileNotFoundError(f"No checkpoint to resume from in {resume!r}")
    if ckpt:
        try:
            state = torch.load(os.path.join(ckpt, STATE_NAME), map_location=device, weights_only=False)
            saved = FocusAdapter.from_pretrained(ckpt)
        except (OSError, ValueError, RuntimeError, EOFError) as e:  # (torch.load's errors for a damaged file)
            raise ValueError(f"cannot resume from {ckpt!r}: {e}") from e
        _check_resume(ckpt, state, saved.config, adapter.config, tc)
        with torch.no_grad():
            adapter.centroids.copy_(saved.centroids)
            if adapter.config.center:
                adapter.query_means.copy_(saved.query_means)
                adapter.key_means.copy_(saved.key_means)
        optimizer.load_state_dict(state["optimizer"])
        start, history = state["step"], state["history"]
    elif tc.init != "keep":  # the first window: the heads' means (centered routing), then the k-means start
        if rank == 0 and (adapter.config.center or tc.init == "kmeans"):
            first = teacher_qkv(model, windows[batch_indices(len(windows), 1, tc.seed, 0)])
            if adapter.config.center:
                calibrate_means(adapter, first, model)
            if tc.init == "kmeans":
                kmeans_init(adapter, first, tc.seed, centering=centerings(adapter, model))
        if world > 1:
            for t in (adapter.centroids.data, adapter.query_means, adapter.key_means):
                if t is not None:
                    dist.broadcast(t, 0)
    centering = centerings(adapter, model)
    dev_qkv = [teacher_qkv(model, w[None]) for w in dev_windows] if dev_windows is not None and rank == 0 else []
    say = log if log is not None and rank == 0 else (lambda msg: None)
    lm_mode = tc.objective in ("lm", "kd")
    if lm_mode:
        adapter.mode = "soft"
        adapter.attach(model)
    bar = tqdm(range(start, tc.steps), initial=start, total=tc.steps, desc=f"train ({tc.objective})",
               disable=not progress or rank != 0)
    try:
        for step in bar:
            t0 = time.perf_counter()
            for group in optimizer.param_groups:
                group["lr"] = learning_rate(tc, step)
            optimizer.zero_grad(set_to_none=False)
            positions = list(range(rank, tc.batch_size, world))
            batch = batch_indices(len(windows), tc.batch_size, tc.seed, step)
            idx = [batch[i] for i in positions]
            parts = accumulate_gradients(model, adapter, windows[idx], positions, tc, step, centering)
            if world > 1:
                dist.all_reduce(adapter.centroids.grad)
                totals = torch.tensor([parts[k] for k in sorted(parts)], dtype=torch.float64)
                dist.all_reduce(totals)
                parts = dict(zip(sorted(parts), totals.tolist(), strict=True))
            if not math.isfinite(parts["loss"]):
                raise ValueError(f"the training loss is {parts['loss']} at step {step + 1}: lower --lr or "
                                 f"--balance-weight (the last checkpoint, if any, is from before this step)")
            kept = adapter.centroids.detach()[frozen].clone()
            optimizer.step()
            with torch.no_grad():  # routing only sees directions: keep the centroids unit-norm
                adapter.centroids.copy_(F.normalize(adapter.centroids, dim=-1))
                adapter.centroids[frozen] = kept  # bit for bit (lm, kd: their gradients flow but do not apply)
            entry = {"step": step + 1, "lr": learning_rate(tc, step), **parts,
                     "seconds": time.perf_counter() - t0}
            last = step + 1 == tc.steps
            if dev_qkv and ((tc.eval_every and (step + 1) % tc.eval_every == 0) or last):
                entry["dev"] = dev_metrics(adapter, dev_qkv, centering=centering)
                say(f"step {step + 1}: dev " + json.dumps({k: round(v, 4) for k, v in entry["dev"].items()}))
            history.append(entry)
            bar.set_postfix(loss=f"{parts['loss']:.4f}", balance=f"{parts['balance']:.3f}")
            if output_dir and rank == 0 and ((tc.checkpoint_every and (step + 1) % tc.checkpoint_every == 0)
                                             or last):
                save_checkpoint(output_dir, adapter, optimizer, step + 1, tc, history)
    finally:
        if lm_mode:
            adapter.detach(model)
    return history
