"""The fast path and the soft path against the one definition of Focus (`reference_attention`)."""

import functools
import itertools
import subprocess
import sys
import warnings

import numpy as np
import pytest
import torch
import torch.nn.functional as F

from focus_flex import FocusConfig, flash, focus_attention, native, reference_attention, routing, soft_attention
from focus_flex.attention import bucket, causal_blocks, default_kernel, focus_pattern, plan_attention
from focus_flex.decode import KeyIndex


def make(b, hq, hkv, lq, lk, d=16, g=4, dtype=torch.float32, seed=0, pad=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, lq, d, generator=gen).to(dtype)
    k = torch.randn(b, hkv, lk, d, generator=gen).to(dtype)
    v = torch.randn(b, hkv, lk, d, generator=gen).to(dtype)
    c = torch.randn(hkv, g, d, generator=gen)
    mask = None
    if pad:
        mask = torch.ones(b, lk, dtype=torch.bool)
        mask[0, :pad] = False  # left padding in the first row
        if b > 1:
            mask[-1, lk - 3:] = False  # right padding in the last row
    return q, k, v, c, mask


def max_diff(a, b):
    return (a.float() - b.float()).abs().max().item()


CASES = [
    # (B, Hq, Hkv, Lq, Lk, top-k q, top-k k, window, sinks, pad)
    (1, 2, 1, 100, 100, 1, 1, 32, 4, 0),  # GQA, L not a multiple of the block
    (2, 4, 2, 77, 77, 1, 1, 16, 2, 13),  # batch with left and right padding
    (2, 4, 2, 90, 90, 2, 1, 16, 0, 0),  # top-2 queries, no sinks
    (1, 2, 2, 120, 120, 3, 2, 8, 3, 0),  # top-3 / top-2: pairs must not be counted twice
    (2, 2, 1, 60, 60, 2, 2, 500, 1, 5),  # window larger than L
    (2, 4, 2, 40, 100, 1, 1, 16, 2, 9),  # chunked prefill: 40 new queries on a 100-token cache
    (2, 4, 2, 1, 90, 2, 1, 16, 3, 5),  # decode: one query on a KV cache
    (1, 4, 1, 3, 70, 1, 2, 4, 0, 0),  # a few queries (gather path), MQA
]


KERNELS = ["flex", "flash", "flash-torch"]


def use_kernel(name, monkeypatch):
    """The ``kernel=`` argument for a test of kernel ``name``: compiled flex, the flash kernel in C (which must build
    here), or ``flash-torch``, the chunks of PyTorch's flash attention that replace it where it cannot run."""
    if name == "flash":
        assert native.library() is not None, "the C kernels did not build"
    if name == "flash-torch":
        monkeypatch.setattr(native, "prefill_applies", lambda *args: False)
        return "flash"
    return name


@pytest.fixture(params=KERNELS)
def kernel(request, monkeypatch):
    return use_kernel(request.param, monkeypatch)


@pytest.fixture(params=["flash", "flash-torch"])
def flash_kernel(request, monkeypatch):
    return use_kernel(request.param, monkeypatch)


@pytest.mark.parametrize("case", CASES, ids=[str(c) for c in CASES])
def test_fast_path_matches_reference_fp32(case, kernel):
    b, hq, hkv, lq, lk, kq, kk, w, s, pad = case
    cfg = FocusConfig(num_groups=4, query_top_k=kq, key_top_k=kk, window=w, sink_tokens=s, block_size=32)
    q, k, v, c, mask = make(b, hq, hkv, lq, lk, pad=pad)
    ref = reference_attention(q, k, v, c, cfg, attention_mask=mask)
    if kernel == "flash" and kq > 1 and kk > 1 and not native.prefill_applies(q, k, v):  # only the C kernel and flex
        # count a pair that shares two groups once
        with pytest.raises(ValueError, match="kernel='flex'"):
            focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel=kernel)
        return
    out = focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel=kernel)
    assert out.shape == q.shape and out.dtype == q.dtype
    assert max_diff(out, ref) <= 1e-4
    if pad:  # padded query rows are zeros
        real_q = mask[:, lk - lq:][:, None, :, None].expand_as(out)
        assert out[~real_q].abs().sum() == 0 and out[real_q].abs().sum() > 0
    # Gradients to q, k, v (the kernels' log-sum-exps carry none; the backward is the reference's): exact.
    inputs = [t.clone().requires_grad_() for t in (q, k, v)]
    grad = torch.randn(out.shape, generator=torch.Generator().manual_seed(1))
    with_grad = focus_attention(*inputs, c, cfg, attention_mask=mask, kernel=kernel)
    assert torch.equal(with_grad.detach(), out)
    got = torch.autograd.grad(with_grad, inputs, grad)
    want = torch.autograd.grad(reference_attention(*inputs, c, cfg, attention_mask=mask), inputs, grad)
    assert all(max_diff(a, b) <= 1e-5 for a, b in zip(got, want, strict=True))


