"""``python -m benchmarks.bench`` (from a checkout): the Focus fast path against its baselines, side by side, on this
machine.

Sections (``--sections``):

* ``op`` — one attention layer of SmolLM2's shape (9 query / 3 KV heads, head dim 64), per length and dtype:
  Focus (the default kernel: ``flash`` on CPU, in C where it builds) vs causal SDPA, Focus on the ``flex`` kernel,
  compiled FlexAttention (causal) and window-only attention (the default kernel without a far pair: sliding window +
  sinks); block density, the ideal speedup (causal blocks / computed blocks), the fraction of it achieved, the pair
  density, and the share of routing + planning (the flash kernel's far plan; the flex kernel's block masks).
  Routing is balanced: queries and keys are drawn around the centroids.
* ``prefill`` — SmolLM2 end to end (``logits_to_keep=1``): Focus vs SDPA, plus the pair density of real routing.
* ``decode`` — tokens/s on a KV cache of each length: Focus vs SDPA, alternating in one process (SDPA on a copy of
  the model), each on its own cache; and Focus's device path (a static ``FocusCache``, each step one compiled
  FlexAttention call per layer: what GPUs run, slow on CPU, recorded for the cost model of docs/gpu.md). A cache
  holds a real 2K-token prefill's keys/values tiled to the length, preallocated (transformers' ``DynamicCache``
  re-concatenates the whole cache every step, which would dominate both methods alike). A line through the
  shortest and longest cache splits each method's time per token into a fixed part and a part per cached token.
* ``memory`` — peak RSS of Focus and SDPA for each op, prefill and decode size, each method alone in a fresh process
  (op and prefill: its first full-size call after a small warm-up; decode: its timed steps after two warm-up
  steps), under both allocator settings: the C library's default (what a program importing focus_flex gets) and
  the ``focus-flex`` command's.
* ``compile`` — the flex kernel's first-call compile time (cold inductor cache) and recompiles while lengths vary;
  the C kernels' one-time build (the flash kernel compiles nothing per shape).
* ``guard`` — for every build of the C kernels this CPU runs (:func:`focus_flex.native.build_targets`: this CPU's
  own, the AVX2 build on an AVX-512 CPU, the portable one), the default prefill, decode step and routing of one
  SmolLM2 layer at ``--guard-length`` tokens against their PyTorch fallbacks, alternating in one process; the run
  fails (exit code 1) where a default takes more than ``GUARD_RATIO`` times its fallback's time.

Every configuration runs in a fresh subprocess (``python -m benchmarks.bench _worker SPEC``), timings with the
allocator setting of the ``focus-flex`` command (:func:`focus_flex.cli.keep_freed_memory`: freed buffers stay in
the heap instead of being faulted in again at every call; it matters for Focus' temporaries, not for SDPA; it can
also leave the heap more fragmented, so memory is reported under both settings). There each method is
warmed up, then timed ``repeats`` times alternating with its baseline (min and median reported; a method stops
repeating once it has used ``max_seconds``). A peak RSS is the process' high-water mark, reset
(``/proc/self/clear_refs``) just before the measured call(s). Before anything is timed, the fast path is checked
against :func:`~focus_flex.attention.reference_attention` (fp32 and bf16, padding, GQA, decode): a wrong kernel stops
the benchmark, so no speedup is ever reported for it.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import re
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

SECTIONS = ("op", "prefill", "decode", "memory", "compile", "guard")
ADAPTER_FIELDS = ("num_groups", "query_top_k", "key_top_k", "window", "sink_tokens", "dense_tail", "layer_top_k")
# A build target other than this CPU's own runs PyTorch as a CPU of that kind would too: its kernels (ATen), oneDNN's
# and MKL's capped at the same instructions. On an AVX-512 machine, x86-64-v3 is then a stand-in for an AVX2 one.
EMULATE = {"x86-64-v3": {"ATEN_CPU_CAPABILITY": "avx2", "ONEDNN_MAX_CPU_ISA": "AVX2",
                          "MKL_ENABLE_INSTRUCTIONS": "AVX2"},
           "portable": {"ATEN_CPU_CAPABILITY": "default", "ONEDNN_MAX_CPU_ISA": "SSE41",
                        "MKL_ENABLE_INSTRUCTIONS": "SSE4_2"}}
GUARD_RATIO = 1.3  # the guard fails where a default kernel takes more than this times its PyTorch fallback's time
TOLERANCE = {"float32": 1e-4, "bfloat16": 2e-2}
HQ, HKV, HEAD_DIM = 9, 3, 64  # SmolLM2-135M attention
ALLOCATORS = ("default", "focus-flex")  # the C library's malloc as it comes; keep_freed_memory (the CLI's)
TARGETS = {"op_speedup_32k": 8.0, "ideal_fraction": 0.8, "plan_share": 0.10, "prefill_16k": 2.0, "decode_32k": 3.0}


class BenchError(RuntimeError):
    """The benchmark refused to run or a worker failed."""


# ---- CLI -----------------------------------------------------------------------------------------


def _ints(text: str) -> list[int]:
    return [int(float(x.lower().replace("k", "")) * (1024 if "k" in x.lower() else 1)) for x in text.split(",") if x]


def _names(text: str) -> list[str]:
    return [x.strip() for x in text.split(",") if x.strip()]


def build_parser() -> argparse.ArgumentParser:
    """The command line of ``python -m benchmarks.bench``."""
    p = argparse.ArgumentParser(prog="python -m benchmarks.bench", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--lengths", type=_ints, default=[4096, 8192, 16384, 32768], help="op lengths (4096 or 4k)")
    p.add_argument("--dtypes", type=_names, default=["float32", "bfloat16"], help="op dtypes")
    p.add_argument("--prefill-lengths", type=_ints, default=[4096, 8192, 16384], help="SmolLM2 prefill lengths")
    p.add_argument("--decode-lengths", type=_ints, default=[8192, 32768], help="KV cache lengths")
    p.add_argument("--decode-tokens", type=int, default=8, help="timed decode steps per method")
    p.add_argument("--repeats", type=int, default=3, help="timed repetitions per method (min and median reported)")
    p.add_argument("--max-seconds", type=float, default=60.0, help="stop repeating a method after this much time")
    p.add_argument("--sections", type=_names, default=list(SECTIONS), help=",".join(SECTIONS))
    p.add_argument("--output-dir", default="bench-results", help="where bench.md, bench.json and bench.png go")
    focus = "(op; prefill/decode too when they fall back to k-means centroids)"
    p.add_argument("--groups", type=int, default=16, help=f"Focus groups per KV head {focus}")
    p.add_argument("--top-k", type=int, default=1, help=f"groups per query (and per key unless --key-top-k) {focus}")
    p.add_argument("--key-top-k", type=int, default=None, help=f"groups per key (default: --top-k) {focus}")
    p.add_argument("--window", type=int, default=256, help=f"sliding window {focus}")
    p.add_argument("--sinks", type=int, default=4, help=f"attention sinks {focus}")
    p.add_argument("--block-size", type=int, default=64, help="FlexAttention tile of the fast path")
    p.add_argument("--model-dtype", default="float32",
                   help="dtype of SmolLM2 in prefill/decode (bf16 matmuls are ~7x slower on AVX2-only CPUs)")
    p.add_argument("--adapter", default=None,
                   help="trained adapter for prefill/decode (default: benchmarks/smollm2-135m-instruct-focus-g16 "
                        "in a source checkout, else k-means centroids of the model's own keys)")
    p.add_argument("--guard-length", type=int, default=8192, help="tokens of the guard section")
    p.add_argument("--target", default="native", choices=["native", *EMULATE],
                   help="run every section but the guard as on a CPU of this kind: x86-64-v3 (AVX2 + FMA) or portable "
                        "C kernels, with PyTorch capped at the same instructions (see EMULATE)")
    p.add_argument("--flex-causal-max", type=int, default=16384,
                   help="skip the compiled-flex causal baseline above this length (~2x slower than SDPA: minutes)")
    return p


def _cli(args: argparse.Namespace) -> int:
    try:
        prog = "python -m benchmarks.bench"
        run_bench(lengths=args.lengths, dtypes=args.dtypes, repeats=args.repeats, sections=args.sections,
                  output_dir=args.output_dir, prefill_lengths=args.prefill_lengths,
                  decode_lengths=args.decode_lengths, decode_tokens=args.decode_tokens, groups=args.groups,
                  top_k=args.top_k, key_top_k=args.key_top_k, window=args.window, sinks=args.sinks,
                  block_size=args.block_size,
                  model_dtype=args.model_dtype, adapter=args.adapter, max_seconds=args.max_seconds,
                  flex_causal_max=args.flex_causal_max, guard_length=args.guard_length, target=args.target,
                  command=" ".join([prog, *sys.argv[1:]]))
    except BenchError as e:
        print(f"benchmarks.bench: {e}", file=sys.stderr)
        return 1
    return 0


# ---- the driver ----------------------------------------------------------------------------------


def run_bench(*, lengths: Sequence[int] = (4096, 8192, 16384, 32768), dtypes: Sequence[str] = ("float32", "bfloat16"),
              repeats: int = 3, sections: Sequence[str] = SECTIONS, output_dir: str | os.PathLike = "bench-results",
              prefill_lengths: Sequence[int] = (4096, 8192, 16384), decode_lengths: Sequence[int] = (8192, 32768),
              decode_tokens: int = 8, groups: int = 16, top_k: int = 1, key_top_k: int | None = None,
              window: int = 256, sinks: int = 4,
              block_size: int = 64, model_dtype: str = "float32", adapter: str | None = None,
              max_seconds: float = 60.0, flex_causal_max: int = 16384, guard_length: int = 8192,
              target: str = "native", command: str = "",
              log: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the selected sections; write ``bench.json``, ``bench.md`` and ``bench.png`` into ``output_dir``.

    Raises :class:`BenchError` after writing them if the guard section found a default kernel more than
    :data:`GUARD_RATIO` times slower than its fallback."""
    log = log or (lambda msg: print(msg, file=sys.stderr, flush=True))
    unknown = sorted(set(sections) - set(SECTIONS))
    bad_dtypes = sorted(set(dtypes) - set(TOLERANCE))
    if unknown or bad_dtypes:
        raise BenchError(f"unknown sections {unknown} or dtypes {bad_dtypes}; choose from {SECTIONS} and "
                         f"{tuple(TOLERANCE)}")
    if target != "native" and target not in EMULATE:
        raise BenchError(f"unknown target {target!r}; choose native or one of {tuple(EMULATE)}")
    focus = {"num_groups": groups, "query_top_k": top_k, "key_top_k": top_k if key_top_k is None else key_top_k,
             "window": window,
             "sink_tokens": sinks, "block_size": block_size}
    started = time.time()
    results: dict[str, Any] = {"machine": {**machine_info(), "target": target}, "command": command, "focus": focus,
                               "repeats": repeats, "max_seconds": max_seconds}
    out = Path(output_dir)

    def worker(section: str, spec: dict[str, Any]) -> None:  # results so far survive a failed or stopped run
        results.setdefault(section, []).append(_run_worker(spec))
        out.mkdir(parents=True, exist_ok=True)
        (out / "bench.partial.json").write_text(json.dumps(results, indent=2) + "\n")
    log("checking the fast path against reference_attention ...")
    results["correctness"] = check_correctness(focus, flex=bool({"op", "compile"} & set(sections)))
    common = {"focus": focus, "repeats": repeats, "max_seconds": max_seconds, "target": target}
    if "op" in sections:
        for dtype in dtypes:
            for n in lengths:
                log(f"op: {dtype} N={n} ...")
                worker("op", {**common, "task": "op", "n": n, "dtype": dtype, "flex_causal": n <= flex_causal_max})
    adapter_dir = adapter or _find_adapter()
    model_spec = {**common, "model_dtype": model_dtype, "adapter": adapter_dir}
    if adapter_dir and {"prefill", "decode"} & set(sections):
        from focus_flex.config import FocusConfig

        cfg = FocusConfig.from_pretrained(adapter_dir)
        results["adapter"] = {"path": str(adapter_dir), **{k: getattr(cfg, k) for k in ADAPTER_FIELDS}}
    if "prefill" in sections:
        for n in prefill_lengths:
            log(f"prefill: N={n} ...")
            worker("prefill", {**model_spec, "task": "prefill", "n": n})
    if "decode" in sections:
        for n in decode_lengths:
            log(f"decode: cache={n} ...")
            worker("decode", {**model_spec, "task": "decode", "n": n, "tokens": decode_tokens})
    if "memory" in sections:  # a fresh process per method, size and allocator: nothing left over from other calls
        sizes = [("op", n, dtype) for dtype in dtypes for n in lengths if "op" in sections]
        sizes += [("prefill", n, model_dtype) for n in prefill_lengths if "prefill" in sections]
        sizes += [("decode", n, model_dtype) for n in decode_lengths if "decode" in sections]
        for of, n, dtype in sizes:
            for allocator in ALLOCATORS:
                log(f"memory: {of} {dtype} N={n}, {allocator} allocator ...")
                spec = {**(common if of == "op" else model_spec), "task": "memory", "of": of, "n": n, "dtype": dtype,
                        "allocator": allocator, "tokens": decode_tokens}
                pair = {m: _run_worker({**spec, "method": m}) for m in ("focus", "sdpa")}
                results.setdefault("memory", []).append({"of": of, "n": n, "dtype": dtype, "allocator": allocator,
                                                         **{m: r["peak_rss_mb"] for m, r in pair.items()}})
    if "guard" in sections:
        from focus_flex import native

        for target in native.build_targets():
            log(f"guard: C kernels built for {target}, N={guard_length} ...")
            worker("guard", {**common, "task": "guard", "n": guard_length, "target": target,
                             "repeats": max(repeats, 5)})
    if "compile" in sections:
        log("compile ...")
        worker("compile", {**common, "task": "compile", "dtype": dtypes[0]})
        results["compile"] = results["compile"][0]
    results["sections"] = list(sections)
    results["targets"] = evaluate_targets(results)
    results["wall_seconds"] = round(time.time() - started, 1)
    out.mkdir(parents=True, exist_ok=True)
    (out / "bench.json").write_text(json.dumps(results, indent=2) + "\n")
    (out / "bench.partial.json").unlink(missing_ok=True)
    (out / "bench.md").write_text(to_markdown(results))
    plot(results, out / "bench.png")
    log(f"wrote {out / 'bench.md'}, bench.json, bench.png ({results['wall_seconds']:.0f} s)")
    inverted = [f"{r['kernels']}: {part} {r[part]['ratio']:.2f}x its fallback's time"
                for r in results.get("guard", []) for part in GUARD_PARTS
                if part in r and r[part]["ratio"] > GUARD_RATIO]
    if inverted:
        raise BenchError(f"guard: a default kernel is more than {GUARD_RATIO}x slower than its PyTorch fallback "
                         f"({'; '.join(inverted)}; see {out / 'bench.md'})")
    return results


