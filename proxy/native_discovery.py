"""Placeholder: being written (issue 6)."""

from __future__ import annotations

from aiohttp import web


def add_ollama_discovery(app: web.Application, prefix: str) -> None:
    """The discovery calls the Ollama client makes (model list, version, ...) under `prefix`."""
