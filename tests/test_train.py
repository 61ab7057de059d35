"""Tests of focus_flex.train: only centroids learn, runs are reproducible, resumable and data-parallel."""

from __future__ import annotations

import dataclasses
import math
import os
import re

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel
from transformers import Gemma3ForCausalLM, Gemma3TextConfig, LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

from focus_flex import FocusAdapter, FocusConfig, routing
from focus_flex import train as T
from focus_flex.adapter import has_focus
from focus_flex.attention import focus_pattern, reference_attention
from focus_flex.train import TrainConfig, capture_qkv, distill_layer_loss, model_checksum, train

FOCUS = FocusConfig(num_groups=4, window=8, sink_tokens=2, block_size=16)


def tiny_llama(seed: int = 0) -> LlamaForCausalLM:
    torch.manual_seed(seed)
    cfg = LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                      num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    return LlamaForCausalLM(cfg).eval()


def windows(n: int = 6, length: int = 48, seed: int = 1) -> torch.Tensor:
    return torch.randint(0, 96, (n, length), generator=torch.Generator().manual_seed(seed))


def run(objective: str = "distill", *, seed: int = 0, steps: int = 3, batch_size: int = 2, tc_repeats: int = 0,
        **kw) -> FocusAdapter:
    model = tiny_llama()
    adapter = FocusAdapter.for_model(model, FOCUS, seed=seed)
    tc = TrainConfig(objective=objective, steps=steps, batch_size=batch_size, seq_len=48, query_samples=16, seed=seed,
                     repeats=tc_repeats, repeat_span=4)
    train(model, adapter, windows(), tc, progress=False, **kw)
    return adapter


@pytest.mark.parametrize("objective", ["distill", "lm", "kd"])
def test_only_centroids_get_gradients_and_base_model_is_untouched(objective):
    model = tiny_llama()
    adapter = FocusAdapter.for_model(model, FOCUS)
    before = model_checksum(model)
    tc = TrainConfig(objective=objective, steps=1, batch_size=2, seq_len=48, query_samples=16)
    model.requires_grad_(False)
    if objective != "distill":
        adapter.mode = "soft"
        adapter.attach(model)
    parts = T.accumulate_gradients(model, adapter, windows()[:2], [0, 1], tc, step=0)
    assert all(p.grad is None for p in model.parameters())
    g = adapter.centroids.grad
    assert g is not None and torch.isfinite(g).all() and g.abs().sum() > 0
    assert parts["loss"] > 0 and parts["balance"] > 0
    if objective != "distill":
        adapter.detach(model)
    start = adapter.centroids.detach().clone()
    train(model, adapter, windows(), tc, progress=False)
    assert model_checksum(model) == before
    assert not torch.equal(adapter.centroids.detach(), start)
    assert torch.allclose(adapter.centroids.norm(dim=-1), torch.ones(()), atol=1e-5)


def test_checksum_sees_any_change():
    model = tiny_llama()
    before = model_checksum(model)
    with torch.no_grad():
        model.model.layers[1].mlp.up_proj.weight[3, 5] += 1e-7
    assert model_checksum(model) != before


@pytest.mark.parametrize("objective", ["distill", "lm", "kd"])
def test_same_seed_same_centroids(objective):
    a, b, c = run(objective, seed=3), run(objective, seed=3), run(objective, seed=4)
    assert torch.equal(a.centroids, b.centroids)
    assert not torch.equal(a.centroids, c.centroids)


