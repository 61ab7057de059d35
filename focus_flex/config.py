"""`FocusConfig`: every knob of Focus attention, round-tripping to JSON like a PEFT config."""

from __future__ import annotations

import dataclasses
import json
import math
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

__version__ = "0.1.0"  # the library's version (pyproject.toml reads it from here), written into saved configs
CONFIG_NAME = "focus_config.json"  # not adapter_config.json: transformers hands that file to PEFT
WEIGHTS_NAME = "focus_adapter.safetensors"
MAX_GROUPS = 63  # group memberships are packed into one int64 bitmask per token
DECODE_MAX_QUERIES = 16  # a forward of at most this many queries is a decode step (gathered keys; `dense_decode`)


def cache_dir() -> Path:
    """Root of focus_flex's own cache (converted models, the built C decode step): ``$FOCUS_FLEX_CACHE`` or
    ``~/.cache/focus_flex``."""
    root = os.environ.get("FOCUS_FLEX_CACHE")
    if root:
        return Path(root).expanduser()
    return Path(os.environ.get("XDG_CACHE_HOME", "~/.cache")).expanduser() / "focus_flex"


def tail_queries(dense_tail: int, lq: int) -> int:
    """How many of a forward's ``lq`` queries attend every earlier key as a prefill's dense tail: the last
    ``dense_tail`` of a prefill, none of a decode step (a forward of at most ``DECODE_MAX_QUERIES`` queries)."""
    return min(dense_tail, lq) if lq > DECODE_MAX_QUERIES else 0


