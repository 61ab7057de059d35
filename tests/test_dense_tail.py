"""``FocusConfig.dense_tail``: the last N queries of a prefill (the question at the end of a prompt) attend every
earlier key; the other queries, and decode steps, keep the Focus pattern. Tail rows are checked against plain causal
attention built here, the rest against the pattern without the tail; the densities against counting the masks."""

import pytest
import torch
from test_dense_decode import causal, generate_on_every_cache
from test_flex_core import make, max_diff

from focus_flex import FocusAdapter, FocusConfig, focus_attention, reference_attention
from focus_flex.attention import focus_pattern, routed
from focus_flex.config import DECODE_MAX_QUERIES
from focus_flex.evaluate import RoutingMeter, pattern_density, window_density, window_only
from focus_flex.routing import hard_membership

TAIL = 12
CFG = FocusConfig(num_groups=4, window=8, sink_tokens=2, block_size=16, dense_tail=TAIL)
SPARSE = FocusConfig(**{**CFG.to_dict(), "dense_tail": 0})


def test_tail_rows_are_causal_attention_and_the_others_focus():
    q, k, v, c, mask = make(2, 4, 2, 100, 100, g=4, seed=1, pad=6)
    got = focus_pattern(q, k, c, CFG, attention_mask=mask)
    sparse = focus_pattern(q, k, c, SPARSE, attention_mask=mask)
    assert torch.equal(got[:, :, -TAIL:], causal(q[:, :, -TAIL:], k, v, mask)[1].expand(-1, 4, -1, -1))
    assert torch.equal(got[:, :, :-TAIL], sparse[:, :, :-TAIL])
    assert not torch.equal(got, sparse)
    for lq in (1, DECODE_MAX_QUERIES):  # a decode step is no prefill: no tail
        assert torch.equal(focus_pattern(q[:, :, -lq:], k, c, CFG, attention_mask=mask),
                           focus_pattern(q[:, :, -lq:], k, c, SPARSE, attention_mask=mask))


@pytest.mark.parametrize("kernel", [None, "flex", "flash"])
@pytest.mark.parametrize("center", [False, True])
def test_fast_paths_equal_the_reference_with_a_dense_tail(kernel, center):
    q, k, v, c, mask = make(2, 6, 2, 120, 120, g=4, seed=2, pad=7 if kernel != "flash" else 0)
    centering = None
    if center:
        from focus_flex.routing import Centering
        centering = Centering(torch.randn(6, 16), torch.randn(2, 16), None)
    out = focus_attention(q, k, v, c, CFG, attention_mask=mask, kernel=kernel, centering=centering)
    expected = reference_attention(q, k, v, c, CFG, attention_mask=mask, centering=centering)
    assert max_diff(out, expected) <= 1e-5
    assert max_diff(out[:, :, -TAIL:], causal(q[:, :, -TAIL:], k, v, mask)[0]) <= 1e-5
    assert max_diff(out, reference_attention(q, k, v, c, SPARSE, attention_mask=mask, centering=centering)) > 1e-3


def test_gradients_with_a_dense_tail_are_the_references():
    q, k, v, c, _ = make(1, 4, 2, 60, 60, g=4, seed=3)
    grads = []
    for fn in (focus_attention, reference_attention):
        x = [t.clone().requires_grad_() for t in (q, k, v)]
        fn(*x, c, CFG).square().sum().backward()
        grads.append([t.grad for t in x])
    for a, b in zip(*grads, strict=True):
        assert max_diff(a, b) <= 1e-4


