"""`python -m benchmarks.bench`: a tiny real run writes its report, a wrong kernel is refused before anything is
timed, and the guard holds."""

import collections
import json
import time

import pytest

from benchmarks import bench
from focus_flex import attention, native


def test_tiny_run_writes_json_markdown_and_plot(tmp_path):
    res = bench.run_bench(lengths=[512], dtypes=["float32"], repeats=1, sections=["op", "memory"],
                          output_dir=tmp_path, flex_causal_max=0, max_seconds=5, log=lambda msg: None)
    assert {c["dtype"] for c in res["correctness"]} == {"float32", "bfloat16"}
    assert all(c["max_abs_diff"] <= c["tolerance"] for c in res["correctness"])
    saved = json.loads((tmp_path / "bench.json").read_text())
    (op,) = saved["op"]
    assert op["n"] == 512 and op["kernel"] == f"flash (C, {native.library().focus_vector_bits()}-bit)"
    assert set(op["times"]) == {"focus", "focus_flex", "sdpa", "window", "fallback"}
    assert {"prefill, flash kernel", "prefill, flex kernel", "decode"} <= {c["case"] for c in res["correctness"]}
    assert 0 < op["pair_density"] <= 1 and 0 < op["density"]["total"] <= 2
    assert op["times"]["focus"]["min"] > 0
    assert [m["allocator"] for m in saved["memory"]] == ["default", "focus-flex"]
    for mem in saved["memory"]:
        assert (mem["of"], mem["n"]) == ("op", 512) and mem["focus"] > 100 and mem["sdpa"] > 100
    assert 0 < op["density"]["total"] <= 2 and op["recompiles_after_warmup"] == 0
    md = (tmp_path / "bench.md").read_text()
    assert "## Attention op" in md and "## Peak RSS" in md and "## Targets" in md and "| float32 | 512 | flash (C" in md
    assert machine_line(md).startswith(bench.machine_info()["cpu"]) and f"({native.vector_isa()})" in md
    assert "Adapter (" not in md and "Focus: G=16, top-k 1 (queries) / 1 (keys)" in md  # no model section
    assert (tmp_path / "bench.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def logits_with(model, adapter, x):
    """``model(x).logits`` with ``adapter`` attached for this call only."""
    adapter.attach(model)
    try:
        return model(x).logits
    finally:
        adapter.detach(model)


def machine_line(md: str) -> str:
    return md.splitlines()[2]


def test_decode_section_times_both_methods_in_one_process(tmp_path):
    res = bench.run_bench(sections=["decode"], decode_lengths=[600], decode_tokens=2, repeats=2, output_dir=tmp_path,
                          max_seconds=5, log=lambda msg: None)
    (dec,) = res["decode"]
    assert dec["n"] == 600 and dec["tokens"] == 2
    for method in ("focus", "sdpa", "fallback"):
        assert dec[method]["rounds"] == 2 and dec[method]["tokens_per_s"] > 0
    md = (tmp_path / "bench.md").read_text()
    assert "## Decode" in md and "Focus (op section): G=16" in md
    assert f"Adapter (prefill, decode): `{bench._find_adapter()}`: G=16, top-k 1 (queries) / 1 (keys)" in md


def test_guard_default_kernels_are_not_slower_than_their_fallbacks(tmp_path):
    """The CI guard: for every build of the C kernels this CPU runs (its own, AVX2 on an AVX-512 CPU, portable), the
    default prefill, decode step and routing at 8K tokens against the PyTorch fallbacks, in one process per build.
    A gross inversion (default > 1.3x its fallback's time) makes run_bench raise."""
    res = bench.run_bench(sections=["guard"], repeats=3, max_seconds=3, output_dir=tmp_path, log=lambda msg: None)
    assert [r["target"] for r in res["guard"]] == native.build_targets()
    bits = [int(r["kernel"].split(", ")[1].split("-")[0]) for r in res["guard"]]
    assert bits == sorted(bits, reverse=True) and bits[-1] >= 128  # each build computes with its own vector width
    for row, width in zip(res["guard"], bits, strict=True):
        assert "prefill" in row  # the decode step and routing too where the build runs them in C (wide vectors)
        assert ("decode step" in row) == ("routing" in row) == (width >= native.DECODE_MIN_BITS)
        for part in set(bench.GUARD_PARTS) & set(row):
            assert 0 < row[part]["ratio"] <= bench.GUARD_RATIO
    assert "## Guard" in (tmp_path / "bench.md").read_text()


def test_guard_judges_an_inversion_on_a_second_measurement():
    """A default slow only for a moment (its first timings) passes on the second measurement, which the result shows
    next to the first; a default slow every time stays inverted. Times per call come from ``calls`` calls."""
    state = {"calls": 0}

    def hiccup() -> None:  # 30 ms for its first 6 calls (the first measurement: warm-up excluded), then 1 ms
        state["calls"] += 1
        time.sleep(0.03 if state["calls"] <= 6 else 0.001)

    def fallback() -> None:
        time.sleep(0.005)

    noisy = bench.guard_pair(hiccup, fallback, calls=2, repeats=3, max_seconds=10)
    assert noisy["first_ratio"] > 3 * bench.GUARD_RATIO and noisy["ratio"] < 1
    assert noisy["fallback"] == pytest.approx(0.005, rel=0.8)  # per call, not per timing of 2 calls
    slow = bench.guard_pair(lambda: time.sleep(0.03), fallback, calls=2, repeats=3, max_seconds=10)
    assert slow["ratio"] > 3 * bench.GUARD_RATIO and slow["first_ratio"] > 3 * bench.GUARD_RATIO
    fine = bench.guard_pair(lambda: time.sleep(0.001), fallback, calls=2, repeats=3, max_seconds=10)
    assert fine["ratio"] < 1 and "first_ratio" not in fine
    assert "0.40 (first 4.00)" in bench._guard_cell({"default": 0.002, "fallback": 0.005, "ratio": 0.4,
                                                     "first_ratio": 4.0})


def test_a_wrong_kernel_is_refused(monkeypatch, tmp_path):
    """A fast path that forgets the attention sinks would be faster; the bench must not report it."""
    real = attention.focus_attention

    def no_sinks(q, k, v, centroids, config, **kw):
        import dataclasses

        return real(q, k, v, centroids, dataclasses.replace(config, sink_tokens=0), **kw)

    monkeypatch.setattr(attention, "focus_attention", no_sinks)
    with pytest.raises(bench.BenchError, match="wrong"):
        bench.run_bench(lengths=[512], dtypes=["float32"], repeats=1, sections=["op"], output_dir=tmp_path,
                        log=lambda msg: None)
    assert not (tmp_path / "bench.json").exists()


def test_cli_flags():
    args = bench.build_parser().parse_args(["--lengths", "4k,8192", "--sections", "op,compile", "--dtypes", "bfloat16",
                                            "--target", "x86-64-v3", "--top-k", "32", "--key-top-k", "4"])
    assert args.lengths == [4096, 8192] and args.sections == ["op", "compile"] and args.dtypes == ["bfloat16"]
    assert args.target == "x86-64-v3" and (args.top_k, args.key_top_k) == (32, 4)
    assert bench.build_parser().parse_args([]).key_top_k is None  # keys: --top-k's
    with pytest.raises(bench.BenchError, match="unknown sections"):
        bench.run_bench(sections=["op", "nope"], output_dir="unused")


def test_targets_report_met_and_missed():
    op = {"dtype": "float32", "n": 32768, "first_call_s": 1.0, "density": {"local": 0.03, "far": 0.07, "total": 0.1},
          "plan": {"min": 0.25}, "times": {"focus": {"min": 2.0}, "sdpa": {"min": 20.0}, "window": {"min": 0.5}}}
    memory = [{"of": "op", "n": 32768, "dtype": "float32", "focus": 900.0, "sdpa": 1000.0}]
    targets = {t["target"]: t for t in bench.evaluate_targets({"op": [op], "memory": memory,
                                                                "sections": ["op", "memory"]})}
    assert targets["attention op >= 8x SDPA (float32 N=32768)"]["met"]  # 10x
    assert targets["attention op >= 80% of ideal (float32 N=32768)"]["value"] == pytest.approx(1.0)
    assert not targets["routing + planning <= 10% of Focus (float32 N=32768)"]["met"]  # 12.5%
    assert targets["peak RSS <= SDPA's (op float32 N=32768, focus-flex allocator)"]["met"]


def test_decode_fit_separates_fixed_and_per_token_costs():
    """Two cache lengths give each method's fixed cost and cost per cached token."""
    def row(n, focus_ms, sdpa_ms):
        return {"n": n, "focus": {"s_per_token": focus_ms / 1e3}, "sdpa": {"s_per_token": sdpa_ms / 1e3}}

    # Focus: 80 ms + 1 ms per 1K tokens; SDPA: 50 ms + 6 ms per 1K tokens.
    fit = bench.decode_fit([row(32768, 112, 242), row(8192, 88, 98)])
    assert fit["n"] == [8192, 32768]
    assert fit["focus"]["fixed"] == pytest.approx(0.080) and fit["focus"]["per_1k"] == pytest.approx(0.001)
    assert fit["sdpa"]["fixed"] == pytest.approx(0.050) and fit["sdpa"]["per_1k"] == pytest.approx(0.006)
    assert bench.decode_fit([row(8192, 88, 98)]) is None


def test_passkey_oracle_layer_subset_is_focus_in_those_layers_only():
    """``passkey_oracle --layers``: the adapter's own centroids and means on the chosen layers; the model attends
    fully elsewhere (a tiny Llama: the subset's forward equals Focus in layer 1 and nothing in layer 0)."""
    import torch
    from test_adapter import ids, tiny

    from benchmarks.passkey_oracle import layer_subset
    from focus_flex import FocusAdapter, FocusConfig

    model = tiny("llama")
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2, center=True), seed=3)
    adapter.query_means.data.normal_()
    adapter.key_means.data.normal_()
    sub = layer_subset(adapter, [1])
    assert sub.config.layers == [1] and torch.equal(sub.centroids, adapter.centroids[1:])
    assert torch.equal(sub.key_means, adapter.key_means[1:]) and torch.equal(sub.query_means, adapter.query_means[1:])
    x = ids(1, 60)
    with torch.no_grad():
        full = model(x).logits
        partial = logits_with(model, sub, x)
        both = logits_with(model, adapter, x)
    assert (partial - full).abs().max() > 1e-4 and (partial - both).abs().max() > 1e-4
    with pytest.raises(SystemExit, match="not Focus layers"):
        layer_subset(sub, [0])
    # centered on some layers only: a subset keeps the centering of its own layers
    some = FocusAdapter(FocusConfig.from_dict({**adapter.config.to_dict(), "center": [1]}), adapter.centroids,
                        query_means=adapter.query_means, key_means=adapter.key_means)
    assert layer_subset(some, [0]).config.center is False and layer_subset(some, [1]).config.center == [1]
    assert layer_subset(some, [0, 1]).config.center == [1]
    # dense heads and layers with their own top-k: those of the subset's layers kept, the others dropped
    own = FocusAdapter(FocusConfig.from_dict({**adapter.config.to_dict(), "dense_heads": [[0, 0], [1, 1]],
                                              "layer_top_k": [[0, 3, 2], [1, 2, 2]]}), adapter.centroids,
                       query_means=adapter.query_means, key_means=adapter.key_means)
    assert layer_subset(own, [1]).config.dense_heads == [[1, 1]] and layer_subset(own, [1]).config.layer_top_k == [
        [1, 2, 2]]
    assert layer_subset(own, [0, 1]).config.layer_top_k == [[0, 3, 2], [1, 2, 2]]


