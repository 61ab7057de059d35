"""``FocusConfig.dense_decode``: Focus for the prefill, full attention for decode steps (forwards of at most
``DECODE_MAX_QUERIES`` queries). Every path is checked against plain causal attention built here, independently of
the library's pattern, and against the reference."""

import contextlib

import pytest
import torch
import torch.nn.functional as F
from test_cache import HostReads, compiled_decode_steps
from test_flex_core import HostSyncs, make, max_diff

from focus_flex import FocusAdapter, FocusConfig, focus_attention, reference_attention
from focus_flex.attention import focus_pattern
from focus_flex.cache import FocusDynamicLayer, FocusStaticLayer, cached_attention
from focus_flex.config import DECODE_MAX_QUERIES
from focus_flex.decode import KeyIndex
from focus_flex.evaluate import window_only

CFG = FocusConfig(num_groups=4, window=8, sink_tokens=2, block_size=16, dense_decode=True)


def causal(q, k, v, valid):
    """Plain causal attention of the last Lq queries over all Lk keys, padding masked; padded query rows zero."""
    lq, lk = q.shape[2], k.shape[2]
    valid = torch.ones(k.shape[0], lk, dtype=torch.bool) if valid is None else valid
    i, j = torch.arange(lk - lq, lk)[:, None], torch.arange(lk)[None, :]
    mask = ((j <= i)[None] & valid[:, None, :] & valid[:, lk - lq:, None])[:, None]
    out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=True)
    return out.masked_fill(~mask.any(-1, keepdim=True), 0.0), mask


@pytest.mark.parametrize("lq", [1, 5, DECODE_MAX_QUERIES])
def test_decode_pattern_is_causal_attention_and_prefill_pattern_is_focus(lq):
    q, k, v, c, mask = make(2, 4, 2, 100, 100, g=4, seed=1, pad=6)
    sparse = FocusConfig(**{**CFG.to_dict(), "dense_decode": False})
    expected = causal(q[:, :, -lq:], k, v, mask)[1].expand(-1, 4, -1, -1)
    got = focus_pattern(q[:, :, -lq:], k, c, CFG, attention_mask=mask)
    assert torch.equal(got, expected)
    assert not torch.equal(focus_pattern(q[:, :, -lq:], k, c, sparse, attention_mask=mask), expected)
    lq = DECODE_MAX_QUERIES + 1  # more queries: a (chunked) prefill, Focus as without the switch
    assert torch.equal(focus_pattern(q[:, :, -lq:], k, c, CFG, attention_mask=mask),
                       focus_pattern(q[:, :, -lq:], k, c, sparse, attention_mask=mask))


@pytest.mark.parametrize("path", ["default", "flex", "key-index"])
@pytest.mark.parametrize("lq", [1, 3, DECODE_MAX_QUERIES])
def test_fast_path_decode_is_causal_attention(path, lq):
    pad = 0 if path == "key-index" else 7  # the key index serves unpadded caches
    q, k, v, c, mask = make(2, 6, 2, 120, 120, g=4, seed=2, pad=pad)
    q = q[:, :, -lq:]
    index = None
    if path == "key-index":
        index = KeyIndex(2, 2, 4, "cpu")
        index.extend(k, c, CFG)
    out = focus_attention(q, k, v, c, CFG, attention_mask=mask, key_index=index,
                          kernel="flex" if path == "flex" else None)
    expected = causal(q, k, v, mask)[0]
    assert max_diff(out, expected) <= 1e-5
    assert max_diff(reference_attention(q, k, v, c, CFG, attention_mask=mask), expected) <= 1e-5


def test_gradients_of_a_dense_decode_step_are_causal_attentions():
    q, k, v, c, _ = make(1, 4, 2, 1, 80, g=4, seed=3)
    grads = []
    for fn in (lambda q, k, v: focus_attention(q, k, v, c, CFG), lambda q, k, v: causal(q, k, v, None)[0]):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*x).square().sum().backward()
        grads.append([t.grad for t in x])
    for a, b in zip(*grads, strict=True):
        assert max_diff(a, b) <= 1e-5


