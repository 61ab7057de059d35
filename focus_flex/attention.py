"""Focus attention: the reference (the semantics), the soft training path and the fast path.

Shapes everywhere: q ``[B, Hq, Lq, D]``, k/v ``[B, Hkv, Lk, D]`` (GQA: Hq a multiple of Hkv),
centroids ``[Hkv, G, D]``; queries are the **last** Lq of the Lk keys (Lq == Lk for a prefill,
Lq == 1 for decode with a KV cache). ``attention_mask`` is an optional ``[B, Lk]`` key padding mask
(True/1 = real token). Positions count real tokens only, so a left-padded row behaves exactly like
the unpadded sequence. Rows of padded queries come out as zeros.
"""

from __future__ import annotations

import contextlib
import math
import warnings
from collections.abc import Callable
from typing import Any, NamedTuple

import torch
import torch.nn.functional as F
from torch.nn.attention.flex_attention import AuxRequest, BlockMask, flex_attention

from focus_flex import flash, routing
from focus_flex.config import DECODE_MAX_QUERIES, FocusConfig
from focus_flex.decode import KeyIndex, indexed_attention
from focus_flex.plan import (
    FarPlan,
    FocusPlan,
    LocalPlan,
    bucket,  # noqa: F401 - re-exported: the flex path's length buckets (bench, tests)
    focus_plan,
    route,
    token_positions,
)
from focus_flex.threads import outer, small_work, using

# ---- input checks and shared helpers -------------------------------------------------------------