@torch.no_grad()
def test_measured_density_counts_the_tail_pairs():
    """The density RoutingMeter reports (far pairs by distance + the tail's extra pairs) is the count of the pattern's
    pairs, tail included, over the causal pairs."""
    from test_adapter import ids, tiny

    model = tiny("llama")
    adapter = FocusAdapter.for_model(model, CFG, seed=3)
    adapter.attach(model)
    meter = RoutingMeter(adapter)
    masks = []

    def count(module, args, output):
        _, slot, query, key = args[:4]
        pattern = focus_pattern(query, key, module.centroids[slot].detach(), CFG)
        masks.append(pattern.sum().item() / (pattern.shape[1] * n * (n + 1) / 2))

    n = 70
    handle = adapter.register_forward_hook(count)
    model(ids(1, n))
    handle.remove()
    density, _ = meter.close()
    assert density == pytest.approx(sum(masks) / len(masks), abs=1e-9)
    q, k, _, c, _ = make(1, 4, 2, n, n, g=4, seed=5)
    valid = torch.ones(1, n, dtype=torch.bool)
    qr, kr = routed(q, k, valid, None)
    density = pattern_density(hard_membership(qr, c, 1), hard_membership(kr, c, 1), CFG.window, CFG.sink_tokens,
                              CFG.tail(n))
    assert torch.equal(density, focus_pattern(q, k, c, CFG).sum((-1, -2)).double() / (n * (n + 1) / 2))


def test_training_dev_density_counts_the_tail():
    """The density that training reports on its dev sequences is the pattern's, tail included."""
    from focus_flex.train import LayerQKV, dev_metrics

    q, k, v, c, _ = make(1, 4, 2, 70, 70, g=4, seed=5)
    adapter = FocusAdapter(FocusConfig(**{**CFG.to_dict(), "num_layers": 1, "num_kv_heads": 2, "head_dim": 16,
                                         "layers": [0]}), c[None])
    density = dev_metrics(adapter, [{0: LayerQKV(q, k, v, None)}])["density"]
    n = q.shape[2]
    assert density == pytest.approx(focus_pattern(q, k, c, CFG).sum().item() / (4 * n * (n + 1) / 2), abs=1e-6)


@torch.no_grad()
def test_window_only_with_a_dense_tail():
    """window_only(dense_tail=N): the last N queries of its prefill attend every token (the equal-cost baseline), and
    window_density counts those pairs."""
    from test_adapter import ids, tiny

    model = tiny("llama")
    x = ids(1, 60)
    full = model(x).logits
    with window_only(model, 8, 2, dense_tail=TAIL):
        tail = model(x).logits
    with window_only(model, 8, 2):
        plain = model(x).logits
    assert max_diff(tail[:, -1], full[:, -1]) > 1e-3  # the earlier layers' windowed keys differ from full attention's
    assert max_diff(tail[:, :-TAIL], plain[:, :-TAIL]) <= 1e-5
    assert max_diff(tail[:, -TAIL:], plain[:, -TAIL:]) > 1e-3
    n, w, s = 60, 8, 2
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = (j <= i) & ((i - j < w) | (j < s) | (i >= n - TAIL))
    assert window_density(n, w, s, TAIL) == pytest.approx(mask.sum().item() / (n * (n + 1) / 2), abs=1e-12)


def test_config_field_round_trips_and_is_checked(tmp_path):
    CFG.save_pretrained(tmp_path)
    assert FocusConfig.from_pretrained(tmp_path).dense_tail == TAIL
    assert CFG.tail(100) == TAIL and FocusConfig(dense_tail=100).tail(DECODE_MAX_QUERIES + 1) == DECODE_MAX_QUERIES + 1
    assert CFG.tail(DECODE_MAX_QUERIES) == 0
    for bad in (-1, True, 2.0):
        with pytest.raises(ValueError, match="dense_tail=.* must be an int >= 0"):
            FocusConfig(dense_tail=bad)


@torch.no_grad()
def test_generate_with_every_cache_equals_the_reference():
    """Greedy generate with a dense tail equals the reference path's on the CPU path, the static cache and a
    flex-kernel FocusCache; the prompt's last logits are not those without the tail."""
    model, adapter, x, kw, expected = generate_on_every_cache(CFG, 4)
    adapter.config.dense_tail = 0
    assert max_diff(model.generate(x, **kw).logits[0], expected.logits[0]) > 1e-3
