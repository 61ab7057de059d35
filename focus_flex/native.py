"""The C kernels (``csrc/*.c``): built with the system C compiler on first use, called with ctypes.

* ``decode_step.c`` — a default decode step (one query, top-1 query routing) is a few dozen small tensor ops per
  layer in PyTorch; in C it is one call that reads each selected key and value row once, in place.
* ``prefill.c`` — a prefill for one sequence and KV head: the window + sinks pass and the same-group pass fused, each
  pair computed once in registers, merged in place; its only buffers are a log-sum-exp per row, the far plan's
  integer lists and a few tiles per thread.
* ``routing.c`` — top-1 routing: every vector's scores and their first maximum in one pass, no temporaries.

Both run on the caller's threads (OpenMP: with a PyTorch that ships GNU OpenMP, the C code joins PyTorch's own thread
pool). The library is compiled once per source version, compiler and CPU into focus_flex's cache
(:func:`focus_flex.config.cache_dir`), in a few seconds, for this CPU's vector instructions. Without a C compiler, or
with ``FOCUS_FLEX_NATIVE=0``, the same attention runs on PyTorch ops instead (same results, slower), after one
warning that says why.
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import hashlib
import os
import platform
import shutil
import subprocess
import tempfile
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, NamedTuple

import numpy as np
import torch

from focus_flex.config import FocusConfig, cache_dir

if TYPE_CHECKING:
    from focus_flex.decode import KeyIndex

SOURCES = tuple(sorted((Path(__file__).with_name("csrc")).glob("*.c")))
# -ffp-contract=fast: fused multiply-adds (ISO C mode turns them off). Tried in order: for the target's vector
# instructions with OpenMP, then portable with OpenMP, then portable on one thread. The target is this CPU unless
# FOCUS_FLEX_MARCH names another: an -march value (e.g. x86-64-v3 for AVX2 + FMA) or ``portable`` (the compiler's
# baseline for this architecture).
FLAGS = ("-O3", "-std=c11", "-ffp-contract=fast", "-shared", "-fPIC")


def march() -> str:
    """The build target: ``FOCUS_FLEX_MARCH``, or ``native`` (this CPU)."""
    return os.environ.get("FOCUS_FLEX_MARCH", "native")


def _variants() -> tuple[tuple[str, ...], ...]:
    portable = (("-fopenmp",), ())
    return portable if march() == "portable" else ((f"-march={march()}", "-fopenmp"), *portable)
DTYPES = (torch.float32, torch.bfloat16)
PREFILL_MAX_D = 256  # prefill.c: head dims up to this, multiples of 16
ROUTE_MIN_BITS = 256  # routing.c runs where the build's vectors are at least this wide
DECODE_MIN_BITS = 256  # the C decode step too (with 128-bit vectors PyTorch's step is faster: docs/speed.md)
_P, _I, _F, _N = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float, ctypes.c_int
_DECODE_ARGS = (_I, _I, _I, _P, _P, _F, _P, _P, _I, _P, _P, _I, _N, _P, _P, _P, _I, _I, _I, _I, _N, _P)
_PLAN_ARGS = (_I, _I, _I, _I, _I, _I, _P, _I, _P, _I, _N) + (_P,) * 9
_PREFILL_ARGS = ((_I, _I, _I, _I, _P, _I, _I, _P, _I, _P, _I, _P, _I, _I, _N, _F, _I, _I, _I, _I) + (_P,) * 9
                 + (_I, _N, _N, _P))


def _cpu() -> bytes:
    """This CPU's instruction-set flags (Linux), so that a cache shared between machines builds per CPU."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return b""
    return next((line for line in info.splitlines() if line.startswith(("flags", "Features"))), "").encode()


