"""``python -m benchmarks.routing_study``: which routing keeps the attention that retrieves a passkey.

For passkey prompts (:mod:`focus_flex.passkey`) one forward of SmolLM2 with its own attention gives, per layer,
the post-RoPE q and k and the attention of the answer's queries (the prompt's last token, then the key's own
tokens, teacher-forced). Each variant's routing decides which far pairs are computed; the study reports the part
of the attention mass on the key's digits that the pattern keeps (summed over all layers and heads, so the heads
that read the key weigh most), and the density of the whole prompt (fraction of causal pairs computed, every 16th
query row).

Variants (``--variants``), ``name:query_top_k``:

* ``adapter`` — the adapter ``--adapter`` (the published one by default), routing as it is configured;
* ``raw`` — untrained centroids: spherical k-means of the keys of one training window (63 groups, keys in 4);
* ``centered`` — untrained and centered (``FocusConfig.center``): the window's pre-RoPE mean query and key removed
  before routing, k-means of the centered keys;
* any other name: the adapter in the folder of that name (e.g. ``runs/x/adapter:1``).

Nothing here changes what an adapter does, except the query top-k of each variant (docs/passkey.md).
"""

from __future__ import annotations

import argparse
import json

import torch
from tqdm.auto import tqdm

from benchmarks.bench import machine_info
from focus_flex import FocusAdapter, FocusConfig, routing
from focus_flex.data import load_documents, token_windows
from focus_flex.models import load_model
from focus_flex.passkey import build_prompt, make_key
from focus_flex.train import calibrate_means, centerings, kmeans_init, routing_vectors, teacher_qkv

UNTRAINED = FocusConfig(num_groups=63, key_top_k=4, window=256, sink_tokens=4)


def untrained(model: torch.nn.Module, window: torch.Tensor, center: bool, seed: int = 0) -> FocusAdapter:
    """k-means centroids of the (centered) keys of one window ``[L]``, with the window's means if ``center``."""
    adapter = FocusAdapter.for_model(model, FocusConfig(**{**UNTRAINED.to_dict(), "center": center}))
    qkv = teacher_qkv(model, window[None])
    if center:
        calibrate_means(adapter, qkv, model)
    kmeans_init(adapter, qkv, seed, centering=centerings(adapter, model))
    return adapter


def study(model, tokenizer, adapters: dict[str, tuple[FocusAdapter, int]], length: int, haystack: str,
          depth: int) -> dict[str, tuple[float, float]]:
    """``{variant: (key mass kept, density)}`` for one prompt (key number 0)."""
    prompt = build_prompt(tokenizer, length, depth, make_key(haystack, length, depth, 0), haystack)
    answer = tokenizer(" " + prompt.key, add_special_tokens=False)["input_ids"]
    ids = torch.cat([prompt.input_ids, torch.tensor(answer[:-1])])
    n = len(ids)
    queries = torch.arange(len(prompt.input_ids) - 1, n)
    digits = torch.tensor([i for i in range(*prompt.needle) if tokenizer.decode(ids[i:i + 1]).strip().isdigit()])
    rows = torch.arange(0, n, 16)
    sel = torch.cat([queries, rows])
    i, j = torch.arange(n)[:, None], torch.arange(n)[None, :]
    causal = j <= i
    qkv = teacher_qkv(model, ids[None])
    probs = {}
    for layer, (q, k, _, scale) in qkv.items():  # the answer's attention, once per layer
        q, k = q[0].float(), k[0].float()
        p = (q[:, queries] @ k.repeat_interleave(q.shape[0] // k.shape[0], 0).transpose(-1, -2))
        probs[layer] = (p * (scale or q.shape[-1] ** -0.5)).masked_fill(~causal[queries], float("-inf")).softmax(-1)
    out = {}
    for name, (adapter, query_top_k) in adapters.items():
        cfg, center = adapter.config, centerings(adapter, model)
        near = causal & ((i - j < cfg.window) | (j < cfg.sink_tokens))
        kept = mass = density = 0.0
        for layer, slot in adapter.slot.items():
            q, k = qkv[layer].q.float(), qkv[layer].k.float()
            c = adapter.centroids[slot].detach()
            qm = routing.hard_membership(routing_vectors(q, center[slot], "query"), c, query_top_k)[0]  # [Hq, n]
            km = routing.hard_membership(routing_vectors(k, center[slot], "key"), c, cfg.key_top_k)[0]
            km = km.repeat_interleave(q.shape[1] // k.shape[1], 0)
            allowed = near[sel] | (((qm[:, sel, None] & km[:, None, :]) != 0) & causal[sel])  # [Hq, Q + rows, n]
            mass += float(probs[layer][..., digits].sum())
            kept += float((probs[layer] * allowed[:, :len(queries)])[..., digits].sum())
            density += float(allowed[:, len(queries):].float().sum() / (causal[rows].sum() * q.shape[1]))
        out[name] = (kept / mass, density / len(adapter.slot))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", default="hub/smollm2-135m-instruct-focus")
    p.add_argument("--variants", nargs="+", default=["adapter:1", "raw:1", "raw:4", "centered:1"])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--haystacks", nargs="+", default=["filler", "prose"])
    p.add_argument("--depths", type=int, nargs="+", default=[10, 50])
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    m = machine_info()
    print(f"{m['date']}: {m['cpu']} ({m['isa']}), {m['cores']} cores, torch {m['torch']}")
    model, tokenizer = load_model()
    window = token_windows(load_documents(None, "train"), tokenizer, 2048, max_windows=3)[1]
    made: dict[str, FocusAdapter] = {}

    def adapter(name: str) -> FocusAdapter:
        if name not in made:
            made[name] = (FocusAdapter.from_pretrained(args.adapter) if name == "adapter" else
                          untrained(model, window, name == "centered") if name in ("raw", "centered") else
                          FocusAdapter.from_pretrained(name))
        return made[name]

    variants = {v: (adapter(v.rsplit(":", 1)[0]), int(v.rsplit(":", 1)[1])) for v in args.variants}
    cells = [(n, h, d) for n in args.lengths for h in args.haystacks for d in args.depths]
    results = {}
    for n, h, d in tqdm(cells, desc="prompts"):
        results[f"{h} {n} {d}%"] = study(model, tokenizer, variants, n, h, d)
    print("| prompt | " + " | ".join(args.variants) + " |\n|---|" + "---|" * len(args.variants))
    for cell, r in results.items():
        print(f"| {cell} | " + " | ".join(f"{r[v][0]:.2f} ({100 * r[v][1]:.1f}%)" for v in args.variants) + " |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