def machine_info() -> dict[str, Any]:
    """Date, CPU, its vector instructions, what the C kernels were built for, cores and library versions, for the
    report header."""
    import transformers

    cpu = platform.processor() or platform.machine()
    try:
        cpu = re.search(r"model name\s*:\s*(.+)", Path("/proc/cpuinfo").read_text()).group(1).strip()
    except (OSError, AttributeError):
        pass
    from focus_flex import native

    return {"date": datetime.date.today().isoformat(), "cpu": cpu, "isa": native.vector_isa(),
            "kernels_built": native.build_label(), "cores": os.cpu_count(),
            "threads": torch.get_num_threads(), "torch": torch.__version__,
            "transformers": transformers.__version__, "python": platform.python_version(),
            "load_average": os.getloadavg()[0] if hasattr(os, "getloadavg") else None}


CHECKOUT = Path(__file__).resolve().parent.parent  # the source checkout this file belongs to
BENCH_ADAPTER = CHECKOUT / "benchmarks" / "smollm2-135m-instruct-focus-g16"


def _find_adapter() -> str | None:
    """The trained adapter of the prefill and decode sections: SmolLM2 centroids with G=16, top-1 queries and keys,
    kept next to the benchmark results; None if it is missing (then k-means centroids of the model's own keys)."""
    from focus_flex.config import CONFIG_NAME, WEIGHTS_NAME

    found = (BENCH_ADAPTER / CONFIG_NAME).is_file() and (BENCH_ADAPTER / WEIGHTS_NAME).is_file()
    return str(BENCH_ADAPTER) if found else None


