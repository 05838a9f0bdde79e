"""llm-anatomy: one LLM API call on your own GPU, and exactly what happens inside it."""

from importlib import import_module

__version__ = "0.1.0"

# Imported on first use: the CLI and the telemetry subprocess should not pay for torch unless they need it.
_EXPORTS = {
    "Engine": "llm_anatomy.engine.engine",
    "EngineConfig": "llm_anatomy.engine.config",
    "GenerationResult": "llm_anatomy.engine.engine",
    "SamplingParams": "llm_anatomy.engine.sampling",
    "Tokenizer": "llm_anatomy.tokenizer",
    "AnatomyError": "llm_anatomy.errors",
    "Anatomy": "llm_anatomy.anatomy",
}
__all__ = list(_EXPORTS)


def __getattr__(name: str):
    if name in _EXPORTS:
        return getattr(import_module(_EXPORTS[name]), name)
    raise AttributeError(f"module 'llm_anatomy' has no attribute {name!r}")