def test_fast_path_matches_reference_bf16(kernel):
    cfg = FocusConfig(num_groups=4, query_top_k=2, window=16, sink_tokens=2, block_size=32)
    q, k, v, c, mask = make(2, 4, 2, 77, 77, dtype=torch.bfloat16, pad=13)
    ref = reference_attention(q.float(), k.float(), v.float(), c, cfg, attention_mask=mask)
    out = focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel=kernel)
    assert out.dtype == torch.bfloat16
    assert max_diff(out, ref) <= 2e-2


FLASH_CASES = [
    # (B, Hq, Hkv, Lq, Lk, top-k q, top-k k, window, sinks, pad, groups)
    (2, 6, 2, 700, 700, 1, 1, 40, 4, 37, 8),  # many local and far chunks, left and right padding
    (1, 3, 1, 300, 650, 2, 1, 64, 3, 0, 4),  # chunked prefill, a query in two groups
    (1, 2, 1, 600, 600, 1, 3, 256, 4, 0, 8),  # a key in three groups, SmolLM2's window
    (1, 2, 2, 500, 500, 1, 1, 7, 0, 0, 16),  # no sinks, a window smaller than a chunk
    (2, 4, 2, 600, 600, 2, 4, 64, 4, 21, 8),  # pairs sharing two groups (the C kernel only), padding
]


@pytest.mark.parametrize("chunks", [(16, 8, 3, 20), (128, 256, 512, 4096)], ids=["tiny chunks", "large chunks"])
@pytest.mark.parametrize("case", FLASH_CASES, ids=[str(c) for c in FLASH_CASES])
def test_flash_kernel_over_many_chunks(case, chunks, flash_kernel, monkeypatch):
    """The flash kernel's tiles (the C kernel's: its sizes are fixed) and chunks (the PyTorch parts': first chunks
    near the sinks, staircase tails of far chunks, blocks of far copies merged at a time) are exact."""
    for name, value in zip(("LOCAL_CHUNK", "FAR_CHUNK", "FAR_TAIL", "FAR_BLOCK"), chunks, strict=True):
        monkeypatch.setattr(flash, name, value)
    b, hq, hkv, lq, lk, kq, kk, w, s, pad, g = case
    cfg = FocusConfig(num_groups=g, query_top_k=kq, key_top_k=kk, window=w, sink_tokens=s)
    q, k, v, c, mask = make(b, hq, hkv, lq, lk, g=g, pad=pad, seed=1)
    ref = reference_attention(q, k, v, c, cfg, attention_mask=mask)
    if kq > 1 and kk > 1 and not native.prefill_applies(q, k, v):
        with pytest.raises(ValueError, match="C kernel, which does not take these inputs"):
            focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel="flash")
        return
    assert max_diff(focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel="flash"), ref) <= 1e-4
    out = focus_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), c, cfg, kernel="flash")
    ref = reference_attention(q.bfloat16().float(), k.bfloat16().float(), v.bfloat16().float(), c, cfg)
    assert out.dtype == torch.bfloat16 and max_diff(out, ref) <= 2e-2


