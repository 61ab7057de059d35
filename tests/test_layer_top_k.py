"""``FocusConfig.layer_top_k``: the layers listed as ``[layer, query_top_k, key_top_k]`` route with their own top-k on
every path; the others keep the config's. A listed layer is checked against the one definition of the pattern
(``reference_attention``; the soft path against ``soft_attention``) under a config with that top-k everywhere,
generation against the reference path on every cache, the measured density against counting the masks, and the
embedded SmolLM2 with the published adapter on its fast path against its reference path."""

import dataclasses

import pytest
import torch
from test_dense_decode import generate_on_every_cache
from test_dense_heads import CFG, MODULE, PATHS, tiny_adapter
from test_flex_core import make, max_diff

from focus_flex import FocusAdapter, FocusConfig, reference_attention, soft_attention
from focus_flex.attention import focus_pattern
from focus_flex.cli import layer_top_k
from focus_flex.evaluate import RoutingMeter


@pytest.mark.parametrize("mode,kernel", PATHS)
@pytest.mark.parametrize("lq", [1, 100])
def test_a_listed_layer_routes_with_its_own_top_k_on_every_path(mode, kernel, lq):
    _, adapter = tiny_adapter()
    adapter.mode, adapter.kernel = mode, kernel
    q, k, v, _, mask = make(2, 4, 2, lq, 100, seed=1, pad=0 if kernel == "flash" else 6)
    with torch.no_grad():
        before = [adapter.forward(MODULE, s, q, k, v, mask, None) for s in (0, 1)]
        adapter.config.layer_top_k = [[1, 3, 2]]
        after = [adapter.forward(MODULE, s, q, k, v, mask, None) for s in (0, 1)]
        wide = dataclasses.replace(adapter.config, query_top_k=3, key_top_k=2, layer_top_k=[])
        definition = soft_attention if mode == "soft" else reference_attention
        expected = definition(q, k, v, adapter.centroids[1], wide, attention_mask=mask)
    assert torch.equal(after[0], before[0])  # layer 0 is not listed
    assert max_diff(after[1], expected) <= 1e-5
    assert max_diff(after[1], before[1]) > 1e-3  # more groups per token change layer 1


@torch.no_grad()
def test_generate_with_a_listed_layer_equals_the_reference_on_every_cache():
    """Focus decode (key index, pools) with layer 1 at top-k 3/2: greedy generate on the CPU path, the static cache
    and a flex FocusCache equals the reference path's, and differs from the same adapter without the listing."""
    cfg = FocusConfig(**{**CFG.to_dict(), "layer_top_k": [[1, 3, 2]]})
    model, adapter, x, kw, expected = generate_on_every_cache(cfg, 6)
    adapter.config.layer_top_k = []
    plain = model.generate(x, **kw)
    assert max(max_diff(a, b) for a, b in zip(plain.logits, expected.logits, strict=True)) > 1e-3


@torch.no_grad()
def test_output_attentions_of_a_listed_layer_are_its_own_patterns_weights():
    """output_attentions=True: each layer's weights are zero exactly outside its own pattern (layer 1 listed at
    top-k 3/2: it attends pairs the config's top-k would skip), rows summing to 1."""
    from test_adapter import ids

    model, adapter = tiny_adapter(FocusConfig(**{**CFG.to_dict(), "layer_top_k": [[1, 3, 2]]}))
    adapter.attach(model)
    q, k = {}, {}  # each Focus layer's q and k, to build its pattern
    hook = adapter.register_forward_hook(lambda a, args, out: q.update({args[1]: args[2]}) or
                                         k.update({args[1]: args[3]}))
    out = model(ids(1, 70), output_attentions=True)
    hook.remove()
    patterns = [focus_pattern(q[s], k[s], adapter.centroids[s].detach(), adapter.layer_config(s)) for s in (0, 1)]
    for w, allowed in zip(out.attentions, patterns, strict=True):
        assert w[~allowed].abs().max() == 0 and torch.allclose(w.sum(-1), torch.ones(()), atol=1e-5)
    plain = focus_pattern(q[1], k[1], adapter.centroids[1].detach(), adapter.config)  # the config's top-k
    assert out.attentions[1][patterns[1] & ~plain].abs().min() > 0


@torch.no_grad()
def test_measured_density_counts_each_layers_own_pattern():
    from test_adapter import ids

    model, adapter = tiny_adapter(FocusConfig(**{**CFG.to_dict(), "layer_top_k": [[0, 4, 1]]}))
    adapter.attach(model)
    n, masks = 70, []

    def count(module, args, output):
        _, slot, query, key = args[:4]
        cfg = module.config if slot else dataclasses.replace(module.config, query_top_k=4, layer_top_k=[])
        pattern = focus_pattern(query, key, module.centroids[slot].detach(), cfg)
        masks.append(pattern.sum().item() / (pattern.shape[1] * n * (n + 1) / 2))

    meter = RoutingMeter(adapter)
    handle = adapter.register_forward_hook(count)
    model(ids(1, n))
    handle.remove()
    density, _ = meter.close()
    assert density == pytest.approx(sum(masks) / len(masks), abs=1e-9)
    assert masks[0] == pytest.approx(1.0)  # every query in all 4 groups: layer 0 is causal attention
    assert masks[1] < 0.9


