"""The flex path as GPU users run it: one sync-free plan, two FlexAttention calls per layer, compiled whole.

No GPU here, so what would make it host-bound is counted instead: the ops that force a host synchronisation on an
accelerator (:class:`HostSyncs`), the flex calls per layer, graph breaks and recompiles.
"""

import collections

import pytest
import torch
from torch._dynamo.testing import CompileCounterWithBackend
from torch.nn.attention.flex_attention import create_mask, flex_attention
from torch.utils._python_dispatch import TorchDispatchMode, _disable_current_modes

from focus_flex import FocusConfig, attention, focus_attention, masks, reference_attention, routing
from focus_flex.attention import focus_pattern

aten = torch.ops.aten

# Ops whose result size or value the host must read: on an accelerator each waits for the device queue to drain.
SYNC_OPS = {aten._local_scalar_dense, aten.item, aten.is_nonzero, aten.equal, aten.allclose, aten.nonzero,
            aten.nonzero_static, aten.masked_select, aten._unique, aten._unique2, aten.unique_dim,
            aten.unique_consecutive, aten.unique_dim_consecutive}


class HostSyncs(TorchDispatchMode):
    """Counts the ops that force a host synchronisation, by name: :data:`SYNC_OPS`, ``repeat_interleave`` with
    tensor repeats and no ``output_size``, and copies of device tensors to the host. (On CPU-only machines copies to
    the host are never seen; ``tolist()``/``numpy()`` of a CPU tensor dispatch no op at all, so they are not.)"""

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        to_host = func.overloadpacket in (aten._to_copy, aten.copy_) and any(
            isinstance(a, torch.Tensor) and a.device.type != "cpu" for a in args) and isinstance(
            out, torch.Tensor) and out.device.type == "cpu"
        repeats = func is aten.repeat_interleave.Tensor and kwargs.get("output_size") is None
        if func.overloadpacket in SYNC_OPS or repeats or to_host:
            self.ops[str(func)] += 1
        return out


def make(b, hq, hkv, lq, lk, d=16, g=4, dtype=torch.float32, seed=0, pad=0, hole=False, logits=None):
    """Random inputs; ``logits="high"``: every score ~ +200 (a shared direction), spread as usual; ``"spread"``:
    scores differing by hundreds between keys."""
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=gen)
    k = torch.randn(b, hkv, lk, d, generator=gen)
    if logits == "high":
        q[..., 0] += 30.0
        k[..., 0] += 30.0
    elif logits == "spread":
        q, k = q * 12.0, k * 12.0
    q, k = q.to(dtype), k.to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=gen).to(dtype)
    c = torch.randn(hkv, g, d, generator=gen)
    mask = None
    if pad or hole:
        mask = torch.ones(b, lk, dtype=torch.bool)
        mask[0, :pad] = False  # left padding in the first row
        if b > 1:
            mask[-1, lk - 3:] = False  # right padding in the last row
        if hole:
            mask[-1, lk // 3:lk // 3 + 40] = False  # a run of padding inside the sequence
    return q, k, v, c, mask


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


@pytest.fixture
def eager_flex_lse(monkeypatch):
    """The route where flex returns the log-sum-exp, on CPU: eager flex (dense, exact) stands in for the compiled
    kernel that GPUs have."""
    monkeypatch.setattr(attention, "_compiled_flex", flex_attention)
    monkeypatch.setitem(attention._LSE_ROUTES, "cpu", "flex")


def test_host_sync_counter_counts():
    """The counter is not vacuous: the syncs of the old flex path are seen."""
    x = torch.arange(10)
    with HostSyncs() as syncs:
        int(x.max()), bool((x > 3).any()), (x > 3).nonzero(), x.repeat_interleave(x)
        x.repeat_interleave(x, output_size=45)  # the size is given: no sync
    assert syncs.ops == {"aten._local_scalar_dense.default": 2, "aten.nonzero.default": 1,
                         "aten.repeat_interleave.Tensor": 1}


@pytest.mark.parametrize("key_top_k", [1, 2], ids=["two calls", "one pass"])
def test_flex_prefill_makes_no_host_sync_and_two_flex_calls(key_top_k, monkeypatch):
    """After warm-up, a padded GQA prefill with top-2 queries is routed, planned, computed and merged without a single
    op that would synchronise with the host, in two flex calls over all heads; with keys in two of the four groups
    too (``one_pass``), in one call."""
    cfg = FocusConfig(num_groups=4, query_top_k=2, key_top_k=key_top_k, window=16, sink_tokens=2, block_size=32)
    assert cfg.one_pass == (key_top_k == 2)
    q, k, v, c, mask = make(2, 4, 2, 100, 100, pad=13)
    focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel="flex")  # warm-up: probes, compiles
    calls = []
    flex = attention._flex

    def opaque_flex(*args, **kwargs):
        """The compiled flex kernel, outside the counter: under a dispatch mode torch.compile would run eagerly.
        It is one fused kernel (on a GPU, one launch); everything around it is counted."""
        calls.append(args[0].shape)
        with _disable_current_modes():
            return flex(*args, **kwargs)

    monkeypatch.setattr(attention, "_flex", opaque_flex)
    with HostSyncs() as syncs:
        out = focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel="flex")
    assert not syncs.ops, f"host syncs in the flex prefill: {dict(syncs.ops)}"
    assert [s[1] for s in calls] == [4] * (1 if cfg.one_pass else 2)  # local and far, each over all query heads
    assert max_diff(out, reference_attention(q, k, v, c, cfg, attention_mask=mask)) <= 1e-4