def test_resume_equals_uninterrupted(tmp_path, monkeypatch):
    tc = TrainConfig(steps=4, batch_size=1, seq_len=48, query_samples=16, checkpoint_every=2)

    def fresh(seed: int = 0) -> tuple[LlamaForCausalLM, FocusAdapter]:
        model = tiny_llama()
        return model, FocusAdapter.for_model(model, FOCUS, seed=seed)

    model, full = fresh()
    train(model, full, windows(), tc, progress=False)

    real, calls = T.accumulate_gradients, []

    def crash_at_step_3(*args, **kwargs):
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return real(*args, **kwargs)

    monkeypatch.setattr(T, "accumulate_gradients", crash_at_step_3)
    model, adapter = fresh()
    with pytest.raises(KeyboardInterrupt):
        train(model, adapter, windows(), tc, progress=False, output_dir=str(tmp_path))
    monkeypatch.setattr(T, "accumulate_gradients", real)
    assert T.latest_checkpoint(str(tmp_path)).endswith("step-000002")

    model, resumed = fresh(seed=99)  # another start: everything comes from the checkpoint
    history = train(model, resumed, windows(), tc, progress=False, output_dir=str(tmp_path), resume=str(tmp_path))
    assert [h["step"] for h in history] == [1, 2, 3, 4]
    assert torch.equal(resumed.centroids, full.centroids)
    assert T.latest_checkpoint(str(tmp_path)).endswith("step-000004")

    # A checkpoint only continues the run it came from: same settings, not past its end.
    more = TrainConfig(**{**tc.__dict__, "steps": 6, "checkpoint_every": 1})  # (these two may change)
    for other, focus, message in ((TrainConfig(**{**more.__dict__, "seed": 7}), FOCUS, "seed: 0 there, 7 now"),
                                  (more, FocusConfig(**{**FOCUS.to_dict(), "window": 9}), "window: 8 there, 9 now"),
                                  (TrainConfig(**{**more.__dict__, "steps": 3}), FOCUS, "at step 4, past --steps 3")):
        model = tiny_llama()
        with pytest.raises(ValueError, match=message):
            train(model, FocusAdapter.for_model(model, focus), windows(), other, progress=False,
                  resume=str(tmp_path))
    state = os.path.join(T.latest_checkpoint(str(tmp_path)), T.STATE_NAME)
    with open(state, "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="cannot resume from"):
        train(model, FocusAdapter.for_model(model, FOCUS), windows(), more, progress=False, resume=str(tmp_path))


def test_a_checkpoint_from_before_a_setting_existed_resumes_with_its_default():
    """A checkpoint's train_config lacks settings added since it was saved: they were the default then."""
    tc = TrainConfig(steps=4)
    older = {k: v for k, v in tc.__dict__.items() if k not in ("query_mass", "query_most", "entropy_weight")}
    T._check_resume("ckpt", {"step": 2, "train_config": older}, FOCUS, FOCUS, tc)
    with pytest.raises(ValueError, match="query_mass: None there, 0.8 now"):
        T._check_resume("ckpt", {"step": 2, "train_config": older}, FOCUS, FOCUS, TrainConfig(steps=4, query_mass=0.8))


def test_a_checkpoint_resumes_only_with_the_same_per_layer_settings():
    """Layers with their own top-k and dense heads change what training routes: a checkpoint made with other ones
    is refused, naming the field."""
    tc = TrainConfig(steps=4)
    state = {"step": 2, "train_config": tc.__dict__}
    for field, value in (("layer_top_k", [[0, 2, 2]]), ("dense_heads", [[0, 1]])):
        with pytest.raises(ValueError, match=rf"{field}: \[\] there, {re.escape(str(value))} now"):
            T._check_resume("ckpt", state, FOCUS, dataclasses.replace(FOCUS, **{field: value}), tc)


def _ddp_worker(rank: int, world: int, init_file: str, out: str, objective: str) -> None:
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        adapter = run(objective, steps=2, batch_size=2)
        if rank == 0:
            torch.save(adapter.centroids.detach(), out)
    finally:
        dist.destroy_process_group()


@pytest.mark.parametrize("objective", ["distill", "lm"])
def test_two_processes_match_one(tmp_path, objective):
    out = str(tmp_path / "ddp.pt")
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "init"), out, objective), nprocs=2, join=True)
    single = run(objective, steps=2, batch_size=2)
    assert torch.allclose(torch.load(out), single.centroids.detach(), atol=1e-6, rtol=0)


def test_batches_are_a_pure_function_of_seed_and_step():
    seen = [i for step in range(3) for i in T.batch_indices(5, 5, seed=0, step=step)]
    assert sorted(seen[:5]) == list(range(5))  # an epoch is a permutation
    assert T.batch_indices(5, 2, 0, 7) == T.batch_indices(5, 2, 0, 7) != T.batch_indices(5, 2, 1, 7)