def test_groups_nobody_routes_to(kernel):
    """Every query and key points away from centroids 2 and 5: empty groups, the last one among them, must not trip
    the plans."""
    cfg = FocusConfig(num_groups=6, window=8, sink_tokens=2)
    gen = torch.Generator().manual_seed(4)
    q, k, v = (torch.randn(1, h, 300, 16, generator=gen) for h in (4, 2, 2))
    q[..., 0], k[..., 0] = -10.0, -10.0
    c = torch.randn(2, 6, 16, generator=gen)
    c[..., 0] = 0.0
    c[:, 2], c[:, 5] = torch.eye(16)[0], torch.eye(16)[0]
    used = routing.hard_groups(torch.cat([q, k.repeat(1, 2, 1, 1)], 2), c, 1).unique().tolist()
    assert used == [0, 1, 3, 4]
    out = focus_attention(q, k, v, c, cfg, kernel=kernel)
    assert max_diff(out, reference_attention(q, k, v, c, cfg)) <= 1e-4


def test_flash_far_chunks_bound_the_staircase_where_keys_crowd_one_group(flash_kernel):
    """Real routing can send most keys but few queries to one group: a far chunk of FAR_CHUNK rows would then see
    thousands of keys under its staircase mask (at 16K tokens a 231 MB mask template, most of it masked). Chunks are
    cut so that no tail is wider than FAR_TAIL; the result stays exact."""
    cfg = FocusConfig(num_groups=4, window=32, sink_tokens=2)
    gen = torch.Generator().manual_seed(5)
    n, d = 3000, 16
    q, k, v = (torch.randn(1, h, n, d, generator=gen) for h in (2, 1, 1))
    c = torch.randn(1, 4, d, generator=gen)
    c[..., 0], c[0, 0] = 0.0, torch.eye(d)[0]
    k[..., 0] += 20.0  # nearly every key in group 0 ...
    q[..., 0] -= 20.0
    q[:, :, ::25, 0] += 40.0  # ... but only every 25th query: 1 row per 25 new keys
    qg, kg = routing.hard_groups(q, c, 1), routing.hard_groups(k, c, 1)
    assert (kg == 0).float().mean() > 0.95 and (qg == 0).float().mean() < 0.05
    plan = flash.far_plan(qg[0], kg[0, 0], 0, cfg)
    hi = plan.hi.numpy()
    a, b = flash._after(hi, plan.lo[0].item(), 0, plan.bounds[1]), plan.bounds[1]
    chunks = flash._far_chunks(hi, a, b)
    assert chunks[0][0] == a and chunks[-1][1] == b  # the chunks tile the group's copies with far keys
    assert all(x[1] == y[0] for x, y in zip(chunks, chunks[1:], strict=False))
    assert max(hi[r1 - 1] - hi[r0] for r0, r1 in chunks) <= flash.FAR_TAIL < hi[b - 1] - hi[a]
    assert len(chunks) > 1 and max(r1 - r0 for r0, r1 in chunks) < flash.FAR_CHUNK  # cut by the tail, not the rows
    assert max_diff(focus_attention(q, k, v, c, cfg, kernel="flash"), reference_attention(q, k, v, c, cfg)) <= 1e-4


@pytest.mark.parametrize("key_top_k", [1, 3])
def test_flash_kernel_routes_as_the_reference_under_exact_ties(key_top_k, flash_kernel):
    """Two identical centroids tie every score between them exactly. Where PyTorch computes the scores (queries whose
    head dim is strided, keys in 3 groups), their last bits can depend on the shape routed at once, so the flash
    kernel must route the whole tensors as the reference does, not one head at a time."""
    cfg = FocusConfig(num_groups=8, key_top_k=key_top_k, window=16, sink_tokens=2)
    gen = torch.Generator().manual_seed(7)
    c = torch.randn(3, 8, 64, generator=gen)
    c[:, 3] = c[:, 0]
    q = torch.randn(2, 6, 200, 128, generator=gen)[..., ::2]
    k, v = (torch.randn(2, 3, 200, 64, generator=gen) for _ in range(2))
    mask = torch.ones(2, 200, dtype=torch.bool)
    mask[1, :30] = False
    out = focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel="flash")
    assert max_diff(out, reference_attention(q, k, v, c, cfg, attention_mask=mask)) <= 1e-4


