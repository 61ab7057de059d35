"""Centered routing (``FocusConfig.center``): every path routes ``x - R(p) mu`` exactly as the reference does."""

import pytest
import torch
from test_adapter import CFG, ids, maxdiff, tiny
from test_attention import CASES, make, use_kernel
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from focus_flex import FocusAdapter, FocusConfig, focus_attention, reference_attention, routing
from focus_flex.adapter import rotary_of
from focus_flex.attention import focus_pattern
from focus_flex.decode import KeyIndex
from focus_flex.train import calibrate_means, centerings, teacher_qkv


def llama_rotary(d: int):
    """A real rotary encoding (transformers' Llama module) as positions -> cos, sin."""
    module = LlamaRotaryEmbedding(LlamaConfig(hidden_size=4 * d, num_attention_heads=4, head_dim=d))
    return lambda pos: module(torch.empty(0), pos)


def centering_for(hq: int, hkv: int, d: int, seed: int = 5) -> routing.Centering:
    gen = torch.Generator().manual_seed(seed)  # means as large as the vectors: centering moves most groups
    return routing.Centering(torch.randn(hq, d, generator=gen) * 1.5, torch.randn(hkv, d, generator=gen) * 1.5,
                             llama_rotary(d))


# the flash kernel takes top-1 queries or keys (a pair sharing two groups: only flex)
RUNS = [(name, case) for name in ("flex", "flash", "flash-torch") for case in CASES
        if name == "flex" or case[5] == 1 or case[6] == 1]


@pytest.mark.parametrize(("name", "case"), RUNS, ids=[f"{n}-{c}" for n, c in RUNS])
def test_fast_paths_with_centering_match_the_reference(case, name, monkeypatch):
    b, hq, hkv, lq, lk, tq, tk, w, s, pad = case
    cfg = FocusConfig(num_groups=4, query_top_k=tq, key_top_k=tk, window=w, sink_tokens=s, block_size=32)
    q, k, v, c, mask = make(b, hq, hkv, lq, lk, pad=pad)
    centering = centering_for(hq, hkv, q.shape[-1])
    kernel = use_kernel(name, monkeypatch)
    ref = reference_attention(q, k, v, c, cfg, attention_mask=mask, centering=centering)
    out = focus_attention(q, k, v, c, cfg, attention_mask=mask, kernel=kernel, centering=centering)
    assert maxdiff(out, ref) <= 1e-5
    if tq + tk <= cfg.num_groups and w < lk - 1:  # groups decide pairs: centering changes the pattern
        plain = focus_pattern(q, k, c, cfg, attention_mask=mask)
        assert not torch.equal(focus_pattern(q, k, c, cfg, attention_mask=mask, centering=centering), plain)


@pytest.mark.parametrize("query_top_k", [1, 2])
def test_indexed_decode_with_centered_key_index_matches_the_reference(query_top_k, decode_path):
    cfg = FocusConfig(num_groups=4, query_top_k=query_top_k, key_top_k=2, window=8, sink_tokens=2)
    b, hq, hkv, n = 2, 4, 2, 60
    q, k, v, c, _ = make(b, hq, hkv, n, n, seed=3)
    centering = centering_for(hq, hkv, q.shape[-1])
    index = KeyIndex(b, hkv, cfg.num_groups, "cpu")
    pos = torch.arange(n).expand(b, -1)
    for t in range(20, n):  # one decode step per token, the index growing by the new key, centered
        index.extend(centering.keys(k[:, :, index.length:t + 1], pos[:, index.length:t + 1]), c, cfg)
        out = focus_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], c, cfg, key_index=index,
                              centering=centering)
        ref = reference_attention(q[:, :, t:t + 1], k[:, :, :t + 1], v[:, :, :t + 1], c, cfg, centering=centering)
        assert maxdiff(out, ref) <= 1e-5


@torch.no_grad()
def test_centering_removes_the_rotated_pre_rope_mean():
    """Independent of Centering's own formula: the routing vector of a key is the model's pre-RoPE key (read off
    k_proj) minus the mean, rotated by transformers' own apply_rotary_pos_emb at the key's position."""
    model = tiny("llama")
    x = ids(1, 50)
    pre = {}
    attn = model.model.layers[1].self_attn
    handle = attn.k_proj.register_forward_hook(lambda m, a, out: pre.setdefault("k", out))
    qkv = teacher_qkv(model, x)
    handle.remove()
    hkv, d = model.config.num_key_value_heads, model.config.head_dim
    k_pre = pre["k"].view(1, 50, hkv, d).transpose(1, 2)
    mu = torch.randn(hkv, d)
    center = routing.Centering(torch.zeros(4, d), mu, rotary_of(model))
    got = center.keys(qkv[1].k, torch.arange(50)[None])
    cos, sin = model.model.rotary_emb(k_pre, torch.arange(50)[None])
    want, _ = apply_rotary_pos_emb(k_pre - mu[None, :, None], k_pre, cos, sin)
    assert maxdiff(got, want) <= 1e-5
    # and the calibrated means are the pre-RoPE means
    adapter = FocusAdapter.for_model(model, FocusConfig(**{**CFG.to_dict(), "center": True}))
    calibrate_means(adapter, qkv, model)
    assert maxdiff(adapter.key_means[1], k_pre[0].mean(1)) <= 1e-5


