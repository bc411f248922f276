"""PyTorch reference CSA2/CED model: configs, formats, reference ops, the model and its KV cache."""

from model.config import ConfigError, LayerMode, ModelConfig, preset

__all__ = ["ConfigError", "LayerMode", "ModelConfig", "preset"]