def test_passkey_oracle_dense_rows_attend_fully_and_the_rest_keep_focus():
    """``passkey_oracle --dense-rows``: the chosen rows of a prefill get causal dense attention, every other output
    is the adapter's own (dense SDPA and the unpatched adapter as references); every row dense is the model without
    Focus."""
    import torch
    import torch.nn.functional as F
    from test_adapter import ids, tiny

    from benchmarks.passkey_oracle import dense_rows
    from focus_flex import FocusAdapter, FocusConfig

    model, x = tiny("llama"), ids(1, 60)  # 2 layers, 4 query heads on 2 KV heads of 16
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2), seed=3)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 96, 16), torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
    module = torch.nn.Module().eval()
    focus = adapter.forward(module, 1, q, k, v, None, None)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    with dense_rows(40, 60):
        out = adapter.forward(module, 1, q, k, v, None, None)
    assert torch.allclose(out[:, :, 40:60], dense[:, :, 40:60], atol=1e-5)
    assert not torch.allclose(focus[:, :, 40:60], dense[:, :, 40:60], atol=1e-3)
    assert torch.equal(out[:, :, :40], focus[:, :, :40]) and torch.equal(out[:, :, 60:], focus[:, :, 60:])
    step = adapter.forward(module, 1, q[:, :, -1:], k, v, None, None)
    with dense_rows(40, 60):  # a decode step is not a prefill: unchanged
        assert torch.equal(adapter.forward(module, 1, q[:, :, -1:], k, v, None, None), step)
    with torch.no_grad():
        full = model(x).logits
        adapter.attach(model)
        assert (model(x).logits - full).abs().max() > 1e-3
        with dense_rows(0, 60):
            assert torch.allclose(model(x).logits, full, atol=1e-5)