def centered_adapter(model, seed=0):
    """A centered adapter, calibrated, then its means moved by about the vectors' own size (a random tiny model has
    no large shared component to remove, so calibrated means alone would barely move a group)."""
    adapter = FocusAdapter.for_model(model, FocusConfig(**{**CFG.to_dict(), "center": True}), seed=seed)
    qkv = teacher_qkv(model, ids(1, 60, seed=7))
    calibrate_means(adapter, qkv, model)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for means, kind in ((adapter.query_means, "q"), (adapter.key_means, "k")):
            size = torch.stack([getattr(x, kind).std() for x in qkv.values()]).mean()
            means.add_(torch.randn(means.shape, generator=gen) * 2 * size)
    return adapter


@pytest.mark.parametrize("arch", ["llama", "gpt2", "gemma3"])
@torch.no_grad()
def test_centered_adapter_fast_equals_reference_and_differs_from_uncentered(arch):
    model = tiny(arch)
    x = ids()
    adapter = centered_adapter(model)
    adapter.attach(model)
    fast = model(x).logits
    adapter.mode = "reference"
    assert maxdiff(fast, model(x).logits) <= 1e-4
    adapter.detach(model)
    plain = FocusAdapter.for_model(model, CFG)  # the same centroids, routing q and k as they are
    plain.centroids.data.copy_(adapter.centroids)
    plain.attach(model)
    assert maxdiff(model(x).logits, fast) > 1e-3


@pytest.mark.parametrize("kernel,cache", [(None, "dynamic"), ("flex", "dynamic"), (None, "static")])
@torch.no_grad()
def test_centered_generate_with_kv_cache_equals_recomputing_the_prefix(kernel, cache):
    """Decode routes each new key once (CPU key index, or the device path's pool, dynamic or static) at its own
    position."""
    model = tiny("llama")
    adapter = centered_adapter(model)
    adapter.attach(model)
    adapter.kernel = kernel
    prompt = ids(2, 40)
    out = model.generate(prompt, max_new_tokens=16, min_new_tokens=16, do_sample=False, cache_implementation=cache)
    seq = prompt
    for _ in range(16):
        seq = torch.cat([seq, model(seq).logits[:, -1].argmax(-1, keepdim=True)], 1)
    assert torch.equal(out, seq)


@torch.no_grad()
def test_centered_left_padded_batch_equals_unpadded_sequences():
    model = tiny("llama")
    adapter = centered_adapter(model)
    adapter.attach(model)
    a, b = ids(1, 50, seed=2), ids(1, 38, seed=3)
    batch = torch.cat([a, torch.cat([torch.zeros(1, 12, dtype=torch.long), b], 1)])
    mask = torch.ones_like(batch)
    mask[1, :12] = 0
    out = model(batch, attention_mask=mask).logits
    assert maxdiff(out[0], model(a).logits[0]) <= 1e-4
    assert maxdiff(out[1, 12:], model(b).logits[0]) <= 1e-4


@torch.no_grad()
def test_centered_adapter_round_trips_and_is_checked(tmp_path):
    model = tiny("llama")
    adapter = centered_adapter(model)
    adapter.save_pretrained(tmp_path / "a")
    loaded = FocusAdapter.from_pretrained(tmp_path / "a")
    assert loaded.config.center and torch.equal(loaded.key_means, adapter.key_means)
    assert torch.equal(loaded.query_means, adapter.query_means)
    x = ids()
    outs = []
    for a in (adapter, loaded):
        a.attach(model)
        outs.append(model(x).logits)
        a.detach(model)
    assert torch.equal(*outs)
    # a file without the means, read as centered, is refused with what it should hold
    FocusAdapter.for_model(model, CFG).save_pretrained(tmp_path / "b")
    (tmp_path / "b" / "focus_config.json").write_text((tmp_path / "a" / "focus_config.json").read_text())
    with pytest.raises(ValueError, match="query_means"):
        FocusAdapter.from_pretrained(tmp_path / "b")
    with pytest.raises(ValueError, match="center"):
        adapter.config.center = False
        adapter.attach(model)
        model(x)


