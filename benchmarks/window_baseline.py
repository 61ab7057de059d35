"""``python -m benchmarks.window_baseline``: what the window-only baseline of ``focus-flex eval`` costs.

One forward of the embedded SmolLM2 (``logits_to_keep=1``) per length, three ways, alternating in one process:
full attention (the model's causal SDPA), the window-only baseline as :func:`focus_flex.evaluate.window_only` runs
it (window + sinks + dense tail computed alone, :func:`focus_flex.flash.window_attention`), and the same pattern as
a dense bool mask in the model's SDPA (every pair scored, then masked). The logits of the last two are compared, so
a wrong fast path stops the run. Min and median of ``--repeats`` forwards.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import AttentionInterface
from transformers.integrations.sdpa_attention import sdpa_attention_forward

from benchmarks.bench import machine_info
from focus_flex.data import load_documents, token_windows
from focus_flex.evaluate import window_mask, window_only
from focus_flex.models import load_model

MASKED = "window_baseline_masked"


def forward(model: torch.nn.Module, x: torch.Tensor, how: str, args: argparse.Namespace) -> torch.Tensor:
    """The last position's logits of one forward over ``x [1, N]``: ``full``, ``window`` (window_only) or ``mask``."""
    if how == "full":
        return model(x, logits_to_keep=1).logits
    if how == "window":
        with window_only(model, args.window, args.sinks, dense_tail=args.tail):
            return model(x, logits_to_keep=1).logits
    model.set_attn_implementation(MASKED)
    try:
        return model(x, logits_to_keep=1).logits
    finally:
        model.set_attn_implementation("sdpa")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--lengths", type=int, nargs="+", default=[2048, 4096, 8192])
    parser.add_argument("--window", type=int, default=364, help="the default adapter's matched window at 4K")
    parser.add_argument("--sinks", type=int, default=4)
    parser.add_argument("--tail", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    info = machine_info()
    print(f"{info['cpu']} ({info['isa']}; C kernels: {info['kernels_built']}), {info['cores']} cores, "
          f"{info['threads']} threads, torch {info['torch']}, {info['date']}; window {args.window} + "
          f"{args.sinks} sinks + dense tail {args.tail}, fp32\n")
    model, tokenizer = load_model()
    model.eval()

    def masked(module, query, key, value, attention_mask, **kwargs):
        band = window_mask(query.shape[2], key.shape[2], args.window, args.sinks, min(args.tail, query.shape[2]))
        return sdpa_attention_forward(module, query, key, value, band[None, None], **kwargs)

    AttentionInterface.register(MASKED, masked)
    print("| tokens | full attention s | window-only s | window as dense mask s | window-only / full | "
          "window-only / dense mask |")
    print("|---|---|---|---|---|---|")
    for n in args.lengths:
        x = token_windows(load_documents(split="eval"), tokenizer, n, max_windows=1)

        times: dict[str, list[float]] = {"full": [], "window": [], "mask": []}
        with torch.no_grad():
            diff = (forward(model, x, "window", args) - forward(model, x, "mask", args)).abs().max().item()
            if diff > 1e-3:
                raise SystemExit(f"window-only logits differ from the dense-mask ones by {diff} at {n} tokens")
            for _ in range(args.repeats):
                for name in times:
                    t = time.perf_counter()
                    forward(model, x, name, args)
                    times[name].append(time.perf_counter() - t)
        s = {k: (min(v), statistics.median(v)) for k, v in times.items()}
        print(f"| {n} | {s['full'][0]:.2f} ({s['full'][1]:.2f}) | {s['window'][0]:.2f} ({s['window'][1]:.2f}) | "
              f"{s['mask'][0]:.2f} ({s['mask'][1]:.2f}) | {s['window'][0] / s['full'][0]:.2f} | "
              f"{s['window'][0] / s['mask'][0]:.2f} |", flush=True)
    print("\nmin (median) seconds per forward; ratios of the minima")


if __name__ == "__main__":
    main()
