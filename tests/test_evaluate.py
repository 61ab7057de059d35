"""Tests of focus_flex.evaluate: exact densities, the window-only baseline, the five-mode evaluation and reports."""

from __future__ import annotations

import contextlib
import json
import math
from dataclasses import replace

import pytest
import torch
import torch.nn.functional as F
from transformers import LlamaConfig, LlamaForCausalLM

from focus_flex import FocusAdapter, FocusConfig, flash, native, routing
from focus_flex import evaluate as E
from focus_flex.attention import focus_pattern


def tiny_llama() -> LlamaForCausalLM:
    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


@pytest.mark.parametrize("kq,kk,window,sinks,n", [(1, 1, 5, 2, 40), (2, 1, 3, 0, 33), (2, 3, 7, 4, 50),
                                                   (1, 2, 1, 1, 20), (3, 3, 64, 4, 30), (1, 1, 4, 9, 12)])
@pytest.mark.parametrize("counting", ["fft", "diagonals"])
def test_pattern_density_counts_exactly_what_focus_pattern_allows(kq, kk, window, sinks, n, counting, monkeypatch):
    """Both ways of counting far pairs (diagonals: where queries have many distinct group sets)."""
    monkeypatch.setattr(E, "DIAGONAL_COUNTING", 0 if counting == "diagonals" else 10 ** 9)
    torch.manual_seed(n)
    cfg = FocusConfig(num_groups=6, query_top_k=kq, key_top_k=kk, window=window, sink_tokens=sinks)
    q, k, c = torch.randn(2, 4, n, 8), torch.randn(2, 2, n, 8), torch.randn(2, 6, 8)
    expected = focus_pattern(q, k, c, cfg).sum((-1, -2)).double() / (n * (n + 1) / 2)
    qm, km = routing.hard_membership(q, c, kq), routing.hard_membership(k, c, kk)
    assert torch.allclose(E.pattern_density(qm, km, window, sinks), expected, atol=1e-12)
    far = E.far_pairs_by_distance(qm, km, sinks)  # [B, Hq, N]: the pattern at every window from one count
    for w in range(1, n + 2):
        mask = focus_pattern(q, k, c, FocusConfig(num_groups=6, query_top_k=kq, key_top_k=kk, window=w,
                                                  sink_tokens=sinks))
        assert torch.equal(E.far_density(far, n, w, sinks), mask.sum((-1, -2)).double() / (n * (n + 1) / 2))
    target = float(expected.mean()) + 0.01
    w = E.matching_pattern_window(far.mean((0, 1)), n, sinks, target)
    assert E.far_density(far.mean((0, 1)), n, w, sinks) >= target or w == n
    assert w == 1 or E.far_density(far.mean((0, 1)), n, w - 1, sinks) < target


def test_random_baseline_matches_focus_density_with_a_dense_tail():
    """With ``dense_tail`` the random-groups baseline's window is matched on the pattern with the tail counted: the
    smallest window whose measured density reaches Focus's, as without a tail."""
    model = tiny_llama()
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2, block_size=16,
                                                        dense_tail=16))
    cfg = adapter.config
    windows = torch.randint(0, 96, (1, 64), generator=torch.Generator().manual_seed(0))
    focus = E.evaluate(model, adapter, windows, modes=("focus",), progress=False)[0].density
    rnd = FocusAdapter(cfg, seed=E.RANDOM_SEED)
    w = E.random_window(model, rnd, windows, focus)
    at = lambda w: E.evaluate(model, FocusAdapter(replace(cfg, window=w), rnd.centroids.detach()), windows,
                              modes=("focus",), progress=False)[0].density
    assert at(w) >= focus > at(w - 1)


def test_window_densities_and_matching_window():
    i, j = torch.arange(100)[:, None], torch.arange(100)[None, :]
    for w, s in [(1, 0), (5, 3), (10, 0), (100, 4), (200, 300)]:
        assert E.window_pairs(100, w, s) == int(((j <= i) & ((i - j < w) | (j < s))).sum())
    assert E.window_density(100, 100, 0) == 1.0
    for target in (0.15, 0.2, 0.5, 0.9):
        w = E.matching_window(100, 4, target)
        assert E.window_density(100, w, 4) >= target > E.window_density(100, w - 1, 4)
    assert E.matching_window(100, 4, 0.05) == 1  # window 1 + 4 sinks already computes more than 5%