def test_layer_configurations_follow_the_live_config():
    _, adapter = tiny_adapter(FocusConfig(**{**CFG.to_dict(), "layer_top_k": [[1, 3, 2]]}))
    first = adapter.layer_config(1)
    assert (first.query_top_k, first.key_top_k, first.layer_top_k, first.window) == (3, 2, [], 8)
    assert adapter.layer_config(0) is adapter.config
    adapter.config.window = 5
    assert adapter.layer_config(1).window == 5
    adapter.config.layer_top_k = []
    assert adapter.layer_config(1) is adapter.config


def test_config_field_round_trips_and_is_checked(tmp_path):
    cfg = FocusConfig(num_groups=8, layer_top_k=[[5, 4, 2], [0, 8, 1], (5, 4, 2)])
    assert cfg.layer_top_k == [[0, 8, 1], [5, 4, 2]]
    assert (cfg.at(5).query_top_k, cfg.at(5).key_top_k, cfg.at(5).num_groups) == (4, 2, 8)
    assert cfg.at(3) is cfg
    cfg.save_pretrained(tmp_path)
    assert FocusConfig.from_pretrained(tmp_path).layer_top_k == [[0, 8, 1], [5, 4, 2]]
    for bad in ([[1, 2]], [[1, 0, 1]], [[1, 1, 9]], [[-1, 1, 1]], "0:2:2", [[1, True, 1]]):
        with pytest.raises(ValueError, match="layer_top_k=.* must be a list of \\[layer, query_top_k, key_top_k\\]"):
            FocusConfig(num_groups=8, layer_top_k=bad)
    with pytest.raises(ValueError, match="names a layer twice"):
        FocusConfig(num_groups=8, layer_top_k=[[1, 2, 2], [1, 3, 2]])
    with pytest.raises(ValueError, match="names layers that are not Focus layers"):
        FocusConfig(layers=[1, 2], layer_top_k=[[0, 1, 1]])
    _, adapter = tiny_adapter()
    adapter.config.layer_top_k = [[7, 2, 2]]  # a live config is checked when the adapter runs
    with pytest.raises(ValueError, match="not Focus layers"):
        adapter._check_config()
    assert layer_top_k("0:32:4") == [0, 32, 4]
    with pytest.raises(Exception, match="expected LAYER:Q:K"):
        layer_top_k("0:32")


@torch.no_grad()
def test_published_adapter_with_wide_lower_layers_on_the_fast_path_equals_its_reference(smollm2):
    """The embedded SmolLM2 with the published adapter, layers 0, 2 and 6 at 32 groups per query and keys in 3
    (docs/passkey.md, points 53 and 59; one pass, ``FocusConfig.one_pass``): on real text every layer's fast-path
    output (C kernels, dense tail) equals the reference attention of the same inputs, and the listing changes the
    logits. (Per layer: with 32 of 63 groups per query, the last bits of a layer's input can move a query's 32nd
    group, so two exact paths through the whole model need not agree.)"""
    from test_passkey import ADAPTER

    from focus_flex.data import load_documents

    model, tokenizer = smollm2
    adapter = FocusAdapter.from_pretrained(ADAPTER)
    assert adapter.config.layer_top_k == [[0, 32, 3], [2, 32, 3], [6, 32, 3]] and adapter.config.at(0).one_pass
    ids = tokenizer(load_documents(split="eval")[0][:6000], return_tensors="pt").input_ids[:, :900]
    seen = {}
    hook = adapter.register_forward_hook(lambda a, args, out: seen.update({args[1]: (args[2:7], out)}))
    adapter.attach(model)
    try:
        listed = model(ids).logits
        hook.remove()
        for slot, ((q, k, v, padding, scale), out) in seen.items():
            ref = reference_attention(q, k, v, adapter.centroids[slot], adapter.layer_config(slot),
                                      attention_mask=padding, scale=scale, centering=adapter.centering(slot))
            assert max_diff(out, ref) <= 1e-4, f"layer {slot}"
        adapter.config.layer_top_k = []
        plain = model(ids).logits
    finally:
        adapter.detach(model)
    assert len(seen) == 30
    assert max_diff(listed, plain) > 0.05


@torch.no_grad()
def test_compiled_static_decode_with_a_listed_layer_compiles_once():
    """transformers' compiled decode step (fullgraph) over a static cache, layer 1 at top-k 3/2 (its configuration
    made inside the trace): the tokens of the eager path, no graph break, and a second generate compiles nothing
    new."""
    from test_adapter import ids
    from test_cache import compiled_static_generate_twice

    model, adapter = tiny_adapter(FocusConfig(**{**CFG.to_dict(), "layer_top_k": [[1, 3, 2]]}))
    adapter.attach(model)
    compiled_static_generate_twice(model, ids(1, 40), dict(max_new_tokens=5, do_sample=False))