def test_wide_layers_with_every_group_attend_fully():
    """``layer_top_k`` (``passkey_oracle --wide-layers --wide-top-k``): with every group per query and key, the wide
    layers attend fully (the model without Focus there: Focus in the other layers only), and the routing meter counts
    them as dense."""
    import torch
    from test_adapter import ids, tiny

    from benchmarks.passkey_oracle import layer_subset
    from focus_flex import FocusAdapter, FocusConfig
    from focus_flex.evaluate import RoutingMeter

    model, x = tiny("llama"), ids(1, 60)
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2), seed=3)
    with torch.no_grad():
        full = model(x).logits
        only_0 = logits_with(model, layer_subset(adapter, [0]), x)
        adapter.attach(model)
        focus = model(x).logits
        meter = RoutingMeter(adapter)
        adapter.config.layer_top_k = [[1, 4, 4]]
        wide_1 = model(x).logits
        adapter.config.layer_top_k = [[0, 4, 4], [1, 4, 4]]
        wide_all = model(x).logits
        meter.close()
    assert (focus - full).abs().max() > 1e-3 and (focus - only_0).abs().max() > 1e-3
    assert torch.allclose(wide_1, only_0, atol=1e-5) and torch.allclose(wide_all, full, atol=1e-5)
    assert meter.density[0] < 1 and meter.density[1] == pytest.approx(1.0) and meter.density[2:] == [1.0, 1.0]


def test_passkey_oracle_adaptive_layers_take_groups_until_they_hold_the_mass():
    """``passkey_oracle --adaptive-layers`` (the groups: :func:`routing.mass_membership`, tested in test_train): with
    a vanishing mass the adapter is itself, with all the mass in every group the adaptive layer attends fully (keys
    in one group each: Focus in the other layers only), and the stats count the groups and the added pairs."""
    import torch
    from test_adapter import ids, tiny

    import focus_flex.adapter
    from benchmarks.passkey_oracle import adaptive_layers, layer_subset
    from focus_flex import FocusAdapter, FocusConfig
    from focus_flex.attention import reference_attention

    model, ids_ = tiny("llama"), ids(1, 60)
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2), seed=3)
    with torch.no_grad():
        full = model(ids_).logits
        only_0 = logits_with(model, layer_subset(adapter, [0]), ids_)
        adapter.attach(model)
        focus = model(ids_).logits
        narrow, wide = collections.defaultdict(list), collections.defaultdict(list)
        with adaptive_layers([1], 1e-6, 4, narrow):
            same = model(ids_).logits
        with adaptive_layers([1], 1.0, 4, wide):
            dense_1 = model(ids_).logits
    assert (focus - full).abs().max() > 1e-3 and (focus - only_0).abs().max() > 1e-3
    assert torch.allclose(same, focus, atol=1e-5) and torch.allclose(dense_1, only_0, atol=1e-5)
    assert narrow == {"groups": [1.0], "added": [0.0]}
    assert wide["groups"] == [4.0] and 0 < wide["added"][0] < 1
    assert adapter.mode == "fast"
    with adaptive_layers([], 1.0, 4, wide):  # no layers: the reference path the other variants patch stays theirs
        assert focus_flex.adapter.reference_attention is reference_attention