def test_window_only_restricts_attention_and_restores_the_model():
    model = tiny_llama()
    x = torch.randint(0, 96, (1, 24))
    y = x.clone()
    y[0, 0] = (y[0, 0] + 1) % 96
    with torch.no_grad():
        full = model(x).logits
        with E.window_only(model, 64, 0):  # window beyond the sequence: full attention
            assert torch.allclose(model(x).logits, full, atol=1e-5)
        with E.window_only(model, 3, 0):  # 2 layers x window 3: position p sees tokens >= p - 4
            a, b = model(x).logits, model(y).logits
            assert torch.equal(a[0, 5:], b[0, 5:]) and not torch.equal(a[0, :5], b[0, :5])
        with E.window_only(model, 3, 1):  # ... unless token 0 is a sink
            assert not torch.equal(model(x).logits[0, 20], model(y).logits[0, 20])
        assert model.config._attn_implementation == "sdpa"
        assert torch.equal(model(x).logits, full)


def banded(lq: int, lk: int, window: int, sinks: int, tail: int = 0) -> torch.Tensor:
    """The window-only pattern as a dense bool mask ``[Lq, Lk]`` (queries at positions ``[Lk - Lq, Lk)``)."""
    i, j = torch.arange(lk - lq, lk)[:, None], torch.arange(lk)[None, :]
    return (j <= i) & ((i - j < window) | (j < sinks) | (i >= lk - tail))


@pytest.mark.parametrize("c_kernel", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("lq,lk,window,sinks", [(200, 200, 32, 4), (150, 300, 64, 0), (100, 100, 500, 3),
                                                (97, 161, 1, 70)])
def test_window_attention_equals_dense_masked_attention(c_kernel, dtype, lq, lk, window, sinks):
    g = torch.Generator().manual_seed(lq)
    q = torch.randn(2, 6, lq, 64, generator=g).to(dtype)
    k, v = (torch.randn(2, 2, lk, 64, generator=g).to(dtype) for _ in range(2))
    expected = F.scaled_dot_product_attention(q.float(), k.float(), v.float(), attn_mask=banded(lq, lk, window, sinks),
                                              enable_gqa=True)
    with contextlib.nullcontext() if c_kernel else native.disabled():
        assert native.prefill_applies(q, k, v) == c_kernel
        out = flash.window_attention(q, k, v, window, sinks, 64 ** -0.5)
    assert out.dtype == dtype
    assert (out.float() - expected).abs().max() <= (1e-5 if dtype == torch.float32 else 2e-2)


@torch.no_grad()
def test_window_only_on_a_real_model_equals_its_dense_masked_attention(smollm2):
    """The window-only baseline of the embedded model (its fast path on CPU, with a dense tail) against the same
    pattern as a dense mask in the model's own SDPA."""
    from transformers import AttentionInterface
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    model, _ = smollm2
    window, sinks, tail = 96, 4, 16

    def masked(module, query, key, value, attention_mask, **kwargs):
        mask = banded(query.shape[2], key.shape[2], window, sinks, tail)[None, None]
        return sdpa_attention_forward(module, query, key, value, mask, **kwargs)

    AttentionInterface.register("test_banded", masked)
    x = torch.randint(0, model.config.vocab_size, (2, 400), generator=torch.Generator().manual_seed(0))
    full = model(x).logits
    with E.window_only(model, window, sinks, dense_tail=tail):
        fast = model(x).logits
    model.set_attn_implementation("test_banded")
    try:
        expected = model(x).logits
    finally:
        model.set_attn_implementation("sdpa")
    assert (fast - expected).abs().max() <= 1e-3 < (fast - full).abs().max()


def test_evaluate_all_modes_and_reports(tmp_path):
    model = tiny_llama()
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2, block_size=16))
    with torch.no_grad():  # two groups in use, about half the tokens each: denser than 4 random groups
        adapter.centroids[:, :, 1:] = -adapter.centroids[:, :, :1]
    windows = torch.randint(0, 96, (2, 64), generator=torch.Generator().manual_seed(0))
    results = E.evaluate(model, adapter, windows, progress=False)
    by = {r.mode: r for r in results}
    assert list(by) == list(E.MODES)
    nll = sum(F.cross_entropy(model(w[None]).logits[0, :-1], w[1:], reduction="sum").item() for w in windows)
    assert by["full"].tokens == 126 and math.isclose(by["full"].perplexity, math.exp(nll / 126), rel_tol=1e-5)
    assert by["full"].density == by["soft"].density == 1.0
    assert 0 < by["focus"].density < 1 and by["focus"].balance >= 1 and by["random"].balance >= 1
    w = E.matching_window(64, 2, by["focus"].density)
    assert by["window"].density == E.window_density(64, w, 2) >= by["focus"].density
    assert f"window {w} + 2 sinks" in by["window"].note
    rnd = FocusAdapter(adapter.config, seed=E.RANDOM_SEED)  # the random baseline, at the window evaluate chose
    w = E.random_window(model, rnd, windows[:1], by["focus"].density)
    assert f"window {w} + 2 sinks" in by["random"].note and w > 8  # random groups: fewer far pairs
    at = lambda w: E.evaluate(model, FocusAdapter(replace(adapter.config, window=w), rnd.centroids.detach()),
                              windows[:1], modes=("focus",), progress=False)[0].density
    assert at(w) >= by["focus"].density > at(w - 1)  # measured on the first window: the smallest that matches
    assert not any(getattr(m, "_focus", None) for m in model.modules())  # everything detached again

    paths = E.save_results(str(tmp_path), results, {"model": "tiny"}, "protocol text", "title")
    data = json.loads(open(paths[E.RESULTS_JSON]).read())
    assert [r["mode"] for r in data["results"]] == list(E.MODES) and data["model"] == "tiny"
    table = open(paths[E.RESULTS_MD]).read()
    assert table.startswith("| mode | perplexity |") and "protocol text" in table and "| focus |" in table
    assert open(paths[E.PLOT_PNG], "rb").read(8) == b"\x89PNG\r\n\x1a\n"


