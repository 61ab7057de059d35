"""``python -m benchmarks.layer_fidelity``: how much of each layer's attention an adapter's hard pattern keeps.

For a passkey prompt (``--haystack``, ``--length``; the needle at ``--depth``), or a window of the training books
(``--haystack train``: text the centroids were trained on, no needle), or a repetitive document built from them
(``--haystack repetitive``: :func:`focus_flex.data.repetitive_documents`, no needle), the model runs once with its
own attention; for ``--queries`` random query positions in the prompt's second half, every Focus layer reports,
averaged over its heads (with ``--per-head``, over the query heads of each KV head): the share of full attention's
probability mass on pairs the adapter's hard pattern computes (``kept``), the relative squared error of the layer
output with the row renormalised to those pairs (``error``: :func:`focus_flex.train.output_error`), and the mass
full attention puts beyond the window and sinks (``far``).
Several ``--adapters`` are compared side by side on the same forward; with ``--per-head``, the KV heads of the
first adapter with the largest output error are listed last. With ``--windows W ...`` each layer is also scored with
its window set to each W, the other layers' unchanged (the inputs are full attention's, so a layer's row does not
depend on the others'): what a narrower window costs each layer (docs/passkey.md, point 62). ``--texts N`` averages
over N windows of the training books.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch

from benchmarks.bench import machine_info
from focus_flex import FocusAdapter
from focus_flex.data import load_documents, repetitive_documents, token_windows
from focus_flex.models import load_model
from focus_flex.passkey import build_prompt
from focus_flex.train import QKV, _attention_rows, centerings, hard_fidelity, teacher_qkv

TEXTS = ("train", "repetitive")  # haystacks of text without a needle: --texts of them can be averaged


@torch.no_grad()
def layer_fidelity(model: torch.nn.Module, adapter: FocusAdapter, qkv: QKV, query_idx: torch.Tensor,
                   window: int | None = None) -> dict[int, torch.Tensor]:
    """``{layer: [3, Hq]}``: (kept, error, far) per query head of ``adapter``'s hard pattern on the captured ``qkv``
    of one forward of ``model`` (:func:`focus_flex.train.teacher_qkv`) at the query positions ``query_idx [Q]``;
    with ``window``, every layer's pattern with that window instead of its own."""
    centering = centerings(adapter, model)
    out = {}
    for layer, slot in adapter.slot.items():
        q, k, v, scale = qkv[layer]
        cfg = adapter.config.at(layer)
        cfg = cfg if window is None else dataclasses.replace(cfg, window=window)
        rows = _attention_rows(q, k, cfg, query_idx, scale)
        kept, error = hard_fidelity(q, k, v, adapter.centroids.detach()[slot], cfg, query_idx, scale,
                                    centering.get(slot), rows)
        p, near, future = rows
        far = (p * ~(near | future)).sum(-1).mean(-1)
        out[layer] = torch.stack([kept[0], error[0], far[0]])
    return out


def per_kv_head(row: torch.Tensor, hkv: int) -> torch.Tensor:
    """One layer's ``row [3, Hq]`` averaged over the query heads of each of its ``hkv`` KV heads: ``[3, Hkv]``."""
    return row.unflatten(-1, (hkv, -1)).mean(-1)


def _cell(row: torch.Tensor | None, kv_head: int | None, hkv: int) -> str:
    """``kept / error / far`` of one layer's ``row [3, Hq]``: the mean over its heads, or over one KV head's."""
    if row is None:
        return "-"
    row = row.mean(-1) if kv_head is None else per_kv_head(row, hkv)[:, kv_head]
    return " / ".join(f"{x:.3f}" for x in row.tolist())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", nargs="+", default=["hub/smollm2-135m-instruct-focus",
                                                          "hub/smollm2-135m-instruct-focus-retrieval"])
    parser.add_argument("--haystack", choices=["filler", "prose", "train", "repetitive"], default="prose")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--depth", type=int, default=10, help="the needle's depth, % of the prompt")
    parser.add_argument("--per-head", action="store_true", help="one row per (layer, KV head)")
    parser.add_argument("--queries", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--windows", type=int, nargs="*", default=[],
                        help="also score every layer with its window set to each of these")
    parser.add_argument("--texts", type=int, default=1, help="windows of the text averaged over (train, repetitive)")
    args = parser.parse_args()
    if args.texts != 1 and args.haystack not in TEXTS:
        parser.error(f"--texts {args.texts}: a passkey haystack is one prompt; use --haystack train or repetitive")
    print(" | ".join(f"{k}: {v}" for k, v in machine_info().items()))
    model, tokenizer = load_model()
    model.eval()
    if args.haystack == "train":
        ids = token_windows(load_documents(split="train"), tokenizer, args.length, max_windows=args.texts)
    elif args.haystack == "repetitive":
        docs = repetitive_documents(load_documents(split="train"), args.texts, tokenizer, args.length, args.seed)
        ids = token_windows(docs, tokenizer, args.length, max_windows=args.texts)
    else:
        ids = build_prompt(tokenizer, args.length, args.depth, "49396", args.haystack).input_ids[None]
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.randint(args.length // 2, args.length, (args.queries,), generator=gen).sort().values
    adapters = {a: FocusAdapter.from_pretrained(a) for a in args.adapters}
    columns = [(a, w) for a in args.adapters for w in [None, *args.windows]]
    names = [a if w is None else f"{a}, window {w}" for a, w in columns]
    rows: dict[str, dict[int, torch.Tensor]] = {n: {} for n in names}
    for text in ids:  # each layer's rows averaged over the texts
        qkv = teacher_qkv(model, text[None])
        for name, (a, w) in zip(names, columns, strict=True):
            for layer, row in layer_fidelity(model, adapters[a], qkv, idx, w).items():
                rows[name][layer] = rows[name].get(layer, 0) + row / len(ids)
    hkv = model.config.num_key_value_heads
    needle = "" if args.haystack in TEXTS else f", needle at {args.depth}%"
    print(f"\n{args.haystack}, {len(ids)} x {args.length} tokens{needle}, {args.queries} queries: kept / error / far\n")
    print(f"| {'layer.KV head' if args.per_head else 'layer'} | " + " | ".join(names) + " |")
    print("|---|" + "---|" * len(names))
    for layer in sorted(set().union(*(r.keys() for r in rows.values()))):
        for h in range(hkv) if args.per_head else [None]:
            name = layer if h is None else f"{layer}.{h}"
            print(f"| {name} | " + " | ".join(_cell(rows[n].get(layer), h, hkv) for n in names) + " |")
    if args.per_head:
        first = rows[names[0]]
        error = {f"{layer}.{h}": e for layer, r in first.items() for h, e in enumerate(per_kv_head(r, hkv)[1].tolist())}
        worst = sorted(error, key=error.get, reverse=True)[:12]
        print(f"\nKV heads of {args.adapters[0]} by output error, largest first: "
              + ", ".join(f"{x} ({error[x]:.3f})" for x in worst))


if __name__ == "__main__":
    main()
