"""gpt2-engine: a from-scratch GPT-2 inference engine that loads the official Hugging Face weights."""

from .api import GPT2
from .core.config import PRESETS, GPT2Config
from .core.errors import (DownloadError, GenerationError, GPT2EngineError, SteeringError, TokenizerError,
                          WeightsError)
from .core.lora import LoraError, LoraSettings
from .core.model import KVCache
from .formats.saes import SAEError
from .interp.sae import SAE
from .interp.spec import Steering
from .core.tokenizer import Tokenizer, load_tokenizer
from .runtime.constraints import Constraint

__all__ = [
    "GPT2", "GPT2Config", "PRESETS", "KVCache", "Tokenizer", "load_tokenizer", "LoraSettings", "Constraint", "SAE", "Steering",
    "GPT2EngineError", "WeightsError", "TokenizerError", "GenerationError", "DownloadError", "LoraError", "SAEError",
    "SteeringError",
]
__version__ = "0.1.0"
