"""``python -m benchmarks.prompt_ablation``: which part of the passkey prompt makes Focus lose the answer's first
token.

The passkey prompts of one cell (``--haystack``, ``--length``, depths, keys: the evaluation's own prompts and keys),
each rebuilt with one part of its text swapped for the retrieval prompts' of ``benchmarks.output_kl`` (on which
Focus keeps the key's log-probability): the instruction; the wording of the needle, the question and the started
answer together (a needle that names a secret code asked about as a pass key would not be a retrieval); or the key's
format (the 5-digit key's first four digits, dashed: ``71432`` becomes ``7-1-4-3``); besides, the needle stated once
(``The pass key is 71432.``), the needle in the retrieval prompt's form naming the pass key (``needle form``), the
passkey's sentences naming a secret code (``naming``), every part swapped, and RULER's phrasing of the evaluation
(``ruler``, ``focus_flex.passkey.PHRASINGS``). The key is appended to the prompt and teacher-forced, so one forward
pass per prompt scores all its tokens (the key's tokens fall in the dense tail, as a generation step with
``dense_decode`` attends every token).

Reported per variant, for full attention and the adapter (hard routing, the inference path): the key's mean
log-probability in nats, split into its first token (for SmolLM2 the space that starts a number) and the rest; how
many prompts the first token wins (greedy decoding would start the key); the adapter's loss on the first token
against full attention's (``gap``); and of the keys greedy decoding reads back with full attention, how many it
reads back with the adapter (the passkey target's measure; the key teacher-forced in the dense tail stands for the
generation steps of ``dense_decode``); with ``--density``, the same for window-only at that fraction of the pairs
(the adapter's sinks and dense tail). The part whose swap closes the gap is what the passkey's loss turns on.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from tqdm.auto import tqdm

from benchmarks.bench import machine_info
from benchmarks.output_kl import RETRIEVAL_TEXT
from focus_flex import FocusAdapter
from focus_flex.evaluate import matching_window, window_density, window_only
from focus_flex.models import load_model
from focus_flex.passkey import PHRASINGS, PromptText, build_prompt, make_key

PASSKEY = PromptText()
INSTRUCTION = RETRIEVAL_TEXT.instruction + "\n\n"  # the passkey's instruction ends in a blank line before the haystack
VARIANTS = {
    "passkey": PASSKEY,
    "instruction": dataclasses.replace(PASSKEY, instruction=INSTRUCTION),
    "wording": dataclasses.replace(PASSKEY, needle=RETRIEVAL_TEXT.needle, question=RETRIEVAL_TEXT.question,
                                   answer_prefix=RETRIEVAL_TEXT.answer_prefix),
    "needle form": dataclasses.replace(PASSKEY, needle=" (A note for the reader: the pass key is {key}. "
                                                       "Do not forget {key}.)"),
    "naming": PromptText(*(part.replace("pass key", "secret code") for part in dataclasses.astuple(PASSKEY))),
    "needle once": dataclasses.replace(PASSKEY, needle=" The pass key is {key}."),
    "key format": PASSKEY,
    "all": dataclasses.replace(RETRIEVAL_TEXT, instruction=INSTRUCTION),
    "ruler": PHRASINGS["ruler"],
}
DASHED = ("key format", "all")


@torch.no_grad()
def key_scores(model: torch.nn.Module, tokenizer, ids: torch.Tensor, key: str) -> tuple[float, float, float, bool]:
    """``(first, rest, margin, greedy)`` of ``" " + key`` teacher-forced after ``ids [L]``: the first token's
    log-probability, the other tokens' summed, the first token's logit minus the best other token's, and whether
    greedy decoding answers with exactly the key (every token of it the most likely, and no digit after it)."""
    target = torch.tensor(tokenizer(" " + key, add_special_tokens=False).input_ids)
    logits = model(torch.cat([ids, target])[None]).logits[0, len(ids) - 1:].float()
    lp = logits[:-1].log_softmax(-1).gather(1, target[:, None])[:, 0]
    after = tokenizer.decode(logits[-1].argmax()).strip()
    greedy = bool((logits[:-1].argmax(-1) == target).all()) and not after[:1].isdigit()
    first = logits[0].clone()
    top = first[target[0]].item()
    first[target[0]] = -float("inf")
    return lp[0].item(), lp[1:].sum().item(), top - first.max().item(), greedy


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--haystack", choices=["prose", "filler"], default="prose")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--depths", type=int, nargs="+", default=[10, 30, 50, 70, 90])
    ap.add_argument("--keys-per-cell", type=int, default=6)
    ap.add_argument("--window", type=int, default=None, help="override the adapter's window")
    ap.add_argument("--density", type=float, default=None,
                    help="also window-only (the adapter's sinks, dense tail and layers) at this fraction of the pairs")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(" | ".join(f"{k}: {v}" for k, v in machine_info().items()))
    model, tok = load_model()
    adapter = FocusAdapter.from_pretrained(args.adapter)
    cfg = adapter.config
    cfg.window = args.window or cfg.window
    cells = [(d, k) for d in args.depths for k in range(args.keys_per_cell)]
    modes = ["full", "focus"] + (["window"] if args.density else [])
    if args.density:
        window = matching_window(args.length, cfg.sink_tokens, args.density, cfg.tail(args.length))
        print(f"window-only: window {window} + {cfg.sink_tokens} sinks + dense tail {cfg.tail(args.length)}, "
              f"{window_density(args.length, window, cfg.sink_tokens, cfg.tail(args.length)):.1%} of the pairs")
    print(f"{args.adapter} (window {cfg.window}), {args.haystack} {args.length}, {len(cells)} prompts\n")
    head = [f"{m}: first; rest (first wins)" for m in modes] + ["gap first", "gap margin"]
    head += [f"keys of full's: {m}" for m in modes[1:]]
    print("| variant | " + " | ".join(head) + " |\n" + "|---" * (len(head) + 1) + "|")
    for name in tqdm(args.variants, desc="variants"):
        rows: dict[str, list[tuple[float, float, float, bool]]] = {m: [] for m in modes}
        for depth, number in cells:
            key = make_key(args.haystack, args.length, depth, number, args.seed)
            if name in DASHED:
                key = "-".join(key[:4])
            ids = build_prompt(tok, args.length, depth, key, args.haystack, number, VARIANTS[name]).input_ids
            rows["full"].append(key_scores(model, tok, ids, key))
            adapter.attach(model)
            rows["focus"].append(key_scores(model, tok, ids, key))
            adapter.detach(model)
            if args.density:
                with window_only(model, window, cfg.sink_tokens, cfg.layers, dense_tail=cfg.dense_tail):
                    rows["window"].append(key_scores(model, tok, ids, key))
        mean = {m: [sum(r[i] for r in rs) / len(rs) for i in range(3)] for m, rs in rows.items()}
        cols = [f"{mean[m][0]:.2f}; {mean[m][1]:.2f} ({sum(r[2] > 0 for r in rows[m])})" for m in modes]
        cols += [f"{mean['focus'][0] - mean['full'][0]:+.2f}", f"{mean['focus'][2] - mean['full'][2]:+.2f}"]
        cols += [f"{sum(f[3] and g[3] for f, g in zip(rows['full'], rows[m], strict=True))} of "
                 f"{sum(f[3] for f in rows['full'])}" for m in modes[1:]]
        print(f"| {name} | " + " | ".join(cols) + " |", flush=True)


if __name__ == "__main__":
    main()