def test_capture_records_post_rope_qkv_without_changing_outputs():
    model = tiny_llama()
    x = windows()[:1]
    with torch.no_grad():
        ref = model(x).logits
        with capture_qkv(model) as qkv:
            got = model(x).logits
    assert torch.equal(ref, got) and model.config._attn_implementation == "sdpa"
    assert sorted(qkv) == [0, 1] and [t.shape for t in qkv[0][:3]] == [(1, 4, 48, 16), (1, 2, 48, 16), (1, 2, 48, 16)]
    assert qkv[0].scale == model.model.layers[0].self_attn.scaling
    gemma = Gemma3ForCausalLM(Gemma3TextConfig(vocab_size=128, hidden_size=64, intermediate_size=128, head_dim=16,
                                               num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                                               query_pre_attn_scalar=64, layer_types=["full_attention"])).eval()
    with torch.no_grad(), capture_qkv(gemma) as qkv:  # a scale other than head_dim ** -0.5: the one recorded
        gemma(x[:, :20])
    assert qkv[0].scale == 64 ** -0.5 == gemma.model.layers[0].self_attn.scaling
    adapter = FocusAdapter.for_model(model, FOCUS)
    adapter.attach(model)
    with pytest.raises(RuntimeError, match="detach"), capture_qkv(model):
        pass
    adapter.detach(model)


@pytest.mark.parametrize("key_top_k,scale", [(1, None), (2, None), (3, 0.2)])
def test_distill_loss_is_the_output_error_of_hard_focus_attention(key_top_k, scale):
    """As routing sharpens, the loss -> relative squared error of reference Focus attention against full attention
    (keys in k > 1 groups: a far pair weighted min(1, shared groups / k), see the module docstring; the layer's own
    score scale)."""
    torch.manual_seed(0)
    cfg = FocusConfig(num_groups=8, query_top_k=2, key_top_k=key_top_k, window=4, sink_tokens=1, tau=1e-6)
    q, k, v, c = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(2, 8, 8)
    idx = torch.arange(4, 32)
    err, _, _ = distill_layer_loss(q, k, v, c, cfg, idx, scale)  # (the balance term: test_balance_loss_...)
    focus = reference_attention(q, k, v, c, cfg, scale=scale)[:, :, idx]
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True, scale=scale)[:, :, idx]
    expected = (focus - full).pow(2).sum((-1, -2)) / full.pow(2).sum((-1, -2))
    qm, km = routing.hard_membership(q, c, 2), routing.hard_membership(k, c, key_top_k).repeat_interleave(2, 1)
    shared = torch.stack([((qm[..., :, None] & km[..., None, :]) >> g) & 1 for g in range(8)]).sum(0)
    i, j = torch.arange(32)[:, None], torch.arange(32)[None, :]
    near = (i - j < 4) | (j < 1)  # window 4, 1 sink
    keep = torch.where(near, 1.0, (shared / key_top_k).clamp_max(1.0))  # a far pair: min(1, shared / k)
    keep = keep.masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril(), 0.0)
    logits = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * (scale or 8 ** -0.5)
    w = logits.masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril(), float("-inf")).softmax(-1) * keep
    soft_out = ((w / w.sum(-1, keepdim=True)) @ v.repeat_interleave(2, 1))[:, :, idx]
    weighted = ((soft_out - full).pow(2).sum((-1, -2)) / full.pow(2).sum((-1, -2))).mean()
    assert err > 0.001 and torch.allclose(err, weighted, rtol=1e-3)
    if key_top_k == 1:  # then exactly the hard pattern's error
        assert torch.allclose(err, expected.mean(), rtol=1e-3)
    p = torch.einsum("bhqd,bhkd->bhqk", q, k.repeat_interleave(2, 1)) * (scale or 8 ** -0.5)
    p = p.masked_fill(~torch.ones(32, 32, dtype=torch.bool).tril(), float("-inf")).softmax(-1)
    kept = (p * focus_pattern(q, k, c, cfg))[:, :, idx].sum(-1)
    hard_kept, hard_err = T.hard_fidelity(q, k, v, c, cfg, idx, scale)
    assert torch.allclose(hard_kept, kept.mean(-1), atol=1e-5) and torch.allclose(hard_err, expected, rtol=1e-3)


def test_balance_loss_prefers_balanced_routing():
    skewed = torch.zeros(1, 64, 4)
    skewed[..., 0] = 5.0
    balanced = torch.zeros(1, 64, 4)
    balanced[0, torch.arange(64), torch.arange(64) % 4] = 5.0
    assert T.balance_loss(balanced, 3) < T.balance_loss(skewed, 3)


