# ruff: noqa: E402
# %% [markdown]
# # What did the centroids learn?
#
# A Focus adapter is nothing but a few centroids per layer and key/value head. Every key (and every
# query) is routed to the group whose centroid it points at most closely (cosine score), and a query
# attends to the distant tokens of its own group only; nearby tokens (a sliding window) and the first
# few tokens (attention sinks) are always attended.
#
# This notebook opens a trained adapter and looks inside:
#
# 1. the tokens most typical of each group, per layer (the paper reports that the groups turn out to
#    be interpretable linguistic categories);
# 2. how big the groups are (Sinkhorn balancing during training keeps any group from swallowing the
#    sequence, which is what makes the sparse pattern cheap);
# 3. one layer's attention pattern, Focus (window + sinks + groups) next to full attention.
#
# Runs on CPU in a minute or two. Plain script version: `python examples/inspect_groups.py`.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("FOCUS_FLEX_EXAMPLES_SMALL") == "1"  # the test suite runs every example in small mode

# The adapter: a Hub repo id ("org/smollm2-focus") or a local folder. None = the adapter this repository
# publishes (hub/smollm2-135m-instruct-focus), else the one finetune_centroids saved, else a tiny one trained here.
ADAPTER = None
DATA = None  # None = the shipped novels (held-out "eval" books); or a text file, a folder of *.txt, a dataset
SPLIT = "eval"
WINDOWS = 1 if SMALL else 8  # how many text windows to route (more windows: better statistics)
WINDOW_TOKENS = 256 if SMALL else 1024  # tokens per window (at least twice the adapter's window is used)
TOP_TOKENS = 6  # typical tokens shown per group
SHOW_LAYERS = None  # layers to list groups for; None = first, middle and last Focus layer
KV_HEAD = 0  # which key/value head's groups to list
PATTERN_LAYER = None  # layer of the attention picture (drawn for the first window); None = the middle Focus layer
PATTERN_HEAD = 0  # query head shown in the attention picture
OUTPUT_DIR = "runs/examples/inspect_groups"  # figures are saved here too

# %%
import sys
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # plain script: write the figures to files only
import matplotlib.pyplot as plt
import torch
from matplotlib.colors import ListedColormap, LogNorm
from tqdm import tqdm

import focus_flex
from focus_flex import FocusAdapter, FocusConfig, routing
from focus_flex.attention import focus_pattern
from focus_flex.data import load_documents, token_windows
from focus_flex.models import load_model
from focus_flex.train import capture_qkv, centerings, routing_vectors

out_dir = Path(OUTPUT_DIR)
out_dir.mkdir(parents=True, exist_ok=True)


def show(fig, name):
    """Save a figure under OUTPUT_DIR and show it (inline in a notebook)."""
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110, bbox_inches="tight")
    print(f"saved {path}")
    if "ipykernel" in sys.modules:
        plt.show()
    else:
        plt.close(fig)


# %% [markdown]
# ## The adapter and its base model
#
# `FocusAdapter.from_pretrained` takes a Hub repo id or a local folder (`focus_config.json` +
# `focus_adapter.safetensors`). If no trained adapter is around, we train a small one on the fly: a few
# steps of the layer-local `distill` objective, starting from k-means centres of the model's keys.

# %%
PUBLISHED = Path(focus_flex.__file__).resolve().parents[1] / "hub" / "smollm2-135m-instruct-focus"


def small_adapter(model, tokenizer):
    """A quickly trained adapter, for when no trained one is at hand (see finetune_centroids for the real thing)."""
    from focus_flex.train import TrainConfig, train

    adapter = FocusAdapter.for_model(model, FocusConfig(window=64 if SMALL else 256))
    windows = token_windows(load_documents(None, "train"), tokenizer, 256 if SMALL else 1024)
    train(model, adapter, windows, TrainConfig(steps=2 if SMALL else 12, seq_len=windows.shape[1]))
    return adapter


FINETUNED = Path("runs/examples/finetune_centroids/adapter")  # where finetune_centroids saves its adapter
if ADAPTER is None:
    ADAPTER = next((str(p) for p in (PUBLISHED, FINETUNED) if (p / "focus_config.json").is_file()), None)
if ADAPTER is not None:
    adapter = FocusAdapter.from_pretrained(ADAPTER)
    model, tokenizer = load_model(adapter.config.base_model)
    print(f"adapter: {ADAPTER}")
else:
    print(f"No trained adapter at {PUBLISHED} or {FINETUNED}: training a small one here.")
    model, tokenizer = load_model()
    adapter = small_adapter(model, tokenizer)

cfg = adapter.config
print(adapter)
print(f"base model {cfg.base_model}: {len(cfg.layers)} Focus layers x {cfg.num_kv_heads} KV heads x "
      f"{cfg.num_groups} groups x {cfg.head_dim} dims = {adapter.centroids.numel():,} trained parameters")
print(f"window {cfg.window}, sinks {cfg.sink_tokens}, top-k queries {cfg.query_top_k} / keys {cfg.key_top_k}")

