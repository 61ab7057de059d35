"""focus_flex: Focus attention (arXiv 2604.03260) on FlexAttention, as Hub-shareable centroid adapters."""

__version__ = "0.1.0"

from focus_flex.config import CONFIG_NAME, WEIGHTS_NAME, FocusConfig  # noqa: E402

__all__ = ["FocusConfig", "CONFIG_NAME", "WEIGHTS_NAME", "__version__"]