def test_kmeans_init_gives_unit_centroids_on_key_clusters():
    model = tiny_llama()
    adapter = FocusAdapter.for_model(model, FOCUS)
    qkv = T.teacher_qkv(model, windows()[:1])
    T.kmeans_init(adapter, qkv, seed=0)
    assert torch.allclose(adapter.centroids.norm(dim=-1), torch.ones(()), atol=1e-5)
    km = routing.hard_membership(qkv[0][1], adapter.centroids[0], 1)
    assert (routing.group_balance(km, 4) < 4).all()  # no group holds every key


def test_kd_is_the_kl_from_full_attention_to_the_soft_pattern():
    model = tiny_llama().requires_grad_(False)
    seq = windows()[0]
    with torch.no_grad():
        full = model(seq[None]).logits[0].log_softmax(-1)
    adapter = FocusAdapter.for_model(model, FOCUS, seed=0)
    adapter.mode = "soft"
    adapter.attach(model)
    with torch.no_grad():
        soft = model(seq[None]).logits[0].log_softmax(-1)
    kl = F.kl_div(soft, full, log_target=True, reduction="none").sum(-1)  # [L]
    follow = torch.tensor([20, 21, 30, 47])
    with torch.no_grad():
        plain, _ = T.lm_losses(model, adapter, seq, kd=True)
        copies, _ = T.lm_losses(model, adapter, seq, kd=True, follow=follow)
    assert plain > 1e-4  # far pairs are lost, so the output distribution moves
    torch.testing.assert_close(plain, kl[FOCUS.window:].mean())
    torch.testing.assert_close(copies, 0.5 * kl[FOCUS.window:].mean() + 0.5 * kl[follow].mean())
    torch.testing.assert_close(kl[:FOCUS.window + 1], torch.zeros(FOCUS.window + 1), atol=1e-5, rtol=0)  # all near
    assert has_focus(model)  # the teacher's forward switched Focus off and back on
    adapter.detach(model)


def test_soft_path_gradient_is_the_derivative_of_its_surrogate():
    """The soft path recomputes its dense terms in the backward pass: the centroids' gradient (reverse mode, through
    the checkpoint) along a random direction equals the forward-mode derivative along it, computed without the
    checkpoint (float64). Both hold the soft top-k's threshold fixed (:func:`routing.soft_membership`), which a finite
    difference of the loss cannot: it differs from both by a few percent on this direction."""
    model = tiny_llama().double().requires_grad_(False)
    seq = windows()[0][None]
    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=8, sink_tokens=2, tau=0.5), seed=0)
    adapter.double()
    adapter.mode = "soft"
    adapter.attach(model)

    def loss() -> torch.Tensor:
        return model(seq).logits.log_softmax(-1)[0, 20:, :8].sum()

    loss().backward()
    direction = torch.randn_like(adapter.centroids, generator=torch.Generator().manual_seed(0))
    slope = (adapter.centroids.grad * direction).sum()
    start = adapter.centroids
    with fwAD.dual_level(), torch.no_grad(), sdpa_kernel(SDPBackend.MATH):  # (the CPU flash kernel has no forward AD)
        del adapter.centroids  # a module's parameter cannot hold a dual tensor: a plain attribute for this forward
        adapter.centroids = fwAD.make_dual(start.detach(), direction)
        tangent = fwAD.unpack_dual(loss()).tangent
    del adapter.centroids
    adapter.centroids = start
    adapter.detach(model)
    assert slope.abs() > 1e-3
    torch.testing.assert_close(tangent, slope, rtol=1e-6, atol=0)  # (the model rounds through float32 RMSNorm)


def test_keep_starts_from_the_adapter_as_given():
    model = tiny_llama()
    start = run(steps=2)
    tc = TrainConfig(steps=1, seq_len=48, query_samples=16, lr=1e-6, init="keep")
    kept = FocusAdapter(start.config, start.centroids.detach().clone())
    train(model, kept, windows(), tc, progress=False)
    torch.testing.assert_close(kept.centroids.detach(), start.centroids.detach(), atol=1e-5, rtol=0)
    fresh = FocusAdapter(start.config, start.centroids.detach().clone())
    train(model, fresh, windows(), TrainConfig(**{**tc.__dict__, "init": "kmeans"}), progress=False)
    assert not torch.allclose(fresh.centroids.detach(), start.centroids.detach(), atol=1e-3)


