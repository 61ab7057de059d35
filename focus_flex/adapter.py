"""`FocusAdapter`: the trainable centroids of every Focus layer, and how they plug into transformers.

    adapter = FocusAdapter.for_model(model, FocusConfig(num_groups=16, window=256))
    adapter.attach(model)          # model now runs Focus attention
    adapter.save_pretrained("my-adapter")
    adapter.detach(model)          # back to the model's own attention, bit for bit

Attaching registers one transformers attention implementation, ``"focus"`` (plus a mask builder
of the same name, so padding masks arrive), and points every attention module at its centroids.
"""

from __future__ import annotations

import contextlib
import inspect
import os
import weakref
from dataclasses import dataclass

import torch
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file
from torch import nn
from torch.utils.checkpoint import checkpoint

from focus_flex.attention import (
    DECODE_MAX_QUERIES,
    attention_weights,
    focus_attention,
    key_validity,
    reference_attention,
    routed,
    soft_attention,
    with_dense_heads,
)
from focus_flex.config import CONFIG_NAME, WEIGHTS_NAME, FocusConfig
from focus_flex.decode import KeyIndex
from focus_flex.plan import token_positions
from focus_flex.routing import Centering, Rotary
from focus_flex.threads import small_work

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3", "gemma3_text", "gpt2")
ATTENTION_MODES = ("fast", "reference", "soft")  # what adapter.mode may be
KERNELS = (None, "flex", "flash")  # what adapter.kernel may be
IMPLEMENTATION = "focus"


@dataclass(frozen=True)
class ModelShape:
    """What the centroids must match: layers, KV heads and head dim, and which layers are full attention."""

    model_type: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    full_attention_layers: tuple[int, ...]
    num_heads: int  # query heads