def check_inputs(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                 config: FocusConfig, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """Validate shapes/dtypes; return the ``[B, Lk]`` bool key-validity mask."""
    if q.dim() != 4 or k.dim() != 4 or v.dim() != 4:
        raise ValueError(f"q, k, v must be 4-D [B, H, L, D]; got {tuple(q.shape)}, {tuple(k.shape)}, {tuple(v.shape)}")
    (b, hq, lq, d), (bk, hkv, lk, dk) = q.shape, k.shape
    if k.shape != v.shape[:3] + (dk,) or v.shape[:3] != k.shape[:3]:
        raise ValueError(f"k {tuple(k.shape)} and v {tuple(v.shape)} must agree on [B, Hkv, Lk]")
    if bk != b or dk != d or hq % hkv:
        raise ValueError(f"q {tuple(q.shape)} and k {tuple(k.shape)}: batch and head_dim must match and "
                         f"the number of query heads must be a multiple of the number of KV heads")
    if lq > lk:
        raise ValueError(f"q has {lq} positions but k only {lk}: queries must be the last Lq of the Lk keys")
    if min(b, hq, lq, d) == 0:
        raise ValueError(f"q {tuple(q.shape)} is empty: Focus attention needs at least one query of one head")
    if not (q.dtype == k.dtype == v.dtype) or not q.dtype.is_floating_point:
        raise TypeError(f"q, k, v must share one floating dtype; got {q.dtype}, {k.dtype}, {v.dtype}")
    if centroids.shape != (hkv, config.num_groups, d):
        raise ValueError(f"centroids {tuple(centroids.shape)} do not fit: expected [Hkv={hkv}, "
                         f"G={config.num_groups}, D={d}] for k {tuple(k.shape)} and this config")
    if attention_mask is not None and attention_mask.shape != (b, lk):
        raise ValueError(f"attention_mask must be a [batch, key_length] = [{b}, {lk}] padding mask (1 = token, "
                         f"0 = padding); got shape {tuple(attention_mask.shape)}. 4-D or custom masks are not "
                         f"supported by Focus attention.")
    if attention_mask is not None and attention_mask.dtype != torch.bool and attention_mask.dtype.is_floating_point:
        raise TypeError("attention_mask must be bool or integer (1 = token, 0 = padding), not an additive float mask")
    return key_validity(k, attention_mask)


def key_validity(k: torch.Tensor, attention_mask: torch.Tensor | None) -> torch.Tensor:
    """The ``[B, Lk]`` bool mask of real keys of k ``[B, Hkv, Lk, D]``: the padding mask on k's device, or all true
    (unchecked: :func:`check_inputs` checks it)."""
    if attention_mask is None:
        return torch.ones(k.shape[0], k.shape[2], dtype=torch.bool, device=k.device)
    return attention_mask.to(device=k.device, dtype=torch.bool)


def routed(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor,
           centering: routing.Centering | None) -> tuple[torch.Tensor, torch.Tensor]:
    """The vectors routing reads for q ``[B, Hq, Lq, D]`` and k ``[B, Hkv, Lk, D]``: q and k themselves, or with
    :class:`~focus_flex.routing.Centering` their mean-removed vectors at their token positions (``valid [B, Lk]``)."""
    if centering is None:
        return q, k
    pos = token_positions(valid)
    return centering.queries(q, pos[:, k.shape[2] - q.shape[2]:]), centering.keys(k, pos)


def groups_from_membership(member: torch.Tensor, k: int, num_groups: int) -> torch.Tensor:
    """Inverse of :func:`routing.membership`: bitmask ``[...]`` -> the k group ids ``[..., k]``."""
    return routing.member_bits(member, num_groups).topk(k, dim=-1).indices


def near_pairs(q_pos: torch.Tensor, k_pos: torch.Tensor, config: FocusConfig) -> torch.Tensor:
    """The pairs every Focus query attends whatever the groups: key in the query's window or a sink. Positions
    ``[..., Lq]`` and ``[..., Lk]`` -> bool ``[..., Lq, Lk]`` (causality and padding are the caller's)."""
    return ((q_pos[..., :, None] - k_pos[..., None, :]) < config.window) | (k_pos < config.sink_tokens)[..., None, :]


def dense_decode(enabled: bool, lq: int) -> bool:
    """Whether a forward of ``lq`` queries is a decode step that dense decode (``enabled``, as
    ``FocusConfig.dense_decode``) leaves to full attention."""
    return enabled and lq <= DECODE_MAX_QUERIES


def tail_rows(lq: int, config: FocusConfig, device: torch.device) -> torch.Tensor:
    """Which of a forward's ``lq`` queries are the prefill's dense tail (``config.tail(lq)``, the last ones): bool
    ``[Lq, 1]``, to broadcast over keys."""
    return (torch.arange(lq, device=device) >= lq - config.tail(lq))[:, None]


def focus_pattern(q: torch.Tensor, k: torch.Tensor, centroids: torch.Tensor, config: FocusConfig, *,
                  attention_mask: torch.Tensor | None = None, q_member: torch.Tensor | None = None,
                  k_member: torch.Tensor | None = None, centering: routing.Centering | None = None) -> torch.Tensor:
    """The Focus pattern as a dense bool ``[B, Hq, Lq, Lk]`` (docs/design.md, "The semantics"). O(Lq * Lk).

    Query i may attend key j iff j <= i, both are real tokens, and
    ``pos_i - pos_j < window or pos_j < sink_tokens or groups(q_i) ∩ groups(k_j) ≠ ∅``; with ``centering`` the groups
    are those of the mean-removed vectors (:class:`~focus_flex.routing.Centering`). With ``config.dense_decode``, the
    queries of a decode step (Lq <= ``DECODE_MAX_QUERIES``) may attend every earlier real key; with
    ``config.dense_tail``, so may the last ``config.tail(Lq)`` queries of a prefill.
    """
    valid = check_inputs(q, k, k, centroids, config, attention_mask)
    lq, lk, hq = q.shape[2], k.shape[2], q.shape[1]
    pos = token_positions(valid)
    q_pos, q_valid = pos[:, lk - lq:], valid[:, lk - lq:]
    idx = torch.arange(lk, device=k.device)
    causal = idx[None, :] <= idx[lk - lq:, None]  # [Lq, Lk]
    real = (q_valid[:, :, None] & valid[:, None, :] & causal)[:, None]  # [B, 1, Lq, Lk]
    if dense_decode(config.dense_decode, lq):
        return real.expand(-1, hq, -1, -1)
    q_route, k_route = routed(q, k, valid, centering)
    if q_member is None:
        q_member = routing.hard_membership(q_route, centroids, config.query_top_k)
    if k_member is None:
        k_member = routing.hard_membership(k_route, centroids, config.key_top_k)
    k_member = k_member.repeat_interleave(hq // k.shape[1], dim=1)
    same = (q_member[..., :, None] & k_member[..., None, :]) != 0  # [B, Hq, Lq, Lk]
    return real & (near_pairs(q_pos, pos, config)[:, None] | same | tail_rows(lq, config, k.device))


def reference_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                        config: FocusConfig, *, attention_mask: torch.Tensor | None = None,
                        scale: float | None = None, centering: routing.Centering | None = None) -> torch.Tensor:
    """The oracle: SDPA with the dense :func:`focus_pattern` as its mask. Returns ``[B, Hq, Lq, D]``."""
    mask = focus_pattern(q, k, centroids, config, attention_mask=attention_mask, centering=centering)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.masked_fill(~mask.any(-1, keepdim=True), 0.0)


def decode_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, scale: float,
                     q_slots: torch.Tensor | None = None) -> torch.Tensor:
    """A decode step under ``config.dense_decode``: queries ``[B, Hq, Lq, D]`` at key slots ``q_slots [Lq]`` (default:
    the last Lq of the Lk keys) attend every real key (``valid [B, Lk]``) at or before their slot; the rows of
    queries that are not real tokens are zeros. One masked SDPA, no host synchronisation."""
    lk, lq = k.shape[2], q.shape[2]
    slots = torch.arange(lk, device=k.device)
    q_slots = slots[lk - lq:] if q_slots is None else q_slots
    q_valid = valid.index_select(1, q_slots)  # [B, Lq]
    mask = (valid[:, None, :] & (slots <= q_slots[:, None]) & q_valid[:, :, None])[:, None]  # [B, 1, Lq, Lk]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)
    return out.masked_fill(~q_valid[:, None, :, None], 0.0)