@pytest.mark.parametrize("objective", ["distill", "kd"])
def test_train_layers_learn_alone_and_the_others_stay_bit_for_bit(objective):
    """train_layers=[1]: layer 1's centroids move, layer 0's are exactly those it started from (a fine-tune of half
    the layers); the distill loss is then layer 1's alone."""
    model = tiny_llama()
    start = run(steps=1)
    tc = TrainConfig(objective=objective, steps=2, seq_len=48, query_samples=16, init="keep", train_layers=[1])
    tuned = FocusAdapter(start.config, start.centroids.detach().clone())
    history = train(model, tuned, windows(), tc, progress=False)
    assert torch.equal(tuned.centroids.detach()[0], start.centroids.detach()[0])
    assert not torch.allclose(tuned.centroids.detach()[1], start.centroids.detach()[1], atol=1e-4)
    if objective == "distill":
        first = windows()[T.batch_indices(len(windows()), 1, tc.seed, 0)]  # the first step's sequence
        every = T.accumulate_gradients(model, FocusAdapter(start.config, start.centroids.detach().clone()), first,
                                       [0], TrainConfig(**{**tc.__dict__, "train_layers": None}), 0)
        alone = T.accumulate_gradients(model, FocusAdapter(start.config, start.centroids.detach().clone()), first,
                                       [0], tc, 0)
        assert alone["distill"] != pytest.approx(every["distill"])  # layer 1's error, not the mean of both
        assert history[0]["distill"] == pytest.approx(alone["distill"], rel=1e-5)
    with pytest.raises(ValueError, match=r"train_layers \[5\] are not Focus layers of this adapter"):
        train(model, tuned, windows(), TrainConfig(**{**tc.__dict__, "train_layers": [1, 5]}), progress=False)


def test_config_errors():
    with pytest.raises(ValueError, match="objective"):
        TrainConfig(objective="sgd")
    with pytest.raises(ValueError, match="steps"):
        TrainConfig(steps=0)
    for bad in ({"lr": float("nan")}, {"lr": float("inf")}, {"balance_weight": float("nan")}):
        with pytest.raises(ValueError, match="finite"):
            TrainConfig(**bad)
    for bad in ([], [1, 1], [-1]):
        with pytest.raises(ValueError, match="train_layers"):
            TrainConfig(train_layers=bad)
    with pytest.raises(ValueError, match="k-means init needs at least as many keys per head as groups"):
        model = tiny_llama()
        train(model, FocusAdapter.for_model(model, FocusConfig(num_groups=60, window=8, sink_tokens=2)),
              windows(length=40), TrainConfig(steps=1, seq_len=40, query_samples=16), progress=False)


