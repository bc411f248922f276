"""PyTorch reference CSA2/CED model: configs, formats, reference ops, the model and its KV cache.

from model import build_model, preset
m = build_model(preset("tiny"), backend="torch", device="cpu", dtype=torch.float32, seed=0)
full = m.forward(tokens)               # [B, N] -> [B, N, vocab]
logits, cache = m.prefill(tokens)      # CED prefill -> [B, vocab]
logits = m.decode(next_tokens, cache)  # [B] -> [B, vocab]
"""

from model.backend import Backend, BackendError, TorchBackend, load_backend
from model.cache import KVCache
from model.config import ConfigError, LayerMode, ModelConfig, preset
from model.inputs import InputError, InputTypeError
from model.model import Model, build_model, count_parameters

__all__ = [
    "Backend",
    "BackendError",
    "ConfigError",
    "InputError",
    "InputTypeError",
    "KVCache",
    "LayerMode",
    "Model",
    "ModelConfig",
    "TorchBackend",
    "build_model",
    "count_parameters",
    "load_backend",
    "preset",
]
