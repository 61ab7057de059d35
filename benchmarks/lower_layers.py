"""``python -m benchmarks.lower_layers``: what the lower layers' far context needs (docs/passkey.md, points 48 and 51).

``errors``: one passkey prompt (``--haystack``, ``--length``, ``--depth``, ``--key-number``) runs once with the
model's own attention; for each of ``--layers`` the relative error of the attention output (all heads; the rows past
the window and before the dense tail) against full attention, of the adapter's hard pattern alone, with the far
summaries of :func:`benchmarks.passkey_oracle.moment_summaries` (``--summaries BLOCK:ORDER ...``), and of sliding
windows (``--windows``).

``attribution``: the same prompt with its key appended runs once with the model's own attention and a backward pass
from the key's log-probability to every layer's attention output ``o`` (:func:`focus_flex.train.capture_qkv`); for each
of ``--layers``, ``g . (o_focus - o)``, the first-order change of the key's log-probability that the adapter's hard
pattern in that layer alone makes, and the share of ``|g|^2`` (the Fisher weight of the key, as
:func:`focus_flex.train.fisher_qkv` weighs the training's rows), summed over the prompt's first 128 rows (the chat
template and the instruction), the rows from there to the needle, the needle, the rows from the needle to the dense
tail, and the tail (the key's own rows: dense decode, no error).

``perplexity``: perplexity of ``--eval-windows`` windows of ``--context`` tokens of the shipped held-out books with
the queries of ``--wide-layers`` routed into ``--wide-top-k`` groups (``FocusConfig.layer_top_k``),
side by side with the adapter as it is; each with window-only at its density. With ``--adaptive-mass P`` their queries
instead take groups until they hold P of their routing probability (:func:`benchmarks.passkey_oracle.adaptive_layers`,
at most ``--adaptive-most``), beside window-only at the density with the pairs that adds.
"""

from __future__ import annotations

import argparse
import collections
import math

import torch
import torch.nn.functional as F

import focus_flex.adapter
from benchmarks.bench import machine_info
from benchmarks.passkey_oracle import adaptive_layers, moment_summaries
from focus_flex import FocusAdapter
from focus_flex.data import load_documents, token_windows
from focus_flex.evaluate import evaluate, matching_window, window_mask, window_nll, window_only
from focus_flex.models import load_model
from focus_flex.passkey import Prompt
from focus_flex.train import capture_qkv, centerings, teacher_qkv

HEAD_ROWS = 128  # attribution: the prompt's first rows (the chat template and the instruction) counted apart


def summary(text: str) -> tuple[int, int]:
    block, order = text.split(":")
    return int(block), int(order)


def focus_output(adapter: FocusAdapter, layer: int, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                 scale: float | None, centerings_: dict) -> torch.Tensor:
    """A layer's attention output ``[B, Hq, L, D]`` under the adapter's hard pattern (its centering included)."""
    slot = adapter.slot[layer]
    return focus_flex.adapter.reference_attention(q, k, v, adapter.centroids.detach()[slot],
                                                  adapter.layer_config(slot), scale=scale,
                                                  centering=centerings_.get(slot))


def errors(model: torch.nn.Module, tokenizer, adapter: FocusAdapter, args: argparse.Namespace) -> None:
    cell = Prompt(args.haystack, args.length, args.depth, args.key_number, args.phrasing)
    ids = cell.build(tokenizer, cell.key(args.seed)).input_ids
    qkv = teacher_qkv(model, ids[None])
    cfg, n = adapter.config, len(ids)
    rows = slice(cfg.window + cfg.sink_tokens, n - cfg.tail(n))
    names = ["focus", *(f"summaries {b}:{o}" for b, o in args.summaries), *(f"window {w}" for w in args.windows)]
    print("layer | " + " | ".join(names))
    cents = centerings(adapter, model)
    for layer in args.layers:
        q, k, v, scale = qkv[layer]
        full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
        outs = [focus_output(adapter, layer, q, k, v, scale, cents)]
        for block, order in args.summaries:
            with moment_summaries(block, order):  # it patches focus_flex.adapter's reference_attention
                outs.append(focus_output(adapter, layer, q, k, v, scale, cents))
        for w in args.windows:
            mask = window_mask(n, n, w, cfg.sink_tokens)
            outs.append(F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True))
        err = [float((o - full)[:, :, rows].norm() / full[:, :, rows].norm()) for o in outs]
        print(f"{layer} | " + " | ".join(f"{e:.3f}" for e in err), flush=True)