def test_mass_routing_takes_each_querys_groups_until_they_hold_the_mass():
    """``query_mass``: a query takes its likeliest groups until they hold that much of its routing probability (checked
    one vector at a time), the soft top-k puts its threshold below each row's own last group, and the distill loss
    with the mass is the loss of the group count every row ends up with."""
    torch.manual_seed(0)
    x, c = torch.randn(1, 2, 40, 16), F.normalize(torch.randn(2, 5, 16), dim=-1)
    member = routing.mass_membership(x, c, 0.3, 0.6, 3)
    p = routing.scores(x, c, 0.3).softmax(-1)
    for h in range(2):
        for i in range(40):
            order, held, want = p[0, h, i].argsort(descending=True).tolist(), 0.0, 0
            for g in order[:3]:
                want |= 1 << g
                held += p[0, h, i, g].item()
                if held >= 0.6:
                    break
            assert member[0, h, i].item() == want, (h, i)
    counts = routing.mass_counts(routing.scores(x, c, 0.3), 0.6, 3)
    assert torch.equal(counts, routing.member_bits(member, 5).sum(-1)) and set(counts.unique().tolist()) == {1, 2, 3}
    s = routing.scores(x, c, 0.3)
    soft = routing.soft_membership(s, counts)
    for k in (1, 2, 3):  # each row as the fixed top-k of its own count
        assert torch.equal(soft[counts == k], routing.soft_membership(s, k)[counts == k])
    assert torch.equal(routing.soft_membership(s, torch.full_like(counts, 5)), torch.ones_like(s))

    cfg = FocusConfig(num_groups=8, query_top_k=1, window=4, sink_tokens=1, tau=0.5)
    q, k, v, c = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(2, 8, 8)
    idx = torch.arange(4, 32)
    one, _, entropy = distill_layer_loss(q, k, v, c, cfg, idx)
    two, _, _ = distill_layer_loss(q, k, v, c, FocusConfig(**{**cfg.to_dict(), "query_top_k": 2}), idx)
    assert torch.equal(distill_layer_loss(q, k, v, c, cfg, idx, query_mass=1e-6)[0], one)
    assert torch.equal(distill_layer_loss(q, k, v, c, cfg, idx, query_mass=1.0, query_most=2)[0], two)
    assert distill_layer_loss(q, k, v, c, cfg, idx, query_mass=1.0, query_most=8)[0] < 1e-12  # every far key kept
    assert one > two > 1e-4
    probs = routing.scores(q[:, :, idx], c, cfg.tau).softmax(-1)
    assert torch.allclose(entropy, -(probs * probs.log()).sum(-1).mean())

    def trained_entropy(weight: float) -> float:  # the routing entropy of the queries after training
        model = tiny_llama()
        adapter = FocusAdapter.for_model(model, FOCUS, seed=0)
        tc = TrainConfig(steps=4, batch_size=2, seq_len=48, query_samples=16, query_mass=0.8, entropy_weight=weight)
        train(model, adapter, windows(), tc, progress=False)
        qkv = T.teacher_qkv(model, windows()[:1])
        return sum(distill_layer_loss(*qkv[i][:3], adapter.centroids[i], FOCUS, torch.arange(8, 48))[2].item()
                   for i in range(2))

    assert trained_entropy(1.0) < trained_entropy(1e-9) - 0.05  # the price of a flatter routing sharpens it
    for bad in ({"query_mass": 0.0}, {"query_mass": 1.5}, {"query_mass": 0.8, "objective": "kd"}):
        with pytest.raises(ValueError, match="query_mass"):
            TrainConfig(**bad)
    with pytest.raises(ValueError, match="query_most"):
        TrainConfig(query_mass=0.8, query_most=0)
    for bad in ({"entropy_weight": 0.1}, {"query_mass": 0.8, "entropy_weight": -1.0}):
        with pytest.raises(ValueError, match="entropy_weight"):
            TrainConfig(**bad)


def test_fisher_weights_are_the_squared_gradient_of_the_sampled_log_likelihood_at_each_heads_output():
    """``fisher_qkv``: the same q/k/v as ``teacher_qkv``, and per layer, head and row the squared norm of the gradient
    of ``sum_t log p(y_t)`` (y drawn from the model's own output) with respect to that head's attention output,
    checked against the gradient of a zero added to the input of the layer's output projection."""
    model = tiny_llama().requires_grad_(False)
    ids = windows(1, 40)
    qkv, fisher = T.fisher_qkv(model, ids, torch.Generator().manual_seed(5))
    teacher = T.teacher_qkv(model, ids)
    for layer in (0, 1):
        assert all(torch.equal(a, b) for a, b in zip(qkv[layer][:3], teacher[layer][:3], strict=True))
    deltas = [torch.zeros(1, 40, 64, requires_grad=True) for _ in range(2)]
    hooks = [layer.self_attn.o_proj.register_forward_pre_hook(lambda m, a, d=d: (a[0] + d,))
             for layer, d in zip(model.model.layers, deltas, strict=True)]
    try:
        logp = model(input_ids=ids).logits[0].log_softmax(-1)
    finally:
        for h in hooks:
            h.remove()
    y = torch.multinomial(logp.detach().exp(), 1, generator=torch.Generator().manual_seed(5))
    grads = torch.autograd.grad(logp.gather(-1, y).sum(), deltas)
    for layer, g in enumerate(grads):
        want = g[0].view(40, 4, 16).pow(2).sum(-1).T  # [Hq, L]
        assert fisher[layer].shape == (4, 40) and want.abs().max() > 0
        assert torch.allclose(fisher[layer], want, rtol=1e-4, atol=1e-10)


def test_fisher_rows_are_drawn_by_weight_and_heads_weighted_by_their_share():
    weights = torch.zeros(2, 20)
    weights[:, 2] = 50.0  # before the window: never a row
    weights[:, 10] = torch.tensor([3.0, 1.0])
    weights[1, 15] = 2.0
    cfg = FocusConfig(num_groups=4, window=4, sink_tokens=1)
    idx, share = T.fisher_rows(weights, 3000, cfg, torch.Generator().manual_seed(0))
    assert set(idx.tolist()) == {10, 15} and share.shape == (1, 2, 3000)
    assert abs((idx == 10).float().mean().item() - 4 / 6) < 0.03
    assert torch.equal(share[0, :, idx == 10].unique(dim=1), torch.tensor([[0.75], [0.25]]))
    assert torch.equal(share[0, :, idx == 15].unique(dim=1), torch.tensor([[0.0], [1.0]]))


