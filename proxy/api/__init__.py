"""Routes beside the request path: account, admin, models, Ollama discovery, OpenAPI."""
