# ruff: noqa: E402
# %% [markdown]
# # Using a Focus adapter
#
# A Focus adapter is a small file of learned centroids (362,880 parameters for the published SmolLM2-135M
# adapter) that turns a frozen pretrained model's attention into **Focus** attention: a sliding window and a
# few attention sinks nearby, and far away only the tokens in the query's own centroid group. Adapters are
# shared on the Hugging Face Hub like PEFT adapters.
#
# This notebook loads an adapter, attaches it to its base model, generates text, and compares outputs
# and speed with and without Focus. CPU is enough. Plain script version: `python examples/use_adapter.py`.

# %% tags=["parameters"]
import os

SMALL = os.environ.get("FOCUS_FLEX_EXAMPLES_SMALL") == "1"  # the test suite runs every example in small mode

# The adapter: a Hub repo id ("org/smollm2-focus") or a local folder. None = the adapter this repository
# publishes (hub/smollm2-135m-instruct-focus), else the one finetune_centroids saved, else a tiny one trained here.
ADAPTER = None
DATA = None  # where the prompt comes from: None = the shipped novels (held-out "eval" books), or a text file
CONTEXT_TOKENS = 256 if SMALL else 4096  # prompt length for generation and for the speed comparison
NEW_TOKENS = 8 if SMALL else 48  # tokens to generate
REPEATS = 1 if SMALL else 3  # timed repetitions (the best is reported)

# %%
import time
from pathlib import Path

import torch

import focus_flex
from focus_flex import FocusAdapter, FocusConfig
from focus_flex.data import load_documents, token_windows
from focus_flex.models import load_model

# %% [markdown]
# ## Load the adapter and its base model
#
# `FocusAdapter.from_pretrained` accepts a Hub repo id (with `revision=`, `token=`, like any Hub
# download) or a local folder holding `focus_config.json` and `focus_adapter.safetensors`. The config
# names the base model the centroids were trained for; `adapter.load_model()` loads it and attaches
# the adapter in one line. Here we load the model with its tokenizer ourselves and call `attach`.

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
print(f"{adapter.centroids.numel():,} centroid parameters for {cfg.base_model}: {cfg.num_groups} groups, "
      f"window {cfg.window}, {cfg.sink_tokens} sink tokens, top-k {cfg.query_top_k} (queries) / {cfg.key_top_k} (keys)")

# %% [markdown]
# ## A long prompt
#
# Focus matters for long contexts, so the prompt is a long stretch of a novel the adapter never saw
# in training; the model continues it.

# %%
docs = load_documents(DATA, "eval")
prompt = token_windows(docs, tokenizer, CONTEXT_TOKENS, max_windows=1)  # [1, CONTEXT_TOKENS] token ids
print(f"prompt: {prompt.shape[1]} tokens, ending with:\n...{tokenizer.decode(prompt[0, -60:])}")

# %% [markdown]
# ## Generate with and without Focus
#
# `adapter.attach(model)` switches every attention layer to Focus in place; `adapter.detach(model)`
# restores the model's own attention exactly. On CPU, Focus runs on small C kernels that focus_flex builds
# with the system C compiler on first use (about a second; without a compiler, on PyTorch's own CPU flash
# attention); on a GPU the first call compiles FlexAttention kernels, once per length bucket.


# %%
def generate(model, ids, n):
    out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=n, do_sample=False,
                         pad_token_id=tokenizer.eos_token_id)
    return out[0, ids.shape[1]:]


with torch.no_grad():
    full_tokens = generate(model, prompt, NEW_TOKENS)
    adapter.attach(model)
    start = time.perf_counter()
    focus_tokens = generate(model, prompt, NEW_TOKENS)
    print(f"Focus generation, first call (it may build the C decode step once): {time.perf_counter() - start:.1f} s")
    adapter.detach(model)

same = int((full_tokens == focus_tokens).long().cumprod(0).sum())
print(f"full attention: {tokenizer.decode(full_tokens)!r}")
print(f"Focus:          {tokenizer.decode(focus_tokens)!r}")
print(f"the two greedy continuations agree on the first {same} of {NEW_TOKENS} tokens")

# %% [markdown]
# ## Quality and speed on the prompt
#
# For each attention: the perplexity of the prompt text (lower is better), and the wall-clock time of a
# prefill, the forward pass over the whole prompt that starts a generation (best of `REPEATS`; both
# paths are already warmed up by the generation above).


# %%
def prefill_seconds(model, ids, repeats):
    best = float("inf")
    for _ in range(repeats):
        start = time.perf_counter()
        model(ids, logits_to_keep=1)  # the logits of the last position only, as generate() does
        best = min(best, time.perf_counter() - start)
    return best


def perplexity(model, ids):
    logits = model(ids).logits[0, :-1].float()
    return torch.nn.functional.cross_entropy(logits, ids[0, 1:]).exp().item()


with torch.no_grad():
    full_time, full_ppl = prefill_seconds(model, prompt, REPEATS), perplexity(model, prompt)
    adapter.attach(model)
    focus_time, focus_ppl = prefill_seconds(model, prompt, REPEATS), perplexity(model, prompt)
    adapter.detach(model)

print(f"{CONTEXT_TOKENS} tokens     perplexity   prefill time")
print(f"full attention  {full_ppl:10.2f}   {full_time:8.3f} s")
print(f"Focus           {focus_ppl:10.2f}   {focus_time:8.3f} s")
print(f"speed-up: {full_time / focus_time:.2f}x (full attention time / Focus time)")
print("Note: the speed-up grows with the context length. Focus computes the window and each token's own "
      "group instead of all pairs, so its cost grows roughly linearly where full attention's grows "
      "quadratically; at a few hundred tokens there is little far attention to skip and Focus is slower. "
      "See docs/speed.md for measured speed-ups.")
if CONTEXT_TOKENS <= 2 * cfg.window:
    print(f"(This prompt is only {CONTEXT_TOKENS} tokens, at most twice the {cfg.window}-token window, so almost "
          f"every pair is inside the window anyway: set CONTEXT_TOKENS to a few thousand to see the difference.)")

# %% [markdown]
# ## Keep Focus on
#
# For your own use, the one-liner is
#
# ```python
# adapter = FocusAdapter.from_pretrained("org/smollm2-focus")
# model = adapter.load_model()  # the base model named in the adapter's config, Focus attached
# ```
#
# and `adapter.detach(model)` brings the model's own attention back. See `inspect_groups.ipynb` for
# what the groups learned and `finetune_centroids.ipynb` to train an adapter on your own text.
