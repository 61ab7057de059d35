"""``python -m benchmarks.output_kl``: how far adapters move the model's next-token distribution, side by side.

Two texts, neither a passkey prompt (what the ``kd`` objective can be checked on without tuning on the test):

* ``books``: windows of the shipped held-out books with ``--repeats`` spans of 32 tokens copied at least 256 tokens
  ahead (as ``retrofit --repeats`` builds training sequences). Reported: the mean ``KL(full || Focus)`` in nats over
  the positions from 256 on (``far``), and over the positions that continue a copy (``copies``, where the model
  reads a span back from far away).
* ``retrieval``: chat prompts built from the *training* books (``--books eval``: the held-out ones), with another
  instruction, needle, question and key format than the passkey evaluation (a 4-digit dashed code,
  :func:`retrieval_prompt`). Reported: the mean
  log-probability of the code's tokens given the started answer (``key``, and its ``first`` token), for full
  attention and each adapter.

Focus runs hard (the inference path); ``--window`` overrides the adapters' window.
"""

from __future__ import annotations

import argparse
import random

import torch

from benchmarks.bench import machine_info
from focus_flex import FocusAdapter
from focus_flex.data import load_documents, token_windows
from focus_flex.models import load_model
from focus_flex.passkey import PromptText, _book_ids, _nearest_boundary, _next_boundary, _wrap
from focus_flex.train import with_repeats

RETRIEVAL_TEXT = PromptText(
    instruction="Read the passage below. Somewhere in it a secret code is mentioned once; you will be asked to recall "
                "it at the end.",
    needle=" (A note for the reader: the secret code is {key}. Do not forget {key}.)",
    question="\n\nWhich secret code did the passage mention?",
    answer_prefix="The secret code is")


def dashed_code(rng: random.Random) -> str:
    """The retrieval prompts' key format: four dashed digits such as ``2-9-1-4``."""
    return "-".join(str(rng.randint(0, 9)) for _ in range(4))


def retrieval_prompt(tokenizer, book_ids: list[int], length: int, rng: random.Random) -> tuple[torch.Tensor,
                                                                                                 torch.Tensor]:
    """``(ids [length], positions)``: a chat prompt whose user turn hides a code such as ``2-9-1-4`` at a random
    sentence boundary of a random excerpt of ``book_ids``, ending with the started answer and the code itself
    (teacher-forced); ``positions`` are the ones that predict the code's tokens."""
    key, text = dashed_code(rng), RETRIEVAL_TEXT
    before, after = _wrap(tokenizer, text.answer_prefix)
    ids = [tokenizer(t, add_special_tokens=False)["input_ids"] for t in
           (before + text.instruction, text.needle.format(key=key), text.question + after, " " + key)]
    head, needle, tail, answer = ids
    n = length - len(head) - len(needle) - len(tail) - len(answer)
    start = _next_boundary(tokenizer, book_ids, rng.randrange(0, len(book_ids) - n - 64))
    hay = book_ids[start:start + n]
    at = _nearest_boundary(tokenizer, hay, rng.randrange(0, n))
    seq = head + hay[:at] + needle + hay[at:] + tail + answer
    first = length - len(answer) - 1
    return torch.tensor(seq), torch.arange(first, first + len(answer))


@torch.no_grad()
def log_probs(model: torch.nn.Module, seq: torch.Tensor) -> torch.Tensor:
    """``[L, V]`` next-token log-probabilities of ``seq [L]``."""
    return model(seq[None]).logits[0].float().log_softmax(-1)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--adapters", nargs="+", required=True)
    ap.add_argument("--text", choices=["books", "retrieval"], default="books")
    ap.add_argument("--length", type=int, default=2048)
    ap.add_argument("--count", type=int, default=4, help="windows (books) or prompts (retrieval)")
    ap.add_argument("--repeats", type=int, default=16, help="books: copied spans per window")
    ap.add_argument("--window", type=int, default=None, help="override the adapters' window")
    ap.add_argument("--books", choices=["train", "eval"], default="train", help="retrieval: the haystack's books")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()
    print(" | ".join(f"{k}: {v}" for k, v in machine_info().items()))
    model, tok = load_model()
    if args.text == "books":
        windows = token_windows(load_documents(None, "eval"), tok, args.length, max_windows=args.count)
        cases = [with_repeats(w, args.repeats, 32, 256, torch.Generator().manual_seed(args.seed + i))
                 for i, w in enumerate(windows)]
    else:
        rng = random.Random(args.seed)
        cases = [retrieval_prompt(tok, _book_ids(tok, args.books), args.length, rng) for _ in range(args.count)]
    full = [log_probs(model, seq) for seq, _ in cases]
    if args.text == "retrieval":
        print("| pattern | key log-probability (first token) |\n|---|---|")
        print(f"| full attention | {_key(full, cases)} |")
    else:
        print("| adapter | window | KL far | KL copies |\n|---|---|---|---|")
    for path in args.adapters:
        adapter = FocusAdapter.from_pretrained(path)
        adapter.config.window = args.window or adapter.config.window
        adapter.attach(model)
        focus = [log_probs(model, seq) for seq, _ in cases]
        adapter.detach(model)
        if args.text == "retrieval":
            print(f"| {path}, window {adapter.config.window} | {_key(focus, cases)} |")
            continue
        kl = [(f.exp() * (f - g)).sum(-1) for f, g in zip(full, focus, strict=True)]
        far = sum(k[256:].mean().item() for k in kl) / len(kl)
        copies = sum(k[pos].mean().item() for k, (_, pos) in zip(kl, cases, strict=True)) / len(kl)
        print(f"| {path} | {adapter.config.window} | {far:.4f} | {copies:.4f} |")


def _key(lps: list[torch.Tensor], cases: list[tuple[torch.Tensor, torch.Tensor]]) -> str:
    """Mean log-probability of the code (all its tokens; the first) over the prompts."""
    vals = [lp[pos, seq[pos + 1]] for lp, (seq, pos) in zip(lps, cases, strict=True)]
    return (f"{sum(v.sum().item() for v in vals) / len(vals):.3f} "
            f"({sum(v[0].item() for v in vals) / len(vals):.3f})")


if __name__ == "__main__":
    main()