def test_passkey_oracle_needle_rows_attend_everything_and_the_rest_keep_the_pattern():
    """``passkey_oracle --variants needle-rows``: the needle's queries get causal dense attention, every other query
    the adapter's own pattern (checked against dense SDPA and the unpatched reference)."""
    import torch
    import torch.nn.functional as F

    import focus_flex.adapter
    from benchmarks.passkey_oracle import extra_pairs
    from focus_flex import FocusConfig
    from focus_flex.attention import reference_attention

    torch.manual_seed(0)
    config = FocusConfig(num_groups=4, window=8, sink_tokens=2)
    q, k, v = torch.randn(1, 4, 96, 16), torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
    centroids = F.normalize(torch.randn(2, 4, 16), dim=-1)
    needle = (40, 52)
    with extra_pairs("needle-rows", 96, needle, tail=0):
        out = focus_flex.adapter.reference_attention(q, k, v, centroids, config)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    focus = reference_attention(q, k, v, centroids, config)
    rows = torch.zeros(96, dtype=torch.bool)
    rows[needle[0]:needle[1]] = True
    assert torch.allclose(out[:, :, rows], dense[:, :, rows], atol=1e-5)
    assert torch.allclose(out[:, :, ~rows], focus[:, :, ~rows], atol=1e-6)
    assert not torch.allclose(focus[:, :, rows], dense[:, :, rows], atol=1e-3)  # the pattern alone is not dense there


def test_passkey_oracle_denominator_keeps_full_attentions_probabilities_on_the_pattern():
    """``passkey_oracle --variants denominator``: full attention's softmax, its probabilities zeroed off the Focus
    pattern and not renormalised (checked against a hand-built softmax and dense SDPA where the pattern is dense)."""
    import torch
    import torch.nn.functional as F

    import focus_flex.adapter
    from benchmarks.passkey_oracle import extra_pairs
    from focus_flex import FocusConfig
    from focus_flex.attention import focus_pattern

    torch.manual_seed(0)
    config = FocusConfig(num_groups=4, window=8, sink_tokens=2)
    q, k, v = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    centroids = F.normalize(torch.randn(2, 4, 16), dim=-1)
    with extra_pairs("denominator", 64, (0, 0), tail=0):
        out = focus_flex.adapter.reference_attention(q, k, v, centroids, config)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    causal = torch.ones(64, 64, dtype=torch.bool).tril()
    p = (q @ kk.transpose(-1, -2) / 4).masked_fill(~causal, float("-inf")).softmax(-1)
    mask = focus_pattern(q, k, centroids, config)
    assert torch.allclose(out, (p * mask) @ vv, atol=1e-5)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(out[:, :, :8], dense[:, :, :8], atol=1e-5)  # rows inside the window: nothing dropped
    assert not torch.allclose(out[:, :, 32:], dense[:, :, 32:], atol=1e-3)


def test_passkey_oracle_summaries_add_one_mean_key_per_far_block():
    """``passkey_oracle --variants summaries``: the Focus pattern plus, per query, the mean key (logit + log block) and
    mean value of every block wholly between the sinks and its window (checked against a hand-built softmax)."""
    import math

    import torch
    import torch.nn.functional as F

    import focus_flex.adapter
    from benchmarks.passkey_oracle import block_summaries
    from focus_flex import FocusConfig
    from focus_flex.attention import focus_pattern, reference_attention

    torch.manual_seed(0)
    config = FocusConfig(num_groups=4, window=8, sink_tokens=2)
    q, k, v = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    centroids = F.normalize(torch.randn(2, 4, 16), dim=-1)
    with block_summaries(16):
        out = focus_flex.adapter.reference_attention(q, k, v, centroids, config)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    mask = focus_pattern(q, k, centroids, config)
    k_sum, v_sum = kk.unflatten(2, (4, 16)).mean(3), vv.unflatten(2, (4, 16)).mean(3)  # [1, 4, blocks, 16]
    i, b = torch.arange(64)[:, None], torch.arange(4)[None, :]
    seen = (b * 16 >= 2) & (b * 16 + 15 <= i - 8)  # block 0 holds the sinks; block 1 from query 39 on
    scores = torch.cat([(q @ kk.transpose(-1, -2) / 4).masked_fill(~mask, float("-inf")),
                        (q @ k_sum.transpose(-1, -2) / 4 + math.log(16)).masked_fill(~seen, float("-inf"))], -1)
    assert torch.allclose(out, scores.softmax(-1) @ torch.cat([vv, v_sum], 2), atol=1e-5)
    focus = reference_attention(q, k, v, centroids, config)
    assert torch.allclose(out[:, :, :39], focus[:, :, :39], atol=1e-6)  # no whole block before the window yet
    assert not torch.allclose(out[:, :, 39:], focus[:, :, 39:], atol=1e-3)
    # A dense tail's queries attend every key already: they get no summaries on top.
    config.dense_tail = 4
    with block_summaries(16):
        out = focus_flex.adapter.reference_attention(q, k, v, centroids, config)
    dense = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    assert torch.allclose(out[:, :, 60:], dense[:, :, 60:], atol=1e-5)
    assert torch.allclose(out[:, :, 39:60], scores.softmax(-1)[:, :, 39:60] @ torch.cat([vv, v_sum], 2), atol=1e-5)


