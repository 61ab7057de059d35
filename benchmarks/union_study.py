"""``python -m benchmarks.union_study``: a token in a content group *and* a position group, before building it.

Every Focus layer of ``--adapter`` (the retrieval adapter: centered groups, 64 sinks) also computes the pairs of
``--union``'s pattern in the layers ``--union-layers`` (an uncentered adapter: groups that follow position), on the
reference path (dense SDPA with the union of the two patterns as mask). Prints the perplexity of the held-out books
(4 windows of 4K, as the cards) and the passkeys retrieved among those full attention retrieves in
``--full-results``, each with the density of the union. Nothing here changes the library: the union is made by
widening the reference path's mask (:func:`benchmarks.passkey_oracle.widened_reference`) for the duration of the run.
"""

from __future__ import annotations

import argparse
import contextlib
import math

import torch

from benchmarks.bench import machine_info
from benchmarks.passkey_oracle import widened_reference
from focus_flex import FocusAdapter, routing
from focus_flex.adapter import rotary_of
from focus_flex.attention import focus_pattern
from focus_flex.data import load_documents, token_windows
from focus_flex.evaluate import window_nll
from focus_flex.models import load_model
from focus_flex.passkey import greedy_answer, load_passkey, score


@contextlib.contextmanager
def union_pattern(adapter: FocusAdapter, other: FocusAdapter, layers: list[int], model: torch.nn.Module, pairs: list):
    """The reference path with ``other``'s pattern added in ``layers``; ``pairs`` collects (computed, causal) pair
    counts of every prefill."""
    slot_of = {adapter.centroids[s].data_ptr(): s for s in adapter.slot.values()}
    rotary = rotary_of(model)

    def widen(mask, q, k, centroids, config, *, attention_mask=None):
        layer = config.layers[slot_of[centroids.data_ptr()]]
        if layer in layers:
            s = other.slot[layer]
            c = routing.Centering(other.query_means[s], other.key_means[s], rotary) if other.config.centers(layer) \
                else None
            mask = mask | focus_pattern(q, k, other.centroids[s].detach(), other.config, attention_mask=attention_mask,
                                        centering=c)
        if q.shape[2] == k.shape[2]:
            n = q.shape[2]
            pairs.append((mask.sum().item() / (mask.shape[0] * mask.shape[1]), n * (n + 1) / 2))
        return mask

    with widened_reference(widen):
        yield


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--adapter", default="hub/smollm2-135m-instruct-focus-retrieval")
    parser.add_argument("--union", required=True, help="the adapter whose groups are added (e.g. uncentered)")
    parser.add_argument("--union-layers", type=int, nargs="+", default=None, help="default: every Focus layer")
    parser.add_argument("--full-results", required=True, help="passkey.json with full attention's answers")
    parser.add_argument("--lengths", type=int, nargs="+", default=[4096])
    parser.add_argument("--haystacks", nargs="+", default=["prose"])
    args = parser.parse_args()
    print(" | ".join(f"{k}: {v}" for k, v in machine_info().items()))
    model, tokenizer = load_model()
    model.eval()
    adapter, other = FocusAdapter.from_pretrained(args.adapter), FocusAdapter.from_pretrained(args.union)
    layers = adapter.config.layers if args.union_layers is None else args.union_layers
    adapter.attach(model)
    adapter.mode = "reference"
    windows = token_windows(load_documents(None, "eval"), tokenizer, 4096, max_windows=4)
    pairs: list = []
    with union_pattern(adapter, other, layers, model, pairs), torch.no_grad():
        nll, count = window_nll(model, windows)
        density = sum(p for p, _ in pairs) / sum(c for _, c in pairs)
        print(f"perplexity {math.exp(nll / count):.3f} at {density:.1%} of the pairs (union in layers {layers})",
              flush=True)
        solved = [r for r in load_passkey(args.full_results)
                  if r.mode == "full" and r.correct and r.length in args.lengths and r.haystack in args.haystacks]
        hits = 0
        for r in solved:
            pairs.clear()
            prompt = r.prompt.build(tokenizer, r.key)
            answer = greedy_answer(model, tokenizer, prompt.input_ids)
            hits += score(answer, r.key)
            density = sum(p for p, _ in pairs) / sum(c for _, c in pairs)
            print(f"{r.haystack} {r.length} {r.depth}% key {r.key_number} {r.key}: {answer!r} "
                  f"{'correct' if score(answer, r.key) else 'wrong'} ({density:.1%} of the pairs)", flush=True)
        print(f"keys full attention retrieves, retrieved: {hits}/{len(solved)}")


if __name__ == "__main__":
    main()