CASES = [
    # (B, Hq, Hkv, Lq, Lk, top-k q, top-k k, window, sinks, pad, hole, logits)
    (1, 2, 1, 100, 100, 1, 1, 32, 4, 0, False, None),  # GQA, L not a multiple of the block
    (2, 4, 2, 77, 77, 1, 1, 16, 2, 13, True, None),  # left, right and inner padding
    (2, 4, 2, 90, 90, 2, 1, 16, 0, 0, False, None),  # top-2 queries, no sinks
    (1, 2, 2, 120, 120, 3, 2, 8, 3, 0, False, None),  # top-3 / top-2: pairs must not be counted twice
    (2, 2, 1, 60, 60, 2, 2, 500, 1, 5, False, None),  # window larger than L
    (2, 4, 2, 77, 77, 4, 2, 16, 2, 13, True, None),  # one pass (top-k product = groups), padding everywhere
    (2, 4, 2, 40, 100, 8, 1, 16, 2, 9, False, None),  # one pass, chunked: every query in every group
    (2, 4, 2, 40, 100, 1, 1, 16, 2, 9, False, None),  # chunked prefill: 40 new queries on a 100-token cache
    (1, 4, 1, 70, 70, 1, 3, 4, 0, 0, False, None),  # MQA, keys in three groups
    (1, 2, 1, 100, 100, 1, 1, 8, 2, 0, False, "high"),  # every lse ~ 200: far beyond a zero-score extra key's range
    (1, 2, 1, 100, 100, 1, 1, 8, 2, 0, False, "spread"),  # scores hundreds apart (flex's own lse only)
]


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_flex_lse_route_matches_reference(case, eager_flex_lse):
    """Where flex returns the log-sum-exp, the calls use it (no extra key); one pass has one call."""
    b, hq, hkv, lq, lk, kq, kk, w, s, pad, hole, logits = case
    cfg = FocusConfig(num_groups=8, query_top_k=kq, key_top_k=kk, window=w, sink_tokens=s, block_size=32)
    q, k, v, c, mask = make(b, hq, hkv, lq, lk, g=8, pad=pad, hole=hole, logits=logits)
    plan = attention.plan_attention(q, k, c, cfg, valid=torch.ones(b, lk, dtype=torch.bool))
    assert plan.local.extra is None and (plan.far is None) == cfg.one_pass == (kq * kk >= 8)
    assert plan.far is None or plan.far.extra is None
    out = focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel="flex")
    assert max_diff(out, reference_attention(q, k, v, c, cfg, attention_mask=mask)) <= 1e-4