def test_union_study_adds_the_other_adapters_pattern_in_the_chosen_layers():
    """``union_study``: with an "other" adapter whose window covers the whole text, its pattern in layer 1 is full
    attention, so the union equals Focus in layer 0 only (passkey_oracle.layer_subset); the pairs count it."""
    import torch
    from test_adapter import ids, tiny

    from benchmarks.passkey_oracle import layer_subset
    from benchmarks.union_study import union_pattern
    from focus_flex import FocusAdapter, FocusConfig

    model = tiny("llama")
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2, center=True), seed=3)
    adapter.query_means.data.normal_()
    adapter.key_means.data.normal_()
    wide = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=64, sink_tokens=2), seed=4)
    x = ids(1, 60)
    with torch.no_grad():
        expected = logits_with(model, layer_subset(adapter, [0]), x)
        adapter.attach(model)
        alone = model(x).logits
        adapter.mode = "reference"
        pairs: list = []
        with union_pattern(adapter, wide, [1], model, pairs):
            got = model(x).logits
    assert (got - expected).abs().max() <= 1e-4 and (got - alone).abs().max() > 1e-4
    assert len(pairs) == 2 and pairs[1][0] == pairs[1][1] == 60 * 61 / 2 and pairs[0][0] < pairs[0][1]


def test_layer_fidelity_is_the_full_attention_mass_on_the_reference_pattern():
    """``layer_fidelity``: ``kept`` is the share of each query's full attention probability on the pairs of the
    reference pattern (``focus_pattern``), averaged over the queries of each head; a window over the whole text keeps
    all of it, with no output error and no far mass; ``window`` scores the adapter's pattern with that window."""
    import torch
    from test_adapter import ids, tiny

    from benchmarks.layer_fidelity import layer_fidelity
    from focus_flex import FocusAdapter, FocusConfig
    from focus_flex.attention import focus_pattern
    from focus_flex.train import centerings, teacher_qkv

    model = tiny("llama")
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2, center=True), seed=3)
    adapter.query_means.data.normal_()
    adapter.key_means.data.normal_()
    qkv = teacher_qkv(model, ids(1, 60))
    idx = torch.tensor([20, 41, 59])
    got = layer_fidelity(model, adapter, qkv, idx)
    for layer, slot in adapter.slot.items():
        q, k, _, scale = qkv[layer]
        mask = focus_pattern(q, k, adapter.centroids.detach()[slot], adapter.config,
                             centering=centerings(adapter, model)[slot])[:, :, idx]
        kk = k.repeat_interleave(q.shape[1] // k.shape[1], 1)
        p = (q[:, :, idx] @ kk.transpose(-1, -2) * scale).masked_fill(idx[:, None] < torch.arange(60), -torch.inf)
        expected = (p.softmax(-1) * mask).sum(-1).mean(-1)[0]  # [Hq]
        kept, error, _ = got[layer]
        assert (kept - expected).abs().max() <= 1e-5 and kept.mean() < 0.999 and error.mean() > 0
    wide = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=64, sink_tokens=2), seed=3)
    for kept, error, far in layer_fidelity(model, wide, qkv, idx).values():
        assert (kept - 1).abs().max() <= 1e-6 and error.max() <= 1e-10 and far.max() == 0
    for kept, error, far in layer_fidelity(model, adapter, qkv, idx, window=64).values():  # the window given
        assert (kept - 1).abs().max() <= 1e-6 and error.max() <= 1e-10 and far.max() == 0
    narrow = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2), seed=3)
    as_narrow = layer_fidelity(model, wide, qkv, idx, window=8)  # the wide adapter's centroids, narrow's window
    for layer, row in layer_fidelity(model, narrow, qkv, idx).items():
        assert torch.equal(as_narrow[layer], row) and row[2].min() > 0


def test_output_kl_retrieval_prompt_hides_the_code_and_scores_its_tokens():
    """``output_kl``'s training-side retrieval prompt: exactly ``length`` tokens, the code twice in the needle and once
    as the answer's last tokens, which the returned positions predict."""
    import random

    from benchmarks.output_kl import retrieval_prompt
    from focus_flex.data import load_documents
    from focus_flex.models import load_model

    _, tok = load_model()
    book = tok(" ".join(load_documents(None, "train")[0].split()[:3000]), add_special_tokens=False)["input_ids"]
    for length in (512, 700):
        seq, pos = retrieval_prompt(tok, book, length, random.Random(length))
        assert seq.shape == (length,) and int(pos[-1]) == length - 2
        text = tok.decode(seq)
        answer = tok.decode(seq[pos + 1])
        code = answer.strip()
        assert len(code) == 7 and code.replace("-", "").isdigit() and text.count(code) == 3
        assert text.endswith("The secret code is" + answer) and tok.decode(seq[:pos[0] + 1]).endswith("code is")


def test_prompt_ablation_scores_the_key_as_generation_does():
    """``prompt_ablation.key_scores`` (the key teacher-forced in one forward pass) gives full attention's log-
    probabilities of the library's ``answer_key`` (prefill, then decode steps on the KV cache), its greedy answer's
    score, and the first token's margin over the best other token; every variant's prompt keeps the haystack and
    changes its words."""
    import torch

    from benchmarks.prompt_ablation import DASHED, VARIANTS, key_scores
    from focus_flex.models import load_model
    from focus_flex.passkey import PromptText, answer_key, build_prompt, score

    model, tok = load_model()
    p = build_prompt(tok, 300, 30, "58213", "filler")
    first, rest, margin, greedy = key_scores(model, tok, p.input_ids, "58213")
    answer, logprobs = answer_key(model, tok, p.input_ids, "58213")
    assert greedy == score(answer, "58213")
    wrong = key_scores(model, tok, p.input_ids, "58214")
    assert wrong[3] is False and wrong[1] < rest
    assert abs(first - logprobs[0]) < 1e-3 and abs(rest - sum(logprobs[1:])) < 1e-3
    with torch.no_grad():
        logits = model(p.input_ids[None]).logits[0, -1]
    space = tok(" 58213", add_special_tokens=False).input_ids[0]
    assert abs(margin - (logits[space] - logits[torch.arange(len(logits)) != space].max()).item()) < 1e-3
    assert VARIANTS["passkey"] == PromptText() and set(DASHED) <= set(VARIANTS)
    for name, text in VARIANTS.items():
        if name not in ("passkey", "key format"):
            assert text != PromptText(), name
            assert tok.decode(build_prompt(tok, 300, 30, "58213", "filler", text=text).input_ids).count("58213") >= 1