@pytest.mark.parametrize("layer_type", [FocusDynamicLayer, FocusStaticLayer])
def test_cache_layers_decode_without_a_pool_and_without_host_syncs(layer_type):
    """A prefill then decode steps of 1 and 3 queries through a Focus cache layer: each step equals causal attention
    over the cache, no group pool is built, and after warm-up no op waits for the host. Turning the switch off
    mid-generation rebuilds the pool from the cache: the next Focus step equals the reference."""
    q, k, v, c, _ = make(1, 4, 2, 70, 70, g=4, seed=4)
    sparse = FocusConfig(**{**CFG.to_dict(), "dense_decode": False})
    layer = layer_type() if layer_type is FocusDynamicLayer else layer_type(max_cache_len=80)
    steps = ((0, 40),) + tuple((t, t + 1) for t in range(40, 46)) + ((46, 49),)
    for attempt in ("warm-up", "counted"):
        layer.reset()
        counted = attempt == "counted"
        outs = []
        with HostSyncs() if counted else contextlib.nullcontext(HostSyncs()) as syncs, \
                HostReads() if counted else contextlib.nullcontext(HostReads()) as reads:
            for lo, hi in steps:
                if lo == 40:  # the prefill may read the cache's length
                    syncs.ops.clear()
                    reads.ops.clear()
                keys, values = layer.update(k[:, :, lo:hi], v[:, :, lo:hi])
                outs.append(cached_attention(layer, q[:, :, lo:hi], keys, values, c, CFG, None, None, None))
        for (lo, hi), out in zip(steps[1:], outs[1:], strict=True):
            assert max_diff(out, causal(q[:, :, lo:hi], k[:, :, :hi], v[:, :, :hi], None)[0]) <= 1e-5
        assert layer.pool is None
        assert sum(syncs.ops.values()) + sum(reads.ops.values()) == 0, f"{dict(syncs.ops)} {dict(reads.ops)}"
    keys, values = layer.update(k[:, :, 49:50], v[:, :, 49:50])
    out = cached_attention(layer, q[:, :, 49:50], keys, values, c, sparse, None, None, None)
    ref = reference_attention(q[:, :, 49:50], k[:, :, :50], v[:, :, :50], c, sparse)
    assert max_diff(out, ref) <= 1e-5
    assert max_diff(out, causal(q[:, :, 49:50], k[:, :, :50], v[:, :, :50], None)[0]) > 1e-3  # Focus again


def test_static_decode_step_compiles_whole_without_recompiling():
    q, k, v, c, _ = make(2, 4, 2, 70, 70, g=4, seed=5)
    layer = FocusStaticLayer(max_cache_len=80)
    keys, values = layer.update(k[:, :, :60], v[:, :, :60])
    cached_attention(layer, q[:, :, :60], keys, values, c, CFG, None, None, "flex")
    for t, out in compiled_decode_steps(layer, CFG, c, q, k, v, range(60, 66)):
        assert max_diff(out, causal(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], None)[0]) <= 1e-5


def generate_on_every_cache(cfg: FocusConfig, new_tokens: int):
    """A tiny Llama with ``cfg`` attached and a left-padded batch: greedy generate on the CPU path, the static cache
    and a flex-kernel FocusCache, each checked equal to the reference path's (sequences, logits within 1e-4).
    Returns ``(model, adapter, x, generate kwargs, the reference's output)``, the adapter back on the CPU path."""
    from test_adapter import ids, tiny

    from focus_flex.cache import FocusCache

    model = tiny("llama")
    adapter = FocusAdapter.for_model(model, cfg, seed=3)
    adapter.attach(model)
    x = ids(2, 40)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=new_tokens, do_sample=False, output_logits=True,
              return_dict_in_generate=True)
    adapter.mode = "reference"
    expected = model.generate(x, **kw)
    adapter.mode = "fast"
    for kernel, extra in ((None, {}), (None, {"cache_implementation": "static"}),
                          ("flex", {"past_key_values": FocusCache(model.config, max_cache_len=64)})):
        adapter.kernel = kernel
        got = model.generate(x, **extra, **kw)
        assert torch.equal(got.sequences, expected.sequences)
        assert max(max_diff(a, b) for a, b in zip(got.logits, expected.logits, strict=True)) <= 1e-4
    adapter.kernel = None
    return model, adapter, x, kw, expected


@torch.no_grad()
def test_generate_with_every_cache_equals_the_reference_and_differs_from_focus_decode():
    """Greedy generate under dense decode equals the reference path's on every cache; the decode steps' logits are
    those of full attention over the Focus prefill's cache, not those of Focus decode."""
    model, adapter, x, kw, expected = generate_on_every_cache(
        FocusConfig(num_groups=4, window=8, sink_tokens=2, block_size=16, dense_decode=True), 6)
    adapter.config.dense_decode = False
    sparse = model.generate(x, **kw)
    assert max_diff(sparse.logits[1], expected.logits[1]) > 1e-3


@torch.no_grad()
def test_window_only_baseline_decodes_densely_when_asked():
    """window_only(dense_decode=True): its prefill is the window's, its decode steps full attention over that cache
    (what the passkey evaluation compares Focus with)."""
    from test_adapter import ids, tiny

    model = tiny("llama")
    x = ids(1, 60)
    logits = {}
    for dense in (False, True):
        with window_only(model, 8, 2, dense_decode=dense):
            out = model(x[:, :-1], use_cache=True)
            logits[dense] = model(x[:, -1:], past_key_values=out.past_key_values).logits
    with window_only(model, 8, 2):
        out = model(x[:, :-1], use_cache=True)
    full_step = model(x[:, -1:], past_key_values=out.past_key_values).logits
    assert max_diff(logits[True], full_step) <= 1e-5
    assert max_diff(logits[False], full_step) > 1e-3


def test_config_switch_round_trips_and_is_checked(tmp_path):
    CFG.save_pretrained(tmp_path)
    assert FocusConfig.from_pretrained(tmp_path).dense_decode is True
    with pytest.raises(ValueError, match="dense_decode=1 must be true or false"):
        FocusConfig(dense_decode=1)