def model_shape(model: nn.Module) -> ModelShape:
    """Read the attention geometry of a transformers causal LM; clear error if unsupported."""
    cfg = getattr(model, "config", None)
    mtype = getattr(cfg, "model_type", None)
    if mtype == "gemma3":  # multimodal wrapper: Focus goes on its text model
        cfg, mtype = cfg.text_config, cfg.text_config.model_type
    if mtype not in SUPPORTED_MODEL_TYPES:
        raise ValueError(f"Focus does not support model_type={mtype!r} ({type(model).__name__}). Supported "
                         f"architectures: {', '.join(SUPPORTED_MODEL_TYPES)}.")
    if mtype == "gpt2":
        n_layers, n_heads = cfg.n_layer, cfg.n_head
        return ModelShape(mtype, n_layers, n_heads, cfg.n_embd // n_heads, tuple(range(n_layers)), n_heads)
    n_layers = cfg.num_hidden_layers
    head_dim = getattr(cfg, "head_dim", None) or cfg.hidden_size // cfg.num_attention_heads
    layer_types = getattr(cfg, "layer_types", None)
    if layer_types is None and getattr(cfg, "sliding_window", None) and getattr(cfg, "use_sliding_window", True):
        layer_types = ["sliding_attention"] * n_layers
    full = tuple(i for i in range(n_layers) if layer_types is None or layer_types[i] == "full_attention")
    return ModelShape(mtype, n_layers, cfg.num_key_value_heads, head_dim, full, cfg.num_attention_heads)


def rotary_of(model: nn.Module) -> Rotary | None:
    """The rotary encoding of ``model``'s full-attention layers as positions ``[B, L]`` -> cos, sin ``[B, L, D]``
    (float32), from the model's own rotary module; None for a model without one (GPT-2: positions are added to the
    embeddings, q and k carry no rotation)."""
    if model_shape(model).model_type == "gpt2":
        return None
    module = next((m for name, m in model.named_modules() if name.split(".")[-1] == "rotary_emb"), None)
    if module is None:
        raise ValueError(f"{type(model).__name__} has no rotary_emb module: centered routing (FocusConfig.center) "
                         "needs the model's rotary encoding to place each head's mean at a token's position.")
    by_type = "layer_type" in inspect.signature(module.forward).parameters  # e.g. Gemma-3: local and global RoPE

    def rotary(pos: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        x = torch.empty(0, dtype=torch.float32, device=pos.device)
        return module(x, pos, "full_attention") if by_type else module(x, pos)

    return rotary


class FocusAdapter(nn.Module):
    """Centroids ``[n_focus_layers, Hkv, G, D]`` plus the :class:`FocusConfig` that describes them.

    ``mode`` chooses the attention path while attached: ``"fast"`` (:func:`~focus_flex.attention.focus_attention`:
    the ``flash`` kernel on CPU, compiled FlexAttention elsewhere; inference), ``"soft"`` (differentiable soft routing,
    training), ``"reference"`` (the dense definition, docs/design.md). ``kernel`` chooses the fast path's kernel:
    None (the fastest on the device), ``"flex"`` (the device path, compiled FlexAttention, also on CPU: prefill and
    decode through :mod:`focus_flex.cache`) or ``"flash"`` (the CPU kernel).
    """

    def __init__(self, config: FocusConfig, centroids: torch.Tensor | None = None, *, seed: int = 0,
                 query_means: torch.Tensor | None = None, key_means: torch.Tensor | None = None):
        super().__init__()
        missing = [n for n in ("num_layers", "num_kv_heads", "head_dim") if getattr(config, n) is None]
        if missing or config.layers is None:
            raise ValueError(f"FocusConfig lacks the model shape ({missing or ['layers']}): a bare config, not an "
                             "adapter's. Build adapters with FocusAdapter.for_model(model, config); a folder written "
                             "by FocusAdapter.save_pretrained holds the shape.")
        self.config = config
        shape = (len(config.layers), config.num_kv_heads, config.num_groups, config.head_dim)
        if centroids is None:
            gen = torch.Generator().manual_seed(seed)
            centroids = nn.functional.normalize(torch.randn(shape, generator=gen), dim=-1)
        elif tuple(centroids.shape) != shape:
            raise ValueError(f"centroids have shape {tuple(centroids.shape)}, but the config describes {shape} "
                             f"= [layers {config.layers}, kv heads, groups, head dim]")
        elif not centroids.is_floating_point():
            raise ValueError(f"centroids have dtype {centroids.dtype}; they must be floating point (focus_flex saves "
                             "float32): this is not a Focus adapter's tensor, or it was converted wrongly.")
        elif not bool(torch.isfinite(centroids).all()) or not bool((centroids.norm(dim=-1) > 0).all()):
            raise ValueError("centroids hold NaN, infinite or all-zero vectors: routing needs a direction per group "
                             "(did training diverge?); retrain, or load an earlier checkpoint.")
        self.centroids = nn.Parameter(centroids.detach().float().clone())
        self.slot = {layer: i for i, layer in enumerate(config.layers)}
        # Centered routing: each head's mean query and key before the rotary encoding (zeros until calibrated).
        if config.center and config.num_query_heads is None:
            raise ValueError("FocusConfig.center needs num_query_heads (the model shape): build the adapter with "
                             "FocusAdapter.for_model(model, config).")
        for name, given, heads in (("query_means", query_means, config.num_query_heads),
                                   ("key_means", key_means, config.num_kv_heads)):
            if not config.center:
                if given is not None:
                    raise ValueError(f"{name} given but config.center is false: set center=True to route with them.")
                self.register_buffer(name, None)
                continue
            expected = (len(config.layers), heads, config.head_dim)
            if given is None:
                given = torch.zeros(expected)
            elif tuple(given.shape) != expected or not given.is_floating_point() or not bool(given.isfinite().all()):
                raise ValueError(f"{name} must be finite floats of shape {expected} = [layers, heads, head dim]; got "
                                 f"{given.dtype} {tuple(given.shape)}")
            self.register_buffer(name, given.detach().float().clone())
        self._rotary: Rotary | None = None
        self._mode = "fast"
        self._kernel: str | None = None
        self._attached: list[tuple[weakref.ref, list]] = []  # (model, its hooks)
        self._active_cache: weakref.ref | None = None
        self._key_index: dict[int, _Indexed] = {}  # slot -> the key routing of the active cache's layer

    @property
    def mode(self) -> str:
        return self._mode

    @mode.setter
    def mode(self, value: str) -> None:
        if value not in ATTENTION_MODES:
            raise ValueError(f"mode={value!r}; choose one of {ATTENTION_MODES}")
        self._mode = value

    @property
    def kernel(self) -> str | None:
        return self._kernel

    @kernel.setter
    def kernel(self, value: str | None) -> None:
        if value not in KERNELS:
            raise ValueError(f"kernel={value!r}; choose one of {KERNELS} (None: the fastest on the device)")
        self._kernel = value

    def device_path(self, device: torch.device) -> bool:
        """Whether decode runs on the device path (:mod:`focus_flex.cache`: a pool paged by group, FlexAttention)
        rather than the CPU's host-side key index: off the CPU, or with ``kernel="flex"``."""
        return self.kernel == "flex" or device.type != "cpu"

    # ---- construction ------------------------------------------------------------------------
    @classmethod
    def for_model(cls, model: nn.Module, config: FocusConfig | None = None, *, seed: int = 0) -> FocusAdapter:
        """Fresh (random unit) centroids sized to ``model``; Focus goes on its full-attention layers."""
        shape = model_shape(model)
        config = FocusConfig(**(config or FocusConfig()).to_dict())  # a copy
        layers = list(shape.full_attention_layers) if config.layers is None else config.layers
        sliding = sorted(set(layers) - set(shape.full_attention_layers))
        if sliding:
            raise ValueError(f"layers {sliding} use the model's own sliding-window attention; Focus goes on the "
                             f"full-attention layers {list(shape.full_attention_layers)}.")
        if not layers:
            window = getattr(getattr(model, "config", None), "sliding_window", None)
            hint = (f": every layer uses the model's sliding-window attention (config.sliding_window={window}). Focus "
                    "replaces full attention; to use it, load the model with sliding_window=None (e.g. "
                    "from_pretrained(..., sliding_window=None)), which makes those layers full attention"
                    if window else "")
            raise ValueError(f"{shape.model_type} model has no full-attention layer for Focus to replace{hint}.")
        config.layers, config.num_layers = layers, shape.num_layers
        config.num_kv_heads, config.head_dim, config.model_type = shape.num_kv_heads, shape.head_dim, shape.model_type
        config.num_query_heads = shape.num_heads
        config.base_model = config.base_model or getattr(model, "name_or_path", None) or None
        config.validate()
        return cls(config, seed=seed).to(next(model.parameters()).device)

    def check_compatible(self, model: nn.Module) -> ModelShape:
        """Raise a clear error unless the centroids fit ``model`` layer for layer, head for head."""
        shape = model_shape(model)
        c = self.config
        problems = []
        if c.num_layers != shape.num_layers:
            problems.append(f"{c.num_layers} layers vs the model's {shape.num_layers}")
        if c.num_kv_heads != shape.num_kv_heads:
            problems.append(f"{c.num_kv_heads} KV heads vs the model's {shape.num_kv_heads}")
        if c.head_dim != shape.head_dim:
            problems.append(f"head dim {c.head_dim} vs the model's {shape.head_dim}")
        if c.center and c.num_query_heads != shape.num_heads:
            problems.append(f"query means of {c.num_query_heads} query heads vs the model's {shape.num_heads}")
        if c.model_type is not None and c.model_type != shape.model_type:
            problems.append(f"trained for a {c.model_type!r} model, this is {shape.model_type!r}")
        bad = sorted(set(c.layers) - set(shape.full_attention_layers))
        if bad and not problems:
            problems.append(f"layers {bad} are not full-attention layers of this model")
        if problems:
            raise ValueError(f"This Focus adapter (base model {c.base_model!r}) does not fit "
                             f"{type(model).__name__} ({getattr(model, 'name_or_path', '') or 'unnamed'}): "
                             f"{'; '.join(problems)}. Train an adapter for this model (`focus-flex retrofit "
                             "--model ...`, or FocusAdapter.for_model in Python).")
        return shape

    # ---- attach / detach ---------------------------------------------------------------------
    def attach(self, model: nn.Module) -> nn.Module:
        """Make ``model`` run Focus attention (in place; returns it). The base weights are untouched."""
        from focus_flex.hub import check_base_model

        self.check_compatible(model)
        check_base_model(self.config.base_model, getattr(model, "name_or_path", None))
        if has_focus(model):
            raise RuntimeError("A Focus adapter is already attached to this model; detach it first.")
        register()
        device = next(model.parameters()).device
        self.to(device)
        self._rotary = rotary_of(model) if self.config.center else None
        hooks = []
        for module in _attention_modules(model):
            module._focus = _FocusState(weakref.ref(self), self.slot.get(module.layer_idx))
            if module._focus.slot is not None:
                hooks.append(module.register_forward_pre_hook(_pass_cache_layer, with_kwargs=True))
        for m in [model, *(h for h in _position_hosts(model) if h is not model)]:
            hooks.append(m.register_forward_pre_hook(self._enter, with_kwargs=True))
            hooks.append(m.register_forward_hook(self._exit))
        _use_focus(model)
        # generate() would build the mask of a static cache ahead of the forward, in a form only the model's own
        # attention reads; the Focus mask builder wants the 2-D padding mask, which the forward then hands it.
        model.create_masks_for_generate = _padding_mask_for_generate
        self._attached.append((weakref.ref(model), hooks))
        return model

    def detach(self, model: nn.Module) -> nn.Module:
        """Restore the model's own attention implementation; outputs are bit-identical to before."""
        for i, (ref, hooks) in enumerate(self._attached):
            if ref() is model:
                for h in hooks:
                    h.remove()
                for module in _attention_modules(model):
                    module._focus = None
                _stop_focus(model)
                del model.create_masks_for_generate
                del self._attached[i]
                self._key_index.clear()
                if not self._attached:
                    self._rotary = None
                return model
        raise ValueError("This adapter is not attached to that model.")

    def _enter(self, module, args, kwargs):
        """Before a forward (of the model, or of a pretrained model inside it that runs the layers):

        * settings changed on ``adapter.config`` since attach are checked again;
        * the KV cache becomes the active one, and a key index is kept only if its cache layer still holds the very
          key tensor it indexed, unmodified: ``reorder_cache`` (beam search), ``crop`` (assisted decoding), batch
          selection or any rewrite replace it, and such a layer's keys are routed again from scratch;
        * a padded call without ``position_ids`` gets positions counting real tokens, as ``generate`` passes them:
          routing reads q and k after the position encoding, so a left-padded row would otherwise route (and
          attend) differently from the same text unpadded.

        Inside a ``torch.compile`` trace (a compiled ``model.__call__``, as ``generate`` compiles decode steps) only the
        last: the checks and the caches' bookkeeping are host-side state, done by the eager forward before (a
        prefill), which a compiled step must not depend on.
        """
        if not torch.compiler.is_compiling():
            self._track_cache(kwargs)
        mask, x = kwargs.get("attention_mask"), kwargs.get("input_ids", args[0] if args else None)
        x = kwargs.get("inputs_embeds") if x is None else x
        if (kwargs.get("position_ids") is None and isinstance(mask, torch.Tensor) and mask.dim() == 2 and x is not None
                and not bool(mask.all()) and "position_ids" in inspect.signature(module.forward).parameters):
            pos = mask.long().cumsum(-1) - 1
            kwargs["position_ids"] = pos.masked_fill(mask == 0, 1)[:, -x.shape[1]:]
        return args, kwargs

    def _track_cache(self, kwargs: dict) -> None:
        """:meth:`_enter`'s host-side part: check the config, make the call's KV cache the active one, turn its Focus
        layers into Focus cache layers where they need a pool, and drop the key indexes of edited caches."""
        self._check_config()
        # (transformers up to 5.23 names the KV cache past_key_values, later versions cache)
        cache = next((kwargs[name] for name in ("past_key_values", "cache") if kwargs.get(name) is not None), None)
        self._active_cache = weakref.ref(cache) if cache is not None else None
        layers = getattr(cache, "layers", None)
        if layers is not None:  # static layers always, dynamic ones on the device path, get a pool (focus_flex.cache)
            from focus_flex.cache import to_focus_layer

            device = next(self.parameters()).device
            for layer in self.config.layers:
                if layer < len(layers) and (self.device_path(device) or type(layers[layer]).__name__ == "StaticLayer"):
                    to_focus_layer(layers[layer])
        for slot, entry in list(self._key_index.items()):
            layer = self.config.layers[slot]
            keys = getattr(layers[layer], "keys", None) if layers is not None and layer < len(layers) else None
            same = keys is not None and keys is entry.keys() and _version(keys) == entry.version
            if entry.cache() is not cache or not same:
                del self._key_index[slot]

    def _check_config(self) -> None:
        """``adapter.config`` is the adapter's live configuration: valid, and still describing the centroids."""
        c = self.config
        c.validate()
        shape = (len(c.layers), c.num_kv_heads, c.num_groups, c.head_dim)
        centered = self.key_means is not None
        if shape != tuple(self.centroids.shape) or c.layers != list(self.slot) or bool(c.center) != centered:
            raise ValueError(f"adapter.config describes centroids {shape} on layers {c.layers}, but the adapter holds "
                             f"{tuple(self.centroids.shape)} on layers {list(self.slot)}: on an adapter only the "
                             "routing may change (query_top_k, key_top_k, window, sink_tokens, tau, dense_decode, "
                             "dense_tail, dense_heads, layer_top_k); for other groups, layers or centering build a "
                             "new one (FocusAdapter.for_model).")

    def layer_config(self, slot: int) -> FocusConfig:
        """The configuration the layer in ``slot`` runs with: ``config.at`` its layer, from the live config."""
        return self.config.at(self.config.layers[slot])

    def _exit(self, module, args, output):
        self._active_cache = None

    # ---- the attention call ------------------------------------------------------------------
    def centering(self, slot: int) -> Centering | None:
        """How the layer in ``slot`` centers what it routes (None: not centered, ``config.centers``), with the rotary
        encoding of the model the adapter is attached to (for another model: ``Centering(adapter.query_means[slot],
        adapter.key_means[slot], rotary_of(model))``)."""
        if not self.config.centers(self.config.layers[slot]):
            return None
        if self.query_means is None:
            raise ValueError("adapter.config.center is true but this adapter holds no query/key means: centering "
                             "is chosen when an adapter is built (FocusConfig(center=True) in FocusAdapter.for_model).")
        if not self._attached:
            raise RuntimeError("Centered routing needs the rotary encoding of the model: attach the adapter first.")
        return Centering(self.query_means[slot], self.key_means[slot], self._rotary)

    def routed(self, slot: int, query: torch.Tensor, key: torch.Tensor,
               padding: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """The vectors the layer in ``slot`` routes for its post-RoPE query ``[B, Hq, Lq, D]`` and key
        ``[B, Hkv, Lk, D]`` (padding ``[B, Lk]``): themselves, or centered (:meth:`centering`)."""
        return routed(query, key, key_validity(key, padding), self.centering(slot))

    def key_index(self, slot: int, key: torch.Tensor, padding: torch.Tensor | None = None) -> KeyIndex | None:
        """Key routing of a KV cache layer's keys ``[B, Hkv, Lk, D]``, kept up to date step by step.

        The index of the active cache grows by the keys appended since the last call (O(new keys)); a different
        cache, or one that was cropped, reordered or rewritten, is routed from scratch. None without a cache.
        """
        cache = self._active_cache() if self._active_cache is not None else None
        if cache is None:
            return None
        cent, c, centering = self.centroids[slot].detach(), self.layer_config(slot), self.centering(slot)
        routed_by = (c.num_groups, c.key_top_k, _version(self.centroids), c.centers(c.layers[slot]),
                     None if self.key_means is None else _version(self.key_means))
        entry = self._key_index.get(slot)
        index = entry.index if entry is not None and entry.routed_by == routed_by else None
        if index is None or index.length > key.shape[2] or key.shape[:2] != index.shape[:2]:
            index = KeyIndex(key.shape[0], key.shape[1], c.num_groups, key.device)
        new = key[:, :, index.length:]
        if centering is not None:  # the new keys' token positions
            pos = torch.arange(index.length, key.shape[2], device=key.device).expand(key.shape[0], -1) \
                if padding is None else token_positions(padding.to(key.device, torch.bool))[:, index.length:]
            new = centering.keys(new, pos)
        index.extend(new, cent, c)
        self._key_index[slot] = _Indexed(weakref.ref(cache), index, weakref.ref(key), _version(key), routed_by)
        return index

    def forward(self, module: nn.Module, slot: int, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor,
                padding: torch.Tensor | None, scaling: float | None, cache_layer: object = None) -> torch.Tensor:
        """Focus attention for one layer: ``[B, Hq, Lq, D]`` q and ``[B, Hkv, Lk, D]`` k/v -> ``[B, Hq, Lq, D]``.
        ``cache_layer``: the KV cache's layer that returned k/v (a Focus cache layer, :mod:`focus_flex.cache`, is the
        one with a ``focus_attention`` method). The layer's ``config.dense_heads`` attend fully on every path."""
        out = self._pattern_attention(module, slot, query, key, value, padding, scaling, cache_layer)
        dense = self.config.dense_kv_heads(self.config.layers[slot])
        if dense and hasattr(cache_layer, "max_cache_len"):  # a static buffer: the splice reads its tokens only
            key, value, padding = _buffer_tokens(cache_layer, key, value, padding)
        return with_dense_heads(out, query, key, value, dense, padding, scaling)

    def _pattern_attention(self, module: nn.Module, slot: int, query: torch.Tensor, key: torch.Tensor,
                           value: torch.Tensor, padding: torch.Tensor | None, scaling: float | None,
                           cache_layer: object) -> torch.Tensor:
        """:meth:`forward` on the path ``mode`` chooses, before the dense heads."""
        cent, c, centering = self.centroids[slot], self.layer_config(slot), self.centering(slot)
        focus_layer = getattr(cache_layer, "focus_attention", None) is not None
        if type(cache_layer).__name__ == "StaticLayer":
            raise ValueError("A static KV cache reached Focus attention without its Focus state: a static cache's "
                             "layers become Focus cache layers at an eager forward of the attached model, and this "
                             "cache's first forward was compiled. Run the prefill eagerly (generate does), or pass "
                             "past_key_values=focus_flex.cache.FocusCache(model.config, max_cache_len=...).")
        if focus_layer and hasattr(cache_layer, "max_cache_len") and self.mode != "fast":  # a static buffer: its tokens
            key, value, padding = _buffer_tokens(cache_layer, key, value, padding)
        if self.mode == "soft":
            if torch.is_grad_enabled() and cent.requires_grad:  # backward keeps q, k, v, not the [B, H, L, L] terms
                return checkpoint(soft_attention, query, key, value, cent, c, attention_mask=padding, scale=scaling,
                                  centering=centering, use_reentrant=False)
            return soft_attention(query, key, value, cent, c, attention_mask=padding, scale=scaling,
                                  centering=centering)
        if module.training and torch.is_grad_enabled() and cent.requires_grad:
            raise ValueError(f"adapter.mode={self.mode!r} routes by hard top-k, which gives the centroids no "
                             "gradient, and the model is in training mode: set adapter.mode = 'soft' to train them; "
                             "for inference call model.eval() or use torch.no_grad(); to train something else with "
                             "Focus on, freeze them (adapter.requires_grad_(False)).")
        if self.mode == "reference":
            return reference_attention(query, key, value, cent.detach(), c, attention_mask=padding, scale=scaling,
                                       centering=centering)
        if focus_layer:
            return cache_layer.focus_attention(query, key, value, cent.detach(), c, padding, scaling, self.kernel,
                                               centering)
        with small_work(query.device) if query.shape[2] <= DECODE_MAX_QUERIES else contextlib.nullcontext():
            return focus_attention(query, key, value, cent.detach(), c, attention_mask=padding, scale=scaling,
                                   key_index=None if c.dense_decode else self.key_index(slot, key, padding),
                                   kernel=self.kernel,
                                   centering=centering)

    # ---- files -------------------------------------------------------------------------------
    def save_pretrained(self, directory: str | os.PathLike) -> str:
        """Write ``focus_config.json`` and ``focus_adapter.safetensors`` into ``directory``."""
        os.makedirs(directory, exist_ok=True)
        self.config.save_pretrained(directory)
        tensors = {"centroids": self.centroids}
        if self.config.center:
            tensors.update(query_means=self.query_means, key_means=self.key_means)
        save_file({name: t.detach().cpu().contiguous() for name, t in tensors.items()},
                  os.path.join(directory, WEIGHTS_NAME), metadata={"format": "pt", "library": "focus_flex"})
        return str(directory)

    @classmethod
    def from_pretrained(cls, name_or_path: str | os.PathLike, *, revision: str | None = None,
                        subfolder: str | None = None, token: str | bool | None = None,
                        cache_dir: str | os.PathLike | None = None, local_files_only: bool = False) -> FocusAdapter:
        """Load from a local folder or a Hub repo id (``revision`` is the adapter's, not the base model's)."""
        from focus_flex.hub import resolve_adapter_dir

        directory = resolve_adapter_dir(str(name_or_path), revision=revision, subfolder=subfolder, token=token,
                                        cache_dir=cache_dir, local_files_only=local_files_only)
        config = FocusConfig.from_json_file(os.path.join(directory, CONFIG_NAME))
        path = os.path.join(directory, WEIGHTS_NAME)
        if not os.path.isfile(path):
            raise FileNotFoundError(f"{directory!r} has {CONFIG_NAME} but no {WEIGHTS_NAME}: partial adapter; "
                                    f"re-download or re-save it.")
        try:
            tensors = load_file(path)
        except (SafetensorError, OSError, ValueError) as e:
            raise ValueError(f"{path} is not a readable safetensors file ({e}): the file is corrupt or truncated; "
                             f"re-download or re-save the adapter.") from e
        expected = {"centroids", "query_means", "key_means"} if config.center else {"centroids"}
        if set(tensors) != expected:
            raise ValueError(f"{path} holds tensors {sorted(tensors)}; a Focus adapter with center={config.center} "
                             f"holds exactly {sorted(expected)}.")
        try:
            return cls(config, tensors["centroids"], query_means=tensors.get("query_means"),
                       key_means=tensors.get("key_means"))
        except ValueError as e:
            raise ValueError(f"{directory!r}: {e}") from e

    def push_to_hub(self, repo_id: str, *, private: bool = False, token: str | None = None,
                    commit_message: str | None = None, revision: str | None = None) -> str:
        """Upload config, safetensors and a model card in one commit; returns the commit URL."""
        import tempfile

        from focus_flex.hub import model_card, push_folder_to_hub

        with tempfile.TemporaryDirectory() as tmp:
            self.save_pretrained(tmp)
            extra = self.config.extra
            card = model_card(self.config.to_dict(), repo_id=repo_id, results=extra.get("results"),
                              results_markdown=extra.get("results_markdown"), command=extra.get("command"))
            with open(os.path.join(tmp, "README.md"), "w") as f:
                f.write(card)
            return push_folder_to_hub(tmp, repo_id, private=private, token=token,
                                      commit_message=commit_message or "Upload Focus adapter", revision=revision)

    def load_model(self, model: nn.Module | None = None, *, dtype: torch.dtype = torch.float32,
                   revision: str | None = None) -> nn.Module:
        """The one-liner: load the base model named in the config (or take ``model``), attach, return it."""
        if model is None:
            from focus_flex.models import load_model

            if not self.config.base_model:
                raise ValueError("This adapter's config names no base_model; pass model=... explicitly.")
            model, _ = load_model(self.config.base_model, dtype=dtype,
                                  revision=revision or self.config.base_model_revision)
        return self.attach(model)

    def extra_repr(self) -> str:
        c = self.config
        return f"layers={len(c.layers)}, kv_heads={c.num_kv_heads}, groups={c.num_groups}, head_dim={c.head_dim}"


# ---- transformers plumbing -----------------------------------------------------------------------


# The attention implementation is a setting of the model's config, which several models can share (built from one
# config object): it switches to Focus at the first attach among them and back at the last detach. Layers of a model
# without Focus state run the model's own attention (see _attention_forward).
_config_users: dict[int, list] = {}  # id(config) -> [weakref to it, its own implementation, models attached]


def _use_focus(model: nn.Module) -> None:
    entry = _config_users.get(id(model.config))
    if entry is None or entry[0]() is not model.config:
        entry = _config_users[id(model.config)] = [weakref.ref(model.config), model.config._attn_implementation, 0]
    entry[2] += 1
    model.set_attn_implementation(IMPLEMENTATION)


def _stop_focus(model: nn.Module) -> None:
    entry = _config_users[id(model.config)]
    entry[2] -= 1
    if entry[2] == 0:
        model.set_attn_implementation(entry[1])
        del _config_users[id(model.config)]


def has_focus(model: nn.Module) -> bool:
    """Whether a Focus adapter is attached to ``model`` (to any of its attention modules)."""
    return any(getattr(m, "_focus", None) is not None for m in model.modules())


def _attention_modules(model: nn.Module) -> list[nn.Module]:
    return [m for m in model.modules() if isinstance(getattr(m, "layer_idx", None), int)
            and hasattr(m, "config") and m.__class__.__name__.endswith("Attention")]


def _position_hosts(model: nn.Module) -> list[nn.Module]:
    """The pretrained models inside ``model`` (itself included) that hold every Focus layer: the ones a padded call
    may reach without ``position_ids``, whoever calls them (the LM head model, a PEFT wrapper, the user)."""
    from transformers import PreTrainedModel

    focus = {id(m) for m in _attention_modules(model) if m._focus.slot is not None}
    return [m for m in model.modules() if isinstance(m, PreTrainedModel) and focus <= {id(x) for x in m.modules()}]


def _buffer_tokens(cache_layer: object, key: torch.Tensor, value: torch.Tensor,
                   padding: torch.Tensor | None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """The filled part of a static cache layer's buffers ``[B, Hkv, max_cache_len, D]`` (and of its padding mask)."""
    length = int(cache_layer.cumulative_length)
    return key[:, :, :length], value[:, :, :length], None if padding is None else padding[:, :length]


def _version(t: torch.Tensor) -> int:
    """How often ``t`` was modified in place (-1 for inference tensors, which do not count: identity only)."""
    return -1 if t.is_inference() else t._version


@dataclass
class _Indexed:
    """A key index and what it was built from: the cache, its layer's key tensor (and that tensor's in-place
    version), and the routing settings (groups, key top-k, the centroids' version)."""

    cache: weakref.ref
    index: KeyIndex
    keys: weakref.ref
    version: int
    routed_by: tuple[int, int, int]


class _FocusState:
    """What an attention module of an attached model holds: its adapter (weak) and its slot (None: not Focus)."""

    def __init__(self, adapter: weakref.ref, slot: int | None):
        self.adapter, self.slot = adapter, slot

    def __deepcopy__(self, memo):
        raise RuntimeError("This model has a Focus adapter attached; detach it (adapter.detach(model)) before "
                           "copying or pickling the model, then attach an adapter to each copy.")

    __reduce_ex__ = __deepcopy__


class FocusMask:
    """What the ``"focus"`` mask builder hands to attention: the padding mask, and the model's own
    dense mask computed only if a layer without Focus asks for it."""

    def __init__(self, **kwargs):
        self.kwargs = kwargs
        self._dense = None

    @property
    def padding(self) -> torch.Tensor | None:
        from transformers.masking_utils import prepare_padding_mask

        k = self.kwargs
        return prepare_padding_mask(k.get("attention_mask"), k["kv_length"], k.get("kv_offset", 0))

    @property
    def is_causal(self) -> bool:
        from transformers.masking_utils import causal_mask_function

        return self.kwargs.get("mask_function", causal_mask_function) is causal_mask_function

    def dense(self) -> torch.Tensor | None:
        from transformers.masking_utils import sdpa_mask

        if self._dense is None:
            self._dense = sdpa_mask(**self.kwargs)
        return self._dense


def _mask_builder(**kwargs) -> FocusMask:
    return FocusMask(**kwargs)


def _padding_mask_for_generate(*, attention_mask: torch.Tensor | None = None, **kwargs) -> torch.Tensor | None:
    """What ``generate`` hands an attached model as its mask: the 2-D padding mask as it is."""
    return attention_mask


def _pass_cache_layer(module: nn.Module, args: tuple, kwargs: dict) -> tuple[tuple, dict]:
    """A Focus attention module's pre-hook: its KV cache layer reaches the attention function as ``focus_cache_layer``
    (transformers passes the module's extra keyword arguments on to it)."""
    cache = kwargs.get("past_key_values")
    if cache is None:  # (transformers from 5.24 on names it cache)
        cache = kwargs.get("cache")
    layers = getattr(cache, "layers", None)
    if layers is not None and module.layer_idx < len(layers):
        kwargs["focus_cache_layer"] = layers[module.layer_idx]
    return args, kwargs


def _attention_forward(module, query, key, value, attention_mask, scaling=None, dropout=0.0, **kwargs):
    """The registered ``"focus"`` attention, in transformers' calling convention (docs/design.md).

    transformers passes post-RoPE ``[B, H, L, D]`` q/k/v (KV cache included, GQA heads not repeated) and expects
    ``([B, Lq, Hq, D], weights)`` back; the padding mask arrives only because ``"focus"`` has its own mask builder.
    """
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    state = getattr(module, "_focus", None)
    adapter = state.adapter() if state is not None else None
    if adapter is None or state.slot is None:  # a layer without Focus (e.g. Gemma-3 sliding): the model's own
        dense = attention_mask.dense() if isinstance(attention_mask, FocusMask) else attention_mask
        return sdpa_attention_forward(module, query, key, value, dense, dropout=dropout, scaling=scaling, **kwargs)
    if dropout and module.training:
        raise ValueError("Focus attention has no attention dropout; call model.eval() or set the model's attention "
                         "dropout to 0 before training centroids.")
    if kwargs.get("softcap") is not None or kwargs.get("sliding_window") is not None:
        raise ValueError("Focus replaces full-attention layers only; this layer uses softcap or a sliding window.")
    if isinstance(attention_mask, FocusMask):
        if not attention_mask.is_causal:
            raise ValueError("Focus attention supports causal attention with a padding mask only, and this call asks "
                             "for another mask function: e.g. Gemma-3's bidirectional attention over image tokens, "
                             "packed sequences, or a custom mask. Run text-only causal inputs, or detach the adapter "
                             "for such calls.")
        padding = attention_mask.padding
    elif attention_mask is None:
        padding = None
    else:
        raise ValueError(f"Focus attention got a {getattr(attention_mask, 'ndim', '?')}-D attention mask; pass a 2-D "
                         f"[batch, length] padding mask (1 = token, 0 = pad). Custom 4-D masks are not supported.")
    out = adapter(module, state.slot, query, key, value, padding, scaling, kwargs.get("focus_cache_layer"))
    weights = None
    if kwargs.get("output_attentions"):
        if adapter.mode == "soft":
            raise ValueError("output_attentions=True: the soft path's weights are not returned; set adapter.mode = "
                             "'fast' or 'reference' for the hard pattern's attention weights.")
        weights = attention_weights(query, key, adapter.centroids[state.slot].detach(),
                                    adapter.layer_config(state.slot), attention_mask=padding, scale=scaling,
                                    centering=adapter.centering(state.slot))
    return out.transpose(1, 2).contiguous(), weights


_registered = False


def register() -> None:
    """Register the ``"focus"`` attention implementation and mask builder with transformers (idempotent)."""
    global _registered
    if not _registered:
        from transformers import AttentionInterface
        from transformers.masking_utils import AttentionMaskInterface

        AttentionInterface.register(IMPLEMENTATION, _attention_forward)
        AttentionMaskInterface.register(IMPLEMENTATION, _mask_builder)
        _registered = True