def build(compiler: str | None = None, directory: Path | None = None) -> Path:
    """Compile the kernels into one shared library (reused if these sources were built with this compiler for this
    CPU before).

    Tries the variants of flags in order (:func:`_variants`). Raises ``RuntimeError`` with the compiler's message if
    all fail, or if no compiler is found (set ``CC`` to choose one).
    """
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang)")
    directory = directory or cache_dir()
    source = b"".join(path.read_bytes() for path in SOURCES) + _cpu()
    builds = []  # (flags, library file), best first
    for variant in _variants():
        flags = FLAGS + variant
        key = hashlib.sha256(source + repr((cc, flags)).encode()).hexdigest()[:16]
        builds.append((flags, directory / f"focus_native-{key}.so"))
    directory.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags, target in builds:  # the best variant that builds; a failure is remembered, not retried
        failed = target.with_suffix(".failed")
        if target.exists():
            return target
        if failed.exists():
            errors.append(failed.read_text())
            continue
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)  # built aside, then renamed: concurrent builds are safe
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, *map(str, SOURCES), "-o", tmp, "-lm"], capture_output=True, text=True)
        except OSError as e:
            os.unlink(tmp)
            raise RuntimeError(f"cannot run the C compiler {cc!r}: {e}") from e
        if done.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        errors.append(done.stderr.strip()[-600:])
        failed.write_text(errors[-1])
    raise RuntimeError(f"{cc} could not compile {', '.join(path.name for path in SOURCES)}: {errors[-1]}")


_disabled = False  # set by disabled()


@contextlib.contextmanager
def disabled() -> Iterator[None]:
    """Inside this block every path runs its PyTorch fallback instead of the C kernels (benchmarks time both in one
    process)."""
    global _disabled
    before, _disabled = _disabled, True
    try:
        yield
    finally:
        _disabled = before


def library() -> ctypes.CDLL | None:
    """The loaded kernels, or None (with one warning) where they cannot be built, or with ``FOCUS_FLEX_NATIVE=0`` or
    inside :func:`disabled`."""
    if _disabled or os.environ.get("FOCUS_FLEX_NATIVE", "1") == "0":
        return None
    return _load()


@functools.cache
def _load() -> ctypes.CDLL | None:
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"focus_flex: the C kernels are unavailable ({e}); routing, prefill and decode use the slower "
                      "PyTorch path. "
                      "Install a C compiler (e.g. gcc) or set FOCUS_FLEX_NATIVE=0 to silence this.", RuntimeWarning,
                      stacklevel=3)
        return None
    lib.focus_decode_step.argtypes, lib.focus_decode_step.restype = _DECODE_ARGS, ctypes.c_int
    lib.focus_prefill_plan.argtypes, lib.focus_prefill_plan.restype = _PLAN_ARGS, ctypes.c_int
    lib.focus_prefill.argtypes, lib.focus_prefill.restype = _PREFILL_ARGS, ctypes.c_int
    lib.focus_route_top1.argtypes, lib.focus_route_top1.restype = (_P, _N) + (_I,) * 7 + (_P, _I, _I, _P, _N), _N
    lib.focus_vector_bits.argtypes, lib.focus_vector_bits.restype = (), _N
    return lib


def build_targets() -> list[str]:
    """The build targets this CPU runs, widest first: ``native``, then (on an AVX-512 x86 CPU) ``x86-64-v3``, the
    AVX2 + FMA build most x86 machines get, then ``portable``."""
    flags = set(_cpu().decode().split(":", 1)[-1].split())
    v3 = platform.machine() in ("x86_64", "AMD64") and "avx512f" in flags and {"avx2", "fma"} <= flags
    return ["native", *(["x86-64-v3"] if v3 else []), "portable"]


def vector_isa() -> str:
    """The vector instructions this CPU has (``AVX-512``, ``AVX2``, ``AVX``, ``SSE``, ``NEON``, ``SVE`` or the
    machine name), from ``/proc/cpuinfo``."""
    flags = set(_cpu().decode().split(":", 1)[-1].split())
    for flag, name in (("avx512f", "AVX-512"), ("avx2", "AVX2"), ("avx", "AVX"), ("sve", "SVE"), ("asimd", "NEON"),
                       ("sse2", "SSE")):
        if flag in flags:
            return name
    return platform.machine()


def build_label() -> str:
    """What the C kernels were built for: ``C, 256-bit vectors (target x86-64-v3)``, or why they are not used."""
    if os.environ.get("FOCUS_FLEX_NATIVE", "1") == "0":
        return "none (FOCUS_FLEX_NATIVE=0)"
    lib = library()
    if lib is None:
        return "none (no build)"
    return f"C, {lib.focus_vector_bits()}-bit vectors (target {march()})"