def attention_weights(q: torch.Tensor, k: torch.Tensor, centroids: torch.Tensor, config: FocusConfig, *,
                      attention_mask: torch.Tensor | None = None, scale: float | None = None,
                      centering: routing.Centering | None = None) -> torch.Tensor:
    """The attention probabilities of the hard pattern, ``[B, Hq, Lq, Lk]`` (what ``output_attentions=True`` returns):
    the softmax of the scaled scores over the keys :func:`focus_pattern` allows, 0 elsewhere. Dense, O(Lq * Lk)."""
    mask = focus_pattern(q, k, centroids, config, attention_mask=attention_mask, centering=centering)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    keys = k.repeat_interleave(q.shape[1] // k.shape[1], dim=1)
    scores = (q.float() @ keys.float().transpose(-1, -2) * scale).masked_fill(~mask, float("-inf"))
    return scores.softmax(-1).nan_to_num(0.0).to(q.dtype)  # a row with no allowed key (padding): zeros


def soft_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                   config: FocusConfig, *, attention_mask: torch.Tensor | None = None,
                   scale: float | None = None, centering: routing.Centering | None = None) -> torch.Tensor:
    """Training path: differentiable in the centroids, dense (fine up to a few thousand tokens).

    Local and sink pairs get no bias; a far pair (i, j) gets ``log min(1, sum_g a_ig b_jg)`` with
    a, b the soft top-k memberships of :func:`routing.soft_membership`. As routing sharpens, a and b
    become the hard top-k indicators and the bias becomes 0 / -inf: exactly :func:`focus_pattern`.
    Future and padded keys get -inf, so nothing leaks from the future.
    """
    valid = check_inputs(q, k, v, centroids, config, attention_mask)
    b, hq, lq, _ = q.shape
    lk = k.shape[2]
    q_route, k_route = routed(q, k, valid, centering)
    a = routing.soft_membership(routing.scores(q_route, centroids, config.tau), config.query_top_k)
    kb = routing.soft_membership(routing.scores(k_route, centroids, config.tau), config.key_top_k)
    kb = kb.repeat_interleave(hq // k.shape[1], dim=1)
    overlap = torch.einsum("bhqg,bhkg->bhqk", a, kb).clamp(1e-6, 1.0)
    pos = token_positions(valid)
    q_pos = pos[:, lk - lq:]
    idx = torch.arange(lk, device=k.device)
    causal = idx[None, :] <= idx[lk - lq:, None]
    near = near_pairs(q_pos, pos, config) | tail_rows(lq, config, k.device)
    allowed = (valid[:, lk - lq:, None] & valid[:, None, :] & causal)[:, None]
    if torch.is_grad_enabled():
        bias = torch.where(near[:, None], torch.zeros((), device=q.device), overlap.log())
        bias = bias.masked_fill(~allowed, float("-inf")).to(q.dtype)
    else:  # evaluation: the same bias, built in place (a few [B, Hq, Lq, Lk] buffers fewer)
        bias = overlap.log_().masked_fill_(near[:, None], 0.0).masked_fill_(~allowed, float("-inf")).to(q.dtype)
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias, scale=scale, enable_gqa=True)
    return out.masked_fill(~allowed.any(-1, keepdim=True), 0.0)


# ---- the flex path: one plan, two FlexAttention calls, merged through their log-sum-exps -------------------------

_compiled_flex = None
RECOMPILE_LIMIT = 64  # distinct (batch, heads, length bucket, dtype) shapes the flex path keeps compiled


def compiled_flex() -> Callable[..., Any]:
    """``torch.compile(flex_attention)``, created on first use, for calls from eager code.

    Shapes are static: dynamic-shape CPU codegen of flex templates fails to compile on torch 2.13 for some shape
    sequences. Lengths are padded to buckets instead (:func:`~focus_flex.plan.bucket`), and padded blocks are empty
    in the block masks, so they cost no attention work. Each call runs with dynamo's recompile limits raised to at
    least :data:`RECOMPILE_LIMIT` for its duration only (many buckets must not silently fall back to eager, dense,
    flex); the user's global limits are left as they are.
    """
    global _compiled_flex
    if _compiled_flex is None:
        compiled = torch.compile(flex_attention, dynamic=False)

        def call(*args: Any, **kwargs: Any) -> Any:
            cfg = torch._dynamo.config
            with cfg.patch(recompile_limit=max(cfg.recompile_limit, RECOMPILE_LIMIT),
                           accumulated_recompile_limit=max(cfg.accumulated_recompile_limit, 4 * RECOMPILE_LIMIT)):
                return compiled(*args, **kwargs)

        _compiled_flex = call
    return _compiled_flex


_LSE_ROUTES: dict[str, str] = {}  # device type -> "flex" or "extra_key", probed once per process


def lse_route(device: torch.device) -> str:
    """How the flex path gets each call's log-sum-exp on ``device``: ``"flex"`` where compiled FlexAttention returns
    it (``return_aux=AuxRequest(lse=True)``: GPUs), ``"extra_key"`` where it does not (torch 2.13's CPU backend).

    Probed once per device type with a tiny compiled call; inside a ``torch.compile`` trace
    nothing can be probed, so there an unprobed device type is assumed to be as in torch 2.13.
    """
    kind = device.type
    if kind not in _LSE_ROUTES:
        if torch.compiler.is_compiling():
            return "extra_key" if kind == "cpu" else "flex"
        x = torch.zeros(1, 1, 16, 16, device=device)
        try:
            compiled_flex()(x, x, x, return_aux=AuxRequest(lse=True))
            _LSE_ROUTES[kind] = "flex"
        except Exception:  # noqa: BLE001 - the backend's lowering error ("return_lse is not supported yet")
            _LSE_ROUTES[kind] = "extra_key"
    return _LSE_ROUTES[kind]


