"""The device path's decode: a KV cache paged by group (focus_flex.cache), checked against the dense reference, for
host synchronisations, under torch.compile(fullgraph=True), and in transformers' generate (static cache, compiled)."""

import collections
import contextlib

import pytest
import torch
from test_flex_core import HostSyncs, make, max_diff
from torch._dynamo.testing import CompileCounterWithBackend
from torch._dynamo.utils import counters
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import _disable_current_modes
from transformers import CompileConfig

from focus_flex import FocusAdapter, FocusConfig, attention, focus_attention, native, reference_attention
from focus_flex.cache import FocusCache, FocusDynamicLayer, FocusStaticLayer, cached_attention
from focus_flex.decode import KeyIndex
from focus_flex.plan import route
from focus_flex.pool import GroupPool


def decode_against_reference(cfg, b, hq, hkv, n, prefix, chunks=2, pad=0, hole=False, dtype=torch.float32,
                             seed=0, tol=1e-5):
    """Fill a pool with a prefix (in ``chunks`` appends: a chunked prefill), then decode the remaining tokens one at a
    time; every step's output against the reference over the whole cache. Returns the worst difference."""
    q, k, v, c, mask = make(b, hq, hkv, n, n, d=16, g=cfg.num_groups, dtype=dtype, seed=seed, pad=pad, hole=hole)
    valid = torch.ones(b, n, dtype=torch.bool) if mask is None else mask
    pool = GroupPool(b, hkv, 16, 16, n, cfg, dtype, "cpu")
    for part in torch.arange(prefix).chunk(chunks):
        sl = slice(int(part[0]), int(part[-1]) + 1)
        pool.append(k[:, :, sl], v[:, :, sl], route(k[:, :, sl], c, cfg.key_top_k), valid[:, sl])
    worst = 0.0
    for t in range(prefix, n):
        pos = pool.append(k[:, :, t:t + 1], v[:, :, t:t + 1], route(k[:, :, t:t + 1], c, cfg.key_top_k),
                          valid[:, t:t + 1])
        out = pool.attend(q[:, :, t:t + 1], c, pos[:, 0], 16 ** -0.5)
        ref = reference_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], c, cfg,
                                  attention_mask=valid[:, :t + 1])
        worst = max(worst, max_diff(out, ref))
    assert worst <= tol, f"decode through the pool differs from the reference by {worst}"
    return worst


@pytest.mark.parametrize("case", [
    dict(cfg=FocusConfig(num_groups=4, window=24, sink_tokens=3, block_size=16), b=2, hq=4, hkv=2, n=150,
         prefix=120),
    # several groups per query and per key (a key in two of the query's groups counts once), left padding
    dict(cfg=FocusConfig(num_groups=4, query_top_k=2, key_top_k=3, window=16, sink_tokens=2, block_size=16), b=2,
         hq=6, hkv=2, n=140, prefix=110, pad=7),
    # no sinks, window 1, a hole of padding, more sinks' rows padded than there are sinks
    dict(cfg=FocusConfig(num_groups=8, query_top_k=3, key_top_k=2, window=1, sink_tokens=0, block_size=32), b=3,
         hq=3, hkv=3, n=130, prefix=100, chunks=3, hole=True, pad=45),
    dict(cfg=FocusConfig(num_groups=4, window=20, sink_tokens=4, block_size=16), b=1, hq=4, hkv=1, n=120,
         prefix=96, dtype=torch.bfloat16, tol=2e-2),
], ids=["top1-gqa", "top2-top3-padded", "window1-no-sinks-hole", "bf16-mqa"])
def test_pool_decode_equals_reference(case):
    decode_against_reference(**case)


