"""Model configs, presets and families built from the tensor-parallel blocks."""

from .config import PRESETS, ModelConfig, load_config
from .gpt import GPTModel

__all__ = ["PRESETS", "ModelConfig", "load_config", "GPTModel"]
