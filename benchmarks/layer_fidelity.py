"""``python -m benchmarks.layer_fidelity``: how much of each layer's attention an adapter's hard pattern keeps.

For a passkey prompt (``--haystack``, ``--length``; the needle at 10% depth) the model runs once with its own
attention; for ``--queries`` random query positions in the prompt's second half, every Focus layer reports, averaged
over its heads: the share of full attention's probability mass on pairs the adapter's hard pattern computes
(``kept``), the relative squared error of the layer output with the row renormalised to those pairs
(``error``: :func:`focus_flex.train.output_error`), and the mass full attention puts beyond the window and sinks
(``far``). Several ``--adapters`` are compared side by side on the same forward.
"""

from __future__ import annotations

import argparse

import torch

from benchmarks.bench import machine_info
from focus_flex import FocusAdapter
from focus_flex.models import load_model
from focus_flex.passkey import build_prompt
from focus_flex.train import QKV, _attention_rows, centerings, hard_fidelity, teacher_qkv


@torch.no_grad()
def layer_fidelity(model: torch.nn.Module, adapter: FocusAdapter, qkv: QKV,
                   query_idx: torch.Tensor) -> dict[int, tuple[float, float, float]]:
    """``{layer: (kept, error, far)}`` of ``adapter``'s hard pattern on the captured ``qkv`` of one forward of
    ``model`` (:func:`focus_flex.train.teacher_qkv`) at the query positions ``query_idx [Q]``, means over heads."""
    centering = centerings(adapter, model)
    out = {}
    for layer, slot in adapter.slot.items():
        q, k, v, scale = qkv[layer]
        kept, error = hard_fidelity(q, k, v, adapter.centroids.detach()[slot], adapter.config, query_idx, scale,
                                    centering.get(slot))
        p, near, future = _attention_rows(q, k, adapter.config, query_idx, scale)
        far = (p * ~(near | future)).sum(-1).mean()
        out[layer] = (kept.mean().item(), error.mean().item(), far.item())
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapters", nargs="+", default=["hub/smollm2-135m-instruct-focus",
                                                          "hub/smollm2-135m-instruct-focus-retrieval"])
    parser.add_argument("--haystack", choices=["filler", "prose"], default="prose")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--queries", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    print(" | ".join(f"{k}: {v}" for k, v in machine_info().items()))
    model, tokenizer = load_model()
    model.eval()
    prompt = build_prompt(tokenizer, args.length, 10, "49396", args.haystack)
    gen = torch.Generator().manual_seed(args.seed)
    idx = torch.randint(args.length // 2, args.length, (args.queries,), generator=gen).sort().values
    qkv = teacher_qkv(model, prompt.input_ids[None])
    rows = {a: layer_fidelity(model, FocusAdapter.from_pretrained(a), qkv, idx) for a in args.adapters}
    print(f"\n{args.haystack}, {args.length} tokens, {args.queries} queries: kept / error / far per adapter\n")
    print("| layer | " + " | ".join(args.adapters) + " |")
    print("|---|" + "---|" * len(args.adapters))
    for layer in sorted(set().union(*(r.keys() for r in rows.values()))):
        cells = [" / ".join(f"{x:.3f}" for x in rows[a][layer]) if layer in rows[a] else "-" for a in args.adapters]
        print(f"| {layer} | " + " | ".join(cells) + " |")


if __name__ == "__main__":
    main()