def _flex(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: BlockMask, scale: float,
          lse: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One FlexAttention call (compiled; inside a trace, the plain op the trace compiles): output ``[B, H, L, Dv]``
    and, if ``lse``, the log-sum-exp ``[B, H, L]`` flex returns (-inf on rows with no key)."""
    gqa = q.shape[1] != k.shape[1]
    aux = {"return_aux": AuxRequest(lse=True)} if lse else {}
    if torch.compiler.is_compiling():
        out = flex_attention(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, **aux)
    else:
        with using(outer()):  # the kernel on the caller's threads, inside the single-threaded small work
            out = compiled_flex()(q, k, v, block_mask=mask, scale=scale, enable_gqa=gqa, **aux)
    return (out[0], out[1].lse) if lse else (out, None)


def _gather_rows(x: torch.Tensor, src: torch.Tensor) -> torch.Tensor:
    """``out[b, h, i] = x[b, h, src[b, h, i]]``, zero where ``src < 0``; x ``[B, H, L, D]``, src ``[B, H, M]``."""
    out = x.gather(2, src.clamp_min(0)[..., None].expand(-1, -1, -1, x.shape[-1]))
    return out.masked_fill((src < 0)[..., None], 0)


def _channel(flags: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """Bool ``[B, H or 1, L]`` -> one head-dim channel ``[B, H, L, 1]`` of ``like``'s dtype, for ``torch.cat``."""
    return flags[..., None].to(like.dtype).expand(like.shape[0], like.shape[1], -1, 1)


SCORE_PAD = 16  # the extra-key score channel comes with zeros up to this many channels: CPU flex vectorises by 16


def _score_channel(x: torch.Tensor, column: torch.Tensor) -> torch.Tensor:
    """``x`` ``[B, H, L, D]`` with ``column`` ``[B, H, L, 1]`` appended as channel D, zero-padded to D + 16 channels
    (compiled CPU flex vectorises the head dim by 16)."""
    return F.pad(torch.cat([x, column.to(x.dtype)], -1), (0, SCORE_PAD - 1))


class Part(NamedTuple):
    """One flex call's result per query row: the output is ``out[..., :D] * norm`` (``norm`` None: ``out[..., :D]``
    is normalised already), its log-sum-exp ``lse`` (-inf: no key)."""

    out: torch.Tensor  # [B, H, L, >= D] the raw flex output
    norm: torch.Tensor | None  # [B, H, L] fp32
    lse: torch.Tensor  # [B, H, L] fp32


def _extra_key_part(out: torch.Tensor, score: torch.Tensor, d: int) -> Part:
    """The :class:`Part` of a call with an extra key.

    The extra key scored ``score`` (``[B, H, L]``) and its value is the flag channel ``d + 1``; real keys carry flag
    channel ``d``. So ``r_real = out[..., d]`` and ``r_extra = out[..., d + 1]`` are the softmax masses of the real
    keys and of the extra key, ``out[..., :d] / r_real`` is the output over the real keys and
    ``lse = score + log r_real - log r_extra`` (docs/design.md, "The kernels": the extra key). Rows with no real
    key get lse = -inf.
    """
    tiny = torch.finfo(torch.float32).tiny
    real, extra = out[..., d].float(), out[..., d + 1].float()
    has = real > 0
    lse = score + real.clamp_min(tiny).log() - extra.clamp_min(tiny).log()
    return Part(out, torch.where(has, 1.0 / real.clamp_min(tiny), 0.0), torch.where(has, lse, float("-inf")))


def _local_score(q: torch.Tensor, k: torch.Tensor, valid: torch.Tensor, plan: LocalPlan, config: FocusConfig,
                 scale: float) -> torch.Tensor:
    """The local call's extra-key score per query ``[B, Hq, Lq]`` (fp32): its highest score among its own key and its
    sinks. No other allowed key outscores it by the ~e^87 that would underflow the extra key's mass in fp32, short of
    extreme logits. O(Lq (1 + sinks) D)."""
    (_, hq, lq, d), (hkv, lk), s = q.shape, k.shape[1:3], config.sink_tokens
    qf = q.float().unflatten(1, (hkv, hq // hkv))  # [B, Hkv, rep, Lq, D]
    best = (qf * k[:, :, None, lk - lq:].float()).sum(-1)  # the query's own key
    if s > 0:
        ks = k.gather(2, plan.sinks.clamp_max(lk - 1)[:, None, :, None].expand(-1, hkv, -1, d)).float()
        q_pos = token_positions(valid)[:, lk - lq:, None]
        seen = (plan.sinks < lk)[:, None, :] & (torch.arange(s, device=k.device) <= q_pos)  # [B, Lq, s]
        sc = (qf @ ks[:, :, None].transpose(-1, -2)).masked_fill(~seen[:, None, None], float("-inf"))
        best = torch.maximum(best, sc.amax(-1))
    return (best * scale).flatten(1, 2)


def _local_queries(x: torch.Tensor, plan: LocalPlan) -> torch.Tensor:
    """``[B, H, Lq, D]`` -> the local layout's query slots ``[B, H, q_len, D]`` (query i in slot ``offset + i``)."""
    return F.pad(x, (0, 0, plan.offset, plan.q_len - plan.offset - x.shape[2]))


def _local_keys(x: torch.Tensor, plan: LocalPlan) -> torch.Tensor:
    """``[B, Hkv, Lk, D]`` -> the local layout's key slots ``[B, Hkv, kv_len, D]``: the sinks' copies, then the
    tokens."""
    lk, s = x.shape[2], plan.sinks.shape[1]
    sinks = x.gather(2, plan.sinks.clamp_max(lk - 1)[:, None, :, None].expand(-1, x.shape[1], -1, x.shape[-1]))
    return torch.cat([F.pad(sinks, (0, 0, 0, plan.sink_slots - s)),
                      F.pad(x, (0, 0, 0, plan.kv_len - plan.sink_slots - lk))], 2)


def local_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, valid: torch.Tensor, plan: LocalPlan,
               config: FocusConfig, scale: float) -> Part:
    """The local call (window + sinks), all heads at once, as a :class:`Part` ``[B, Hq, q_len, ...]`` in the plan's
    query slots (query i in slot ``plan.offset + i``; kept padded, so that a
    ``torch.compile`` trace with a dynamic length never asks whether a slice is the whole tensor)."""
    d = q.shape[3]
    queries, keys = (lambda x: _local_queries(x, plan)), (lambda x: _local_keys(x, plan))
    if plan.extra is None:
        out, lse = _flex(queries(q), keys(k), keys(v), plan.mask, scale, lse=True)
        return Part(out, None, lse)
    score = (_local_score(q, k, valid, plan, config, scale) / scale).to(q.dtype)  # the extra key's: one more channel
    extra = (torch.arange(plan.kv_len, device=k.device) == plan.extra)[None, None]
    kl = _score_channel(keys(k), _channel(extra, k))
    vl = torch.cat([keys(v), _channel(~extra, v), _channel(extra, v)], -1)  # (slots no mask keeps weigh nothing)
    out, _ = _flex(queries(_score_channel(q, score[..., None])), kl, vl, plan.mask, scale, lse=False)
    return _extra_key_part(out, queries(score.float()[..., None])[..., 0] * scale, d)


def far_part(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: FarPlan, local_lse: torch.Tensor,
             offset: int, scale: float) -> Part:
    """The far call over sorted copies, all heads at once: a :class:`Part` ``[B, Hq, Nq, ...]`` per query copy
    (lse -inf for padding copies). With extra keys, a group's extra key scores each copy's local lse
    (``local_lse[.., offset + i]`` for query i): its mass then only underflows where one part outweighs the other by
    ~e^87, and the merge is exact."""
    d = q.shape[-1]
    qf = q.gather(2, plan.q_src[..., None].expand(-1, -1, -1, d))
    kf, vf = _gather_rows(k, plan.k_src), _gather_rows(v, plan.k_src)
    if plan.extra is None:
        out, lse = _flex(qf, kf, vf, plan.mask, scale, lse=True)
        return Part(out, None, torch.where(plan.q_real, lse, float("-inf")))
    score = torch.where(torch.isfinite(local_lse), local_lse, 0.0).gather(2, plan.q_src + offset)
    score = (score / scale).to(q.dtype)
    kf = _score_channel(kf, _channel(plan.extra, k))
    vf = torch.cat([vf, _channel(plan.k_src >= 0, v), _channel(plan.extra, v)], -1)
    out, _ = _flex(_score_channel(qf, score[..., None]), kf, vf, plan.mask, scale, lse=False)
    part = _extra_key_part(out, score.float() * scale, d)
    return part._replace(lse=torch.where(plan.q_real, part.lse, float("-inf")))


def merge(local: Part, far: Part, q_src: torch.Tensor, rows: torch.Tensor, d: int) -> torch.Tensor:
    """Exact union of the two parts (fp32): each part's output weighted by ``exp(lse_part - lse_total)``; a query's
    far copies (``q_src`` ``[B, Hq, Nq]``: the local slot of each one's query) are summed into it; slots where
    ``rows`` (bool ``[B, L]``) is False come out zero. Returns the local part's shape, ``[B, Hq, L, D]``.

    The weights are per row, so each part's output is read once (its normalisation folded into the weight)."""
    m = local.lse.scatter_reduce(2, q_src, far.lse, "amax")
    m = torch.where(torch.isfinite(m), m, 0.0)
    w_l, w_f = torch.exp(local.lse - m), torch.exp(far.lse - m.gather(2, q_src))
    den = w_l.scatter_add(2, q_src, w_f)
    den = torch.where(den > 0, den, 1.0)
    a_l = torch.where(rows[:, None], w_l / den, 0.0)  # padded queries: zeros
    a_f = w_f / den.gather(2, q_src)  # padding copies: w_f = 0
    if local.norm is not None:
        a_l, a_f = a_l * local.norm, a_f * far.norm
    out = local.out[..., :d] * a_l[..., None]  # (fp32: a_l is)
    return out.scatter_add_(2, q_src[..., None].expand(-1, -1, -1, d), far.out[..., :d] * a_f[..., None])


def plan_attention(q: torch.Tensor, k: torch.Tensor, centroids: torch.Tensor, config: FocusConfig, *,
                   valid: torch.Tensor, q_groups: torch.Tensor | None = None, k_groups: torch.Tensor | None = None,
                   extra_key: bool | None = None) -> FocusPlan:
    """Route the tokens (unless their groups are given) and plan both flex calls (:mod:`focus_flex.plan`).
    ``extra_key``: lay out the extra keys of the LSE route without flex's own LSE (None: as :func:`lse_route`)."""
    if q_groups is None:
        q_groups = route(q, centroids, config.query_top_k)
    if k_groups is None:
        k_groups = route(k, centroids, config.key_top_k)
    if extra_key is None:
        extra_key = lse_route(q.device) == "extra_key"
    return focus_plan(q_groups, k_groups, valid, config, extra_key)


def flex_prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor, config: FocusConfig,
                 valid: torch.Tensor, scale: float, centering: routing.Centering | None = None) -> torch.Tensor:
    """Focus attention as two FlexAttention calls over all heads, merged: ``[B, Hq, Lq, D]`` (one pass,
    :attr:`FocusConfig.one_pass`: one call over the tokens in order under the whole pattern).

    Routing, the plan, both calls and the merge are tensor ops with shapes fixed by (batch, heads, length bucket):
    no host synchronisation, and the whole function traces under ``torch.compile(fullgraph=True)``. Called eagerly,
    the two flex calls run compiled (:func:`compiled_flex`) on the caller's threads and the rest on one
    (:func:`~focus_flex.threads.small_work`).
    """
    lq, lk = q.shape[2], k.shape[2]
    # Eagerly on CPU, everything but the two kernels is many small ops: one thread (in a trace: the caller's threads).
    with contextlib.nullcontext() if torch.compiler.is_compiling() else small_work(q.device):
        plan = plan_attention(*routed(q, k, valid, centering), centroids, config, valid=valid)
        rows = F.pad(valid[:, lk - lq:], (plan.local.offset, plan.local.q_len - plan.local.offset - lq))
        if plan.far is None:  # one pass
            lay = plan.local
            out, _ = _flex(_local_queries(q, lay), _local_keys(k, lay), _local_keys(v, lay), lay.mask, scale, False)
            out = out.masked_fill(~rows[:, None, :, None], 0)
        else:
            local = local_part(q, k, v, valid, plan.local, config, scale)
            far = far_part(q, k, v, plan.far, local.lse, plan.local.offset, scale)
            out = merge(local, far, plan.far.q_src + plan.local.offset, rows, q.shape[-1])  # in the local query slots
        # The queries' slots, copied out (a slice would be the whole tensor for one length of the bucket: a trace
        # with a dynamic length would specialise on it).
        return out.index_select(2, torch.arange(lq, device=q.device) + plan.local.offset).to(q.dtype)


def _few_queries_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                           config: FocusConfig, valid: torch.Tensor, k_member: torch.Tensor | None,
                           scale: float, centering: routing.Centering | None) -> torch.Tensor:
    """Decode (few queries): each query attends only its allowed keys, gathered. Exact; O(Hq Lq Lk) bit tests.

    Query rows are grouped by KV head: the keys any of them needs are gathered once, and each row masks the rest.
    """
    b, hq, lq, d = q.shape
    hkv, lk = k.shape[1], k.shape[2]
    rows = hq // hkv * lq  # query rows per KV head, ordered (head in group, query)
    pos = token_positions(valid)
    if k_member is None:
        k_route = k if centering is None else centering.keys(k, pos)
        k_member = routing.hard_membership(k_route, centroids, config.key_top_k)
    q_route = q if centering is None else centering.queries(q, pos[:, lk - lq:])
    q_member = routing.hard_membership(q_route, centroids, config.query_top_k).reshape(b, hkv, rows)
    q_pos, q_valid = pos[:, lk - lq:], valid[:, lk - lq:]
    j = torch.arange(lk, device=k.device)
    causal = j <= (j[lk - lq:, None])  # [Lq, Lk]
    real = valid[:, None, :] & causal & q_valid[:, :, None]  # [B, Lq, Lk]
    near = near_pairs(q_pos, pos, config)
    near, real = (x.repeat(1, rows // lq, 1)[:, None] for x in (near, real))  # [B, Lq, Lk] -> [B, 1, rows, Lk]
    allowed = (((q_member[..., None] & k_member[:, :, None, :]) != 0) | near) & real
    # Keys any query row of a KV head needs are gathered once for all of them.
    union = allowed.any(2)  # [B, Hkv, Lk]
    count = union.sum(-1)
    m = max(int(count.max()), 1)
    used = torch.arange(m, device=k.device) < count[..., None]  # [B, Hkv, m]
    idx = torch.zeros(used.shape, dtype=torch.long, device=k.device).masked_scatter_(used, union.nonzero()[:, 2])
    kg, vg = k.new_empty(b, hkv, m, d), v.new_empty(b, hkv, m, d)
    for i in range(b):  # a memcpy per row, straight into place (a KV cache is often a strided view: no reshape)
        for h in range(hkv):
            torch.index_select(k[i, h], 0, idx[i, h], out=kg[i, h])
            torch.index_select(v[i, h], 0, idx[i, h], out=vg[i, h])
    kg, vg = kg.float(), vg.float()
    s = (kg @ q.reshape(b, hkv, rows, d).float().transpose(-1, -2)).transpose(-1, -2) * scale
    ok = allowed.gather(-1, idx[:, :, None, :].expand(-1, -1, rows, -1)) & used[:, :, None, :]
    p = torch.nan_to_num(s.masked_fill(~ok, float("-inf")).softmax(-1), nan=0.0)
    return torch.einsum("bhrm,bhmd->bhrd", p, vg).reshape(b, hq, lq, d).to(q.dtype)



def default_kernel(device: torch.device, config: FocusConfig, qkv: tuple[torch.Tensor, ...] | None = None) -> str:
    """The prefill kernel :func:`focus_attention` uses unless told: ``"flash"`` on CPU where it applies (to ``qkv``
    if given), else ``"flex"``."""
    return "flash" if flash.supported(device, config, qkv) else "flex"


def focus_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor,
                    config: FocusConfig, *, attention_mask: torch.Tensor | None = None, scale: float | None = None,
                    key_index: KeyIndex | None = None, kernel: str | None = None,
                    centering: routing.Centering | None = None) -> torch.Tensor:
    """The fast path: same result as :func:`reference_attention` (with the same ``centering``).

    Prefill: a local part (window + sinks, tokens in order) and a far part (copies sorted by group), merged exactly
    through their log-sum-exps. ``kernel`` runs them as two block-sparse FlexAttention calls over all heads
    (``"flex"``, :func:`flex_prefill`: no host synchronisation, traceable by ``torch.compile(fullgraph=True)``) or as
    the CPU flash kernel (``"flash"``, :mod:`focus_flex.flash`: faster on CPU, docs/speed.md); None picks
    ``"flash"`` on CPU where it applies (:func:`default_kernel`), else ``"flex"``. ``"flex"`` runs any number of
    queries (a decode step too) through :func:`flex_prefill` unless a ``key_index`` is given.
    Decode (Lq <= 16) with ``config.dense_decode`` is :func:`decode_attention`; else it gathers the allowed keys
    (window + sinks + same-group keys): ``key_index`` (:class:`~focus_flex.decode.KeyIndex`) is the key routing a KV
    cache already computed for exactly these keys; with it and no padding, decode reads its per-group key lists and
    costs O(selected keys); otherwise decode is O(Lk); a ``key_index`` must have routed its keys with the same
    ``centering``. Decode with a KV cache on the device path is :mod:`focus_flex.cache`. The CPU decode, the flash
    kernel and gradients run outside any ``torch.compile`` graph (one graph break).
    Gradients reach q, k and v (not the centroids: hard routing) and are exact, at dense cost: the kernels
    merge through log-sum-exps that carry none, so the backward differentiates :func:`reference_attention`.
    To train the centroids use :func:`soft_attention`.
    """
    if kernel not in (None, "flex", "flash"):
        raise ValueError(f"kernel={kernel!r}: use 'flex', 'flash' or None (automatic)")
    if key_index is not None and key_index.shape != k.shape[:3]:
        raise ValueError(f"key_index routes keys [B, Hkv, Lk] = {key_index.shape}, but k is "
                         f"{tuple(k.shape[:3])}")
    if dense_decode(config.dense_decode, q.shape[2]):
        valid = check_inputs(q, k, v, centroids, config, attention_mask)
        return decode_attention(q, k, v, valid, q.shape[-1] ** -0.5 if scale is None else scale)
    grad = torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad)
    flex = (kernel or default_kernel(q.device, config, (q, k, v))) == "flex"
    if flex and kernel is None and q.device.type == "cpu":  # top-k above 1 for both, and no C kernel for them
        why = (f"which does not take {q.dtype} q, k, v of head dim {q.shape[-1]} (native.prefill_applies)"
               if flash.supported(q.device, config) else "and the C kernels are unavailable")
        warnings.warn(f"focus_flex: with query_top_k and key_top_k both above 1 the CPU flash kernel runs in C only, "
                      f"{why}: this prefill runs on the flex kernel, several times slower (docs/speed.md). Set "
                      "query_top_k or key_top_k to 1 for CPU speed (for a layer listed in FocusConfig.layer_top_k, "
                      "there, or drop the listing).", RuntimeWarning, stacklevel=2)
    if flex and not grad and q.dim() == 4 and (key_index is None or q.shape[2] > DECODE_MAX_QUERIES):  # traceable
        valid = check_inputs(q, k, v, centroids, config, attention_mask)
        out = flex_prefill(q, k, v, centroids, config, valid, q.shape[-1] ** -0.5 if scale is None else scale,
                           centering)
    else:
        out = _host_attention(q, k, v, centroids, config, attention_mask, scale, key_index, kernel, centering)
        if grad:  # the tail is in the function whose gradients these are
            return out
    return with_dense_tail(out, q, k, v, config, attention_mask, scale)


