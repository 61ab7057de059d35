"""The KV cache of the device path: transformers cache layers whose Focus layers also keep a
:class:`~focus_flex.pool.GroupPool` (their keys paged by group), so that a decode step is one FlexAttention call over
exactly the keys it may see, with static shapes and no host synchronisation.

:class:`FocusStaticLayer` and :class:`FocusDynamicLayer` are transformers' static and dynamic cache layers plus a pool;
:class:`FocusCache` is a cache of such layers. An attached Focus adapter also turns the layers of the caches
transformers makes itself (``generate(..., cache_implementation="static")``, the default dynamic cache on the device
path) into these, in place, at the first forward that uses them. The adapter finds a Focus cache layer by its
``focus_attention`` method (this module imports transformers, which ``import focus_flex`` does not).
"""

from __future__ import annotations

import torch
from transformers.cache_utils import Cache, DynamicLayer, StaticLayer

from focus_flex import attention
from focus_flex.config import FocusConfig
from focus_flex.plan import route, token_positions
from focus_flex.pool import GroupPool
from focus_flex.routing import Centering


def _focus_attention(layer: FocusStaticLayer | FocusDynamicLayer, q: torch.Tensor, k: torch.Tensor,
                     v: torch.Tensor, centroids: torch.Tensor, config: FocusConfig, padding: torch.Tensor | None,
                     scale: float | None, kernel: str | None, centering: Centering | None = None) -> torch.Tensor:
    """A Focus cache layer's attention of the new queries, through its pool: :func:`cached_attention`."""
    return cached_attention(layer, q, k, v, centroids, config, padding, scale, kernel, centering)


class FocusStaticLayer(StaticLayer):
    """transformers' ``StaticLayer`` (keys and values in preallocated ``[B, Hkv, max_cache_len, D]`` buffers) plus
    the :class:`~focus_flex.pool.GroupPool` of a Focus layer, created at its first attention call."""

    pool: GroupPool | None = None
    focus_attention = _focus_attention

    def reset(self) -> None:
        super().reset()
        if self.pool is not None:
            self.pool.clear()

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        super().reorder_cache(beam_idx)
        if self.pool is not None:
            self.pool.select(beam_idx)


class FocusDynamicLayer(DynamicLayer):
    """transformers' ``DynamicLayer`` (keys and values grown by concatenation) plus the pool of a Focus layer,
    rebuilt larger when the cache outgrows it and after any edit of the cache."""

    pool: GroupPool | None = None
    focus_attention = _focus_attention

    def reset(self) -> None:
        super().reset()
        self.pool = None

    def crop(self, tokens_to_remove: int) -> None:
        super().crop(tokens_to_remove)
        self.pool = None

    def reorder_cache(self, beam_idx: torch.Tensor) -> None:
        super().reorder_cache(beam_idx)
        if self.pool is not None:
            self.pool.select(beam_idx)

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.pool = None

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.pool = None


def to_focus_layer(layer: object) -> object:
    """A cache layer of a Focus layer, made a Focus cache layer in place (same object and data, now with a pool):
    ``StaticLayer`` -> :class:`FocusStaticLayer`, ``DynamicLayer`` -> :class:`FocusDynamicLayer`. Other layers (and
    layers that are Focus ones already) are returned as they are."""
    if type(layer) is StaticLayer:
        layer.__class__ = FocusStaticLayer
    elif type(layer) is DynamicLayer:
        layer.__class__ = FocusDynamicLayer
    return layer


class FocusCache(Cache):
    """A KV cache for a model with a Focus adapter attached: :class:`FocusStaticLayer` s (``max_cache_len`` given:
    static shapes, for compiled decoding) or :class:`FocusDynamicLayer` s (grown as needed).

    ``generate(..., past_key_values=FocusCache(model.config, max_cache_len=4096))``; layers that are not Focus
    layers behave as transformers' own (their extra state is never created).
    """

    def __init__(self, config: object, max_cache_len: int | None = None):
        text = config.get_text_config(decoder=True) if hasattr(config, "get_text_config") else config
        n = text.num_hidden_layers
        if max_cache_len is None:
            layers = [FocusDynamicLayer() for _ in range(n)]
        else:
            layers = [FocusStaticLayer(max_cache_len=max_cache_len) for _ in range(n)]
        super().__init__(layers=layers)


_CAPACITY_SLACK = 1.5  # a dynamic layer's pool holds this many times the tokens it was built for