@pytest.mark.parametrize("case", [CASES[1], CASES[-2]], ids=["holes", "high logits"])
def test_extra_key_route_matches_reference(case):
    """Where flex returns no log-sum-exp (compiled CPU flex, torch 2.13), an extra key carries it (the rest of the
    cases run in tests/test_attention.py). Its score, each query's best of its own key and sinks, keeps the flags in
    range at any logit size, unless a window key outscores those by ~e^87 (the "spread" case)."""
    assert attention.lse_route(torch.device("cpu")) == "extra_key"
    b, hq, hkv, lq, lk, kq, kk, w, s, pad, hole, logits = case
    cfg = FocusConfig(num_groups=4, query_top_k=kq, key_top_k=kk, window=w, sink_tokens=s, block_size=32)
    q, k, v, c, mask = make(b, hq, hkv, lq, lk, pad=pad, hole=hole, logits=logits)
    out = focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel="flex")
    assert max_diff(out, reference_attention(q, k, v, c, cfg, attention_mask=mask)) <= 1e-4


def test_bf16_on_the_flex_lse_route(eager_flex_lse):
    cfg = FocusConfig(num_groups=4, query_top_k=2, window=16, sink_tokens=2, block_size=32)
    q, k, v, c, mask = make(2, 4, 2, 77, 77, dtype=torch.bfloat16, pad=13)
    ref = reference_attention(q.float(), k.float(), v.float(), c, cfg, attention_mask=mask)
    out = focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel="flex")
    assert out.dtype == torch.bfloat16 and max_diff(out, ref) <= 2e-2


def test_mask_mods_draw_the_focus_pattern():
    """The attention-gym pieces of masks.py, composed, are the one definition (DESIGN.md §2)."""
    cfg = FocusConfig(num_groups=4, query_top_k=2, key_top_k=1, window=5, sink_tokens=2)
    q, k, _, c, _ = make(1, 2, 1, 40, 40)
    q_member = routing.hard_membership(q, c, cfg.query_top_k)
    k_member = routing.hard_membership(k, c, cfg.key_top_k).expand(-1, 2, -1)
    mod = masks.focus_mask_mod(cfg.window, cfg.sink_tokens, q_member, k_member)
    assert torch.equal(create_mask(mod, 1, 2, 40, 40, device="cpu"), focus_pattern(q, k, c, cfg))


@pytest.mark.parametrize("top_k", [1, 2], ids=["two calls", "one pass"])
def test_fullgraph_compile_without_recompiles_within_a_bucket(top_k):
    """A Focus layer's flex prefill compiles whole (``fullgraph=True``: no graph break); with the length dynamic,
    lengths within one bucket reuse that graph; dynamo's global limits are left as they were."""
    cfg = FocusConfig(num_groups=4, query_top_k=top_k, key_top_k=top_k, window=16, sink_tokens=2, block_size=32)
    limits = (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit)

    def layer(q, k, v, c, mask):
        return focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel="flex")

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(layer, backend=counter, fullgraph=True)
    q, k, v, c, mask = make(1, 4, 2, 128, 128, pad=5, seed=3)
    for n in (110, 97, 128):  # (first not the bucket size: a cached static graph of size 128 would match it)
        qn, kn, vn = (x[:, :, :n].contiguous() for x in (q, k, v))
        mn = mask[:, :n].contiguous()
        for x, dim in ((qn, 2), (kn, 2), (vn, 2), (mn, 1)):
            torch._dynamo.mark_dynamic(x, dim)
        out = compiled(qn, kn, vn, c, mn)
        assert max_diff(out, reference_attention(qn, kn, vn, c, cfg, attention_mask=mn)) <= 1e-4
    assert counter.frame_count == 1, "a length within the bucket recompiled"
    assert (torch._dynamo.config.recompile_limit, torch._dynamo.config.accumulated_recompile_limit) == limits
