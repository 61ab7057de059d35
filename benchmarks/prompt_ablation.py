"""``python -m benchmarks.prompt_ablation``: which part of the passkey prompt makes Focus lose the answer's first token.

The passkey prompts of one cell (``--haystack``, ``--length``, depths, keys: the evaluation's own prompts and keys),
each rebuilt with one part of its text swapped for the retrieval prompts' of ``benchmarks.output_kl`` (on which Focus
keeps the key's log-probability): the instruction, the needle, the question with the started answer, or the key's
format (the 5-digit key's first four digits, dashed: ``71432`` becomes ``7-1-4-3``); besides, the needle stated once
(``The pass key is 71432.``) and every part swapped. The key is appended to the prompt and teacher-forced, so one
forward pass per prompt scores all its tokens (the key's tokens fall in the dense tail, as a generation step with
``dense_decode`` attends every token).

Reported per variant, for full attention and the adapter (hard routing, the inference path): the key's mean
log-probability in nats, split into its first token (for SmolLM2 the space that starts a number) and the rest;
how many prompts the first token wins (greedy decoding would start the key); and the adapter's loss on the first
token against full attention's (``gap``). The part whose swap closes the gap is what the passkey's loss turns on.
"""

from __future__ import annotations

import argparse
import dataclasses

import torch
from tqdm.auto import tqdm

from benchmarks.bench import machine_info
from benchmarks.output_kl import RETRIEVAL_TEXT
from focus_flex import FocusAdapter
from focus_flex.models import load_model
from focus_flex.passkey import PromptText, build_prompt, make_key

VARIANTS = {
    "passkey": lambda t: t,
    "instruction": lambda t: dataclasses.replace(t, instruction=RETRIEVAL_TEXT.instruction + "\n\n"),
    "needle": lambda t: dataclasses.replace(t, needle=RETRIEVAL_TEXT.needle),
    "needle once": lambda t: dataclasses.replace(t, needle=" The pass key is {key}."),
    "question": lambda t: dataclasses.replace(t, question=RETRIEVAL_TEXT.question,
                                              answer_prefix=RETRIEVAL_TEXT.answer_prefix),
    "key format": lambda t: t,
    "all": lambda t: dataclasses.replace(RETRIEVAL_TEXT, instruction=RETRIEVAL_TEXT.instruction + "\n\n"),
}
DASHED = ("key format", "all")


@torch.no_grad()
def key_scores(model: torch.nn.Module, tokenizer, ids: torch.Tensor, key: str) -> tuple[float, float, float]:
    """``(first, rest, margin)`` of ``" " + key`` teacher-forced after ``ids [L]``: the first token's
    log-probability, the other tokens' summed, and the first token's logit minus the best other token's."""
    target = torch.tensor(tokenizer(" " + key, add_special_tokens=False).input_ids)
    logits = model(torch.cat([ids, target])[None]).logits[0, len(ids) - 1:-1].float()
    lp = logits.log_softmax(-1).gather(1, target[:, None])[:, 0]
    first = logits[0].clone()
    top = first[target[0]].item()
    first[target[0]] = -float("inf")
    return lp[0].item(), lp[1:].sum().item(), top - first.max().item()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapter", required=True)
    ap.add_argument("--haystack", choices=["prose", "filler"], default="prose")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--depths", type=int, nargs="+", default=[10, 30, 50, 70, 90])
    ap.add_argument("--keys-per-cell", type=int, default=6)
    ap.add_argument("--window", type=int, default=None, help="override the adapter's window")
    ap.add_argument("--variants", nargs="+", choices=list(VARIANTS), default=list(VARIANTS))
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(" | ".join(f"{k}: {v}" for k, v in machine_info().items()))
    model, tok = load_model()
    adapter = FocusAdapter.from_pretrained(args.adapter)
    adapter.config.window = args.window or adapter.config.window
    cells = [(d, k) for d in args.depths for k in range(args.keys_per_cell)]
    print(f"{args.adapter} (window {adapter.config.window}), {args.haystack} {args.length}, {len(cells)} prompts\n")
    print("| variant | full: first; rest (first wins) | Focus: first; rest (first wins) | gap first | "
          "gap margin |\n|---|---|---|---|---|")
    for name in tqdm(args.variants, desc="variants"):
        text = VARIANTS[name](PromptText())
        rows = {"full": [], "focus": []}
        for depth, number in cells:
            key = make_key(args.haystack, args.length, depth, number, args.seed)
            if name in DASHED:
                key = "-".join(key[:4])
            ids = build_prompt(tok, args.length, depth, key, args.haystack, number, text).input_ids
            rows["full"].append(key_scores(model, tok, ids, key))
            adapter.attach(model)
            rows["focus"].append(key_scores(model, tok, ids, key))
            adapter.detach(model)
        mean = {m: [sum(r[i] for r in rs) / len(rs) for i in range(3)] for m, rs in rows.items()}
        wins = {m: sum(r[2] > 0 for r in rs) for m, rs in rows.items()}
        cols = [f"{mean[m][0]:.2f}; {mean[m][1]:.2f} ({wins[m]}/{len(cells)})" for m in ("full", "focus")]
        print(f"| {name} | {cols[0]} | {cols[1]} | {mean['focus'][0] - mean['full'][0]:+.2f} | "
              f"{mean['focus'][2] - mean['full'][2]:+.2f} |", flush=True)


if __name__ == "__main__":
    main()