def with_dense_tail(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, config: FocusConfig,
                    attention_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """``out [B, Hq, Lq, D]`` with the rows of the prefill's dense tail (``config.tail(Lq)``, the last queries)
    replaced in place by full attention over every earlier real key: one SDPA of those rows, no host
    synchronisation."""
    t = config.tail(q.shape[2])
    if not t:
        return out
    valid = key_validity(k, attention_mask)  # (checked by the path that computed ``out``)
    dense = decode_attention(q[:, :, -t:], k, v, valid, q.shape[-1] ** -0.5 if scale is None else scale)
    out[:, :, -t:] = dense.to(out.dtype)
    return out


def with_dense_heads(out: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, kv_heads: list[int],
                     attention_mask: torch.Tensor | None, scale: float | None) -> torch.Tensor:
    """``out [B, Hq, Lq, D]`` with the query heads of ``kv_heads`` (``FocusConfig.dense_kv_heads``) replaced by full
    causal attention over every earlier real key: one SDPA of those heads, no host synchronisation."""
    if not kv_heads:
        return out
    group = q.shape[1] // k.shape[1]
    heads = torch.tensor(kv_heads, device=q.device)
    rows = (heads[:, None] * group + torch.arange(group, device=q.device)).flatten()
    dense = decode_attention(q.index_select(1, rows), k.index_select(1, heads), v.index_select(1, heads),
                             key_validity(k, attention_mask), q.shape[-1] ** -0.5 if scale is None else scale)
    return out.index_copy(1, rows, dense.to(out.dtype))


@torch.compiler.disable(reason="the flash kernel, decode's host-side key index and gradients: one graph break; the "
                                "rest of a compiled model stays compiled")
def _host_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor, config: FocusConfig,
                    attention_mask: torch.Tensor | None, scale: float | None, key_index: KeyIndex | None,
                    kernel: str | None, centering: routing.Centering | None) -> torch.Tensor:
    """:func:`focus_attention` for everything but the flex prefill: gradients, decode, the flash kernel."""
    if torch.is_grad_enabled() and (q.requires_grad or k.requires_grad or v.requires_grad):
        return _ReferenceGradients.apply(q, k, v, centroids.detach(), config, attention_mask, scale, key_index, kernel,
                                         centering)
    valid = check_inputs(q, k, v, centroids, config, attention_mask)
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    lq = q.shape[2]
    if kernel == "flash" and not flash.supported(q.device, config, (q, k, v)):
        raise ValueError(f"kernel='flash' needs CPU tensors (got {q.device.type}), and with top-k above 1 for both "
                         f"queries and keys (got {config.query_top_k} and {config.key_top_k}) the C kernel, which "
                         "does not take these inputs (native.prefill_applies says why); use kernel='flex'")
    if lq <= DECODE_MAX_QUERIES and key_index is not None and (attention_mask is None or bool(valid.all())):
        q_pos = torch.arange(k.shape[2] - lq, k.shape[2], device=q.device).expand(q.shape[0], -1)
        q_route = q if centering is None else centering.queries(q, q_pos)
        with small_work(q.device):
            return indexed_attention(q, k, v, centroids, config, key_index, scale, outer(), q_route)
    k_member = None if key_index is None else key_index.member
    if lq <= DECODE_MAX_QUERIES:
        with small_work(q.device):
            return _few_queries_attention(q, k, v, centroids, config, valid, k_member, scale, centering)
    # Key routing a KV cache already did; else the kernel routes the keys itself (centered: routed here).
    k_groups = None if k_member is None else groups_from_membership(k_member, config.key_top_k, config.num_groups)
    q_groups = None
    if centering is not None:  # (keys a cache already routed are not centered again)
        pos = token_positions(valid)
        q_groups = routing.hard_groups(centering.queries(q, pos[:, k.shape[2] - lq:]), centroids, config.query_top_k)
        if k_groups is None:
            k_groups = routing.hard_groups(centering.keys(k, pos), centroids, config.key_top_k)
    return flash.flash_attention(q, k, v, centroids, k_groups, valid, config, scale, q_groups)