# %% [markdown]
# ## Route some text
#
# One ordinary forward pass (the model's own attention) records every layer's post-RoPE queries and keys
# (`focus_flex.train.capture_qkv`); the routing scores are cosine similarities to the centroids,
# `routing.scores(keys, centroids, tau)`, of the vectors each layer routes: the queries and keys themselves,
# or, in the layers the adapter centers (`cfg.center`), with their head's mean removed.

# %%
layers = cfg.layers
pattern_layer = PATTERN_LAYER if PATTERN_LAYER is not None else layers[len(layers) // 2]
length = max(WINDOW_TOKENS, 2 * cfg.window)  # longer than the window, so that distant tokens exist
docs = load_documents(DATA, SPLIT)
windows = token_windows(docs, tokenizer, length, max_windows=WINDOWS)
print(f"{len(windows)} windows of {length} tokens from {len(docs)} documents")

center = centerings(adapter, model)  # slot -> how that layer centers what it routes (None: it does not)
key_scores = {layer: [] for layer in cfg.layers}  # layer -> [scores [Hkv, L, G] per window]
query_member = {layer: [] for layer in cfg.layers}  # layer -> [hard query groups, bitmask [Hq, L] per window]
with torch.no_grad():
    for ids in tqdm(windows, desc="routing"):
        with capture_qkv(model) as qkv:
            model(ids[None])
        for layer, slot in adapter.slot.items():
            q = routing_vectors(qkv[layer].q, center[slot], "query")
            k = routing_vectors(qkv[layer].k, center[slot], "key")
            cent = adapter.centroids[slot]
            key_scores[layer].append(routing.scores(k, cent, cfg.tau)[0])
            query_member[layer].append(routing.hard_membership(q, cent, cfg.query_top_k)[0])
            if layer == pattern_layer and len(key_scores[layer]) == 1:
                pattern_qk = qkv[layer][:2]  # the first window's queries and keys, for the picture below
                pattern_route = q, k  # and what the layer routes for them
key_scores = {layer: torch.cat(s, dim=1) for layer, s in key_scores.items()}  # [Hkv, N, G]
query_member = {layer: torch.cat(m, dim=1) for layer, m in query_member.items()}  # [Hq, N]
tokens = windows.reshape(-1)  # token id of every routed position, same order as the scores

# %% [markdown]
# ## The tokens most typical of each group
#
# For a layer and KV head, a group's most typical tokens are those whose **key** vectors score highest
# for its centroid (distinct tokens, best first). `share` is the fraction of all keys routed to the
# group. Early layers tend to group by surface form (punctuation, function words, word pieces),
# later layers by role and meaning; uncentered keys also carry position (RoPE), so some groups are
# "the first tokens" or "line starts".

# %%
show_layers = SHOW_LAYERS or sorted({layers[0], layers[len(layers) // 2], layers[-1]})


def token_text(token_id):
    return repr(tokenizer.decode([int(token_id)]))  # quoted, so leading spaces and newlines show


def typical_tokens(scores, group, n):
    """Distinct tokens with the highest scores for ``group`` (scores: [N, G])."""
    seen, picked = set(), []
    for pos in scores[:, group].argsort(descending=True).tolist():
        t = int(tokens[pos])
        if t not in seen:
            seen.add(t)
            picked.append(token_text(t))
            if len(picked) == n:
                break
    return picked


for layer in show_layers:
    s = key_scores[layer][KV_HEAD]  # [N, G]
    share = torch.bincount(s.argmax(-1), minlength=cfg.num_groups).float() / s.shape[0]
    print(f"\nlayer {layer}, KV head {KV_HEAD}")
    print(f"{'group':>5} {'share':>6}  typical tokens")
    for g in range(cfg.num_groups):
        print(f"{g:>5} {share[g]:>6.1%}  " + "  ".join(typical_tokens(s, g, TOP_TOKENS)))

# %% [markdown]
# ## Group sizes
#
# Each bar is the fraction of keys (or queries) whose top group is that group; the dashed line is a
# perfectly even split. Balanced groups matter for speed: the far attention costs roughly the sum of
# the squared group sizes, so one giant group would make Focus as expensive as full attention. The
# right panel shows the balance of every layer: largest key group / mean group size (1.0 = perfect).

# %%
G = cfg.num_groups
fig, axes = plt.subplots(1, len(show_layers) + 1, figsize=(4.2 * (len(show_layers) + 1), 3.4))
for ax, layer in zip(axes, show_layers, strict=False):
    key_share = torch.bincount(key_scores[layer][KV_HEAD].argmax(-1), minlength=G).float()
    rep = query_member[layer].shape[0] // cfg.num_kv_heads
    qm = query_member[layer][KV_HEAD * rep:(KV_HEAD + 1) * rep]  # the query heads sharing this KV head
    query_share = ((qm.reshape(-1, 1) >> torch.arange(G)) & 1).sum(0).float()
    x = torch.arange(G)
    ax.bar(x - 0.2, key_share / key_share.sum(), width=0.4, label="keys")
    ax.bar(x + 0.2, query_share / query_share.sum(), width=0.4, label="queries")
    ax.axhline(1 / G, color="k", ls="--", lw=1)
    ax.set_title(f"layer {layer}, KV head {KV_HEAD}")
    ax.set_xlabel("group")
    ax.set_xticks(range(0, G, max(1, G // 8)))
axes[0].set_ylabel("fraction of tokens")
axes[0].legend()
key_member = {layer: routing.membership(routing.top_groups(s, cfg.key_top_k)) for layer, s in key_scores.items()}
balance = [routing.group_balance(key_member[layer][None], G).mean().item() for layer in layers]
axes[-1].plot(layers, balance, marker="o")
axes[-1].axhline(1.0, color="k", ls="--", lw=1)
axes[-1].set_title("largest / mean key group")
axes[-1].set_xlabel("layer")
fig.tight_layout()
show(fig, "group_sizes")

# %% [markdown]
# ## One layer's attention: full vs Focus
#
# Left: the model's own (full, causal) attention weights for one head on the first window of text,
# on a log scale. Middle: what Focus lets that head see: the sliding window and the sink columns
# (blue) plus the distant keys in the query's group (orange); everything else (white) is never
# computed. Right: every causal same-group pair, near or far, with queries and keys sorted by their
# group: block-diagonal. This is how the fast path computes the far part: tokens sorted by group, so a
# group's pairs fill whole blocks and FlexAttention skips all the others (block sparsity).

# %%
layer = pattern_layer
q, k = pattern_qk
n = q.shape[2]
cent = adapter.centroids[adapter.slot[layer]].detach()
rep = q.shape[1] // k.shape[1]
h, kv = PATTERN_HEAD, PATTERN_HEAD // rep

scale = q.shape[-1] ** -0.5
i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
causal = j <= i
weights = (q[0, h].float() @ k[0, kv].float().T * scale).masked_fill(~causal, float("-inf")).softmax(-1)
pattern = focus_pattern(q, k, cent, cfg, centering=center[adapter.slot[layer]])[0, h]
local = causal & ((i - j < cfg.window) | (j < cfg.sink_tokens))
kinds = local.long() + 2 * (pattern & ~local).long()  # 0 skipped, 1 window/sink, 2 same group

q_route, k_route = pattern_route
q_member = routing.hard_membership(q_route, cent, cfg.query_top_k)[0, h]
k_member = routing.hard_membership(k_route, cent, cfg.key_top_k)[0, kv]
same_group = causal & ((q_member[:, None] & k_member[None, :]) != 0)
q_group = routing.top_groups(routing.scores(q_route, cent, cfg.tau), 1)[0, h, :, 0]
k_group = routing.top_groups(routing.scores(k_route, cent, cfg.tau), 1)[0, kv, :, 0]
rows = sorted(range(n), key=lambda t: (int(q_group[t]), t))  # queries sorted by (top group, position)
cols = sorted(range(n), key=lambda t: (int(k_group[t]), t))
same_sorted = same_group[rows][:, cols]

density = pattern.sum().item() / causal.sum().item()
kept = (weights * pattern).sum(-1).mean().item()
kept_local = (weights * local).sum(-1).mean().item()
print(f"layer {layer}, head {h}, {n} tokens: Focus computes {density:.1%} of the causal pairs and keeps "
      f"{kept:.1%} of full attention's mass (window + sinks alone: {kept_local:.1%})")

colors = ListedColormap(["white", "tab:blue", "tab:orange"])
fig, axes = plt.subplots(1, 3, figsize=(15, 5))
shown = weights.clamp_min(1e-5).masked_fill(~causal, float("nan"))  # future keys: blank
axes[0].imshow(shown, norm=LogNorm(vmin=1e-5, vmax=1), cmap="magma_r", interpolation="nearest")
axes[0].set_title(f"full attention weights (layer {layer}, head {h})")
axes[1].imshow(kinds, cmap=colors, vmin=0, vmax=2, interpolation="nearest")
axes[1].set_title(f"Focus: window+sinks (blue), same group (orange)\n{density:.1%} of pairs, {kept:.1%} of the mass")
axes[2].imshow(same_sorted, cmap=ListedColormap(["white", "tab:orange"]), vmin=0, vmax=1, interpolation="nearest")
axes[2].set_title("all same-group pairs, tokens sorted by group")
for ax in axes:
    ax.set_xlabel("key position")
axes[0].set_ylabel("query position")
axes[2].set_xlabel("keys, sorted by group")
axes[2].set_ylabel("queries, sorted by group")
fig.tight_layout()
show(fig, "attention_pattern")

# %% [markdown]
# ## Where next
#
# * `use_adapter.ipynb`: load an adapter, generate with and without Focus, compare speed.
# * `finetune_centroids.ipynb`: train your own centroids on your own text.