def _run_worker(spec: dict[str, Any], timeout: float = 3600) -> dict[str, Any]:
    """Run one configuration in a fresh interpreter, as on a CPU of ``spec["target"]``'s kind (:data:`EMULATE`; the C
    kernels built for it); its last stdout line is ``RESULT <json>``."""
    cmd = [sys.executable, "-m", "benchmarks.bench", "_worker", json.dumps(spec)]
    target = spec.get("target", "native")
    env = {**os.environ, "FOCUS_FLEX_MARCH": target, **EMULATE.get(target, {})}
    if target in EMULATE:  # inductor's cache key ignores the capped ISA: its kernels would serve uncapped processes
        env["TORCHINDUCTOR_CACHE_DIR"] = str(Path(tempfile.gettempdir()) / f"focus-bench-inductor-{target}")
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env, cwd=CHECKOUT)
    for line in reversed(proc.stdout.splitlines()):
        if line.startswith("RESULT "):
            return json.loads(line[7:])
    tail = "\n".join(proc.stderr.strip().splitlines()[-15:])
    raise BenchError(f"worker {spec.get('task')} (n={spec.get('n')}) failed with exit code {proc.returncode}:\n{tail}")


# ---- keeping it honest ---------------------------------------------------------------------------


def check_correctness(focus: dict[str, Any], flex: bool = True) -> list[dict[str, Any]]:
    """Fast path vs the reference at a small length (prefill with padding, chunked prefill, decode), fp32 and bf16;
    the prefill on the default kernel, and on the flex kernel too if ``flex`` (it compiles for a while).

    Raises :class:`BenchError` if any case exceeds the tolerance (1e-4 fp32, 2e-2 bf16): no speedup is reported for a
    kernel that is not exact.
    """
    from focus_flex import attention
    from focus_flex.config import FocusConfig
    from focus_flex.decode import KeyIndex

    cfg = FocusConfig(**{**focus, "window": min(focus["window"], 96), "sink_tokens": min(focus["sink_tokens"], 4)})
    gen = torch.Generator().manual_seed(0)
    out = []
    for dtype in ("float32", "bfloat16"):
        for name, b, lq, lk, pad in (("prefill", 2, 700, 700, 37), ("chunked prefill", 1, 300, 700, 0),
                                     ("decode", 2, 1, 700, 11), ("decode, key index", 2, 1, 700, 0)):
            c = F.normalize(torch.randn(HKV, cfg.num_groups, HEAD_DIM, generator=gen), dim=-1)
            q = torch.randn(b, HQ, lq, HEAD_DIM, generator=gen)
            k, v = (torch.randn(b, HKV, lk, HEAD_DIM, generator=gen) for _ in range(2))
            mask = torch.ones(b, lk, dtype=torch.bool)
            mask[0, :pad] = False
            q, k, v = (x.to(getattr(torch, dtype)) for x in (q, k, v))
            ref = attention.reference_attention(q.float(), k.float(), v.float(), c, cfg, attention_mask=mask)
            index = None
            if name == "decode, key index":  # what a KV cache hands the few-queries path: O(selected keys)
                index = KeyIndex(b, HKV, cfg.num_groups, k.device)
                index.extend(k, c, cfg)
            kernels = [None] if lq <= attention.DECODE_MAX_QUERIES else _kernels(cfg) if flex else \
                [attention.default_kernel(q.device, cfg)]
            for kernel in kernels:
                got = attention.focus_attention(q, k, v, c, cfg, attention_mask=mask, key_index=index, kernel=kernel)
                err = (got.float() - ref).abs().max().item()
                case = name if kernel is None else f"{name}, {kernel} kernel"
                out.append({"case": case, "dtype": dtype, "max_abs_diff": err, "tolerance": TOLERANCE[dtype]})
                if not err <= TOLERANCE[dtype]:
                    raise BenchError(f"the fast path is wrong ({case}, {dtype}): max |focus - reference| = {err:.3g} "
                                     f"> {TOLERANCE[dtype]}; refusing to benchmark it")
    return out


def _kernels(cfg: Any) -> list[str]:
    """The prefill kernels that run here (on CPU): flex always, and the default one if that is another."""
    from focus_flex import attention

    return list(dict.fromkeys(["flex", attention.default_kernel(torch.device("cpu"), cfg)]))


# ---- measuring -----------------------------------------------------------------------------------


def _reset_peak() -> bool:
    try:
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)
        return True
    except OSError:
        return False


