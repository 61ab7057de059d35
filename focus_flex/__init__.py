"""focus_flex: Focus attention (arXiv 2604.03260) on FlexAttention, as Hub-shareable centroid adapters."""

from focus_flex.adapter import FocusAdapter
from focus_flex.attention import focus_attention, reference_attention, soft_attention
from focus_flex.config import CONFIG_NAME, WEIGHTS_NAME, FocusConfig, __version__

__all__ = [
    "FocusConfig",
    "FocusAdapter",
    "FocusCache",
    "focus_attention",
    "reference_attention",
    "soft_attention",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "__version__",
]


def __getattr__(name: str):
    """``focus_flex.FocusCache``, imported on first use (it brings in transformers, which attention alone does not
    need)."""
    if name == "FocusCache":
        from focus_flex.cache import FocusCache

        return FocusCache
    raise AttributeError(f"module 'focus_flex' has no attribute {name!r}")