def test_pool_fills_pages_and_recycles_the_ring():
    """Pages are taken only as groups fill them; a group's list holds its keys in order, each once; the ring keeps the
    last window of positions."""
    cfg = FocusConfig(num_groups=4, key_top_k=2, window=20, sink_tokens=3, block_size=16)
    _, k, v, c, _ = make(1, 2, 2, 200, 200, g=4, seed=5)
    pool = GroupPool(1, 2, 16, 16, 200, cfg, torch.float32, "cpu")
    groups = route(k, c, 2)
    pool.append(k, v, groups, torch.ones(1, 200, dtype=torch.bool))
    counts = torch.zeros(1, 2, 4, dtype=torch.long).scatter_add_(2, groups.flatten(2), torch.ones_like(
        groups.flatten(2)))
    assert torch.equal(pool.counts, counts)
    assert torch.equal(pool.next_page, (-(-counts // 16)).sum(-1))  # no page wasted
    for h in range(2):
        for g in range(4):
            pages = pool.pages[0, h, g, :-(-int(counts[0, h, g]) // 16)]
            slots = (pool.page_start + pages[:, None] * 16 + torch.arange(16)).flatten()[:int(counts[0, h, g])]
            expect = (groups[0, h] == g).any(-1).nonzero()[:, 0]
            assert torch.equal(pool.pos[0, h, slots], expect)
            assert torch.equal(pool.k[0, h, slots], k[0, h, expect])
    ring = pool.pos[0, 0, pool.sink_slots:pool.sink_slots + pool.ring]
    assert sorted(ring.tolist()) == list(range(200 - pool.ring, 200))


class HostReads(TorchFunctionMode):
    """Counts the tensor methods that hand a tensor's data to Python (``tolist``, ``numpy``, ``item``, ``int()``,
    ``bool()``...): on an accelerator each is a device-to-host copy and a wait. On CPU they dispatch no op, so
    :class:`HostSyncs` does not see them; this mode does."""

    READS = {torch.Tensor.tolist, torch.Tensor.numpy, torch.Tensor.item, torch.Tensor.__bool__,
             torch.Tensor.__int__, torch.Tensor.__index__, torch.Tensor.__float__}

    def __init__(self) -> None:
        super().__init__()
        self.ops: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        if func in self.READS:
            self.ops[func.__name__] += 1
        return func(*args, **(kwargs or {}))


def test_host_read_counter_counts():
    """The counter is not vacuous: a decode step of the host-side key index (the CPU path's, and what decode ran off
    the CPU before focus_flex.cache: its PyTorch ops) is seen reading, in the index's update and in the step."""
    cfg = FocusConfig(num_groups=4, window=24, sink_tokens=3, block_size=16)
    q, k, v, c, _ = make(1, 4, 2, 60, 60, g=4, seed=2)
    index = KeyIndex(1, 2, 4, "cpu")
    index.extend(k[:, :, :-1], c, cfg)
    with HostReads() as reads, native.disabled():
        index.extend(k[:, :, -1:], c, cfg)
        focus_attention(q[:, :, -1:], k, v, c, cfg, key_index=index)
    assert reads.ops["tolist"] >= 2, dict(reads.ops)


def test_decode_steps_never_wait_for_the_host(monkeypatch):
    """A flex prefill and decode steps through a dynamic Focus cache layer, and decode steps through a static one:
    not one op that forces a host synchronisation, after warm-up. (The host-side key index of the CPU path, which
    decode used everywhere before, needs several per layer and step.) The flex calls run outside the counting mode:
    each is one fused kernel, and a compiled function cannot run under a dispatch mode."""
    flex = attention._flex

    def opaque_flex(*args, **kwargs):
        with _disable_current_modes():
            return flex(*args, **kwargs)

    monkeypatch.setattr(attention, "_flex", opaque_flex)
    cfg = FocusConfig(num_groups=4, window=24, sink_tokens=3, block_size=16)
    q, k, v, c, _ = make(1, 4, 2, 90, 90, g=4, seed=2)
    for layer in (FocusDynamicLayer(), FocusStaticLayer(max_cache_len=96)):
        for attempt in ("warm-up", "counted"):
            layer.reset()
            counted = attempt == "counted"
            with HostSyncs() if counted else contextlib.nullcontext(HostSyncs()) as syncs, \
                    HostReads() if counted else contextlib.nullcontext(HostReads()) as reads:
                for lo, hi in ((0, 40),) + tuple((t, t + 1) for t in range(40, 46)):
                    if lo == 40 and isinstance(layer, FocusStaticLayer):  # its prefill reads its length once
                        syncs.ops.clear()
                        reads.ops.clear()
                    keys, values = layer.update(k[:, :, lo:hi], v[:, :, lo:hi])
                    out = cached_attention(layer, q[:, :, lo:hi], keys, values, c, cfg, None, None, "flex")
            ref = reference_attention(q[:, :, 40:46], k[:, :, :46], v[:, :, :46], c, cfg)
            assert max_diff(out, ref[:, :, -1:]) <= 1e-5
        assert sum(syncs.ops.values()) + sum(reads.ops.values()) == 0, \
            f"{type(layer).__name__}: {dict(syncs.ops)} {dict(reads.ops)}"


def compiled_decode_steps(layer, cfg, c, q, k, v, steps):
    """Decode steps ``t`` in ``steps`` through ``layer`` (its prefill done), each one call of a function compiled with
    ``fullgraph=True`` (cache update and attention): the outputs ``(t, out)``, once no step recompiled."""

    def step(q1, k1, v1):
        keys, values = layer.update(k1, v1)
        return cached_attention(layer, q1, keys, values, c, cfg, None, None, "flex")

    counter = CompileCounterWithBackend("inductor")
    compiled = torch.compile(step, backend=counter, fullgraph=True)
    outs = [(t, compiled(q[:, :, t:t + 1], k[:, :, t:t + 1], v[:, :, t:t + 1])) for t in steps]
    assert counter.frame_count == 1, "a decode step recompiled"
    return outs


def test_decode_step_compiles_whole_without_recompiling():
    """One decode step of a Focus layer (cache update, routing, the pool's writes, the block mask, the flex call)
    under torch.compile(fullgraph=True): one graph for every step."""
    cfg = FocusConfig(num_groups=4, query_top_k=2, window=24, sink_tokens=3, block_size=16)
    q, k, v, c, _ = make(2, 4, 2, 100, 100, g=4, seed=4)
    layer = FocusStaticLayer(max_cache_len=112)
    keys, values = layer.update(k[:, :, :60], v[:, :, :60])
    cached_attention(layer, q[:, :, :60], keys, values, c, cfg, None, None, "flex")  # the prefill, eager
    for t, out in compiled_decode_steps(layer, cfg, c, q, k, v, range(60, 66)):
        ref = reference_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], c, cfg)
        assert max_diff(out, ref) <= 1e-5


TINY_CFG = FocusConfig(num_groups=4, query_top_k=2, window=8, sink_tokens=2, block_size=16)


@torch.no_grad()
def test_generate_with_static_and_focus_caches_equals_the_dynamic_cache():
    """A tiny Llama: greedy and beam-search generate with cache_implementation='static', with a FocusCache (static
    and dynamic) and with kernel='flex' on the default cache, all equal the CPU path on the default dynamic cache;
    left padding included."""
    from test_adapter import ids, tiny

    model = tiny("llama")
    adapter = FocusAdapter.for_model(model, TINY_CFG, seed=3)
    adapter.attach(model)
    x = ids(2, 40)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    for beams in (1, 2):
        kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False, num_beams=beams)
        expected = model.generate(x, **kw)
        assert torch.equal(model.generate(x, cache_implementation="static", **kw), expected)
        assert torch.equal(model.generate(x, past_key_values=FocusCache(model.config, max_cache_len=64), **kw),
                           expected)
        adapter.kernel = "flex"
        assert torch.equal(model.generate(x, **kw), expected)
        assert torch.equal(model.generate(x, past_key_values=FocusCache(model.config), **kw), expected)
        adapter.kernel = None


@pytest.mark.parametrize("arch", ["gpt2", "gemma3"])
@torch.no_grad()
def test_static_cache_generate_across_architectures(arch):
    """GPT-2 (no rotary encoding, its own attention signature) and Gemma-3 (sliding-window layers beside the Focus
    ones, which keep transformers' own attention) generate the same tokens with the static cache as without."""
    from test_adapter import ids, tiny

    model = tiny(arch)
    FocusAdapter.for_model(model, TINY_CFG, seed=3).attach(model)
    x = ids(2, 40)
    mask = torch.ones_like(x)
    mask[0, :5] = 0
    kw = dict(attention_mask=mask, max_new_tokens=6, do_sample=False)
    assert torch.equal(model.generate(x, cache_implementation="static", **kw), model.generate(x, **kw))


def compiled_static_generate_twice(model, x, kw):
    """Greedy ``generate`` with the static cache and transformers' compiled decode step (fullgraph), twice: each equal
    to the eager generate, no graph break, and the second compiling nothing new. Returns the output."""
    compile_config = CompileConfig(fullgraph=True, mode="default")
    compile_config._compile_all_devices = True  # transformers compiles decode steps on accelerators only otherwise
    expected = model.generate(x, **kw)
    torch._dynamo.reset()
    counters.clear()
    graphs = []
    for _ in range(2):
        out = model.generate(x, cache_implementation="static", compile_config=compile_config, **kw)
        assert torch.equal(out, expected)
        graphs.append(counters["stats"]["unique_graphs"])
    assert not counters["graph_break"], dict(counters["graph_break"])
    assert graphs[0] > 0 and graphs[1] == graphs[0], "the second generate compiled again"
    return out


@pytest.mark.slow
@torch.no_grad()
def test_real_smollm2_static_cache_compiled_generate_equals_recomputing_the_prefix():
    """SmolLM2-135M-Instruct with the published adapter: generate with the static cache and transformers' compiled
    decode step (fullgraph) gives the same tokens as the eager CPU path, and as recomputing each prefix with the
    dense reference; a second generate compiles nothing new."""
    from focus_flex.models import load_model

    model, tok = load_model()
    adapter = FocusAdapter.from_pretrained("hub/smollm2-135m-instruct-focus")
    adapter.config.window = 64  # far attention within a short prompt
    adapter.attach(model)
    prompt = tok("The three laws of the house were written on the kitchen door. " * 12, return_tensors="pt")
    x = prompt.input_ids[:, :120]
    kw = dict(max_new_tokens=6, do_sample=False)
    out = compiled_static_generate_twice(model, x, kw)
    adapter.mode = "reference"
    logits = model(out[:, :-1]).logits
    assert torch.equal(logits[0, x.shape[1] - 1:].argmax(-1), out[0, x.shape[1]:])
