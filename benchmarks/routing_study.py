"""``python -m benchmarks.routing_study``: which routing keeps the attention that retrieves a passkey.

For passkey prompts (:mod:`focus_flex.passkey`) one forward of SmolLM2 with its own attention gives, per layer,
the post-RoPE q and k and the attention of the answer's queries (the prompt's last token, then the key's own
tokens, teacher-forced). Each routing variant decides which far pairs are computed (window 256, 4 sinks, keys in
their top-4 of 63 groups); the study reports the part of the attention mass on the key's digits that the pattern
keeps (summed over all layers and heads, so the heads that read the key weigh most), and the density of the whole
prompt (fraction of causal pairs computed, every 16th query row).

Variants (``--variants``), ``name:query_top_k``:

* ``adapter`` — the centroids of ``--adapter`` (the published one by default), routing as shipped;
* ``raw`` — untrained centroids, spherical k-means of the post-RoPE keys of one training window; routing as shipped;
* ``centered`` — k-means of the keys minus their mean, routing the keys as ``k - R(p) mu_k`` (``mu_k``: the mean
  pre-RoPE key of the window, ``R(p)`` the rotary rotation at the key's position), queries as they are;
* ``both`` — the same, and the queries routed as ``q - R(p) mu_q``.

Nothing here changes the library's routing: this measures what a change would buy (docs/passkey.md).
"""

from __future__ import annotations

import argparse
import json

import torch
from tqdm.auto import tqdm

from benchmarks.bench import machine_info
from focus_flex import FocusAdapter, routing
from focus_flex.data import load_documents, token_windows
from focus_flex.models import load_model
from focus_flex.passkey import build_prompt, make_key
from focus_flex.train import spherical_kmeans, teacher_qkv

GROUPS, KEY_TOP_K, WINDOW, SINKS = 63, 4, 256, 4


def _rotate_half(x: torch.Tensor) -> torch.Tensor:
    a, b = x.chunk(2, -1)
    return torch.cat([-b, a], -1)


def rotation(model: torch.nn.Module, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """The model's rotary ``cos, sin`` ``[n, D]`` for positions ``0..n-1``."""
    x = torch.zeros(1, n, model.config.head_dim, dtype=torch.float32)
    cos, sin = model.model.rotary_emb(x, torch.arange(n)[None])
    return cos[0], sin[0]


def rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, inverse: bool = False) -> torch.Tensor:
    """RoPE (or its inverse) of ``x [H, n, D]`` at positions ``0..n-1``."""
    return x * cos + _rotate_half(x) * (-sin if inverse else sin)


def calibrate(model: torch.nn.Module, window: torch.Tensor, seed: int = 0) -> dict[str, dict[int, torch.Tensor]]:
    """Per layer: the mean pre-RoPE query and key (``[H, 1, D]``) and k-means centroids (``[Hkv, G, D]``) of the
    raw and of the centered keys of one window ``[L]``."""
    cos, sin = rotation(model, len(window))
    gen = torch.Generator().manual_seed(seed)
    out: dict[str, dict[int, torch.Tensor]] = {"mu_q": {}, "mu_k": {}, "raw": {}, "centered": {}}
    for layer, (q, k, _, _) in tqdm(teacher_qkv(model, window[None]).items(), desc="calibrate", leave=False):
        q, k = q[0].float(), k[0].float()
        out["mu_q"][layer] = rotate(q, cos, sin, inverse=True).mean(1, keepdim=True)
        out["mu_k"][layer] = rotate(k, cos, sin, inverse=True).mean(1, keepdim=True)
        centered = k - rotate(out["mu_k"][layer].expand_as(k), cos, sin)
        out["raw"][layer] = torch.stack([spherical_kmeans(x, GROUPS, 10, gen) for x in k])
        out["centered"][layer] = torch.stack([spherical_kmeans(x, GROUPS, 10, gen) for x in centered])
    return out


def study(model, tokenizer, adapter: FocusAdapter, cal: dict, variants: list[str], length: int, haystack: str,
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
    near = causal & ((i - j < WINDOW) | (j < SINKS))
    cos, sin = rotation(model, n)
    qkv = teacher_qkv(model, ids[None])
    out = {}
    for variant in variants:
        kind, query_top_k = variant.split(":")
        kept = mass = density = 0.0
        for layer, (q, k, _, scale) in qkv.items():
            q, k = q[0].float(), k[0].float()
            rep = q.shape[0] // k.shape[0]
            probs = (q[:, queries] @ k.repeat_interleave(rep, 0).transpose(-1, -2)) * (scale or q.shape[-1] ** -0.5)
            probs = probs.masked_fill(~causal[queries], float("-inf")).softmax(-1)  # [Hq, Q, n]
            q_route, k_route = q, k
            if kind in ("centered", "both"):
                k_route = k - rotate(cal["mu_k"][layer].expand_as(k), cos, sin)
            if kind == "both":
                q_route = q - rotate(cal["mu_q"][layer].expand_as(q), cos, sin)
            c = (adapter.centroids[adapter.slot[layer]].detach().float() if kind == "adapter"
                 else cal["raw" if kind == "raw" else "centered"][layer])
            qm = routing.hard_membership(q_route[None], c, int(query_top_k))[0]  # [Hq, n]
            km = routing.hard_membership(k_route[None], c, KEY_TOP_K)[0].repeat_interleave(rep, 0)
            allowed = near[sel] | (((qm[:, sel, None] & km[:, None, :]) != 0) & causal[sel])  # [Hq, Q + rows, n]
            mass += float(probs[..., digits].sum())
            kept += float((probs * allowed[:, :len(queries)])[..., digits].sum())
            density += float(allowed[:, len(queries):].float().sum() / (causal[rows].sum() * q.shape[0]))
        out[variant] = (kept / mass, density / len(qkv))
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--adapter", default="hub/smollm2-135m-instruct-focus")
    p.add_argument("--variants", nargs="+", default=["adapter:1", "raw:1", "raw:4", "centered:1", "both:1"])
    p.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096])
    p.add_argument("--haystacks", nargs="+", default=["filler", "prose"])
    p.add_argument("--depths", type=int, nargs="+", default=[10, 50])
    p.add_argument("--output", default=None, help="write the results as JSON here")
    args = p.parse_args()
    torch.set_grad_enabled(False)
    m = machine_info()
    print(f"{m['date']}: {m['cpu']} ({m['isa']}), {m['cores']} cores, torch {m['torch']}")
    model, tokenizer = load_model()
    adapter = FocusAdapter.from_pretrained(args.adapter)
    cal = calibrate(model, token_windows(load_documents(None, "train"), tokenizer, 2048, max_windows=3)[1])
    cells = [(n, h, d) for n in args.lengths for h in args.haystacks for d in args.depths]
    results = {}
    for n, h, d in tqdm(cells, desc="prompts"):
        results[f"{h} {n} {d}%"] = study(model, tokenizer, adapter, cal, args.variants, n, h, d)
    print("| prompt | " + " | ".join(args.variants) + " |\n|---|" + "---|" * len(args.variants))
    for cell, r in results.items():
        print(f"| {cell} | " + " | ".join(f"{r[v][0]:.2f} ({100 * r[v][1]:.1f}%)" for v in args.variants) + " |")
    if args.output:
        with open(args.output, "w") as f:
            json.dump(results, f, indent=1)


if __name__ == "__main__":
    main()