@dataclass
class FocusConfig:
    """Configuration of a Focus adapter.

    Attention semantics (docs/design.md, "The semantics"): query i may attend key j iff j <= i and
    ``(pos_i - pos_j < window) or (pos_j < sink_tokens) or groups(q_i) ∩ groups(k_j) ≠ ∅``,
    where positions count non-padded tokens and groups are the top-k centroids by cosine score. With ``center``,
    a vector is routed with its head's mean (before the rotary encoding, rotated to its position) removed
    (:class:`focus_flex.routing.Centering`), in every Focus layer (``True``) or in the layers listed; the adapter
    then also holds those means. With ``dense_decode``, the
    queries of a decode step (a forward of at most ``DECODE_MAX_QUERIES`` queries) attend every earlier key:
    Focus for the prefill only (as MInference does), and a decode step costs what full attention's does. With
    ``dense_tail`` N, the last N queries of a prefill (a forward of more than ``DECODE_MAX_QUERIES`` queries) attend
    every earlier key: the question at the end of a long prompt reads all of it. With ``dense_heads``, the query
    heads of the KV heads listed as ``[layer, kv_head]`` attend every earlier key: heads whose far attention the
    groups cannot carry (docs/passkey.md, point 20). With ``layer_top_k``, the layers listed as
    ``[layer, query_top_k, key_top_k]`` route with their own top-k (:meth:`at` gives a layer's configuration): layers
    whose far attention needs more groups than the others' (docs/passkey.md, point 53).
    """

    num_groups: int = 16
    query_top_k: int = 1
    key_top_k: int = 1
    window: int = 256
    sink_tokens: int = 4
    tau: float = 0.1
    block_size: int = 64  # tile of the flex kernel's block masks: speed only, never the pattern (docs/speed.md)
    layers: list[int] | None = None  # None: every full-attention layer of the model
    sinkhorn_iters: int = 3
    center: bool | list[int] = False  # route mean-removed queries and keys: in every Focus layer, or in those listed
    dense_decode: bool = False  # forwards of at most 16 queries (decode steps) attend every earlier key
    dense_tail: int = 0  # the last this many queries of a prefill attend every earlier key
    dense_heads: list[list[int]] = field(default_factory=list)  # [layer, kv_head]: its query heads attend fully
    layer_top_k: list[list[int]] = field(default_factory=list)  # [layer, query_top_k, key_top_k]: that layer's top-k
    # Shape of the model the centroids belong to (filled in by `FocusAdapter.for_model`).
    num_layers: int | None = None
    num_kv_heads: int | None = None
    num_query_heads: int | None = None
    head_dim: int | None = None
    base_model: str | None = None
    base_model_revision: str | None = None
    model_type: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)  # free-form metadata (training args, results)

    def __post_init__(self) -> None:
        self.validate()

    def validate(self) -> None:
        def need(cond: bool, msg: str) -> None:
            if not cond:
                raise ValueError(f"Invalid FocusConfig: {msg}")

        def is_int(x: Any) -> bool:  # bool is an int subclass, and JSON true/false would pass as 1/0
            return isinstance(x, int) and not isinstance(x, bool)

        need(is_int(self.num_groups) and 1 <= self.num_groups <= MAX_GROUPS,
             f"num_groups={self.num_groups!r} must be an int in [1, {MAX_GROUPS}]")
        for name in ("query_top_k", "key_top_k"):
            k = getattr(self, name)
            need(is_int(k) and 1 <= k <= self.num_groups,
                 f"{name}={k!r} must be an int in [1, num_groups={self.num_groups}]")
        need(is_int(self.window) and self.window >= 1, f"window={self.window!r} must be an int >= 1")
        need(is_int(self.sink_tokens) and self.sink_tokens >= 0,
             f"sink_tokens={self.sink_tokens!r} must be an int >= 0")
        need(isinstance(self.tau, (int, float)) and not isinstance(self.tau, bool) and 0 < self.tau < math.inf,
             f"tau={self.tau!r} must be a finite number > 0")
        need(is_int(self.block_size) and self.block_size >= 16 and self.block_size % 16 == 0,
             f"block_size={self.block_size!r} must be a multiple of 16 (FlexAttention's tile size)")
        need(is_int(self.sinkhorn_iters) and self.sinkhorn_iters >= 0,
             f"sinkhorn_iters={self.sinkhorn_iters!r} must be an int >= 0")
        if self.layers is not None:
            need(isinstance(self.layers, (list, tuple)) and all(is_int(i) and i >= 0 for i in self.layers),
                 f"layers={self.layers!r} must be None or a list of layer indices >= 0")
            self.layers = sorted(set(self.layers))
            if self.num_layers is not None:
                need(all(i < self.num_layers for i in self.layers),
                     f"layers={self.layers} has indices >= num_layers={self.num_layers}")
        if isinstance(self.center, (list, tuple)):
            need(all(is_int(i) and i >= 0 for i in self.center),
                 f"center={self.center!r} must be true, false or a list of Focus layer indices")
            self.center = sorted(set(self.center)) or False
            if self.center and self.layers is not None:
                need(set(self.center) <= set(self.layers),
                     f"center={self.center} lists layers that are not Focus layers (layers={self.layers})")
        need(isinstance(self.center, (bool, list)),
             f"center={self.center!r} must be true, false or a list of Focus layer indices")
        need(isinstance(self.dense_decode, bool), f"dense_decode={self.dense_decode!r} must be true or false")
        need(is_int(self.dense_tail) and self.dense_tail >= 0,
             f"dense_tail={self.dense_tail!r} must be an int >= 0 (prefill queries that attend densely)")
        for name in ("num_layers", "num_kv_heads", "num_query_heads", "head_dim"):
            v = getattr(self, name)
            need(v is None or (is_int(v) and v >= 1), f"{name}={v!r} must be None or an int >= 1")
        need(isinstance(self.dense_heads, (list, tuple)) and all(
            isinstance(p, (list, tuple)) and len(p) == 2 and all(is_int(i) and i >= 0 for i in p)
            for p in self.dense_heads),
             f"dense_heads={self.dense_heads!r} must be a list of [layer, kv_head] pairs of ints >= 0")
        self.dense_heads = [list(p) for p in sorted({tuple(p) for p in self.dense_heads})]
        if self.layers is not None:
            need(all(a in self.layers for a, _ in self.dense_heads),
                 f"dense_heads={self.dense_heads} names layers that are not Focus layers (layers={self.layers})")
        if self.num_kv_heads is not None:
            need(all(b < self.num_kv_heads for _, b in self.dense_heads),
                 f"dense_heads={self.dense_heads} names KV heads >= num_kv_heads={self.num_kv_heads}")
        need(isinstance(self.layer_top_k, (list, tuple)) and all(
            isinstance(t, (list, tuple)) and len(t) == 3 and all(is_int(i) for i in t) and t[0] >= 0
            and 1 <= t[1] <= self.num_groups and 1 <= t[2] <= self.num_groups for t in self.layer_top_k),
             f"layer_top_k={self.layer_top_k!r} must be a list of [layer, query_top_k, key_top_k], each top-k an int "
             f"in [1, num_groups={self.num_groups}]")
        self.layer_top_k = [list(t) for t in sorted({tuple(t) for t in self.layer_top_k})]
        named = [t[0] for t in self.layer_top_k]
        need(len(named) == len(set(named)), f"layer_top_k={self.layer_top_k} names a layer twice")
        if self.layers is not None:
            need(set(named) <= set(self.layers),
                 f"layer_top_k={self.layer_top_k} names layers that are not Focus layers (layers={self.layers})")

    def tail(self, lq: int) -> int:
        """How many of a forward's ``lq`` queries attend densely as the prefill's tail (:func:`tail_queries`)."""
        return tail_queries(self.dense_tail, lq)

    def at(self, layer: int) -> FocusConfig:
        """The configuration Focus layer ``layer`` runs with: this one, or a copy with that layer's own
        ``query_top_k`` and ``key_top_k`` (``layer_top_k``)."""
        for a, q, k in self.layer_top_k:
            if a == layer:
                return dataclasses.replace(self, query_top_k=q, key_top_k=k, layer_top_k=[])
        return self

    @property
    def one_pass(self) -> bool:
        """Whether a prefill runs this configuration as one causal pass that tests the query's and the key's group
        bitmasks beyond the window, instead of a local pass and a far pass over a copy of each query per group: where
        queries and keys join so many groups (``query_top_k * key_top_k >= num_groups``) that the copies would
        compute a far pair about once per group it shares, at more than a dense layer's work (docs/speed.md)."""
        return self.query_top_k * self.key_top_k >= self.num_groups

    def dense_kv_heads(self, layer: int) -> list[int]:
        """The KV heads of Focus layer ``layer`` whose query heads attend every earlier key (``dense_heads``)."""
        return [h for a, h in self.dense_heads if a == layer]

    def centers(self, layer: int) -> bool:
        """Whether Focus layer ``layer`` routes mean-removed vectors (``center`` true, or listing it)."""
        return self.center is True or (isinstance(self.center, list) and layer in self.center)

    # ---- JSON round trip -------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> FocusConfig:
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - known - {"focus_flex_version"})
        if unknown:
            raise ValueError(f"Unknown FocusConfig fields {unknown}: was this file written by a newer focus_flex? "
                             f"Known fields: {sorted(known)}")
        return cls(**{k: v for k, v in d.items() if k in known})

    def to_json_string(self) -> str:
        return json.dumps({**self.to_dict(), "focus_flex_version": __version__}, indent=2, sort_keys=True) + "\n"

    def save_pretrained(self, directory: str | os.PathLike) -> str:
        text = self.to_json_string()  # first: a value JSON cannot hold must not leave a truncated file behind
        os.makedirs(directory, exist_ok=True)
        path = os.path.join(directory, CONFIG_NAME)
        with open(path, "w") as f:
            f.write(text)
        return path

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, *, revision: str | None = None,
                        subfolder: str | None = None, token: str | bool | None = None,
                        cache_dir: str | os.PathLike | None = None, local_files_only: bool = False) -> FocusConfig:
        """Read ``focus_config.json`` from a local folder or a Hub repo id, as `FocusAdapter.from_pretrained` does.

        The arguments and errors are those of `focus_flex.hub.resolve_adapter_dir`, which fetches only the config
        here (the centroids are not downloaded).
        """
        from focus_flex.hub import resolve_adapter_dir  # the Hub client is imported only when a config is loaded

        directory = resolve_adapter_dir(name_or_path, revision=revision, subfolder=subfolder, token=token,
                                        cache_dir=cache_dir, local_files_only=local_files_only, files=(CONFIG_NAME,))
        return cls.from_json_file(os.path.join(directory, CONFIG_NAME))

    @classmethod
    def from_json_file(cls, path: str | os.PathLike) -> FocusConfig:
        """Read one ``focus_config.json`` file."""
        try:
            with open(path) as f:
                data = json.load(f)
        except json.JSONDecodeError as e:
            raise ValueError(f"{path} is not valid JSON ({e}); the file is corrupt or partial, "
                             f"re-download or re-save the adapter.") from e
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a JSON object, got {type(data).__name__}.")
        return cls.from_dict(data)
