# ruff: noqa: E402
# %% [markdown]
# # Retrofit Focus onto a pretrained model with your own text
#
# Focus attention (*Why Attend to Everything? Focus is the Key*, arXiv 2604.03260) keeps a frozen
# model's attention at full resolution nearby (a sliding window plus a few "sink" tokens at the start)
# and, beyond the window, lets each token attend only to the tokens of its own **group**. The groups
# come from a few learned **centroids** per layer and key/value head: the only parameters that are
# trained. Everything else in the model stays frozen, so the result is a tiny adapter file.
#
# This notebook:
#
# 1. loads a model and some text,
# 2. trains the centroids (a few minutes on a CPU),
# 3. compares perplexity on held-out text with full attention and with cheaper baselines,
# 4. saves the adapter, and pushes it to the Hugging Face Hub if you ask it to.
#
# It defaults to the embedded SmolLM2-135M-Instruct and the public-domain novels shipped with
# `focus_flex`, so it runs offline. **The next cell is the only one you must edit** for your own model
# and data. Plain script version: `python examples/finetune_centroids.py`.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("FOCUS_FLEX_EXAMPLES_SMALL") == "1"  # the test suite runs every example in small mode

# Model: a Hub id or a local folder of a causal LM (Llama, Mistral, Qwen2/3, Gemma-3, GPT-2 architectures).
MODEL = "HuggingFaceTB/SmolLM2-135M-Instruct"  # the default works offline (embedded copy)
# Text: None = the shipped novels; or a .txt file, a folder of *.txt files, a glob, or a `datasets` name
# (its "text" column). Keep evaluation text separate from training text.
TRAIN_DATA, TRAIN_SPLIT = None, "train"  # shipped corpus: "train" = five Austen novels
EVAL_DATA, EVAL_SPLIT = None, "eval"  # shipped corpus: "eval" = Persuasion and Great Expectations (held out)

# Focus: groups per head, how many groups each key joins, local window and attention sinks (the paper's knobs;
# 63 groups with keys in their best 4 are `focus-flex retrofit`'s defaults, chosen on a development split).
GROUPS = 63
KEY_TOP_K = 4
WINDOW = 64 if SMALL else 256
SINKS = 4

# Training (only the centroids learn). "distill" fits the groups to the model's own attention layer by
# layer (fast, CPU-friendly); "lm" back-propagates the next-token loss through the whole model.
OBJECTIVE = "distill"
STEPS = 2 if SMALL else 24
SEQ_LEN = 256 if SMALL else 2048  # tokens per training sequence
LR = 0.05

# Evaluation: perplexity on held-out windows.
EVAL_LEN = 256 if SMALL else 2048
EVAL_WINDOWS = 1 if SMALL else 4
EVAL_MODES = ("full", "focus", "window") if SMALL else ("full", "focus", "window", "random")  # explained below

OUTPUT_DIR = "runs/examples/finetune_centroids"  # the adapter is saved in OUTPUT_DIR/adapter
PUSH_TO = None  # e.g. "your-name/smollm2-135m-focus" to upload the adapter (needs a token, see the end)

# %%
import sys
from dataclasses import asdict
from pathlib import Path

import matplotlib

if "ipykernel" not in sys.modules:
    matplotlib.use("Agg")  # plain script: write the figures to files only
import matplotlib.pyplot as plt
import torch

from focus_flex import FocusAdapter, FocusConfig
from focus_flex.data import load_documents, token_windows
from focus_flex.evaluate import evaluate, results_markdown
from focus_flex.models import load_model
from focus_flex.train import TrainConfig, train

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
# ## Model and data
#
# `load_model` returns the model (frozen, eval mode) and its tokenizer. `token_windows` cuts every
# document into fixed-length windows of token ids; a window never spans two documents.

# %%
model, tokenizer = load_model(MODEL)
print(f"{MODEL}: {sum(p.numel() for p in model.parameters()) / 1e6:.0f}M parameters, "
      f"{model.config.num_hidden_layers} layers")

train_docs = load_documents(TRAIN_DATA, TRAIN_SPLIT)
eval_docs = load_documents(EVAL_DATA, EVAL_SPLIT)
train_windows = token_windows(train_docs, tokenizer, SEQ_LEN)
eval_windows = token_windows(eval_docs, tokenizer, EVAL_LEN, max_windows=EVAL_WINDOWS)
print(f"training: {len(train_docs)} documents -> {len(train_windows)} windows of {SEQ_LEN} tokens")
print(f"evaluation: {len(eval_docs)} documents -> {len(eval_windows)} windows of {EVAL_LEN} tokens")

# %% [markdown]
# ## A fresh adapter
#
# `FocusAdapter.for_model` sizes the centroids to the model: one set of `GROUPS` centroids per layer and
# key/value head, in head-dimension space. Training starts them at k-means centres of the model's keys.

# %%
focus_config = FocusConfig(num_groups=GROUPS, key_top_k=KEY_TOP_K, window=WINDOW, sink_tokens=SINKS)
adapter = FocusAdapter.for_model(model, focus_config)
print(adapter)
print(f"trainable parameters: {adapter.centroids.numel():,} "
      f"(the model has {sum(p.numel() for p in model.parameters()):,}, all frozen)")

