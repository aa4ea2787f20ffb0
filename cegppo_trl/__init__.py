"""CE-GPPO (gradient-preserving clipping policy optimization) for TRL."""

from .config import CEGPPOConfig
from .controller import EntropyController
from .core import cegppo_per_token_loss, gradient_preserving_correction, ppo_clip_per_token_loss
from .trainer import CEGPPOTrainer


__version__ = "0.1.0"

__all__ = [
    "CEGPPOConfig",
    "CEGPPOTrainer",
    "EntropyController",
    "cegppo_per_token_loss",
    "gradient_preserving_correction",
    "ppo_clip_per_token_loss",
]
