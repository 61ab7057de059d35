"""The C decode step (``csrc/decode_step.c``): built with the system C compiler on first use, called with ctypes.

A default decode step (one query, top-1 query routing) is a few dozen small tensor ops per layer in PyTorch; in C it
is one call that reads each selected key and value row once, in place, on the caller's threads (OpenMP: with a
PyTorch that ships GNU OpenMP, the C code joins PyTorch's own thread pool). The library is compiled once per source
version and compiler into focus_flex's cache (:func:`focus_flex.config.cache_dir`), in about a second. Without a C
compiler, or with ``FOCUS_FLEX_NATIVE=0``, decode runs the PyTorch path instead (same results, slower), after one
warning that says why.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import os
import shutil
import subprocess
import tempfile
import warnings
from pathlib import Path
from typing import TYPE_CHECKING

import numpy as np
import torch

from focus_flex.config import cache_dir

if TYPE_CHECKING:
    from focus_flex.decode import KeyIndex

SOURCE = Path(__file__).with_name("csrc") / "decode_step.c"
FLAGS = ("-O3", "-std=c11", "-shared", "-fPIC")
DTYPES = (torch.float32, torch.bfloat16)
_P, _I = ctypes.c_void_p, ctypes.c_int64
_ARGS = (_I, _I, _I, _P, _P, ctypes.c_float, _P, _P, _I, _P, _P, _I, ctypes.c_int, _P, _P, _P, _I, _I, _I, _I,
         ctypes.c_int, _P)


def build(compiler: str | None = None, directory: Path | None = None) -> Path:
    """Compile the decode step into a shared library (reused if this source was built with this compiler before).

    Tries with OpenMP first, then without (one thread). Raises ``RuntimeError`` with the compiler's message if both
    fail, or if no compiler is found (set ``CC`` to choose one).
    """
    cc = compiler or os.environ.get("CC") or shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")
    if not cc:
        raise RuntimeError("no C compiler found (looked for $CC, cc, gcc, clang)")
    directory = directory or cache_dir()
    source = SOURCE.read_bytes()
    builds = []  # (flags, library file): with OpenMP, else one thread
    for flags in (FLAGS + ("-fopenmp",), FLAGS):
        key = hashlib.sha256(source + repr((cc, flags)).encode()).hexdigest()[:16]
        builds.append((flags, directory / f"decode_step-{key}.so"))
    for _, target in builds:
        if target.exists():
            return target
    directory.mkdir(parents=True, exist_ok=True)
    errors = []
    for flags, target in builds:
        fd, tmp = tempfile.mkstemp(suffix=".so", dir=directory)  # built aside, then renamed: concurrent builds are safe
        os.close(fd)
        try:
            done = subprocess.run([cc, *flags, str(SOURCE), "-o", tmp, "-lm"], capture_output=True, text=True)
        except OSError as e:
            os.unlink(tmp)
            raise RuntimeError(f"cannot run the C compiler {cc!r}: {e}") from e
        if done.returncode == 0:
            os.replace(tmp, target)
            return target
        os.unlink(tmp)
        errors.append(done.stderr.strip()[-600:])
    raise RuntimeError(f"{cc} could not compile {SOURCE.name}: {errors[-1]}")


@functools.cache
def library() -> ctypes.CDLL | None:
    """The loaded decode step, or None (with one warning) where it cannot be built or ``FOCUS_FLEX_NATIVE=0``."""
    if os.environ.get("FOCUS_FLEX_NATIVE", "1") == "0":
        return None
    try:
        lib = ctypes.CDLL(str(build()))
    except (RuntimeError, OSError) as e:
        warnings.warn(f"focus_flex: the C decode step is unavailable ({e}); decode uses the slower PyTorch path. "
                      "Install a C compiler (e.g. gcc) or set FOCUS_FLEX_NATIVE=0 to silence this.", RuntimeWarning,
                      stacklevel=3)
        return None
    lib.focus_decode_step.argtypes, lib.focus_decode_step.restype = _ARGS, ctypes.c_int
    return lib


def applies(k: torch.Tensor, v: torch.Tensor) -> bool:
    """Whether the C step can read this cache: CPU tensors of one dtype in :data:`DTYPES`, rows contiguous."""
    return (k.device.type == "cpu" and v.device.type == "cpu" and k.dtype == v.dtype and k.dtype in DTYPES
            and k.stride(-1) == 1 and v.stride(-1) == 1)


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
    if code:
        raise (MemoryError if code == 1 else ValueError)(f"the C decode step failed (code {code}): "
                                                         f"{'out of memory' if code == 1 else 'bad arguments'}")
    return out