def layer_changes(model: torch.nn.Module, adapter: FocusAdapter, ids: torch.Tensor, target: list[int],
                  layers: list[int]) -> tuple[float, dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """The log-probability of ``target`` after the prompt ``ids [n]`` under the model's own attention, and for each
    of ``layers`` per row ``[n]``: the first-order change of it that the adapter's hard pattern in that layer alone
    makes, ``g . (o_focus - o)`` summed over the heads (``o``: the layer's attention output, ``g``: the gradient of the
    log-probability with respect to it), and the squared norm of ``g`` (the target's Fisher weight of the row)."""
    n = len(ids)
    outputs: dict[int, torch.Tensor] = {}
    with capture_qkv(model, outputs) as qkv, torch.enable_grad():
        seq = torch.cat([ids, torch.tensor(target)])[None]
        logits = model(input_ids=seq, use_cache=False, logits_to_keep=len(target) + 1).logits
        logp = logits[0, :-1].float().log_softmax(-1)  # the scores of the target's tokens
        total = logp.gather(-1, torch.tensor(target)[:, None]).sum()
        grads = torch.autograd.grad(total, [outputs[i] for i in layers])
    out, cents = {}, centerings(adapter, model)
    for layer, g in zip(layers, grads, strict=True):
        q, k, v, scale = (t[:, :, :n] if torch.is_tensor(t) else t for t in qkv[layer])
        with torch.no_grad():
            full = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)
            focus = focus_output(adapter, layer, q, k, v, scale, cents)
        g = g[0, :n].transpose(0, 1)  # [Hq, n, D]
        out[layer] = ((g * (focus - full)[0]).sum((0, 2)), g.pow(2).sum((0, 2)))
    return total.item(), out


def attribution(model: torch.nn.Module, tokenizer, adapter: FocusAdapter, args: argparse.Namespace) -> None:
    cell = Prompt(args.haystack, args.length, args.depth, args.key_number, args.phrasing)
    prompt = cell.build(tokenizer, cell.key(args.seed))
    target = tokenizer(" " + prompt.key, add_special_tokens=False).input_ids
    n, cfg = len(prompt.input_ids), adapter.config
    key_logprob, changes = layer_changes(model, adapter, prompt.input_ids, target, args.layers)
    start, stop = prompt.needle
    tail = n - cfg.tail(n)
    head = min(HEAD_ROWS, start)
    ranges = {f"first {head}": slice(0, head), "to needle": slice(head, start), "needle": slice(start, stop),
              "needle to tail": slice(stop, tail), "tail": slice(tail, n)}
    print(f"key {prompt.key}: log-probability {key_logprob:.3f} (full attention, teacher-forced); needle "
          f"[{start}, {stop}) of {n} tokens; per layer: first-order change of it by the adapter's pattern in that "
          "layer alone (total, then by rows), and the rows' share of |g|^2")
    print("layer | change | " + " | ".join(ranges) + " | " + " | ".join(f"|g|^2 {r}" for r in ranges))
    for layer, (change, weight) in changes.items():
        print(f"{layer} | {change.sum().item():+.3f} | " + " | ".join(f"{change[r].sum().item():+.3f}" for r in
              ranges.values()) + " | " + " | ".join(f"{weight[r].sum().item() / weight.sum().item():.3f}"
                                                    for r in ranges.values()), flush=True)
    print(f"sum over these layers: {sum(c.sum().item() for c, _ in changes.values()):+.3f}")


