"""The C decode step: the same rows as the PyTorch step and the reference, its build, and its fallback."""

import os
import shutil
import subprocess
import sys

import pytest
import torch

from focus_flex import FocusConfig, native, reference_attention, routing
from focus_flex.decode import KeyIndex, _far_end, _one_group_attention


def setup(b, hq, hkv, lk, g, cfg, dtype=torch.float32, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q = torch.randn(b, hq, 1, 32, generator=gen).to(dtype)
    k, v = (torch.randn(b, hkv, lk, 32, generator=gen).to(dtype) for _ in range(2))
    c = torch.randn(hkv, g, 32, generator=gen)
    index = KeyIndex(b, hkv, g, "cpu")
    index.extend(k, c, cfg)
    return q, k, v, c, index


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("parts", [1, 2, 3, 7])
def test_c_step_equals_pytorch_step_and_reference(parts, dtype, monkeypatch):
    """8 query heads per KV head over 3 groups (rows share passes over their keys), a cache of 1,500 keys split
    into up to 7 spans per pass, float32 and bfloat16 caches."""
    cfg = FocusConfig(num_groups=3, window=40, sink_tokens=4)
    q, k, v, c, index = setup(2, 16, 2, 1500, 3, cfg, dtype)
    groups = routing.hard_groups(q, c, 1)
    assert len(set(groups[0, :8].flatten().tolist())) < 8  # some rows of a KV head share a group
    end = _far_end(k.shape[2], 1, cfg)
    rows = q.reshape(32, 32).float()
    out = native.decode_step(rows, groups.reshape(-1), 32 ** -0.5, k, v, index, 4, end, parts)
    ref = reference_attention(q.float(), k.float(), v.float(), c, cfg).reshape(32, 32)
    monkeypatch.setattr(native, "library", lambda: None)
    torch_step = _one_group_attention(q, k, v, c, cfg, index, 32 ** -0.5, 2).reshape(32, 32).float()
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # (the PyTorch step rounds its probabilities to bfloat16)
    assert (out - ref).abs().max() <= 1e-5
    assert (out - torch_step).abs().max() <= tol


def test_c_step_rejects_bad_arguments():
    cfg = FocusConfig(num_groups=3, window=8, sink_tokens=2)
    q, k, v, c, index = setup(1, 4, 2, 50, 3, cfg)
    groups = torch.tensor([0, 1, 2, 3])  # group 3 of 3
    with pytest.raises(ValueError, match="bad arguments"):
        native.decode_step(q.reshape(4, 32), groups, 1.0, k, v, index, 2, 40, 1)


def test_build_is_reused_and_failures_say_why(tmp_path):
    first = native.build(directory=tmp_path)
    stamp = first.stat().st_mtime_ns
    assert native.build(directory=tmp_path) == first and first.stat().st_mtime_ns == stamp  # built once
    assert [p.name for p in tmp_path.iterdir()] == [first.name]  # no temporary files left
    with pytest.raises(RuntimeError, match="cannot run the C compiler"):
        native.build(str(tmp_path / "no-such-cc"), tmp_path / "other")
    with pytest.raises(RuntimeError, match="could not compile"):
        native.build(shutil.which("false"), tmp_path / "other")


STEP = """if True:
    import warnings
    import torch
    from focus_flex import FocusConfig, focus_attention, reference_attention
    from focus_flex.decode import KeyIndex
    cfg = FocusConfig(num_groups=4, window=8, sink_tokens=2)
    q, c = torch.randn(1, 4, 1, 16), torch.randn(2, 4, 16)
    k, v = torch.randn(1, 2, 40, 16), torch.randn(1, 2, 40, 16)
    index = KeyIndex(1, 2, 4, "cpu")
    index.extend(k, c, cfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        for _ in range(2):
            out = focus_attention(q, k, v, c, cfg, key_index=index)
    print((out - reference_attention(q, k, v, c, cfg)).abs().max().item() < 1e-5, [str(w.message) for w in caught])
"""


@pytest.mark.parametrize("case", ["no compiler", "no OpenMP", "switched off"])
def test_without_the_c_step_or_openmp_decode_is_still_exact(case, tmp_path):
    """No compiler: one warning that says why and how to fix it, then the PyTorch path. A compiler without OpenMP:
    the C step on one thread, silently (it is still the fast path). Switched off: the PyTorch path, no warning."""
    cc = tmp_path / "cc-without-openmp"
    cc.write_text(f'#!/bin/sh\ncase "$*" in *-fopenmp*) echo "no OpenMP here" >&2; exit 1;; esac\n'
                  f'exec {shutil.which("cc") or shutil.which("gcc")} "$@"\n')
    cc.chmod(0o755)
    env = {"no compiler": {"CC": "/no/such/cc"}, "no OpenMP": {"CC": str(cc)},
           "switched off": {"FOCUS_FLEX_NATIVE": "0"}}[case]
    cache = tmp_path / "cache"  # empty: nothing prebuilt
    done = subprocess.run([sys.executable, "-c", STEP], capture_output=True, text=True,
                          env={**os.environ, "FOCUS_FLEX_CACHE": str(cache), **env})
    assert done.returncode == 0, done.stderr[-2000:]
    exact, warned = done.stdout.strip().split(" ", 1)
    assert exact == "True"
    built = sorted(p.name for p in cache.glob("*.so")) if cache.exists() else []
    if case == "no compiler":
        assert warned.count("C decode step is unavailable") == 1 and "/no/such/cc" in warned
        assert built == []
    else:
        assert warned == "[]"
        assert len(built) == (case == "no OpenMP")