def _trim() -> None:
    """Return the free heap to the OS (glibc ``malloc_trim``; a no-op elsewhere)."""
    import ctypes
    import gc

    gc.collect()
    try:
        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _peak_mb() -> float:
    try:
        return int(re.search(r"VmHWM:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024
    except (OSError, AttributeError):
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


def _rss_mb() -> float:
    try:
        return int(re.search(r"VmRSS:\s+(\d+)", Path("/proc/self/status").read_text()).group(1)) / 1024
    except (OSError, AttributeError):
        return float("nan")


def _stats(times: list[float]) -> dict[str, Any]:
    s = sorted(times)
    return {"min": s[0], "median": s[len(s) // 2] if len(s) % 2 else (s[len(s) // 2 - 1] + s[len(s) // 2]) / 2,
            "n": len(s), "all": times}


def _measure(methods: dict[str, Callable[[], Any]], repeats: int, max_seconds: float) -> dict[str, dict[str, Any]]:
    """Time already warmed-up methods, alternating them."""
    times: dict[str, list[float]] = {name: [] for name in methods}
    for _ in range(repeats):
        for name, fn in methods.items():
            if times[name] and sum(times[name]) >= max_seconds:
                continue
            t = time.perf_counter()
            fn()
            times[name].append(time.perf_counter() - t)
    return {name: _stats(ts) for name, ts in times.items()}


def _unique_graphs() -> int:
    from torch._dynamo.utils import counters

    return int(counters["stats"]["unique_graphs"])


def balanced_inputs(n: int, dtype: torch.dtype, groups: int, seed: int = 0) -> tuple[torch.Tensor, ...]:
    """q ``[1, 9, n, 64]``, k, v ``[1, 3, n, 64]`` and centroids ``[3, G, 64]``, tokens drawn around the centroids
    (uniform group labels) so that routing is balanced, as Sinkhorn-trained centroids aim for."""
    gen = torch.Generator().manual_seed(seed)
    c = F.normalize(torch.randn(HKV, groups, HEAD_DIM, generator=gen), dim=-1)

    def around(heads: int) -> torch.Tensor:
        labels = torch.randint(0, groups, (1, heads, n), generator=gen)
        kv_head = (torch.arange(heads) * HKV // heads)[None, :, None]
        return 2.0 * c[kv_head, labels] + 0.5 * torch.randn(1, heads, n, HEAD_DIM, generator=gen)

    q, k = around(HQ), around(HKV)
    v = torch.randn(1, HKV, n, HEAD_DIM, generator=gen)
    return q.to(dtype), k.to(dtype), v.to(dtype), c


def kernel_label(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, cfg: Any) -> str:
    """The default prefill kernel for these inputs: ``flex``, ``flash (C, 256-bit)`` or ``flash (PyTorch)``."""
    from focus_flex import attention, native

    kernel = attention.default_kernel(q.device, cfg)
    if kernel == "flex":
        return kernel
    return f"flash (C, {native.library().focus_vector_bits()}-bit)" if native.prefill_applies(q, k, v) else \
        "flash (PyTorch)"


def _op_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from focus_flex import attention, evaluate, flash, masks, native, routing
    from focus_flex import plan as fplan
    from focus_flex.config import FocusConfig
    from focus_flex.threads import small_work

    n, dtype = spec["n"], getattr(torch, spec["dtype"])
    cfg = FocusConfig(**spec["focus"])
    bs = cfg.block_size
    q, k, v, c = balanced_inputs(n, dtype, cfg.num_groups)
    valid = torch.ones(1, n, dtype=torch.bool)
    scale = HEAD_DIM ** -0.5
    threads = torch.get_num_threads()
    kernel = attention.default_kernel(q.device, cfg)
    rep = HQ // HKV

    def focus() -> torch.Tensor:
        return attention.focus_attention(q, k, v, c, cfg)

    def focus_flex() -> torch.Tensor:
        return attention.focus_attention(q, k, v, c, cfg, kernel="flex")

    def fallback() -> torch.Tensor:  # the default kernel's PyTorch fallback (no C kernels)
        with native.disabled():
            return attention.focus_attention(q, k, v, c, cfg)

    def sdpa() -> torch.Tensor:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)

    fused = kernel == "flash" and native.prefill_applies(q, k, v)

    def head_groups(j: int) -> tuple[torch.Tensor, torch.Tensor]:  # KV head j's routing, as flash_attention's
        qg = routing.hard_groups(q[:, j * rep:(j + 1) * rep], c[j:j + 1], cfg.query_top_k)[0]
        return qg, routing.hard_groups(k[:, j:j + 1], c[j:j + 1], cfg.key_top_k)[0, 0]

    def two_passes() -> torch.Tensor:  # one pass's baseline: the same C kernel over a copy of each query per group
        out = torch.empty_like(q)
        for j in range(HKV):
            hs = slice(j * rep, (j + 1) * rep)
            native.prefill(q[0, hs], k[0, j], v[0, j], native.prefill_plan(*head_groups(j), cfg, one_pass=False), cfg,
                           scale, out[0, hs], threads)
        return out

    def window() -> Any:  # window + sinks only: the default kernel without a far pair
        if kernel == "flash":
            return flash.window_attention(q, k, v, cfg.window, cfg.sink_tokens, scale)
        lay = fplan.local_plan(valid, n, cfg, attention.lse_route(q.device) == "extra_key")
        part = attention.local_part(q, k, v, valid, lay, cfg, scale)
        return part.out[..., :HEAD_DIM] * (1 if part.norm is None else part.norm[..., None])

    def plan() -> Any:  # routing + planning, as the default kernel runs them
        if kernel == "flex":
            with small_work(q.device):
                return attention.plan_attention(q, k, c, cfg, valid=valid)
        plans = []
        for j in range(HKV):  # per KV head, as flash.flash_attention routes
            qg, kg = head_groups(j)
            plans.append(native.prefill_plan(qg, kg, cfg) if fused else flash.far_plan(qg, kg, 0, cfg))
        return plans

    res: dict[str, Any] = {"n": n, "dtype": spec["dtype"], "threads": threads,
                           "kernel": kernel_label(q, k, v, cfg)}
    F.scaled_dot_product_attention(q[:, :, :256], k[:, :, :256], v[:, :, :256], is_causal=True, enable_gqa=True)
    t = time.perf_counter()
    focus()
    res["first_call_s"] = time.perf_counter() - t
    t = time.perf_counter()
    focus_flex()  # compiles this length's bucket
    res["flex_first_call_s"] = time.perf_counter() - t
    window()
    fallback()
    methods = {"focus": focus, "sdpa": sdpa, "focus_flex": focus_flex, "window": window}
    if fused:
        methods["fallback"] = fallback
    if fused and cfg.one_pass:
        methods["two_passes"] = two_passes
    if kernel == "flex":
        del methods["focus_flex"]
    if spec.get("flex_causal"):
        ranges = torch.arange(-(-n // 128))[None, None]
        causal_mask = masks.range_block_mask(torch.ones_like(ranges, dtype=torch.bool), 0, ranges * 0, ranges + 1,
                                             ranges * 0, ranges, masks.causal, n, n, 128)

        def flex_causal() -> torch.Tensor:
            return attention.compiled_flex()(q, k, v, block_mask=causal_mask, enable_gqa=True)

        t = time.perf_counter()
        flex_causal()
        res["flex_causal_first_call_s"] = time.perf_counter() - t
        methods["flex_causal"] = flex_causal
    graphs = _unique_graphs()
    res["rss_before_mb"] = _rss_mb()
    res["times"] = _measure(methods, spec["repeats"], spec["max_seconds"])
    res["plan"] = _measure({"plan": plan}, spec["repeats"], spec["max_seconds"])["plan"]
    res["recompiles_after_warmup"] = _unique_graphs() - graphs
    p = attention.plan_attention(q, k, c, cfg, valid=valid)  # the block-sparse limit, whichever kernel runs
    res["density"] = p.density(attention.causal_blocks(n, bs))
    q_member = routing.hard_membership(q, c, cfg.query_top_k)
    k_member = routing.hard_membership(k, c, cfg.key_top_k)
    res["pair_density"] = evaluate.pattern_density(q_member, k_member, cfg.window, cfg.sink_tokens).mean().item()
    return res


def pair_density(n: int, cfg: Any, far_pairs: float) -> float:
    """Allowed (query, key) pairs over causal pairs for n tokens, given the far pairs per query head: the sparsity
    limit, independent of tiling."""
    pos = torch.arange(n)
    local = torch.minimum(pos + 1, torch.tensor(cfg.window)) + (pos - cfg.window + 1).clamp(0, cfg.sink_tokens)
    return float((local.sum() + far_pairs) / (n * (n + 1) / 2))


# ---- the real model ------------------------------------------------------------------------------


def _load(spec: dict[str, Any]) -> tuple[Any, Any, Any]:
    from focus_flex.adapter import FocusAdapter
    from focus_flex.config import FocusConfig
    from focus_flex.models import load_model

    model, tokenizer = load_model(dtype=getattr(torch, spec["model_dtype"]))
    if spec.get("adapter"):
        adapter = FocusAdapter.from_pretrained(spec["adapter"])
        adapter.config.block_size = spec["focus"]["block_size"]  # tiling only: the same attention
    else:
        adapter = FocusAdapter.for_model(model, FocusConfig(**spec["focus"]))
        adapter.centroids.data = kmeans_centroids(model, tokenizer, adapter)
    return model, tokenizer, adapter


def kmeans_centroids(model: Any, tokenizer: Any, adapter: Any, n: int = 2048, iters: int = 10) -> torch.Tensor:
    """Stand-in for trained centroids: spherical k-means of each layer's keys on ``n`` training tokens.

    Random centroids on real activations route most tokens to a few groups (near-dense attention); k-means groups
    are far closer to the balanced groups that Sinkhorn training produces. ``[layers, Hkv, G, D]``.
    """
    from focus_flex.data import load_documents, token_windows

    ids = token_windows(load_documents(split="train"), tokenizer, n, max_windows=1)
    with torch.inference_mode():
        cache = model(ids, use_cache=True, logits_to_keep=1).past_key_values
    gen = torch.Generator().manual_seed(0)
    out = []
    for layer in adapter.config.layers:
        keys = F.normalize(cache.layers[layer].keys[0].float(), dim=-1)  # [Hkv, n, D]
        c = keys[:, torch.randperm(n, generator=gen)[:adapter.config.num_groups]]
        for _ in range(iters):
            assign = torch.einsum("hnd,hgd->hng", keys, c).argmax(-1)
            sums = torch.zeros_like(c).scatter_add_(1, assign[..., None].expand_as(keys), keys)
            c = torch.where(sums.norm(dim=-1, keepdim=True) > 0, F.normalize(sums, dim=-1), c)
        out.append(c)
    return torch.stack(out)


def _tokens(tokenizer: Any, n: int) -> torch.Tensor:
    from focus_flex.data import load_documents, token_windows

    return token_windows(load_documents(split="eval"), tokenizer, n, max_windows=1)


def _warm_focus(model: Any, adapter: Any, lq: int, lk: int) -> None:
    """Compile the fast path for one layer's shapes (every layer has the same) outside the timed forward (layer 0's
    configuration)."""
    from focus_flex import attention

    cfg = model.config
    dt = next(model.parameters()).dtype
    hq, hkv, d = cfg.num_attention_heads, cfg.num_key_value_heads, cfg.hidden_size // cfg.num_attention_heads
    q, k = torch.randn(1, hq, lq, d, dtype=dt), torch.randn(1, hkv, lk, d, dtype=dt)
    attention.focus_attention(q, k, k, adapter.centroids[0].detach(), adapter.layer_config(0))


def _prefill_worker(spec: dict[str, Any]) -> dict[str, Any]:
    from focus_flex import attention, flash, native

    model, tokenizer, adapter = _load(spec)
    n = spec["n"]
    ids = _tokens(tokenizer, n)
    cfg = adapter.config
    calls = model.config.num_hidden_layers * model.config.num_key_value_heads  # one far plan per layer and KV head
    far_pairs: list[int] = []
    # the far plans of the flash, C and flex kernels (whichever runs), recorded on the first forward only
    planners = [(flash, "far_plan", lambda p: p.pairs), (native, "prefill_plan", lambda p: p.pairs),
                (attention, "plan_attention", lambda p: p.far.pairs)]
    originals = [getattr(module, name) for module, name, _ in planners]

    def recording(module: Any, name: str, plan: Callable[..., Any], pairs: Callable[[Any], int]) -> Callable[..., Any]:
        def record(*args: Any, **kwargs: Any) -> Any:  # real routing
            p = plan(*args, **kwargs)
            far_pairs.append(pairs(p))
            if len(far_pairs) == calls:
                setattr(module, name, plan)
            return p
        return record

    def forward() -> None:
        with torch.inference_mode():
            model(ids, use_cache=False, logits_to_keep=1)

    res: dict[str, Any] = {"n": n, "model_dtype": spec["model_dtype"], "adapter": spec.get("adapter") or "k-means",
                           "kernel": kernel_label(*[torch.empty(1, 1, 1, HEAD_DIM, dtype=model.dtype)] * 3, cfg)}
    with torch.inference_mode():
        model(ids[:, :64], use_cache=False, logits_to_keep=1)  # warm-up (SDPA needs no compilation)
    adapter.attach(model)
    t = time.perf_counter()
    _warm_focus(model, adapter, n, n)
    res["compile_s"] = time.perf_counter() - t
    for (module, name, pairs), plan in zip(planners, originals, strict=True):
        setattr(module, name, recording(module, name, plan, pairs))
    times = _measure({"focus": forward, "sdpa": lambda: _as_sdpa(model, adapter, forward)}, spec["repeats"],
                     spec["max_seconds"])
    for (module, name, _), plan in zip(planners, originals, strict=True):
        setattr(module, name, plan)
    if native.library() is not None:  # the default kernel's PyTorch fallback, after the pair above
        with native.disabled():
            times.update(_measure({"fallback": forward}, spec["repeats"], spec["max_seconds"]))
    res.update(times)
    hq = model.config.num_attention_heads
    res["density"] = pair_density(n, cfg, sum(far_pairs) / max(len(far_pairs), 1) * model.config.num_key_value_heads
                                  / hq)
    res["layers"] = len(far_pairs) // model.config.num_key_value_heads
    return res


def _as_sdpa(model: Any, adapter: Any, fn: Callable[[], None]) -> None:
    adapter.detach(model)
    try:
        fn()
    finally:
        adapter.attach(model)


class _GrowingLayer:
    """Factory for a KV-cache layer with preallocated capacity: appending a token is O(1) copies, where
    transformers' ``DynamicLayer`` re-concatenates the whole cache at every step (the same for both methods)."""

    @staticmethod
    def make(capacity: int) -> Any:
        from transformers.cache_utils import DynamicLayer

        class GrowingLayer(DynamicLayer):
            def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any):
                if not self.is_initialized:
                    self.lazy_initialization(key_states, value_states)
                    shape = key_states.shape[:2] + (capacity, key_states.shape[3])
                    self._k, self._v, self._n = key_states.new_empty(shape), value_states.new_empty(shape), 0
                end = self._n + key_states.shape[2]
                self._k[:, :, self._n:end], self._v[:, :, self._n:end] = key_states, value_states
                self._n = end
                self.keys, self.values = self._k[:, :, :end], self._v[:, :, :end]
                return self.keys, self.values

        return GrowingLayer()


def _decode_steps(model: Any, count: int, cache: Any, tok: torch.Tensor) -> torch.Tensor:
    """``count`` greedy decode steps from ``tok`` ``[B, 1]`` on ``cache``; returns the last token."""
    with torch.inference_mode():
        for _ in range(count):
            tok = model(tok, past_key_values=cache, use_cache=True).logits[:, -1].argmax(-1, keepdim=True)
    return tok


def _decode_setup(spec: dict[str, Any]) -> tuple[Any, Any, Callable[[], Any], torch.Tensor]:
    """Model, adapter (detached), a factory of caches holding ``spec["n"]`` tokens, and the first token to feed."""
    from transformers import DynamicCache

    from focus_flex.cache import FocusCache

    model, tokenizer, adapter = _load(spec)
    n, steps = spec["n"], spec["tokens"]
    real = min(n, 2048)
    ids = _tokens(tokenizer, real)
    with torch.inference_mode():
        out = model(ids, use_cache=True, logits_to_keep=1)
    kv = [(layer.keys, layer.values) for layer in out.past_key_values.layers]
    capacity = n + (2 * spec.get("repeats", 1) + 1) * steps + 4  # warm-up steps, then rounds of `steps` (x2: Focus
    # with and without the C kernels share a cache)
    reps = -(-n // real)

    def fresh_cache(device_path: bool = False) -> Any:  # the real prefill's K/V tiled to n tokens (attention cost
        # does not depend on values); device_path: a static FocusCache, whose Focus layers decode through their pool
        if device_path:
            cache = FocusCache(model.config, max_cache_len=capacity)
        else:
            cache = DynamicCache(config=model.config)
            cache.layers = [_GrowingLayer.make(capacity) for _ in kv]
        for i, (k, v) in enumerate(kv):
            cache.layers[i].update(k.repeat(1, 1, reps, 1)[:, :, :n], v.repeat(1, 1, reps, 1)[:, :, :n])
        return cache

    return model, adapter, fresh_cache, out.logits[:, -1].argmax(-1, keepdim=True)


def _decode_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Both methods in one process, ``tokens`` steps at a time, alternating: SDPA on a copy of the model, so that
    Focus stays attached (detaching drops its key index, and re-routing the whole cache is not a decode cost)."""
    import copy

    from focus_flex import native

    model, adapter, fresh_cache, first = _decode_setup(spec)
    steps = spec["tokens"]
    models = {"sdpa": copy.deepcopy(model), "focus": adapter.attach(model), "device": model}
    caches = {name: fresh_cache(device_path=name == "device") for name in models}
    # Warm-up: two steps each (Focus routes the whole cache in the first; the device path compiles its flex call).
    last = {name: _decode_steps(m, 2, caches[name], first) for name, m in models.items()}

    def step(name: str) -> None:
        last[name] = _decode_steps(models[name], steps, caches[name], last[name])

    def fallback() -> None:  # the same model and cache without the C kernels
        with native.disabled():
            step("focus")

    methods = {"focus": lambda: step("focus"), "sdpa": lambda: step("sdpa"), "device": lambda: step("device")}
    if native.library() is not None:
        methods["fallback"] = fallback
    times = _measure(methods, spec["repeats"], spec["max_seconds"])
    res: dict[str, Any] = {"n": spec["n"], "tokens": steps, "model_dtype": spec["model_dtype"],
                           "adapter": spec.get("adapter") or "k-means"}
    for name, t in times.items():
        res[name] = {"tokens_per_s": steps / t["min"], "s_per_token": t["min"] / steps,
                     "s_per_token_median": t["median"] / steps, "rounds": t["n"]}
    return res


def _memory_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """Peak RSS of one method's first full-size call (decode: its timed steps), alone in a fresh process, after a
    small warm-up call."""
    from focus_flex import attention

    n, method = spec["n"], spec["method"]
    if spec["of"] == "op":
        q, k, v, c = balanced_inputs(n, getattr(torch, spec["dtype"]), spec["focus"]["num_groups"])
        from focus_flex.config import FocusConfig

        cfg = FocusConfig(**spec["focus"])

        def call(m: int) -> Any:
            qm, km, vm = q[:, :, :m], k[:, :, :m], v[:, :, :m]
            if method == "focus":
                return attention.focus_attention(qm, km, vm, c, cfg)
            return F.scaled_dot_product_attention(qm, km, vm, is_causal=True, enable_gqa=True)
    elif spec["of"] == "prefill":
        model, tokenizer, adapter = _load(spec)
        ids = _tokens(tokenizer, n)
        if method == "focus":
            adapter.attach(model)

        def call(m: int) -> Any:
            with torch.inference_mode():
                return model(ids[:, :m], use_cache=False, logits_to_keep=1)
    else:  # decode: the timed steps, after two warm-up steps
        model, adapter, fresh_cache, first = _decode_setup(spec)
        if method == "focus":
            adapter.attach(model)
        cache = fresh_cache()
        last = _decode_steps(model, 2, cache, first)

        def call(m: int) -> Any:  # (m unused: every call is the same decode steps on the same cache)
            return _decode_steps(model, spec["tokens"], cache, last)
    call(512)
    _trim()  # give freed heap back, so that the baseline is live memory and every method starts from it
    before = _rss_mb()
    _reset_peak()
    call(n)
    return {**{key: spec[key] for key in ("of", "n", "method") if key in spec}, "dtype": spec.get("dtype"),
            "rss_before_mb": before, "peak_rss_mb": _peak_mb()}


def _compile_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """First-call compile time in a cold inductor cache, then recompiles while lengths vary within warmed buckets;
    the C kernels' build time in an empty cache."""
    from focus_flex import attention, native
    from focus_flex.config import FocusConfig

    cfg = FocusConfig(**spec["focus"])
    dtype = getattr(torch, spec["dtype"])
    q, k, v, c = balanced_inputs(4096, dtype, cfg.num_groups)
    res: dict[str, Any] = {"dtype": spec["dtype"]}
    t = time.perf_counter()
    attention.focus_attention(q, k, v, c, cfg, kernel="flex")
    res["first_call_s"] = time.perf_counter() - t
    t = time.perf_counter()
    attention.focus_attention(q, k, v, c, cfg, kernel="flex")
    res["steady_call_s"] = time.perf_counter() - t
    lengths = [int(x) for x in torch.randint(1025, 4097, (10,), generator=torch.Generator().manual_seed(1))]
    g0 = _unique_graphs()
    for n in lengths:  # warm-up pass: compiles each new bucket once
        attention.focus_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], c, cfg, kernel="flex")
    g1 = _unique_graphs()
    extra = [n - 7 for n in lengths if attention.bucket(n - 7, cfg.block_size) == attention.bucket(n, cfg.block_size)]
    for n in reversed(lengths + extra):
        attention.focus_attention(q[:, :, :n], k[:, :, :n], v[:, :, :n], c, cfg, kernel="flex")
    res.update({"lengths": lengths, "buckets": sorted({attention.bucket(n, cfg.block_size) for n in lengths}),
                "compiles_in_warmup": g1 - g0, "recompiles_after_warmup": _unique_graphs() - g1})
    with tempfile.TemporaryDirectory() as cold:  # the C kernels' one-time build, as on a machine that never ran them
        t = time.perf_counter()
        try:
            res["native_build"] = native.build(directory=Path(cold)).name
        except RuntimeError as e:
            res["native_build"] = f"failed: {e}"
        res["native_build_s"] = time.perf_counter() - t
    return res


GUARD_PARTS = ("prefill", "decode step", "routing")
GUARD_CALLS = {"prefill": 1, "decode step": 20, "routing": 10}  # calls per timing (a decode step or a routing: ~ms)


def guard_pair(default: Callable[[], Any], fallback: Callable[[], Any], calls: int, repeats: int,
               max_seconds: float) -> dict[str, float]:
    """Seconds per call of a warmed-up default and its fallback (the best of ``repeats`` alternating timings of
    ``calls`` calls each) and their ratio. A ratio above :data:`GUARD_RATIO` is measured once more and judged on
    that second measurement (``first_ratio`` keeps the first): a real inversion persists, a noisy moment does not."""

    def many(fn: Callable[[], Any]) -> Callable[[], None]:
        def run() -> None:
            for _ in range(calls):
                fn()

        return run

    timed = {"default": many(default), "fallback": many(fallback)}

    def measure() -> dict[str, float]:
        t = _measure(timed, repeats, max_seconds)
        d, f = t["default"]["min"] / calls, t["fallback"]["min"] / calls
        return {"default": d, "fallback": f, "ratio": d / f}

    first = measure()
    if first["ratio"] <= GUARD_RATIO:
        return first
    return {**measure(), "first_ratio": first["ratio"]}


def _guard_worker(spec: dict[str, Any]) -> dict[str, Any]:
    """One layer's default prefill, decode step (on a key index of the whole sequence) and top-1 routing against the
    same with the C kernels disabled, alternating."""
    from focus_flex import attention, native, routing
    from focus_flex.config import FocusConfig
    from focus_flex.decode import KeyIndex

    cfg = FocusConfig(**spec["focus"])
    q, k, v, c = balanced_inputs(spec["n"], torch.float32, cfg.num_groups)
    index = KeyIndex(1, HKV, cfg.num_groups, "cpu")
    index.extend(k, c, cfg)
    q1 = q[:, :, -1:].contiguous()
    parts = {"prefill": lambda: attention.focus_attention(q, k, v, c, cfg)}
    if native.applies(k, v):  # (else the decode step is PyTorch's either way)
        parts["decode step"] = lambda: attention.focus_attention(q1, k, v, c, cfg, key_index=index)
    if native.routes(q, c):  # (likewise routing)
        parts["routing"] = lambda: routing.hard_groups(q, c, 1)
    res: dict[str, Any] = {"n": spec["n"], "target": spec["target"], "kernels": native.build_label(),
                           "kernel": kernel_label(q, k, v, cfg)}
    for name, fn in parts.items():
        def fallback(fn: Callable[[], Any] = fn) -> None:
            with native.disabled():
                fn()

        fn(), fallback()  # warm-up
        res[name] = guard_pair(fn, fallback, GUARD_CALLS[name], spec["repeats"], spec["max_seconds"])
    return res


def _worker_main(argv: list[str]) -> int:
    from focus_flex.cli import keep_freed_memory

    spec = json.loads(argv[0])
    if spec.get("allocator", "focus-flex") == "focus-flex":
        keep_freed_memory()  # the allocator setting of the focus-flex command, for every method alike
    task = {"op": _op_worker, "prefill": _prefill_worker, "decode": _decode_worker, "memory": _memory_worker,
            "compile": _compile_worker, "guard": _guard_worker}
    if spec["task"] == "compile" and not os.environ.get("FOCUS_BENCH_WARM"):
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = tempfile.mkdtemp(prefix="focus-bench-inductor-")  # cold cache
    result = task[spec["task"]](spec)
    print("RESULT " + json.dumps(result), flush=True)
    return 0


# ---- reporting -----------------------------------------------------------------------------------


def _op_row(r: dict[str, Any]) -> dict[str, Any]:
    t = r["times"]
    f, s = t["focus"]["min"], t["sdpa"]["min"]
    ideal = 1 / r["density"]["total"]
    row = {"dtype": r["dtype"], "n": r["n"], "kernel": r.get("kernel", "flex"), "focus": f, "sdpa": s,
           "speedup": s / f, "ideal": ideal, "fraction": s / f / ideal, "plan": r["plan"]["min"],
           "plan_share": r["plan"]["min"] / f, "window": t["window"]["min"], "density": r["density"],
           "pair_density": r.get("pair_density"), "first_call": r.get("flex_first_call_s", r["first_call_s"])}
    for name in ("flex_causal", "focus_flex", "fallback", "two_passes"):
        if name in t:
            row[name] = t[name]["min"]
    return row


def evaluate_targets(results: dict[str, Any]) -> list[dict[str, Any]]:
    """The speed targets (:data:`TARGETS`), each with the measured value and whether it is met."""
    out = []

    def add(name: str, value: float, target: float, higher: bool = True) -> None:
        out.append({"target": name, "value": value, "goal": target,
                    "met": value >= target if higher else value <= target})

    rows = [_op_row(r) for r in results.get("op", [])]
    for row in rows:
        tag = f"{row['dtype']} N={row['n']}"
        if row["n"] >= 32768:
            add(f"attention op >= {TARGETS['op_speedup_32k']:g}x SDPA ({tag})", row["speedup"],
                TARGETS["op_speedup_32k"])
        if row["n"] >= 16384:
            add(f"attention op >= 80% of ideal ({tag})", row["fraction"], TARGETS["ideal_fraction"])
        add(f"routing + planning <= 10% of Focus ({tag})", row["plan_share"], TARGETS["plan_share"], higher=False)
    for r in results.get("prefill", []):
        if r["n"] >= 16384:
            add(f"prefill >= 2x SDPA (N={r['n']})", r["sdpa"]["min"] / r["focus"]["min"], TARGETS["prefill_16k"])
    for r in results.get("decode", []):
        if r["n"] >= 32768:
            add(f"decode >= 3x SDPA (cache={r['n']})", r["focus"]["tokens_per_s"] / r["sdpa"]["tokens_per_s"],
                TARGETS["decode_32k"])
    for name, allocator, focus, sdpa in _memory_rows(results):
        add(f"peak RSS <= SDPA's ({name}, {allocator} allocator)", focus / sdpa, 1.0, higher=False)
    return out


def decode_fit(decode: list[dict[str, Any]]) -> dict[str, Any] | None:
    """Each method's seconds per token as ``fixed + per_1k * N / 1024``, a line through the shortest and longest
    cache (``fixed`` extrapolates below the shortest). None with fewer than two cache lengths."""
    rows = sorted(decode, key=lambda r: r["n"])
    if len(rows) < 2 or rows[0]["n"] == rows[-1]["n"]:
        return None
    (n0, r0), (n1, r1) = (rows[0]["n"], rows[0]), (rows[-1]["n"], rows[-1])
    out: dict[str, Any] = {"n": [n0, n1]}
    for m in ("focus", "sdpa"):
        per_1k = (r1[m]["s_per_token"] - r0[m]["s_per_token"]) / (n1 - n0) * 1024
        out[m] = {"per_1k": per_1k, "fixed": r1[m]["s_per_token"] - per_1k * n1 / 1024}
    return out


def _memory_rows(results: dict[str, Any]) -> list[tuple[str, str, float, float]]:
    """(measurement, allocator, Focus MB, SDPA MB) of each memory record."""
    return [(f"{r['of']} {r['dtype']} N={r['n']}", r.get("allocator", "focus-flex"), r["focus"], r["sdpa"])
            for r in results.get("memory", [])]


def _ms(x: float) -> str:
    return f"{x * 1e3:,.0f}" if x >= 0.01 else f"{x * 1e3:.2f}"


def to_markdown(results: dict[str, Any]) -> str:
    """The report: header, one table per section, targets."""
    m, f = results["machine"], results["focus"]
    lines = [f"# focus-flex bench — {m['date']}", "",
             f"{m['cpu']} ({m.get('isa', '?')}), {m['cores']} cores ({m['threads']} threads), torch {m['torch']}, "
             f"transformers {m['transformers']}, load average at start {m['load_average']:.1f}. "
             + (f"C kernels: {m.get('kernels_built', '?')}.  " if m.get("target", "native") == "native" else
                f"**Run as a `{m['target']}` CPU** (C kernels built for it; PyTorch capped to its instructions: "
                f"{', '.join(f'{k}={v}' for k, v in EMULATE[m['target']].items())}).  "),
             f"Focus{' (op section)' if results.get('adapter') else ''}: G={f['num_groups']}, top-k "
             f"{f['query_top_k']} (queries) / {f['key_top_k']} (keys), window {f['window']}, {f['sink_tokens']} sinks, "
             f"block {f['block_size']}. Times are min over repeats (median in JSON); ratios are baseline / Focus, "
             f"measured side by side in the same process.", ""]
    if a := results.get("adapter"):
        lines[-1:-1] = [f"Adapter (prefill, decode): `{a['path']}`: G={a['num_groups']}, top-k "
                        f"{a['query_top_k']} (queries) / {a['key_top_k']} (keys), window {a['window']}, "
                        f"{a['sink_tokens']} sinks, dense tail {a['dense_tail']}, layers with their own top-k "
                        f"(layer, queries, keys) {a['layer_top_k'] or 'none'}."]
    if results.get("command"):
        lines += [f"Command: `{results['command']}`", ""]
    worst = max(c["max_abs_diff"] / c["tolerance"] for c in results["correctness"])
    lines += [f"Correctness (checked in this run before timing): worst |fast - reference| = {worst:.2g} of the "
              "tolerance (1e-4 fp32, 2e-2 bf16).", ""]
    if results.get("op"):
        kernels = sorted({_op_row(r)["kernel"] for r in results["op"]})
        lines += ["## Attention op (one SmolLM2 layer: 9 query / 3 KV heads, head dim 64, balanced routing)", "",
                  f"Focus runs the default kernel ({', '.join(kernels)}); `Focus flex` is the same attention on the "
                  "block-sparse compiled-FlexAttention kernel. The ideal speedup is causal blocks / computed blocks "
                  "of the block-sparse pattern; pair density is allowed pairs / causal pairs. `PyTorch fallback` is "
                  "the default kernel without the C kernels (`FOCUS_FLEX_NATIVE=0`). Where queries and keys join so "
                  "many groups that the C kernel runs one pass (`FocusConfig.one_pass`), `two passes` is the same "
                  "kernel over a copy of each query per group.", "",
                  "| dtype | N | kernel | Focus ms | SDPA ms | x SDPA | PyTorch fallback ms | two passes ms | "
                  "Focus flex ms | flex causal ms | window-only ms | block density (local+far) | ideal x | "
                  "% of ideal | pair density | routing+plan ms (% of Focus) | flex first call s |",
                  "|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|---|"]
        for row in map(_op_row, results["op"]):
            d = row["density"]
            ff, fc, fb, tp = row.get("focus_flex"), row.get("flex_causal"), row.get("fallback"), row.get("two_passes")
            pd = row["pair_density"]
            lines.append(f"| {row['dtype']} | {row['n']} | {row['kernel']} | {_ms(row['focus'])} | "
                         f"{_ms(row['sdpa'])} | "
                         f"{row['speedup']:.2f} | {_ms(fb) if fb else '-'} | {_ms(tp) if tp else '-'} | "
                         f"{_ms(ff) if ff else '-'} | "
                         f"{_ms(fc) if fc else '-'} | "
                         f"{_ms(row['window'])} | {d['local']:.3f}+{d['far']:.3f}={d['total']:.3f} | "
                         f"{row['ideal']:.1f} | {row['fraction']:.0%} | {f'{pd:.3f}' if pd else '-'} | "
                         f"{_ms(row['plan'])} ({row['plan_share']:.0%}) | {row['first_call']:.1f} |")
        lines.append("")
    if results.get("prefill"):
        lines += ["## Prefill (SmolLM2-135M end to end, `logits_to_keep=1`)", "",
                  "| N | dtype | adapter | kernel | Focus s | SDPA s | x SDPA | PyTorch fallback s | "
                  "real-routing pair density | warm-up s |",
                  "|---|---|---|---|---|---|---|---|---|---|"]
        for r in results["prefill"]:
            fb = f"{r['fallback']['min']:.1f}" if "fallback" in r else "-"
            lines.append(f"| {r['n']} | {r['model_dtype']} | {Path(r['adapter']).name} | {r.get('kernel', 'flex')} | "
                         f"{r['focus']['min']:.1f} | "
                         f"{r['sdpa']['min']:.1f} | {r['sdpa']['min'] / r['focus']['min']:.2f} | {fb} | "
                         f"{r['density']:.3f} | {r['compile_s']:.1f} |")
        lines.append("")
    if results.get("decode"):
        lines += ["## Decode (tokens/s on a KV cache of N tokens; both methods in one process, alternating rounds of "
                  "steps, each on its own preallocated cache; best round)", "",
                  "| cache N | dtype | steps x rounds | Focus tok/s | SDPA tok/s | x SDPA | PyTorch fallback tok/s | "
                  "device path (static FocusCache, flex) tok/s |",
                  "|---" * 8 + "|"]
        for r in results["decode"]:
            rounds = min(r[m].get("rounds", 1) for m in ("focus", "sdpa"))
            fb = f"{r['fallback']['tokens_per_s']:.2f}" if "fallback" in r else "-"
            dev = f"{r['device']['tokens_per_s']:.2f}" if "device" in r else "-"
            lines.append(f"| {r['n']} | {r['model_dtype']} | {r['tokens']} x {rounds} | "
                         f"{r['focus']['tokens_per_s']:.2f} | {r['sdpa']['tokens_per_s']:.2f} | "
                         f"{r['focus']['tokens_per_s'] / r['sdpa']['tokens_per_s']:.2f} | {fb} | {dev} |")
        fit = decode_fit(results["decode"])
        if fit:
            f, s = fit["focus"], fit["sdpa"]
            lines += ["", f"Seconds per token as a line through the N={fit['n'][0]} and N={fit['n'][1]} rows, fixed + "
                      f"per 1K cached tokens: Focus {f['fixed'] * 1e3:.0f} ms + {f['per_1k'] * 1e3:.2f} ms, SDPA "
                      f"{s['fixed'] * 1e3:.0f} ms + {s['per_1k'] * 1e3:.2f} ms ({s['per_1k'] / f['per_1k']:.1f}x "
                      f"less per cached token; the fixed parts extrapolate below N={fit['n'][0]})."]
        lines.append("")
    if _memory_rows(results):
        lines += ["## Peak RSS (MB; each method alone in a fresh process: op and prefill, its first full-size call; "
                  "decode, its timed steps)", "",
                  "`default`: the C library's allocator as a program importing focus_flex gets it; `focus-flex`: the "
                  "command's setting (freed buffers kept in the heap: faster, but the heap can fragment).", "",
                  "| measurement | allocator | Focus | SDPA | Focus / SDPA |", "|---|---|---|---|---|"]
        lines += [f"| {name} | {alloc} | {fo:,.0f} | {sd:,.0f} | {fo / sd:.2f} |"
                  for name, alloc, fo, sd in _memory_rows(results)]
        lines.append("")
    if results.get("compile"):
        c = results["compile"]
        lines += ["## Compilation", "",
                  f"Flex kernel: first call at N=4096 ({c['dtype']}, cold inductor cache): {c['first_call_s']:.1f} s "
                  f"(steady call {c['steady_call_s']:.2f} s). Ten random lengths in 1025..4096 compiled "
                  f"{c['compiles_in_warmup']} graph(s) for padded lengths {c['buckets']}; replaying them and other "
                  f"lengths in the same buckets afterwards: **{c['recompiles_after_warmup']} recompiles**.", ""]
        if "native_build_s" in c:
            lines += [f"The C kernels (the flash kernel's prefill and the decode step) build once per machine and "
                      f"serve every length and dtype: {c['native_build_s']:.1f} s with the system compiler into an "
                      f"empty cache ({c['native_build']}).", ""]
    if results.get("guard"):
        lines += ["## Guard (default kernels against their PyTorch fallbacks, float32, alternating in one process)",
                  "", f"Fails where a default takes more than {GUARD_RATIO}x its fallback's time (ratio = default / "
                  "fallback; below 1 the default is faster; a ratio above it is measured once more and judged on "
                  "that, the first in brackets).", "",
                  "| C kernels built for | N | " + " | ".join(f"{p} default ms | fallback ms | ratio"
                                                           for p in GUARD_PARTS) + " |",
                  "|---|---|" + "---|---|---|" * len(GUARD_PARTS)]
        for r in results["guard"]:
            cells = [_guard_cell(r[p]) if p in r else "PyTorch's | (the same) | -" for p in GUARD_PARTS]
            lines.append(f"| {r['kernels']} | {r['n']} | " + " | ".join(cells) + " |")
        lines.append("")
    if results.get("targets"):
        lines += ["## Targets", "", "| target | measured | goal | met |", "|---|---|---|---|"]
        for t in results["targets"]:
            lines.append(f"| {t['target']} | {t['value']:.2f} | {t['goal']:g} | {'yes' if t['met'] else 'NO'} |")
        lines.append("")
    return "\n".join(lines)


def _guard_cell(part: dict[str, float]) -> str:
    ratio = f"{'**' if part['ratio'] > GUARD_RATIO else ''}{part['ratio']:.2f}"
    if "first_ratio" in part:
        ratio += f" (first {part['first_ratio']:.2f})"
    return f"{_ms(part['default'])} | {_ms(part['fallback'])} | {ratio}"


def plot(results: dict[str, Any], path: str | os.PathLike) -> None:
    """Time against length, log-log: one panel per op dtype (+ prefill)."""
    import matplotlib
    import matplotlib.ticker

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    panels = [(d, [r for r in results.get("op", []) if r["dtype"] == d])
              for d in dict.fromkeys(r["dtype"] for r in results.get("op", []))]
    if results.get("prefill"):
        panels.append(("prefill", results["prefill"]))
    fig, axes = plt.subplots(1, max(len(panels), 1), figsize=(5.5 * max(len(panels), 1), 4.2), squeeze=False)
    for ax, (name, rows) in zip(axes[0], panels, strict=False):
        ns = [r["n"] for r in rows]
        labels = {"focus": "Focus", "focus_flex": "Focus, flex kernel", "sdpa": "SDPA causal",
                  "window": "window only", "flex_causal": "flex causal"}
        for key, label in labels.items():
            pts = [(r["n"], (r if name == "prefill" else r["times"])[key]["min"]) for r in rows
                   if key in (r if name == "prefill" else r["times"])]
            if pts:
                ax.plot([x for x, _ in pts], [y for _, y in pts], marker="o", label=label)
        ax.set(xscale="log", yscale="log", xlabel="tokens", ylabel="seconds",
               title=f"attention op, {name}" if name != "prefill" else "SmolLM2 prefill")
        ax.set_xticks(ns, [f"{n // 1024}K" for n in ns])
        ax.xaxis.set_minor_formatter(matplotlib.ticker.NullFormatter())
        ax.grid(True, which="both", alpha=0.3)
        ax.legend()
    fig.suptitle(f"focus-flex bench {results['machine']['date']}: {results['machine']['cores']} cores, "
                 f"torch {results['machine']['torch']}")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv: list[str] | None = None) -> int:
    """``python -m benchmarks.bench [args]``."""
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["_worker"]:
        return _worker_main(argv[1:])
    return _cli(build_parser().parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
