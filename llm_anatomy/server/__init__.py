"""`llm-anatomy serve`: an OpenAI-compatible server whose every response can carry its own anatomy."""
