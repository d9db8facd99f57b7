"""Client-facing chat dialects (OpenAI, vLLM, Anthropic, Ollama): a schema and a translation
each. Pure."""
