"""``FocusConfig.dense_heads``: the query heads of the listed ``[layer, kv_head]`` attend every earlier key on every
path; the other heads keep the Focus pattern. Dense heads are checked against plain causal attention built here, the
rest against the same path without them; the density against counting the masks; every head dense against the model
without Focus."""

import pytest
import torch
from test_dense_decode import causal, generate_on_every_cache
from test_flex_core import make, max_diff

from focus_flex import FocusAdapter, FocusConfig
from focus_flex.attention import focus_pattern
from focus_flex.cli import layer_head
from focus_flex.evaluate import RoutingMeter

CFG = FocusConfig(num_groups=4, window=8, sink_tokens=2, block_size=16)
MODULE = torch.nn.Module().eval()
PATHS = [("fast", None), ("fast", "flex"), ("fast", "flash"), ("reference", None), ("soft", None)]  # (mode, kernel)


def tiny_adapter(cfg: FocusConfig = CFG) -> tuple[torch.nn.Module, FocusAdapter]:
    """A tiny Llama (2 layers, 4 query heads on 2 KV heads of 16) and an adapter for it."""
    from test_adapter import tiny

    model = tiny("llama")
    return model, FocusAdapter.for_model(model, cfg, seed=3)


@pytest.mark.parametrize("mode,kernel", PATHS)
@pytest.mark.parametrize("lq", [1, 100])
def test_dense_heads_are_causal_attention_and_the_others_keep_their_path(mode, kernel, lq):
    _, adapter = tiny_adapter()
    adapter.mode, adapter.kernel = mode, kernel
    q, k, v, _, mask = make(2, 4, 2, lq, 100, seed=1, pad=0 if kernel == "flash" else 6)
    with torch.no_grad():
        before = [adapter.forward(MODULE, s, q, k, v, mask, None) for s in (0, 1)]
        adapter.config.dense_heads = [[1, 1]]
        after = [adapter.forward(MODULE, s, q, k, v, mask, None) for s in (0, 1)]
    assert torch.equal(after[0], before[0])  # layer 0 lists no dense head
    assert torch.equal(after[1][:, :2], before[1][:, :2])  # KV head 0's query heads: unchanged
    dense, _ = causal(q[:, 2:], k[:, 1:], v[:, 1:], mask)
    assert max_diff(after[1][:, 2:], dense) <= 1e-5
    assert max_diff(before[1][:, 2:], dense) > 1e-3  # the pattern alone is not dense there


@torch.no_grad()
def test_every_head_dense_generates_what_the_model_does_on_every_cache():
    """All heads of all layers dense: greedy generate on the CPU path, the static cache and a flex FocusCache (each
    equal to the reference path's) equals the model's own generate."""
    dense = FocusConfig(**{**CFG.to_dict(), "dense_heads": [[a, b] for a in range(2) for b in range(2)]})
    model, adapter, x, kw, expected = generate_on_every_cache(dense, 4)
    adapter.detach(model)
    own = model.generate(x, **kw)
    assert torch.equal(own.sequences, expected.sequences)
    assert max(max_diff(a, b) for a, b in zip(own.logits, expected.logits, strict=True)) <= 1e-4


def test_measured_density_counts_dense_heads_fully():
    """RoutingMeter's density: the pattern's pairs over the causal pairs, per head, with a dense head's at 1."""
    from test_adapter import ids

    model, adapter = tiny_adapter(FocusConfig(**{**CFG.to_dict(), "dense_heads": [[0, 1]]}))
    adapter.attach(model)
    n, masks = 70, []

    def count(module, args, output):
        _, slot, query, key = args[:4]
        pattern = focus_pattern(query, key, module.centroids[slot].detach(), module.config)
        if slot == 0:
            pattern[:, 2:] = torch.ones(n, n, dtype=torch.bool).tril()  # KV head 1's query heads
        masks.append(pattern.sum().item() / (pattern.shape[1] * n * (n + 1) / 2))

    meter = RoutingMeter(adapter)
    handle = adapter.register_forward_hook(count)
    with torch.no_grad():
        model(ids(1, n))
    handle.remove()
    density, _ = meter.close()
    assert density == pytest.approx(sum(masks) / len(masks), abs=1e-9)
    assert masks[0] > masks[1] + 0.2  # the dense head is counted


def test_config_field_round_trips_and_is_checked(tmp_path):
    cfg = FocusConfig(dense_heads=[[5, 0], [4, 0], (4, 0)])
    assert cfg.dense_heads == [[4, 0], [5, 0]] and cfg.dense_kv_heads(4) == [0] and cfg.dense_kv_heads(3) == []
    cfg.save_pretrained(tmp_path)
    assert FocusConfig.from_pretrained(tmp_path).dense_heads == [[4, 0], [5, 0]]
    for bad in ([[1]], [[1, -1]], "4.0", [[1, True]]):
        with pytest.raises(ValueError, match="dense_heads=.* must be a list of \\[layer, kv_head\\] pairs"):
            FocusConfig(dense_heads=bad)
    with pytest.raises(ValueError, match="names layers that are not Focus layers"):
        FocusConfig(layers=[1, 2], dense_heads=[[0, 0]])
    with pytest.raises(ValueError, match="KV heads >= num_kv_heads=2"):
        FocusConfig(num_kv_heads=2, dense_heads=[[0, 2]])
    _, adapter = tiny_adapter()
    adapter.config.dense_heads = [[7, 0]]  # a live config is checked when the adapter runs
    with pytest.raises(ValueError, match="not Focus layers"):
        adapter._check_config()
    assert layer_head("4.0") == [4, 0]
    with pytest.raises(Exception, match="expected LAYER.KV_HEAD"):
        layer_head("4")