def _readable(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Keys and values the C kernels read: CPU tensors of one dtype in :data:`DTYPES`, rows contiguous."""
    return (k.device.type == "cpu" and v.device.type == "cpu" and k.dtype == v.dtype and k.dtype in DTYPES
            and k.stride(-1) == 1 and v.stride(-1) == 1)


def applies(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the C decode step takes this cache: :func:`_readable`, and the library built with vectors of at least
    :data:`DECODE_MIN_BITS`."""
    lib = library() if _readable(k, v) else None
    return lib is not None and lib.focus_vector_bits() >= DECODE_MIN_BITS


def decode_step(q: torch.Tensor, groups: torch.Tensor, scale: float, k: torch.Tensor, v: torch.Tensor,
                index: KeyIndex, sinks: int, end: int, threads: int) -> torch.Tensor:
    """One query row per (batch row, query head) against its sinks, window ``[end, Lk)`` and far group keys.

    q ``[B * Hq, D]`` (computed in float32), groups ``[B * Hq]`` (each row's one group), k/v ``[B, Hkv, Lk, D]``
    (:func:`applies`), ``index`` the :class:`~focus_flex.decode.KeyIndex` of exactly these keys.
    Returns float32 ``[B * Hq, D]``.
    """
    lib = library()
    b, hkv, lk, d = k.shape
    if index.shape != (b, hkv, lk):
        raise ValueError(f"the key index routes keys [B, Hkv, Lk] = {index.shape}, but k is {(b, hkv, lk)}")
    rows = q.shape[0]
    q, groups = q.float().contiguous(), groups.long().contiguous()  # (no copies for the inputs decode passes)
    pool, starts, counts = (np.ascontiguousarray(x, t) for x, t in ((index.pool, np.int32), (index.starts, np.int64),
                                                                     (index.counts, np.int64)))
    k_at, v_at = (np.array([i * x.stride(0) + h * x.stride(1) for i in range(b) for h in range(hkv)], np.int64)
                  for x in (k, v))  # offset of position 0 of each (batch row, KV head)
    out = q.new_empty(rows, d)
    code = lib.focus_decode_step(
        rows, d, rows // (b * hkv), q.data_ptr(), groups.data_ptr(), scale, k.data_ptr(), k_at.ctypes.data, k.stride(2),
        v.data_ptr(), v_at.ctypes.data, v.stride(2), k.dtype == torch.bfloat16, pool.ctypes.data, starts.ctypes.data,
        counts.ctypes.data, index.num_groups, sinks, end, lk, max(1, threads), out.data_ptr())
    _check(code, "decode step")
    return out


def routes(x: torch.Tensor, centroids: torch.Tensor) -> bool:
    """Whether :func:`route_top1` takes x: CPU, float32/bfloat16, rows of D contiguous, D <= 256, the library built
    with vectors of at least :data:`ROUTE_MIN_BITS` (with narrower ones PyTorch's matmul routes faster)."""
    (h, d), hkv = x.shape[1::2], centroids.shape[0]
    lib = library()
    return (x.device.type == "cpu" and x.dtype in DTYPES and x.stride(-1) == 1 and d <= PREFILL_MAX_D and h % hkv == 0
            and lib is not None and lib.focus_vector_bits() >= ROUTE_MIN_BITS)


@torch.compiler.disable(reason="a ctypes call into the C library: one graph break where a compiled model routes")
def route_top1(x: torch.Tensor, centroids: torch.Tensor) -> torch.Tensor | None:
    """Top-1 routing in C (``csrc/routing.c``): the first index of the largest ``<x, c_g>`` (a NaN counts as
    largest, as ``torch.max`` has it), ``[B, H, L, D]`` -> ``[B, H, L, 1]`` int64, scores summed in float32 in one
    fixed order, so a vector's group never depends on the vectors routed with it. ``centroids`` ``[Hkv, G, D]``
    normalised. None where it cannot run (not CPU, not float32/bfloat16, rows of D not contiguous, D > 256, or no
    library)."""
    if not routes(x, centroids):
        return None
    (b, h, n, d), (hkv, g) = x.shape, centroids.shape[:2]
    if centroids.shape[-1] != d:
        raise ValueError(f"centroids {tuple(centroids.shape)} do not fit vectors of head dim {d}")
    c = centroids.float().contiguous()
    out = torch.empty(b, h, n, 1, dtype=torch.long)
    code = library().focus_route_top1(x.data_ptr(), x.dtype == torch.bfloat16, b, h, n, d, *x.stride()[:3],
                                      c.data_ptr(), hkv, g, out.data_ptr(), torch.get_num_threads())
    _check(code, "routing")
    return out


def prefill_applies(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether :func:`prefill` can run: the library built, CPU tensors of one dtype in :data:`DTYPES`, rows of the
    head dim contiguous, a head dim that is a multiple of 16 up to :data:`PREFILL_MAX_D`."""
    return _prefill_takes(q, k, v) and library() is not None


def _prefill_takes(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> bool:
    """The inputs :func:`prefill` reads: :func:`prefill_applies` without the library."""
    d = q.shape[-1]
    return (_readable(k, v) and q.device.type == "cpu" and q.dtype == k.dtype and q.stride(-1) == 1
            and d % 16 == 0 and d <= PREFILL_MAX_D)


class PrefillPlan(NamedTuple):
    """The far plan of one sequence and KV head (``csrc/prefill.c``: ``focus_prefill_plan``): O(N) integer lists.

    Each group's keys past the sinks, ascending (``klist[kstart[g]:kstart[g + 1]]``); each group's query copies that
    see a far key, ascending by position, as (flat row ``head * Lq + query``, number of its group's keys it sees)
    (``crow``/``chi``, from ``cstart[g]``); and tiles of them, ``tiles[ctiles[g]:ctiles[g + 1]]`` as ``[c0, c1)``.
    With query and key top-k both above 1 a pair can share several groups; the kernel computes it in the first, by
    the rows' and keys' group bitmasks ``qbits``/``kbits``. With ``one_pass`` (:attr:`FocusConfig.one_pass`) the
    kernel tests those bitmasks in one causal pass, and the lists are empty.
    """

    kstart: torch.Tensor  # [G + 1] int64
    klist: torch.Tensor  # [Lk * kk] int32
    cstart: torch.Tensor  # [G + 1] int64
    crow: torch.Tensor  # [R * Lq * kq] int32
    chi: torch.Tensor  # [R * Lq * kq] int32
    ctiles: torch.Tensor  # [G + 1] int64
    tiles: torch.Tensor  # [R * Lq * kq, 2] int32
    qbits: torch.Tensor  # [R * Lq] int64 (empty unless query and key top-k are both above 1, or one pass)
    kbits: torch.Tensor  # [Lk] int64 (the same)
    query_top_k: int
    key_top_k: int
    one_pass: bool
    shape: tuple[int, int, int]  # (R, Lq, Lk) it was planned for
    pattern: tuple[int, int, int]  # (groups, window, sinks) it was planned for, window and sinks capped at Lk + 1

    @property
    def pairs(self) -> int:
        """Far (query, key) pairs the plan lists (copies without far keys are left 0); with query and key top-k both
        above 1, a pair sharing s groups is listed s times (and computed once); in one pass, the far pairs whose
        group bitmasks meet, counted a diagonal at a time (for statistics only)."""
        if not self.one_pass:
            return int(self.chi.long().sum())
        (r, lq, lk), (_, w, s) = self.shape, self.pattern
        q_bits, start, total = self.qbits.view(r, lq), lk - lq, 0
        for d in range(w, lk - s):  # key j = p - d of the query at position p = start + i, past the sinks
            i0 = max(0, s + d - start)
            if i0 < lq:
                total += int(((q_bits[:, i0:] & self.kbits[start + i0 - d:lk - d]) != 0).sum())
        return total


def prefill_plan(q_groups: torch.Tensor, k_groups: torch.Tensor, config: FocusConfig,
                 one_pass: bool | None = None) -> PrefillPlan:
    """The far plan for queries routed to ``q_groups`` ``[R, Lq, kq]`` (positions ``[Lk - Lq, Lk)``) and keys routed
    to ``k_groups`` ``[Lk, kk]``, one unpadded sequence and KV head. ``one_pass``: plan for one pass or two (None:
    :attr:`FocusConfig.one_pass`; either gives the same attention). Needs :func:`library`."""
    (r, lq, kq), (lk, kk), g = q_groups.shape, k_groups.shape, config.num_groups
    qg, kg = q_groups.long().contiguous(), k_groups.long().contiguous()
    one_pass = config.one_pass if one_pass is None else one_pass
    lists, bits = not one_pass, one_pass or (kq > 1 and kk > 1)
    copies, keys, heads = r * lq * kq * lists, lk * kk * lists, (g + 1) * lists
    pattern = _pattern(config, lk)
    plan = PrefillPlan(torch.empty(heads, dtype=torch.long), torch.empty(keys, dtype=torch.int32),
                       torch.empty(heads, dtype=torch.long), torch.zeros(copies, dtype=torch.int32),
                       torch.zeros(copies, dtype=torch.int32), torch.empty(heads, dtype=torch.long),
                       torch.empty(copies, 2, dtype=torch.int32), torch.empty(r * lq * bits, dtype=torch.long),
                       torch.empty(lk * bits, dtype=torch.long), kq, kk, one_pass, (r, lq, lk), pattern)
    code = library().focus_prefill_plan(r, lq, lk, pattern[1], pattern[2], g, qg.data_ptr(), kq,
                                        kg.data_ptr(), kk, one_pass, *(x.data_ptr() for x in plan[:9]))
    _check(code, "prefill plan")
    return plan


def prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, plan: PrefillPlan, config: FocusConfig, scale: float,
            out: torch.Tensor, threads: int) -> None:
    """Focus attention of one unpadded sequence and KV head, written into ``out``.

    q and out ``[R, Lq, D]`` (the query heads of the KV head; rows of D contiguous, any head/position strides),
    k/v ``[Lk, D]``, queries at positions ``[Lk - Lq, Lk)``; ``plan`` from :func:`prefill_plan`.
    :func:`prefill_applies` must hold.
    """
    r, lq, d = q.shape
    if not _prefill_takes(q, k, v):
        raise ValueError(f"the C prefill takes q, k, v of one dtype among {DTYPES} with contiguous rows of a head dim "
                         f"that is a multiple of 16 up to {PREFILL_MAX_D}; got {q.dtype}, {k.dtype}, {v.dtype}, "
                         f"D = {d}, strides {q.stride()}, {k.stride()}, {v.stride()} (prefill_applies says which)")
    if plan.pattern != _pattern(config, k.shape[0]):
        raise ValueError(f"the plan was made for (groups, window, sinks) = {plan.pattern}, not for this config's "
                         f"{_pattern(config, k.shape[0])}: make the plan with the same config")
    if plan.shape != (r, lq, k.shape[0]) or k.shape != (k.shape[0], d) or v.shape != k.shape:
        raise ValueError(f"q {tuple(q.shape)}, k {tuple(k.shape)} and v {tuple(v.shape)} do not fit a plan made for "
                         f"[R, Lq, Lk] = {plan.shape} with [Lk, D] keys and values")
    if out.shape != q.shape or out.dtype != q.dtype or out.stride(-1) != 1:
        raise ValueError(f"out {tuple(out.shape)} {out.dtype} must match q {tuple(q.shape)} {q.dtype}, rows contiguous")
    lse = torch.empty(r * lq)
    code = library().focus_prefill(
        r, lq, k.shape[0], d, q.data_ptr(), q.stride(0), q.stride(1), k.data_ptr(), k.stride(0), v.data_ptr(),
        v.stride(0), out.data_ptr(), out.stride(0), out.stride(1), q.dtype == torch.bfloat16, scale, plan.pattern[1],
        plan.pattern[2], plan.pattern[0], plan.query_top_k, *(x.data_ptr() for x in plan[:9]), plan.key_top_k,
        plan.one_pass, max(1, threads), lse.data_ptr())
    _check(code, "prefill")


def _pattern(config: FocusConfig, lk: int) -> tuple[int, int, int]:
    """(groups, window, sinks) as the C prefill takes them: a window or sink count past Lk + 1 means the same as
    Lk + 1 (and the kernel's positions are 32-bit)."""
    return config.num_groups, min(config.window, lk + 1), min(config.sink_tokens, lk + 1)


def _check(code: int, name: str) -> None:
    if code:
        raise (MemoryError if code == 1 else ValueError)(f"the C {name} failed (code {code}): "
                                                         f"{'out of memory' if code == 1 else 'bad arguments'}")