def test_passkey_oracle_best_pairs_keep_the_likeliest_far_pairs_at_focus_cost():
    """``passkey_oracle --variants best-pairs``: in each head the window and sinks, plus as many far pairs as the Focus
    pattern keeps there, those of highest full-attention probability (checked against a hand-built selection and
    softmax); it keeps more attention mass than the pattern at the same density."""
    import torch
    import torch.nn.functional as F

    import focus_flex.adapter
    from benchmarks.passkey_oracle import best_pairs
    from focus_flex import FocusConfig
    from focus_flex.attention import focus_pattern

    torch.manual_seed(0)
    config = FocusConfig(num_groups=4, window=8, sink_tokens=2)
    q, k, v = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    centroids = F.normalize(torch.randn(2, 4, 16), dim=-1)
    stats = {"focus density": [], "focus mass": [], "best density": [], "best mass": []}
    with best_pairs(stats):
        out = focus_flex.adapter.reference_attention(q, k, v, centroids, config)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    i, j = torch.arange(64)[:, None], torch.arange(64)[None, :]
    causal = j <= i
    local = causal & ((i - j < 8) | (j < 2))
    p = (q @ kk.transpose(-1, -2) / 4).masked_fill(~causal, float("-inf")).softmax(-1)[0]  # [4, 64, 64]
    far_kept = (focus_pattern(q, k, centroids, config)[0] & ~local).flatten(1).sum(-1)  # [4]
    chosen = local.expand(4, -1, -1).clone()
    for h in range(4):
        order = p[h].masked_fill(~causal | local, -1.0).flatten().argsort(descending=True)[:int(far_kept[h])]
        chosen[h].view(-1)[order] = True
    expected = (p * chosen / (p * chosen).sum(-1, keepdim=True)) @ vv[0]
    assert torch.allclose(out[0], expected, atol=1e-5)
    assert stats["best density"] == pytest.approx(stats["focus density"], abs=1e-9)
    assert all(b > f for b, f in zip(stats["best mass"], stats["focus mass"], strict=True))
    assert not torch.allclose(out, focus_flex.attention.reference_attention(q, k, v, centroids, config), atol=1e-3)
    denser = {"focus density": [], "focus mass": [], "best density": [], "best mass": []}
    with best_pairs(denser, density=0.6):  # a budget of its own: 60% of each head's causal pairs
        focus_flex.adapter.reference_attention(q, k, v, centroids, config)
    assert denser["best density"] == pytest.approx([0.6] * 4, abs=1 / causal.sum().item())
    assert all(b > f for b, f in zip(denser["best mass"], stats["best mass"], strict=True))
    rows = {"focus density": [], "focus mass": [], "best density": [], "best mass": []}
    with best_pairs(rows, per_row=True):  # best-rows: each query keeps as many far pairs as Focus gives it
        out = focus_flex.adapter.reference_attention(q, k, v, centroids, config)
    far_kept = (focus_pattern(q, k, centroids, config)[0] & ~local).sum(-1)  # [4, 64]
    ranks = p.masked_fill(~causal | local, -1.0).argsort(-1, descending=True).argsort(-1)
    chosen = local | (ranks < far_kept[..., None])
    expected = (p * chosen / (p * chosen).sum(-1, keepdim=True)) @ vv[0]
    assert torch.allclose(out[0], expected, atol=1e-5)
    assert rows["best density"] == pytest.approx(rows["focus density"], abs=1e-9)
    assert all(f <= r < b for f, r, b in zip(rows["focus mass"], rows["best mass"], stats["best mass"], strict=True))


def test_passkey_oracle_best_error_keeps_the_far_pairs_whose_loss_moves_the_output_most():
    """``passkey_oracle --variants best-error``: in each head the window and sinks, plus the far pairs whose removal
    alone moves their row's full-attention output most, ``p |o - v| / (1 - p)`` (checked against a hand-built
    selection), as many as make ``density`` of the causal pairs; not the likeliest pairs."""
    import torch

    import focus_flex.adapter
    from benchmarks.passkey_oracle import best_pairs
    from focus_flex import FocusConfig

    torch.manual_seed(0)
    config = FocusConfig(num_groups=4, window=8, sink_tokens=2)
    q, k = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16)
    v = torch.randn(1, 2, 64, 16) * torch.rand(1, 2, 64, 1) * 4  # values of unequal norms: error and probability differ
    centroids = torch.nn.functional.normalize(torch.randn(2, 4, 16), dim=-1)
    kk, vv = k.repeat_interleave(2, dim=1), v.repeat_interleave(2, dim=1)
    i, j = torch.arange(64)[:, None], torch.arange(64)[None, :]
    causal = j <= i
    local = causal & ((i - j < 8) | (j < 2))
    p = (q @ kk.transpose(-1, -2) / 4).masked_fill(~causal, float("-inf")).softmax(-1)[0]  # [4, 64, 64]
    moved = p * torch.cdist(p @ vv[0], vv[0]) / (1 - p)  # [4, 64, 64]: how far dropping (i, j) alone moves o_i
    kept = round(0.4 * int(causal.sum())) - int(local.sum())
    outputs = {}
    for by_error, ranking in ((True, moved), (False, p)):
        stats = {"focus density": [], "focus mass": [], "best density": [], "best mass": []}
        with best_pairs(stats, density=0.4, by_error=by_error):
            outputs[by_error] = focus_flex.adapter.reference_attention(q, k, v, centroids, config)
        chosen = local.expand(4, -1, -1).clone()
        for h in range(4):
            order = ranking[h].masked_fill(~causal | local, -1.0).flatten().argsort(descending=True)[:kept]
            chosen[h].view(-1)[order] = True
        expected = (p * chosen / (p * chosen).sum(-1, keepdim=True)) @ vv[0]
        assert torch.allclose(outputs[by_error][0], expected, atol=1e-5)
        assert stats["best density"] == pytest.approx([0.4] * 4, abs=1 / causal.sum().item())
    assert not torch.allclose(outputs[True], outputs[False], atol=1e-3)