def test_fisher_weighted_distill_weighs_each_head_and_row():
    """With head weights the distill error is ``sum r |o - o^full|^2 / sum r |o^full|^2`` over heads and rows: the
    weight on one head alone gives that head's own relative error (the unweighted loss of that head by itself),
    a common scale changes nothing, and training with ``fisher=True`` moves the centroids of a real forward pass."""
    torch.manual_seed(0)
    cfg = FocusConfig(num_groups=8, query_top_k=1, window=4, sink_tokens=1, tau=0.5)
    q, k, v, c = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(2, 8, 8)
    idx = torch.arange(4, 32)
    for h in range(4):
        r = torch.zeros(1, 4, len(idx))
        r[0, h] = 1.0
        alone, _, _ = distill_layer_loss(q[:, h:h + 1], k[:, h // 2:h // 2 + 1], v[:, h // 2:h // 2 + 1],
                                         c[h // 2:h // 2 + 1], cfg, idx)
        weighted, _, _ = distill_layer_loss(q, k, v, c, cfg, idx, head_weights=r)
        assert alone > 1e-4 and torch.allclose(weighted, alone, rtol=1e-5)
        assert torch.allclose(distill_layer_loss(q, k, v, c, cfg, idx, head_weights=7 * r)[0], alone, rtol=1e-5)
    model = tiny_llama()
    adapter = FocusAdapter.for_model(model, FOCUS, seed=0)
    start = adapter.centroids.detach().clone()
    history = train(model, adapter, windows(), TrainConfig(steps=2, batch_size=2, seq_len=48, query_samples=16,
                                                           fisher=True), progress=False)
    assert all(math.isfinite(h["loss"]) for h in history) and not torch.equal(adapter.centroids, start)
    with pytest.raises(ValueError, match="fisher"):
        TrainConfig(objective="kd", fisher=True)


def test_with_repeats_copies_spans_far_ahead():
    seq = torch.randint(0, 10**6, (400,), generator=torch.Generator().manual_seed(0))
    out, follow = T.with_repeats(seq, 4, 12, 64, torch.Generator().manual_seed(3))
    follow = set(follow.tolist())
    starts = sorted(f - 1 for f in follow if f - 1 not in follow)
    assert len(starts) == 4 and len(follow) == 4 * 11
    inside = torch.zeros(400, dtype=torch.bool)
    for t in starts:
        inside[t:t + 12] = True
        assert follow >= set(range(t + 1, t + 12))
        assert any(torch.equal(out[t:t + 12], out[s:s + 12]) for s in range(t - 64 - 12 + 1))  # far enough back
    assert torch.equal(out[~inside], seq[~inside])
    again, _ = T.with_repeats(seq, 4, 12, 64, torch.Generator().manual_seed(3))
    assert torch.equal(out, again)
    with pytest.raises(ValueError, match="do not fit"):
        T.with_repeats(seq, 40, 12, 64, torch.Generator())


def test_repeats_change_what_is_distilled():
    plain, repeats = run(steps=2), run(steps=2, tc_repeats=2)
    assert torch.isfinite(repeats.centroids).all()
    assert not torch.allclose(plain.centroids, repeats.centroids)
    with pytest.raises(ValueError, match="repeats needs objective='distill'"):
        TrainConfig(objective="lm", repeats=2)
    with pytest.raises(ValueError, match="repeats"):
        TrainConfig(repeats=-1)


def test_train_refuses_inputs_it_cannot_learn_from():
    model = tiny_llama()
    adapter = FocusAdapter.for_model(model, FOCUS)
    tc = TrainConfig(steps=1, seq_len=48, query_samples=16)
    for bad, message in ((windows(length=40), "windows have 40 tokens but tc.seq_len is 48"),
                         (windows()[0], r"non-empty \[N, L\] tensor"), (windows().float(), "integer token ids"),
                         (windows(length=300), "more than the model's context of 256")):
        with pytest.raises(ValueError, match=message):
            train(model, adapter, bad, TrainConfig(**{**tc.__dict__, "seq_len": bad.shape[-1]})
                  if "seq_len" not in message else tc, progress=False)
    short = FocusAdapter.for_model(model, FocusConfig(num_groups=4, window=46, sink_tokens=2))
    with pytest.raises(ValueError, match=r"<= window 46 \+ 2 sinks: every pair is local"):
        train(model, short, windows(), tc, progress=False)
    other = LlamaForCausalLM(LlamaConfig(vocab_size=96, hidden_size=64, intermediate_size=128, num_hidden_layers=3,
                                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256))
    with pytest.raises(ValueError, match="does not fit.*2 layers vs the model's 3"):
        train(other, adapter, windows(), tc, progress=False)
    adapter.attach(model)
    with pytest.raises(RuntimeError, match="detach it before training"):
        train(model, adapter, windows(), tc, progress=False)
    adapter.detach(model)
    adapter.mode = "reference"  # int32 ids train like int64; the adapter's mode comes back as it was
    train(model, adapter, windows().int(), TrainConfig(**{**tc.__dict__, "objective": "lm"}), progress=False)
    assert adapter.mode == "reference"


def test_a_diverging_loss_stops_training_and_the_model_comes_back_as_it_was(monkeypatch):
    model = tiny_llama().train()
    real = T.accumulate_gradients
    monkeypatch.setattr(T, "accumulate_gradients", lambda *a, **k: {**real(*a, **k), "loss": float("nan")})
    with pytest.raises(ValueError, match="training loss is nan at step 1"):
        train(model, FocusAdapter.for_model(model, FOCUS), windows(), TrainConfig(steps=2, seq_len=48,
              query_samples=16), progress=False)
    assert model.training and all(p.requires_grad for p in model.parameters())  # train() froze it meanwhile
    with pytest.raises(FileNotFoundError, match="resume"):
        run(steps=1, resume=os.devnull + "-missing")


def test_centered_distill_loss_is_the_error_of_centered_hard_focus_attention():
    """With centering the distilled rows route as the centered reference does (key top-1, sharp routing)."""
    torch.manual_seed(0)
    cfg = FocusConfig(num_groups=8, query_top_k=1, key_top_k=1, window=4, sink_tokens=1, tau=1e-6)
    q, k, v, c = torch.randn(1, 4, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(1, 2, 32, 8), torch.randn(2, 8, 8)
    rotary = LlamaRotaryEmbedding(LlamaConfig(hidden_size=32, num_attention_heads=4, head_dim=8))
    center = routing.Centering(torch.randn(4, 8) * 2, torch.randn(2, 8) * 2,
                               lambda pos: rotary(torch.empty(0), pos))
    idx = torch.arange(4, 32)
    full = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)[:, :, idx]
    errors = []
    for centering in (center, None):
        focus = reference_attention(q, k, v, c, cfg, centering=centering)[:, :, idx]
        expected = ((focus - full).pow(2).sum((-1, -2)) / full.pow(2).sum((-1, -2))).mean()
        err, _, _ = distill_layer_loss(q, k, v, c, cfg, idx, centering=centering)
        assert torch.allclose(err, expected, rtol=1e-3)
        hard_err = T.hard_fidelity(q, k, v, c, cfg, idx, centering=centering)[1].mean()
        assert torch.allclose(hard_err, expected, rtol=1e-3)
        errors.append(err)
    assert not torch.allclose(*errors)  # centering changed what was routed


def test_training_a_centered_adapter_calibrates_its_means_and_keeps_them():
    model = tiny_llama()
    adapter = FocusAdapter.for_model(model, FocusConfig(**{**FOCUS.to_dict(), "center": True}))
    assert adapter.key_means.abs().max() == 0
    tc = TrainConfig(steps=2, batch_size=1, seq_len=48, query_samples=16)
    data = windows()
    train(model, adapter, data, tc, progress=False)
    first = T.teacher_qkv(model, data[T.batch_indices(len(data), 1, tc.seed, 0)])
    expected = FocusAdapter.for_model(model, FocusConfig(**{**FOCUS.to_dict(), "center": True}))
    T.calibrate_means(expected, first, model)
    assert adapter.key_means.abs().max() > 0
    assert torch.equal(adapter.key_means, expected.key_means) and torch.equal(adapter.query_means,
                                                                            expected.query_means)
