"""focus_flex: Focus attention (arXiv 2604.03260) on FlexAttention, as Hub-shareable centroid adapters."""

__version__ = "0.1.0"

from focus_flex.adapter import FocusAdapter  # noqa: E402
from focus_flex.attention import focus_attention, reference_attention, soft_attention  # noqa: E402
from focus_flex.config import CONFIG_NAME, WEIGHTS_NAME, FocusConfig  # noqa: E402

__all__ = [
    "FocusConfig",
    "FocusAdapter",
    "focus_attention",
    "reference_attention",
    "soft_attention",
    "CONFIG_NAME",
    "WEIGHTS_NAME",
    "__version__",
]