def test_passkey_oracle_best_pairs_in_some_layers_keep_focus_in_the_others():
    """``passkey_oracle --oracle-layers``: the best-pairs choice in the named layers only; the other Focus layers
    attend with the adapter's own pattern (the unpatched reference path) and add no stats."""
    import torch
    from test_adapter import tiny

    from benchmarks.passkey_oracle import best_pairs
    from focus_flex import FocusAdapter, FocusConfig
    from focus_flex.attention import reference_attention

    model = tiny("llama")  # 2 layers, 4 query heads on 2 KV heads of 16
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2), seed=3)
    adapter.mode = "reference"
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 64, 16), torch.randn(1, 2, 64, 16), torch.randn(1, 2, 64, 16)
    module = torch.nn.Module().eval()
    focus = [reference_attention(q, k, v, adapter.centroids[s].detach(), adapter.config) for s in (0, 1)]
    with best_pairs():
        oracle = [adapter.forward(module, s, q, k, v, None, None) for s in (0, 1)]
    stats = {"focus density": [], "focus mass": [], "best density": [], "best mass": []}
    with best_pairs(stats, layers=[1]):
        mixed = [adapter.forward(module, s, q, k, v, None, None) for s in (0, 1)]
    assert not torch.allclose(oracle[0], focus[0], atol=1e-3) and not torch.allclose(oracle[1], focus[1], atol=1e-3)
    assert torch.equal(mixed[0], focus[0]) and torch.equal(mixed[1], oracle[1])
    assert len(stats["best mass"]) == 4  # layer 1's heads only


def test_passkey_oracle_moment_summaries_of_single_keys_are_full_attention():
    """``passkey_oracle --variants moments``: with blocks of one key every dropped key is its own summary (count 1,
    variance 0), so each order gives full causal attention (dense SDPA as reference); wider blocks change the Focus
    output but not the rows the dense tail already attends fully."""
    import torch
    import torch.nn.functional as F

    import focus_flex.adapter
    from benchmarks.passkey_oracle import moment_summaries
    from focus_flex import FocusConfig
    from focus_flex.attention import reference_attention

    config = FocusConfig(num_groups=4, window=8, sink_tokens=2, dense_tail=6)
    torch.manual_seed(0)
    q, k, v = torch.randn(1, 4, 96, 16), torch.randn(1, 2, 96, 16), torch.randn(1, 2, 96, 16)
    centroids = F.normalize(torch.randn(2, 4, 16), dim=-1)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
    focus = reference_attention(q, k, v, centroids, config)
    assert not torch.allclose(focus, full, atol=1e-3)
    for order in (0, 1, 2):
        with moment_summaries(1, order):
            out = focus_flex.adapter.reference_attention(q, k, v, centroids, config)
        assert torch.allclose(out, full, atol=1e-5), order
    with moment_summaries(16, 1):
        out = focus_flex.adapter.reference_attention(q, k, v, centroids, config)
    assert not torch.allclose(out[:, :, :90], focus[:, :, :90], atol=1e-3)
    assert torch.allclose(out[:, :, 90:], full[:, :, 90:], atol=1e-5)  # the dense tail: no summaries
    with pytest.raises(ValueError, match="order 0, 1 or 2; got 3"), moment_summaries(16, 3):
        pass


@pytest.mark.slow
def test_lower_layers_perplexity_compares_the_adapter_as_it_is_with_its_wide_layers(smollm2, capsys):
    """``lower_layers perplexity``: first the adapter as it is (its own ``layer_top_k`` included), then with the
    queries of ``--wide-layers`` in ``--wide-top-k`` groups; the adapter's listing is its own again afterwards."""
    import argparse

    from benchmarks.lower_layers import perplexity
    from focus_flex import FocusAdapter
    from focus_flex.data import load_documents, token_windows
    from focus_flex.evaluate import evaluate

    model, tokenizer = smollm2
    adapter = FocusAdapter.from_pretrained("hub/smollm2-135m-instruct-focus")
    own = [[0, 32, 4], [2, 32, 4]]
    adapter.config.layer_top_k = own
    args = argparse.Namespace(context=512, eval_windows=1, adaptive_mass=None, wide_layers=[2, 3], wide_top_k=[8, 4])
    perplexity(model, tokenizer, adapter, args)
    lines = capsys.readouterr().out.splitlines()
    assert adapter.config.layer_top_k == own
    windows = token_windows(load_documents(None, "eval"), tokenizer, 512, max_windows=1)
    as_is = evaluate(model, adapter, windows, modes=("focus",), progress=False)[0]
    assert lines[0] == f"the adapter as it is: focus perplexity {as_is.perplexity:.3f}, density " \
                       f"{100 * as_is.density:.1f}%"
    adapter.config.layer_top_k = [[0, 32, 4], [2, 8, 4], [3, 8, 4]]  # layer 0 kept, 2 and 3 at the wide top-k
    wide = evaluate(model, adapter, windows, modes=("focus",), progress=False)[0]
    assert lines[2] == f"layers [2, 3] with groups per query and key 8, 4: focus perplexity {wide.perplexity:.3f}, " \
                       f"density {100 * wide.density:.1f}%"
    assert lines[0] != lines[2].replace("layers [2, 3] with groups per query and key 8, 4", "the adapter as it is")