def cached_attention(layer: FocusStaticLayer | FocusDynamicLayer, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
                     centroids: torch.Tensor, config: FocusConfig, padding: torch.Tensor | None, scale: float | None,
                     kernel: str | None, centering: Centering | None = None) -> torch.Tensor:
    """Focus attention of the new queries ``[B, Hq, Lq, D]`` through a Focus cache layer whose ``update`` has just
    returned ``k``/``v`` (the whole buffer of a static layer, ``[B, Hkv, max_cache_len, D]``). The new keys go into
    the layer's pool; one query per row (a decode step) attends through it (:meth:`GroupPool.attend`); more (a
    prefill) run :func:`~focus_flex.attention.focus_attention` on the cache's tokens with ``kernel``. With
    ``config.dense_decode`` no pool is kept and a decode step is :func:`~focus_flex.attention.decode_attention` over
    the buffer. ``centering``: route mean-removed vectors (:class:`~focus_flex.routing.Centering`).
    """
    b, hq, lq, d = q.shape
    dev, static = q.device, isinstance(layer, FocusStaticLayer)
    scale = d ** -0.5 if scale is None else scale
    if static:
        end = layer.cumulative_length  # tokens in the cache, the new ones included (a device scalar)
        new = end - lq + torch.arange(lq, device=dev)
    valid = None if padding is None else padding.to(dev, torch.bool)

    def real(index: torch.Tensor | slice) -> torch.Tensor:  # [B, n]: which of these cache slots hold real tokens
        if valid is None:
            n = len(index) if isinstance(index, torch.Tensor) else len(range(k.shape[2])[index])
            return torch.ones(b, n, dtype=torch.bool, device=dev)
        return valid.index_select(1, index) if isinstance(index, torch.Tensor) else valid[:, index]

    def keys_route(x: torch.Tensor, index: torch.Tensor | slice) -> torch.Tensor:  # what routing reads for these keys
        if centering is None:
            return x
        slots = torch.arange(k.shape[2], device=dev)
        pos = (slots.expand(b, -1) if valid is None else token_positions(valid[:, :k.shape[2]]))
        return centering.keys(x, pos.index_select(1, index) if isinstance(index, torch.Tensor) else pos[:, index])

    if config.dense_decode:  # the pool serves only Focus decode steps: none is kept (it is rebuilt if needed)
        layer.pool = None
        if attention.dense_decode(config.dense_decode, lq):
            held = real(slice(0, k.shape[2]))  # [B, slots]; a static buffer holds tokens only before its length
            if static:
                held = held & (torch.arange(k.shape[2], device=dev) < end)
            return attention.decode_attention(q, k, v, held, scale, new if static else None)
        return _prefill(q, k, v, centroids, config, valid, scale, kernel, centering, int(end) if static else None)
    pool = layer.pool
    if pool is None or (not static and k.shape[2] > pool.capacity):
        capacity = layer.max_cache_len if static else int(k.shape[2] * _CAPACITY_SLACK) + config.block_size
        pool = layer.pool = GroupPool(b, k.shape[1], d, v.shape[-1], capacity, config, k.dtype, dev)
        before = int(end) - lq if static else k.shape[2] - lq  # tokens cached before this call (host read: once)
        if before:
            pool.append(k[:, :, :before], v[:, :, :before],
                        route(keys_route(k[:, :, :before], slice(0, before)), centroids, config.key_top_k),
                        real(slice(0, before)))
    if static:
        where: torch.Tensor | slice = new
        k_new, v_new, valid_new = k.index_select(2, new), v.index_select(2, new), real(new)
    else:
        where = slice(k.shape[2] - lq, None)
        k_new, v_new, valid_new = k[:, :, -lq:], v[:, :, -lq:], real(where)
    pos = pool.append(k_new, v_new, route(keys_route(k_new, where), centroids, config.key_top_k), valid_new)
    if lq == 1:
        q_route = q if centering is None else centering.queries(q, pos.clamp_min(0))
        return pool.attend(q, centroids, pos[:, 0], scale, q_route)
    return _prefill(q, k, v, centroids, config, valid, scale, kernel, centering, int(end) if static else None)


def _prefill(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, centroids: torch.Tensor, config: FocusConfig,
             valid: torch.Tensor | None, scale: float, kernel: str | None, centering: Centering | None,
             length: int | None) -> torch.Tensor:
    """More than one query per row: :func:`~focus_flex.attention.focus_attention` on the cache's first ``length``
    tokens (None: all of ``k``; a static layer's length is read on the host, once per call)."""
    length = k.shape[2] if length is None else length
    return attention.focus_attention(q, k[:, :, :length], v[:, :, :length], centroids, config,
                                     attention_mask=None if valid is None else valid[:, :length], scale=scale,
                                     kernel=kernel, centering=centering)