class _ReferenceGradients(torch.autograd.Function):
    """:func:`focus_attention`'s output, :func:`reference_attention`'s gradients (the same function, computed densely:
    the fast kernels' log-sum-exps carry no gradient)."""

    @staticmethod
    def forward(ctx, q, k, v, centroids, config, attention_mask, scale, key_index, kernel, centering):
        ctx.save_for_backward(q, k, v, centroids, attention_mask)
        ctx.config, ctx.scale, ctx.centering = config, scale, centering
        return focus_attention(q, k, v, centroids, config, attention_mask=attention_mask, scale=scale,
                               key_index=key_index, kernel=kernel, centering=centering)

    @staticmethod
    def backward(ctx, grad):
        q, k, v, centroids, attention_mask = ctx.saved_tensors
        inputs = [t.detach().requires_grad_(need) for t, need in zip((q, k, v), ctx.needs_input_grad[:3], strict=True)]
        with torch.enable_grad():
            out = reference_attention(*inputs, centroids, ctx.config, attention_mask=attention_mask, scale=ctx.scale,
                                      centering=ctx.centering)
            wanted = [t for t in inputs if t.requires_grad]
            grads = iter(torch.autograd.grad(out, wanted, grad))
        return (*(next(grads) if t.requires_grad else None for t in inputs), *[None] * 7)


def causal_blocks(n: int, block_size: int) -> float:
    """Number of blocks of a causal mask over n tokens (the dense baseline of a density)."""
    nb = math.ceil(n / block_size)
    return nb * (nb + 1) / 2

