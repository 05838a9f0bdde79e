"""llm-anatomy: one LLM API call on your own GPU, and exactly what happens inside it."""

from .engine.engine import Engine, GenerationResult
from .engine.sampling import SamplingParams
from .errors import AnatomyError
from .tokenizer import Tokenizer

__all__ = ["AnatomyError", "Engine", "GenerationResult", "SamplingParams", "Tokenizer"]
__version__ = "0.1.0"