# %% [markdown]
# ## Train the centroids
#
# `focus_flex.train.train` runs the optimisation with a progress bar and returns the history (losses per
# step; `dev` metrics on a held-out training window at the end: the share of full attention's weight the hard
# Focus pattern keeps, the fraction of query-key pairs it computes, and the group balance).

# %%
train_config = TrainConfig(objective=OBJECTIVE, steps=STEPS, seq_len=SEQ_LEN, lr=LR)
# One training window is held out for the dev metrics; the evaluation windows stay unseen until the end.
history = train(model, adapter, train_windows[:-1], train_config, dev_windows=train_windows[-1:], log=print)

steps = [h["step"] for h in history]
fig, ax = plt.subplots(figsize=(6, 3.5))
ax.plot(steps, [h[OBJECTIVE] for h in history], marker="o", label=f"{OBJECTIVE} loss")
ax.plot(steps, [h["balance"] for h in history], marker="o", label="balance loss")
ax.set_xlabel("step")
ax.set_ylabel("loss")
ax.legend()
ax.set_title("centroid training")
show(fig, "training_curve")
print("held-out routing at the end:", {k: round(v, 4) for k, v in history[-1].get("dev", {}).items()})

# %% [markdown]
# ## Perplexity: Focus vs full attention
#
# `focus_flex.evaluate.evaluate` scores the same held-out windows with each attention in `EVAL_MODES`:
#
# * `full`: the model's own attention (every pair);
# * `focus`: the trained adapter, hard routing, the fast path (the inference kernels);
# * `window`: window + sinks only, widened until it computes as many pairs as `focus` (same cost, no groups);
# * `random`: untrained random centroids with the same groups and top-k, their window widened until they too
#   compute as many pairs as `focus` (same cost, groups that learned nothing).
#
# `density` is the fraction of causal query-key pairs computed; `balance` is the largest group over the
# mean group size (1.0 = perfectly even). With short evaluation windows (small mode) almost everything is
# inside the window and all rows look alike; the differences show at a few thousand tokens.

# %%
results = evaluate(model, adapter, eval_windows, modes=EVAL_MODES)
print(results_markdown(results))

fig, ax = plt.subplots(figsize=(6, 3.5))
colors = {"full": "gray", "focus": "tab:orange", "window": "tab:blue", "random": "tab:red", "soft": "tab:green"}
ax.bar([r.mode for r in results], [r.perplexity for r in results], color=[colors[r.mode] for r in results])
for i, r in enumerate(results):
    ax.annotate(f"{r.perplexity:.2f}\n{r.density:.0%} of pairs", (i, r.perplexity), ha="center", va="bottom",
                fontsize=8)
ax.set_ylabel("held-out perplexity (lower is better)")
ax.set_ylim(0, 1.2 * max(r.perplexity for r in results))
show(fig, "perplexity")

# %% [markdown]
# ## Save the adapter
#
# Two small files: `focus_config.json` (the settings and the model it belongs to) and
# `focus_adapter.safetensors` (the centroids). The results go into the config's `extra` field, which
# also ends up in the model card when the adapter is pushed.

# %%
by_mode = {r.mode: r for r in results}
adapter.config.extra = {
    "results": {f"perplexity ({r.mode})": round(r.perplexity, 3) for r in results}
    | {"density (focus)": round(by_mode["focus"].density, 4), "eval tokens per window": EVAL_LEN},
    "training": {**asdict(train_config), "data": TRAIN_DATA or "focus_flex shipped corpus (train split)"},
}
adapter_dir = adapter.save_pretrained(out_dir / "adapter")
for f in sorted(Path(adapter_dir).iterdir()):
    print(f"{f}  {f.stat().st_size / 1024:.1f} KiB")

reloaded = FocusAdapter.from_pretrained(adapter_dir)
assert torch.equal(reloaded.centroids, adapter.centroids.detach())
print("reloaded OK; use it with FocusAdapter.from_pretrained(" + repr(str(adapter_dir)) + ")")

# %% [markdown]
# ## Push to the Hugging Face Hub
#
# Set `PUSH_TO` in the parameter cell to a repo id you can write to (for example
# `"your-name/smollm2-135m-focus"`) and run this cell. It needs a Hugging Face token with write access:
# run `hf auth login` once, or set the `HF_TOKEN` environment variable before starting Jupyter (never
# paste a token into a notebook you share). `push_to_hub` uploads the config, the centroids and a
# model card in one commit; anyone can then load the adapter with
# `FocusAdapter.from_pretrained("your-name/smollm2-135m-focus")`. Without `PUSH_TO` nothing is sent.

# %%
if PUSH_TO:
    url = adapter.push_to_hub(PUSH_TO, commit_message="Upload Focus adapter (examples/finetune_centroids)")
    print(f"pushed: {url}")
else:
    print("PUSH_TO is None: nothing pushed. The adapter is in", adapter_dir)