def test_evaluate_scores_the_model_itself_in_eval_mode_and_checks_its_inputs():
    model = tiny_llama()
    for m in model.modules():  # attention dropout: in training mode, "full" would be random
        if hasattr(m, "attention_dropout"):
            m.attention_dropout = 0.5
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8))
    windows = torch.randint(0, 96, (2, 32), generator=torch.Generator().manual_seed(0))
    model.train()
    adapter.mode = "soft"
    runs = [E.evaluate(model, adapter, windows.int(), modes=("full", "focus"), progress=False) for _ in range(2)]
    assert runs[0][0].perplexity == runs[1][0].perplexity and model.training and adapter.mode == "soft"
    model.eval()
    assert E.evaluate(model, adapter, windows, modes=("full",), progress=False)[0].perplexity == runs[0][0].perplexity
    adapter.attach(model)
    with pytest.raises(RuntimeError, match="'full' would not be the model's own attention"):
        E.evaluate(model, adapter, windows, modes=("full",), progress=False)
    adapter.detach(model)
    for bad, message in ((windows[:0], "non-empty"), (windows[:, :1], "L >= 2"), (windows[0], "non-empty"),
                         (torch.zeros(1, 300, dtype=torch.long), "more than the model's context of 256")):
        with pytest.raises(ValueError, match=message):
            E.evaluate(model, adapter, bad, modes=("full",), progress=False)


@pytest.mark.parametrize("baseline", ["window", "random"])
def test_evaluate_rejects_a_baseline_without_focus(baseline):
    model = tiny_llama()
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8))
    with pytest.raises(ValueError, match=f"{baseline} needs focus too"):
        E.evaluate(model, adapter, torch.zeros(1, 16, dtype=torch.long), modes=("full", baseline))