def test_flash_kernel_takes_strided_inputs(flash_kernel):
    """transformers hands attention ``[B, L, H, D]`` projections transposed to ``[B, H, L, D]`` (not contiguous)."""
    cfg = FocusConfig(num_groups=4, window=16, sink_tokens=2)
    gen = torch.Generator().manual_seed(2)
    q = torch.randn(1, 256, 4, 16, generator=gen).transpose(1, 2)
    k, v = (torch.randn(1, 256, 2, 16, generator=gen).transpose(1, 2) for _ in range(2))
    c = torch.randn(2, 4, 16, generator=gen)
    assert not q.is_contiguous()
    out = focus_attention(q, k, v, c, cfg, kernel="flash")
    assert max_diff(out, reference_attention(q, k, v, c, cfg)) <= 1e-4
    assert out.transpose(1, 2).is_contiguous()  # q's layout, as SDPA's output: transformers' transpose back is free
    for q in (torch.randn(1, 4, 256, 32, generator=gen)[..., ::2],  # rows of head dim 16 that are not contiguous
              torch.randn(16, 256, 4, 1, generator=gen).permute(3, 2, 1, 0)):  # dense, but head dim outermost
        assert max_diff(focus_attention(q, k, v, c, cfg, kernel="flash"), reference_attention(q, k, v, c, cfg)) <= 1e-4


DECODE_CASES = [
    # (B, Hq, Hkv, top-k q, top-k k, window, sinks, groups)
    (1, 9, 3, 1, 1, 16, 4, 8),  # SmolLM2's GQA 9/3
    (2, 4, 2, 2, 1, 8, 0, 4),  # batch 2, top-2 queries, no sinks
    (1, 2, 2, 3, 2, 8, 3, 4),  # top-3 / top-2: a far key in several groups counts once
    (2, 4, 1, 2, 2, 500, 1, 4),  # window larger than the cache, MQA
    (1, 4, 4, 1, 1, 1, 0, 16),  # window 1: a query sees itself and its group only
    (2, 6, 3, 1, 2, 8, 2, 4),  # top-1 queries, top-2 keys: a key in two lists, each row reads one
    (1, 4, 2, 1, 1, 500, 2, 4),  # top-1, window larger than the cache: no far keys at all
    (1, 2, 1, 1, 1, 8, 2, 40),  # 40 groups: 64-bit group masks
    (1, 3, 1, 1, 4, 8, 2, 63),  # the published adapter's routing: 63 groups (the top bit), keys in 4
]


def decode_steps(b, hq, hkv, cfg, dtype=torch.float32, n=150, prefix=37):
    """A decode loop on a growing KV cache (steps of 1 to 16 queries): yields (q, k, v, index) at every step."""
    gen = torch.Generator().manual_seed(0)
    c = torch.randn(hkv, cfg.num_groups, 16, generator=gen)
    q, k, v = (torch.randn(b, h, n, 16, generator=gen).to(dtype) for h in (hq, hkv, hkv))
    index = KeyIndex(b, hkv, cfg.num_groups, "cpu")
    index.extend(k[:, :, :prefix], c, cfg)
    end, sizes = prefix, [1, 3, 1, 16, 1, 2]
    while end < n:
        start, end = end, min(n, end + sizes[end % len(sizes)])
        index.extend(k[:, :, start:end], c, cfg)
        yield c, q[:, :, start:end], k[:, :, :end], v[:, :, :end], index


@pytest.mark.parametrize("case", DECODE_CASES, ids=[str(c) for c in DECODE_CASES])
def test_indexed_decode_matches_reference_over_many_steps(case, monkeypatch, decode_path):
    from focus_flex import attention, decode

    b, hq, hkv, kq, kk, w, s, g = case
    cfg = FocusConfig(num_groups=g, query_top_k=kq, key_top_k=kk, window=w, sink_tokens=s)
    monkeypatch.setattr(attention, "_few_queries_attention", None)  # the O(Lk) path must not run
    monkeypatch.setattr(decode, "APPEND_CHUNK", 5)  # longer extensions go in several chunks
    steps = 0
    for c, q, k, v, index in decode_steps(b, hq, hkv, cfg):
        out = focus_attention(q, k, v, c, cfg, key_index=index)
        assert max_diff(out, reference_attention(q, k, v, c, cfg)) <= 1e-4
        steps += 1
    assert steps > 20
    # The index holds every key's routing, and each group's list holds exactly its keys in order.
    member = routing.hard_membership(k, c, kk)
    assert torch.equal(index.member.long(), member)
    for g_ in range(g):
        for i in range(b):
            for h in range(hkv):
                keys = ((member[i, h] >> g_) & 1).nonzero()[:, 0]
                assert (index.keys(i, h, g_) == keys.numpy()).all()