def perplexity(model: torch.nn.Module, tokenizer, adapter: FocusAdapter, args: argparse.Namespace) -> None:
    windows = token_windows(load_documents(None, "eval"), tokenizer, args.context, max_windows=args.eval_windows)
    cfg = adapter.config
    if args.adaptive_mass is not None:
        adaptive_perplexity(model, adapter, windows, args)
        return
    own = cfg.layer_top_k
    q, k = args.wide_top_k
    wide = sorted([t for t in own if t[0] not in args.wide_layers] + [[layer, q, k] for layer in args.wide_layers])
    try:
        for name, listing in (("the adapter as it is", own),
                              (f"layers {args.wide_layers} with groups per query and key {q}, {k}", wide)):
            cfg.layer_top_k = listing
            for r in evaluate(model, adapter, windows, modes=("focus", "window"), progress=False):
                print(f"{name}: {r.mode} perplexity {r.perplexity:.3f}, density {100 * r.density:.1f}%", flush=True)
    finally:
        cfg.layer_top_k = own


def adaptive_perplexity(model: torch.nn.Module, adapter: FocusAdapter, windows: torch.Tensor,
                        args: argparse.Namespace) -> None:
    """Perplexity of ``windows [N, L]`` with the queries of ``--wide-layers`` in groups holding ``--adaptive-mass`` of
    their routing probability (:func:`benchmarks.passkey_oracle.adaptive_layers`), density with the added pairs, and
    window-only at that density."""
    cfg, n = adapter.config, windows.shape[1]
    stats = collections.defaultdict(list)
    with adaptive_layers(args.wide_layers, args.adaptive_mass, args.adaptive_most, stats):
        focus = evaluate(model, adapter, windows, modes=("focus",), progress=False)[0]
    density = focus.density + sum(stats["added"]) / (len(windows) * len(cfg.layers))
    w = matching_window(n, cfg.sink_tokens, density, cfg.tail(n))
    with window_only(model, w, cfg.sink_tokens, cfg.layers, dense_tail=cfg.dense_tail):
        total, count = window_nll(model, windows)
    groups = sum(stats["groups"]) / len(stats["groups"])
    print(f"layers {args.wide_layers}, queries' groups holding {args.adaptive_mass} of their routing probability (at "
          f"most {args.adaptive_most}; {groups:.2f} per query): focus perplexity {focus.perplexity:.3f}, density "
          f"{100 * density:.1f}% (top-1 pattern {100 * focus.density:.1f}%); window {w} + {cfg.sink_tokens} sinks at "
          f"that density: perplexity {math.exp(total / count):.3f}", flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("task", choices=["errors", "attribution", "perplexity"])
    parser.add_argument("--adapter", default="hub/smollm2-135m-instruct-focus")
    parser.add_argument("--haystack", choices=["filler", "prose"], default="filler")
    parser.add_argument("--phrasing", choices=["passkey", "ruler"], default="passkey")
    parser.add_argument("--length", type=int, default=8192)
    parser.add_argument("--depth", type=int, default=50)
    parser.add_argument("--key-number", type=int, default=1)
    parser.add_argument("--seed", type=int, default=0, help="the evaluation's seed of the keys")
    parser.add_argument("--layers", type=int, nargs="+", default=[0, 1, 2, 5, 8, 10])
    parser.add_argument("--summaries", type=summary, nargs="*", default=[(256, 1), (256, 2), (1024, 2), (256, 0)],
                        metavar="BLOCK:ORDER", help="moment summaries (orders: passkey_oracle --moment-order)")
    parser.add_argument("--windows", type=int, nargs="*", default=[2048, 4096])
    parser.add_argument("--wide-layers", type=int, nargs="+", default=list(range(11)))
    parser.add_argument("--wide-top-k", type=int, nargs=2, default=[6, 4], metavar=("Q", "K"))
    parser.add_argument("--adaptive-mass", type=float, default=None,
                        help="perplexity: instead of --wide-top-k, each query of --wide-layers takes groups until they "
                             "hold this much of its routing probability")
    parser.add_argument("--adaptive-most", type=int, default=10, help="perplexity: at most this many groups then")
    parser.add_argument("--context", type=int, default=4096)
    parser.add_argument("--eval-windows", type=int, default=4)
    args = parser.parse_args()
    print(" | ".join(f"{k}: {v}" for k, v in machine_info().items()))
    model, tokenizer = load_model()
    model.eval()
    adapter = FocusAdapter.from_pretrained(args.adapter)
    {"errors": errors, "attribution": attribution, "perplexity": perplexity}[args.task](model, tokenizer, adapter, args)


if __name__ == "__main__":
    main()