@pytest.mark.parametrize("kernel", [None, "flex"])
@torch.no_grad()
def test_centering_listed_layers_routes_those_centered_and_the_others_as_they_are(kernel):
    """``center=[layer]``: that layer routes as a centered adapter's does, the others as an uncentered one's (the
    same centroids), in the prefill and in cached decode; training calibrates means for the listed layers only."""
    model = tiny("llama")
    everywhere = centered_adapter(model)
    listed = FocusAdapter(FocusConfig(**{**everywhere.config.to_dict(), "center": [1]}), everywhere.centroids,
                          query_means=everywhere.query_means, key_means=everywhere.key_means)
    # the independent construction: centered everywhere, with the means of layer 0 removed (x - R(p) 0 = x)
    zero_mean = FocusAdapter(everywhere.config, everywhere.centroids, query_means=everywhere.query_means,
                             key_means=everywhere.key_means)
    zero_mean.query_means[0] = 0
    zero_mean.key_means[0] = 0
    plain = FocusAdapter(FocusConfig(**{**everywhere.config.to_dict(), "center": False}), everywhere.centroids)
    x, prompt = ids(), ids(2, 40)
    logits, generated = {}, {}
    for name, adapter in (("listed", listed), ("zero_mean", zero_mean), ("everywhere", everywhere), ("plain", plain)):
        adapter.attach(model)
        adapter.kernel = kernel
        logits[name] = model(x).logits
        generated[name] = model.generate(prompt, max_new_tokens=12, min_new_tokens=12, do_sample=False)
        adapter.detach(model)
    assert maxdiff(logits["listed"], logits["zero_mean"]) <= 1e-5
    assert torch.equal(generated["listed"], generated["zero_mean"])
    assert maxdiff(logits["listed"], logits["everywhere"]) > 1e-3 and maxdiff(logits["listed"], logits["plain"]) > 1e-3
    assert [c is None for c in centerings(listed, model).values()] == [True, False]
    calibrate_means(listed, teacher_qkv(model, ids(1, 60, seed=7)), model)
    assert not listed.key_means[0].any() and not listed.query_means[0].any() and listed.key_means[1].any()


def test_center_layers_round_trip_and_are_checked(tmp_path):
    cfg = FocusConfig(layers=[2, 5, 7], center=[7, 2, 2])
    assert cfg.center == [2, 7] and cfg.centers(2) and not cfg.centers(5)
    cfg.save_pretrained(tmp_path)
    assert FocusConfig.from_pretrained(tmp_path) == cfg
    assert FocusConfig(center=[]).center is False and FocusConfig(center=True).centers(3)
    with pytest.raises(ValueError, match="not Focus layers"):
        FocusConfig(layers=[2, 5], center=[3])
    with pytest.raises(ValueError, match="list of Focus layer indices"):
        FocusConfig(center=["2"])
    with pytest.raises(ValueError, match="list of Focus layer indices"):
        FocusConfig(center="yes")


def test_training_centerings_follow_the_adapter():
    model = tiny("llama")
    adapter = centered_adapter(model)
    c = centerings(adapter, model)
    with torch.no_grad():
        adapter.key_means.add_(1.0)
    assert torch.equal(c[0].key_mean, adapter.key_means[0])  # a view: calibration after construction shows


@pytest.mark.slow
@torch.no_grad()
def test_real_smollm2_centered_fast_path_and_decode_equal_the_reference():
    """The embedded SmolLM2 (real RoPE, GQA 9/3), a centered adapter calibrated and k-means-initialised on a real
    text window: prefill (C kernel) and cached decode equal the dense reference; centering moves real groups."""
    from focus_flex.data import load_documents
    from focus_flex.models import load_model
    from focus_flex.train import kmeans_init

    model, tok = load_model()
    text = load_documents(split="eval")[0][:6000]
    x = tok(text, return_tensors="pt").input_ids[:, :400]
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=16, window=64, sink_tokens=4, center=True))
    qkv = teacher_qkv(model, x[:, :300])
    calibrate_means(adapter, qkv, model)
    kmeans_init(adapter, qkv, 0, centering=centerings(adapter, model))
    center = centerings(adapter, model)[20]
    k = qkv[20].k
    plain = routing.hard_groups(k, adapter.centroids[20], 1)
    moved = (routing.hard_groups(center.keys(k, torch.arange(300)[None]), adapter.centroids[20], 1) != plain)
    assert moved.float().mean() > 0.2  # real keys share a large component: removing it changes many groups
    adapter.attach(model)
    fast = model(x).logits
    out = model.generate(x[:, :350], max_new_tokens=6, min_new_tokens=6, do_sample=False, output_logits=True,
                         return_dict_in_generate=True)
    adapter.mode = "reference"
    ref = model(x).logits
    assert maxdiff(fast, ref) <= 1e-3 * ref.abs().max().item()
    full = model(out.sequences).logits[:, 349:-1]
    assert maxdiff(torch.stack(out.logits, 1), full) <= 1e-3 * full.abs().max().item()