def fresh_copy(index):
    """The same lists without the bitmasks kept so far."""
    copy = KeyIndex(*index.shape[:2], index.num_groups, "cpu")
    copy.__dict__.update({**index.__dict__, "_member": None})
    return copy


def test_key_index_lists_grow_geometrically_in_one_pool():
    """Keys appended one at a time and in chunks, their groups drifting (a group empty at first takes most keys later):
    every list stays exactly its keys in order across pool rebuilds, rebuilds come geometrically rarer, and the pool
    is the entries in use plus an eighth plus the per-list slack, not padded to the largest list. Group bitmasks, once
    asked for, follow every append."""
    from focus_flex import decode

    b, h, g, k = 2, 3, 8, 2
    gen = torch.Generator().manual_seed(0)
    index, truth, rebuilds, n, asked = KeyIndex(b, h, g, "cpu"), {}, 0, 0, None
    while n < 6000:
        size = 1 if n % 1000 < 900 else 37  # mostly decode steps, some chunks
        weights = torch.ones(g)
        weights[n * g // 6000] = 40.0  # one group in favour at a time, group 0 first, group 7 last
        groups = torch.multinomial(weights.expand(b * h * size, g), k, generator=gen).reshape(b, h, size, k)
        pool = index.pool
        index.append(groups)
        rebuilds += index.pool is not pool
        for (i, j, t, x) in itertools.product(range(b), range(h), range(size), range(k)):
            truth.setdefault((i, j, int(groups[i, j, t, x])), []).append(n + t)
        n += size
        if n >= 3000 and asked is None:
            asked = index.member  # a padded batch asks: from now on the bitmasks follow every append
        if n % 500 < size:
            assert all((index.keys(*at) == np.array(truth.get(at, []))).all() for at in np.ndindex(b, h, g))
    assert index.shape == (b, h, n) and int(index.counts.sum()) == b * h * n * k
    assert 10 <= rebuilds <= 60, rebuilds  # ~log(n) per list; one per append to a full list would be thousands
    assert index.pool.size <= index.counts.sum() * 9 / 8 + decode.SLACK * b * h * g
    expected = torch.zeros(b, h, n, dtype=torch.int64)
    for (i, j, group), keys in truth.items():
        expected[i, j, keys] |= 1 << group
    assert torch.equal(index.member.long(), expected)  # built from the lists at 3,000 keys, then kept up to date
    assert torch.equal(fresh_copy(index).member.long(), expected)  # built from the lists at the end


def test_decode_reads_on_outer_threads_and_restores_them(monkeypatch, decode_path):
    """Decode runs its small ops on one thread but reads the cache (the C step; or gathers, sampled matmul, bag sums)
    on the caller's threads, and leaves the count as it was. The key routing is read off the index's lists on the host:
    no tensor gathers of it."""
    from focus_flex import decode, native, threads

    cfg = FocusConfig(num_groups=4, window=8, sink_tokens=2)
    seen = []
    spied = [(native, "decode_step"), (decode.torch.Tensor, "index_select"), (decode.torch.sparse, "sampled_addmm"),
             (decode.F, "embedding_bag")]
    for owner, name in spied:
        original = getattr(owner, name)

        def spy(*a, _f=original, _n=name, **k):
            seen.append((_n, a[0].is_floating_point(), a[-1] if _n == "decode_step" else torch.get_num_threads()))
            return _f(*a, **k)
        monkeypatch.setattr(owner, name, spy)
    old, steps = torch.get_num_threads(), 0
    torch.set_num_threads(2)
    try:
        for c, q, k, v, index in decode_steps(1, 4, 2, cfg, n=60):
            out = focus_attention(q, k, v, c, cfg, key_index=index)
            assert torch.get_num_threads() == 2 and threads.outer() == 2
            assert max_diff(out, reference_attention(q, k, v, c, cfg)) <= 1e-4
            steps += 1
    finally:
        torch.set_num_threads(old)
    # Every read of keys or values on the caller's 2 threads, but the C step's: a step this small runs on one.
    one_query = {"decode_step"} if decode_path == "native" else {"sampled_addmm", "embedding_bag"}
    assert {name for name, _, _ in seen} == {"index_select"} | one_query  # (several queries: gathers)
    assert {n for name, _, n in seen} == {1 if name == "decode_step" else 2 for name, _, _ in seen}
    assert all(data for name, data, _ in seen if name == "index_select")  # keys and values, never group bits
    assert len(seen) >= steps


def test_decode_step_warns_nothing():
    """A fresh process, warnings as errors: the first one-query decode step (a sparse sampling pattern, which PyTorch
    calls beta once per process) shows the user no warning."""
    code = """if True:
        import warnings
        import torch
        from focus_flex import FocusConfig
        from focus_flex.attention import focus_attention
        from focus_flex.decode import KeyIndex
        cfg = FocusConfig(num_groups=4, window=8, sink_tokens=2)
        q, c = torch.randn(1, 4, 1, 16), torch.randn(2, 4, 16)
        k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
        index = KeyIndex(1, 2, 4, "cpu")
        warnings.simplefilter("error")
        index.extend(k, c, cfg)
        print(focus_attention(q, k, v, c, cfg, key_index=index).shape)
    """
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert done.returncode == 0 and done.stdout.strip() == "torch.Size([1, 4, 1, 16])", done.stderr[-2000:]


def test_indexed_decode_reads_any_cache_layout(decode_path):
    """One-query steps read k/v through one flat view of their rows: a cache sliced from a larger buffer (gaps between
    heads, the decode loop's layout), or a [B, L, H, D] buffer seen as [B, H, L, D] (rows not D apart: copied)."""
    cfg = FocusConfig(num_groups=4, window=8, sink_tokens=2)
    steps = 0
    for c, q, k, v, index in decode_steps(2, 6, 3, cfg, n=100):
        ref = reference_attention(q, k, v, c, cfg)
        kt, vt = (x.transpose(1, 2).contiguous().transpose(1, 2) for x in (k, v))
        assert kt.stride(2) != kt.shape[3]
        for kk, vv in ((k, v), (kt, vt), (k, vt)):
            assert max_diff(focus_attention(q, kk, vv, c, cfg, key_index=index), ref) <= 1e-4
        steps += q.shape[2] == 1 and k.stride(1) > k.shape[2] * k.shape[3]  # one query, gaps between heads
    assert steps > 5


@pytest.mark.parametrize("query_top_k", [1, 2])
def test_indexed_decode_bf16_and_padding_fallback(query_top_k, decode_path):
    cfg = FocusConfig(num_groups=4, query_top_k=query_top_k, window=8, sink_tokens=2)
    for c, q, k, v, index in decode_steps(2, 4, 2, cfg, dtype=torch.bfloat16, n=80):
        ref = reference_attention(q.float(), k.float(), v.float(), c, cfg)
        assert max_diff(focus_attention(q, k, v, c, cfg, key_index=index), ref) <= 2e-2
    mask = torch.ones(2, k.shape[2], dtype=torch.bool)
    mask[0, :5] = False  # padding: positions are no longer cache indices, the general path takes over
    q, k, v = q.float(), k.float(), v.float()
    out = focus_attention(q, k, v, c, cfg, attention_mask=mask, key_index=index)
    assert max_diff(out, reference_attention(q, k, v, c, cfg, attention_mask=mask)) <= 1e-4
    with pytest.raises(ValueError, match="key_index"):
        focus_attention(q, k[:, :, :-1], v[:, :, :-1], c, cfg, key_index=index)


def test_groups_actually_matter():
    """The reference is not trivially full attention: far pairs are dropped and groups bring some back."""
    cfg = FocusConfig(num_groups=4, window=8, sink_tokens=1, block_size=32)
    q, k, v, c, _ = make(1, 2, 1, 96, 96)
    pat = focus_pattern(q, k, c, cfg)
    causal = torch.ones(96, 96, dtype=torch.bool).tril()
    near = causal & ~torch.ones(96, 96, dtype=torch.bool).tril(-8)
    assert pat.sum() < causal.sum() and pat.sum() > (near | (torch.arange(96) < 1)).sum() * 2
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert max_diff(reference_attention(q, k, v, c, cfg), full) > 1e-2


@pytest.mark.parametrize("path", ["reference", *KERNELS])
def test_window_covering_sequence_is_full_causal_attention(path, monkeypatch):
    cfg = FocusConfig(num_groups=4, window=128, sink_tokens=0, block_size=32)
    q, k, v, c, _ = make(2, 4, 2, 100, 100)
    fn = reference_attention if path == "reference" else functools.partial(
        focus_attention, kernel=use_kernel(path, monkeypatch))
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert max_diff(fn(q, k, v, c, cfg), full) <= 1e-5


@pytest.mark.parametrize("path", [*KERNELS, "soft"])
def test_causality(path, monkeypatch):
    """Changing tokens after position t never changes outputs at positions <= t."""
    cfg = FocusConfig(num_groups=4, query_top_k=2, window=8, sink_tokens=2, block_size=32)
    q, k, v, c, _ = make(1, 4, 2, 96, 96)
    fn = soft_attention if path == "soft" else functools.partial(focus_attention, kernel=use_kernel(path, monkeypatch))
    before = fn(q, k, v, c, cfg)
    t = 50
    q2, k2, v2 = q.clone(), k.clone(), v.clone()
    q2[:, :, t + 1:] = torch.randn_like(q2[:, :, t + 1:]) * 3
    k2[:, :, t + 1:] = torch.randn_like(k2[:, :, t + 1:]) * 3
    v2[:, :, t + 1:] = torch.randn_like(v2[:, :, t + 1:]) * 3
    after = fn(q2, k2, v2, c, cfg)
    assert torch.equal(before[:, :, : t + 1], after[:, :, : t + 1]) or max_diff(
        before[:, :, : t + 1], after[:, :, : t + 1]) <= 1e-6
    assert max_diff(before[:, :, t + 1:], after[:, :, t + 1:]) > 1e-2


@pytest.mark.parametrize("k_top", [1, 2])
def test_soft_path_approaches_hard_pattern(k_top):
    """As routing sharpens (tau -> 0) the soft bias becomes the hard 0/-inf pattern."""
    q, k, v, c, mask = make(2, 4, 2, 64, 64, pad=7)
    errs = []
    for tau in (1.0, 1e-2, 1e-6):  # (1e-6: no near-ties left at fp32 resolution)
        cfg = FocusConfig(num_groups=4, query_top_k=k_top, key_top_k=k_top, window=8, sink_tokens=2, tau=tau)
        real = mask[:, None, :, None]
        soft = soft_attention(q, k, v, c, cfg, attention_mask=mask) * real
        errs.append(max_diff(soft, reference_attention(q, k, v, c, cfg, attention_mask=mask)))
    assert errs[-1] <= 1e-4 and errs[0] > errs[-1]


def test_soft_path_gradients_reach_centroids_only():
    cfg = FocusConfig(num_groups=4, window=8, sink_tokens=2)
    q, k, v, c, _ = make(1, 4, 2, 64, 64)
    c.requires_grad_(True)
    soft_attention(q, k, v, c, cfg).square().sum().backward()
    assert c.grad is not None and c.grad.abs().sum() > 0


def test_no_recompiles_when_length_changes_within_a_bucket():
    from torch._dynamo.utils import counters

    cfg = FocusConfig(num_groups=4, window=16, sink_tokens=2, block_size=32)
    assert bucket(97, 32) == bucket(128, 32)
    q, k, v, c, _ = make(1, 4, 2, 128, 128, seed=3)
    focus_attention(q, k, v, c, cfg, kernel="flex")  # warm-up: compiles this bucket
    graphs = counters["stats"]["unique_graphs"]
    for n in (97, 101, 110, 128, 123):
        qn, kn, vn = q[:, :, :n], k[:, :, :n], v[:, :, :n]
        out = focus_attention(qn, kn, vn, c, cfg, kernel="flex")
        assert max_diff(out, reference_attention(qn, kn, vn, c, cfg)) <= 1e-4
    assert counters["stats"]["unique_graphs"] == graphs, "a new length recompiled the kernels"


def test_block_masks_are_sparse_for_balanced_groups():
    """Sorted by group, far blocks ~ 1/G of causal; built without any N x N tensor."""
    n, g, d = 16384, 16, 64
    gen = torch.Generator().manual_seed(0)
    c = torch.nn.functional.normalize(torch.randn(1, g, d, generator=gen), dim=-1)
    labels = torch.randint(0, g, (n,), generator=gen)
    k = (c[0, labels] * 4 + torch.randn(n, d, generator=gen) * 0.5)[None, None]
    cfg = FocusConfig(num_groups=g, window=256, sink_tokens=4, block_size=128)
    plan = plan_attention(k, k, c, cfg, valid=torch.ones(1, n, dtype=torch.bool))
    dens = plan.density(causal_blocks(n, 128))
    assert dens["far"] < 2.5 / g and dens["local"] < 0.1, dens
    assert plan.far_mask.kv_indices.numel() < n * n / 100


def test_bad_inputs_have_clear_errors():
    cfg = FocusConfig(num_groups=4)
    q, k, v, c, _ = make(1, 4, 2, 20, 20)
    with pytest.raises(ValueError, match="centroids"):
        focus_attention(q, k, v, torch.randn(2, 5, 16), cfg)
    with pytest.raises(ValueError, match="multiple"):
        focus_attention(q[:, :3], k, v, c, cfg)
    with pytest.raises(ValueError, match="last Lq"):
        focus_attention(torch.randn(1, 4, 30, 16), k, v, c, cfg)
    with pytest.raises(ValueError, match="padding mask"):
        focus_attention(q, k, v, c, cfg, attention_mask=torch.ones(1, 1, 20, 20))
    with pytest.raises(TypeError, match="dtype"):
        focus_attention(q.double(), k, v, c, cfg)
    with pytest.raises(TypeError, match="additive"):
        focus_attention(q, k, v, c, cfg, attention_mask=torch.zeros(1, 20))
    with pytest.raises(ValueError, match="kernel='triton'"):
        focus_attention(q, k, v, c, cfg, kernel="triton")
    with pytest.raises(ValueError, match="empty"):
        focus_attention(q[:, :, :0], k[:, :, :0], v[:, :, :0], c, cfg)


def test_config_round_trip_and_validation(tmp_path):
    cfg = FocusConfig(num_groups=8, query_top_k=2, window=64, layers=[3, 1], extra={"note": "x"})
    assert cfg.layers == [1, 3]
    cfg.save_pretrained(tmp_path)
    assert FocusConfig.from_pretrained(tmp_path) == cfg
    for bad in ({"num_groups": 0}, {"num_groups": 64}, {"query_top_k": 5, "num_groups": 4}, {"window": 0},
                {"tau": 0}, {"block_size": 100}, {"sink_tokens": -1}, {"layers": [-1]},
                # JSON true/false and infinities must not pass as 1/0 and as a temperature
                {"window": True}, {"num_groups": True}, {"sink_tokens": False}, {"layers": [True]},
                {"tau": float("inf")}, {"tau": float("nan")}, {"tau": True}):
        with pytest.raises(ValueError, match="Invalid FocusConfig"):
            FocusConfig(**bad)
    with pytest.raises(ValueError, match="Unknown FocusConfig fields"):
        FocusConfig.from_dict({"num_groups": 4, "windw": 3})


def test_default_kernel_for_pairs_sharing_groups_says_when_it_falls_back_to_flex():
    """Query and key top-k both above 1 run on the C flash kernel by default; inputs it does not take (float16) run on
    flex, with a warning. Both equal the reference."""
    assert native.library() is not None, "the C kernels did not build"
    cfg = FocusConfig(num_groups=4, query_top_k=2, key_top_k=2, window=16, sink_tokens=2)
    q, k, v, c, _ = make(1, 4, 2, 200, 200, seed=3)
    assert default_kernel(q.device, cfg, (q, k, v)) == "flash"
    with warnings.catch_warnings():
        warnings.simplefilter("error", RuntimeWarning)
        assert max_diff(focus_attention(q, k, v, c, cfg), reference_attention(q, k, v, c, cfg)) <= 1e-5
    half = [t.half() for t in (q, k, v)]
    assert default_kernel(q.device, cfg, tuple(half)) == "flex"
    with pytest.warns(RuntimeWarning, match="does not take torch.float16 q, k, v of head dim 16.*flex"):
        out = focus_attention(*half, c, cfg)
    assert max_diff(out, reference_attention(*(t.float() for t in half), c, cfg)) <= 2e-3