def test_lower_layers_attribution_is_the_first_order_change_of_the_keys_logprob(smollm2):
    """``lower_layers attribution`` (:func:`benchmarks.lower_layers.layer_changes`) on the embedded model and the
    published adapter: a layer's first-order change equals the central difference of the target's log-probability
    when a multiple of (the adapter's output in that layer alone - the model's own) is added to that layer's
    attention output in the model's forward pass; the adapter's output taken from the adapter's own path
    (``passkey_oracle --layers``), in an uncentered layer and a centered one."""
    import torch

    from benchmarks.lower_layers import layer_changes
    from benchmarks.passkey_oracle import layer_subset
    from focus_flex import FocusAdapter
    from focus_flex.data import load_documents
    from focus_flex.train import centerings

    model, tokenizer = smollm2
    adapter = FocusAdapter.from_pretrained("hub/smollm2-135m-instruct-focus")
    adapter.config.dense_tail = 0  # the prompt's rows and the target's: one Focus prefill in the reference run
    ids = torch.tensor(tokenizer(load_documents(None, "eval")[0]).input_ids[:700])
    target = tokenizer(" 71432", add_special_tokens=False).input_ids
    seq, n = torch.cat([ids, torch.tensor(target)])[None], len(ids)
    layers = [2, 20]
    cents = centerings(adapter, model)
    assert cents[adapter.slot[2]] is None and cents[adapter.slot[20]] is not None  # uncentered, centered
    base, changes = layer_changes(model, adapter, ids, target, layers)

    def attention_input(layer: int, attached: FocusAdapter | None) -> torch.Tensor:
        seen = []
        hook = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(lambda m, a: seen.append(a[0]))
        try:
            if attached is not None:
                attached.attach(model)
            with torch.no_grad():
                model(seq)
        finally:
            hook.remove()
            if attached is not None:
                attached.detach(model)
        return seen[0]

    def target_logprob(layer: int, delta: torch.Tensor) -> float:
        hook = model.model.layers[layer].self_attn.o_proj.register_forward_pre_hook(lambda m, a: (a[0] + delta,))
        try:
            with torch.no_grad():
                logp = model(seq).logits[0, n - 1:-1].float().log_softmax(-1)
        finally:
            hook.remove()
        return logp.gather(-1, torch.tensor(target)[:, None]).sum().item()

    for layer in layers:
        delta = attention_input(layer, layer_subset(adapter, [layer])) - attention_input(layer, None)
        delta[:, n:] = 0  # the target's own rows: dense decode
        eps = 0.05
        numeric = (target_logprob(layer, eps * delta) - target_logprob(layer, -eps * delta)) / (2 * eps)
        change, weight = changes[layer]
        assert change.shape == weight.shape == (n,) and abs(numeric) > 1e-3, (layer, numeric)
        assert abs(change.sum().item() - numeric) < 0.05 * abs(numeric) + 2e-3, (layer, change.sum().item(), numeric)
    assert abs(base - target_logprob(2, torch.zeros(1))) < 1e-3


def test_position_window_is_the_dense_pattern_with_a_window_per_position():
    import torch

    from benchmarks import position_window as pw
    from focus_flex import evaluate, routing
    from focus_flex.attention import focus_pattern
    from focus_flex.config import FocusConfig

    torch.manual_seed(0)
    n, config = 700, FocusConfig(num_groups=8, key_top_k=2, window=256, sink_tokens=4, dense_tail=32)
    q, k, v = torch.randn(1, 6, n, 32), torch.randn(1, 2, n, 32), torch.randn(1, 2, n, 32)
    centroids = torch.randn(2, 8, 32)
    windows = pw.position_windows(n, 256, 64, 4, 32)
    assert windows[0] == 64 and windows[400] == 96 and windows[-1] == 160  # grows with the chunk's start
    out = pw.chunked_attention(q, k, v, centroids, config, 64, 4)
    # independent reference: the dense pattern with the groups, the sinks and a window per query position
    groups = focus_pattern(q, k, centroids, FocusConfig(num_groups=8, key_top_k=2, window=1, sink_tokens=4))
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    mask = groups | ((j <= i) & ((i - j < windows[:, None]) | (i >= n - 32)))
    scores = (q @ k.repeat_interleave(3, 1).transpose(-1, -2)) * 32 ** -0.5
    ref = scores.masked_fill(~mask, float("-inf")).softmax(-1) @ v.repeat_interleave(3, 1)
    torch.testing.assert_close(out, ref, atol=2e-5, rtol=1e-4)
    qm = routing.hard_membership(q, centroids, 1)[0]
    km = routing.hard_membership(k, centroids, 2)[0]
    density = pw.pattern_density(qm, km, windows, 4, 32, [])
    assert density == pytest.approx(float(mask.sum()) / (6 * n * (n + 1) / 2))
    fixed = pw.pattern_density(qm, km, torch.full((n,), 256), 4, 32, [1])  # KV head 1 dense: its 3 query heads
    library = evaluate.pattern_density(qm[None], km[None], 256, 4, 32)[0]
    assert fixed == pytest.approx((library[:3].sum().item() + 3) / 6)
